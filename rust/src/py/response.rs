//! `Response`: the node's response head, and its body as an async iterator of batches.

use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::bridge::{end_of_iteration, resolve, to_object, LoopBridge};
use crate::bridge::exchange::{Delivery, Exchange, Waiter};

#[pyclass(frozen, name = "Response", module = "pdproxy._pdproxy")]
pub(crate) struct Response {
    /// The node's HTTP status.
    #[pyo3(get)]
    status: u16,
    /// Response headers as ASGI wants them: `(name, value)` byte pairs, without hop-by-hop
    /// headers.
    #[pyo3(get)]
    headers: Py<PyList>,
    /// The node that answered.
    #[pyo3(get)]
    node: String,
    /// The whole body when it was read before the head was handed over (small bodies that
    /// are not event streams); `None` when it streams.
    #[pyo3(get)]
    body: Option<Py<PyBytes>>,
    complete_unread: Mutex<bool>,
    exchange: Option<Arc<Exchange>>,
    bridge: Py<LoopBridge>,
}

/// The parts of a node's response head that reach Python.
pub(crate) struct Head<'a> {
    pub(crate) status: http::StatusCode,
    pub(crate) headers: &'a http::HeaderMap,
    pub(crate) node: &'a str,
    /// The whole body, when it was read with the head.
    pub(crate) complete: Option<&'a [u8]>,
}

impl Response {
    /// Builds the Python response under the GIL, on the loop thread.
    pub(crate) fn build(
        py: Python<'_>,
        head: &Head<'_>,
        exchange: Option<Arc<Exchange>>,
        bridge: Py<LoopBridge>,
    ) -> PyResult<Self> {
        let headers = PyList::empty(py);
        for (name, value) in head.headers {
            headers.append(PyTuple::new(
                py,
                [PyBytes::new(py, name.as_str().as_bytes()), PyBytes::new(py, value.as_bytes())],
            )?)?;
        }
        Ok(Self {
            status: head.status.as_u16(),
            headers: headers.unbind(),
            node: head.node.to_owned(),
            body: head.complete.map(|b| PyBytes::new(py, b).unbind()),
            complete_unread: Mutex::new(head.complete.is_some()),
            exchange,
            bridge,
        })
    }
}

/// A waiter that completes `future` on the loop thread.
fn waiter_for(future: Py<PyAny>, bridge: Py<LoopBridge>) -> Waiter {
    Box::new(move |delivery| {
        bridge.get().submit(Box::new(move |py| {
            let value = match delivery {
                Delivery::Batch(bytes) => Ok(PyBytes::new(py, &bytes).into_any().unbind()),
                Delivery::End => Err(end_of_iteration()),
                Delivery::Failed(e) => Err(e.into()),
            };
            resolve(py, &future, value);
        }));
    })
}

#[pymethods]
impl Response {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The next batch of body bytes: everything received so far, cut after the last
    /// complete server-sent event. Raises `StopAsyncIteration` at the end.
    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bridge = self.bridge.get();
        let ready = |value: Py<PyAny>| -> PyResult<Bound<'py, PyAny>> {
            let future = bridge.create_future(py)?;
            resolve(py, &future.clone().unbind(), Ok(value));
            Ok(future)
        };
        if std::mem::take(&mut *self.complete_unread.lock().unwrap_or_else(PoisonError::into_inner)) {
            if let Some(body) = &self.body {
                return ready(body.clone_ref(py).into_any());
            }
        }
        let Some(exchange) = &self.exchange else {
            return Err(end_of_iteration());
        };
        let delivery = if let Some(delivery) = exchange.take_ready() {
            delivery
        } else {
            let future = bridge.create_future(py)?;
            match exchange.wait(waiter_for(future.clone().unbind(), self.bridge.clone_ref(py))) {
                Ok(()) => return Ok(future),
                Err((delivery, _unused_waiter)) => delivery,
            }
        };
        match delivery {
            Delivery::Batch(bytes) => ready(to_object(py, PyBytes::new(py, &bytes))?),
            Delivery::End => Err(end_of_iteration()),
            Delivery::Failed(e) => Err(e.into()),
        }
    }

    /// Stops reading the body: the node's connection is closed at once and the node's
    /// in-flight count released. Iteration then ends. Safe to call more than once.
    fn close(&self) {
        *self.complete_unread.lock().unwrap_or_else(PoisonError::into_inner) = false;
        if let Some(waiter) = self.exchange.as_ref().and_then(|e| e.close()) {
            waiter(Delivery::End);
        }
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.exchange.as_ref().is_some_and(|e| e.is_closed())
    }

    fn __repr__(&self) -> String {
        format!("<Response [{}] from {}>", self.status, self.node)
    }
}

impl Drop for Response {
    fn drop(&mut self) {
        // An abandoned response frees its node at once; a pending waiter has nobody to wake.
        if let Some(exchange) = &self.exchange {
            drop(exchange.close());
        }
    }
}

//! `Response`: the node's response head, and its body as an async iterator of batches.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use pyo3::exceptions::PyStopAsyncIteration;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::errors::to_pyerr;
use crate::body::BodyStream;
use crate::forward::{ResponseBody, UpstreamResponse};

#[pyclass(frozen, name = "Response", module = "pdproxy._pdproxy")]
pub struct Response {
    /// The node's HTTP status.
    #[pyo3(get)]
    status: u16,
    /// Response headers as ASGI wants them: a list of `(name, value)` byte pairs, without
    /// hop-by-hop headers.
    #[pyo3(get)]
    headers: Py<PyList>,
    /// The node that answered.
    #[pyo3(get)]
    node: String,
    /// The whole body when it was read before the head was handed over (small bodies that
    /// are not event streams); `None` when it streams.
    #[pyo3(get)]
    body: Option<Py<PyBytes>>,
    complete_unread: Mutex<Option<Bytes>>,
    stream: Option<Arc<BodyStream>>,
}

/// The output of the forward future, turned into a `Response` under the GIL.
pub struct ResponseOut(pub UpstreamResponse);

impl<'py> IntoPyObject<'py> for ResponseOut {
    type Target = Response;
    type Output = Bound<'py, Response>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let upstream = self.0;
        let headers = PyList::empty(py);
        for (name, value) in &upstream.headers {
            headers.append(PyTuple::new(
                py,
                [PyBytes::new(py, name.as_str().as_bytes()), PyBytes::new(py, value.as_bytes())],
            )?)?;
        }
        let (body, complete_unread, stream) = match upstream.body {
            ResponseBody::Complete(bytes) => (Some(PyBytes::new(py, &bytes).unbind()), Some(bytes), None),
            ResponseBody::Streaming(stream) => (None, None, Some(stream)),
        };
        Bound::new(
            py,
            Response {
                status: upstream.status.as_u16(),
                headers: headers.unbind(),
                node: upstream.node.url().to_owned(),
                body,
                complete_unread: Mutex::new(complete_unread),
                stream,
            },
        )
    }
}

/// One batch of body bytes, converted under the GIL.
struct Batch(Bytes);

impl<'py> IntoPyObject<'py> for Batch {
    type Target = PyBytes;
    type Output = Bound<'py, PyBytes>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        Ok(PyBytes::new(py, &self.0))
    }
}

#[pymethods]
impl Response {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The next batch of body bytes: everything received so far, cut after the last
    /// complete server-sent event. Raises `StopAsyncIteration` at the end.
    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let complete = self.complete_unread.lock().unwrap_or_else(PoisonError::into_inner).take();
        let stream = self.stream.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            if let Some(bytes) = complete {
                return Ok(Batch(bytes));
            }
            let Some(stream) = stream else {
                return Err(PyStopAsyncIteration::new_err(()));
            };
            match stream.next_batch().await {
                Ok(Some(bytes)) => Ok(Batch(bytes)),
                Ok(None) => Err(PyStopAsyncIteration::new_err(())),
                Err(e) => Err(to_pyerr(&e)),
            }
        })
    }

    /// Stops reading the body: the node's connection is closed at once and the node's
    /// in-flight count released. Iteration then ends. Safe to call more than once.
    fn close(&self) {
        self.complete_unread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(stream) = &self.stream {
            stream.cancel();
        }
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_cancelled())
    }

    fn __repr__(&self) -> String {
        format!("<Response [{}] from {}>", self.status, self.node)
    }
}

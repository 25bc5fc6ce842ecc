//! The bridge from runtime threads to one asyncio event loop.
//!
//! Runtime threads never take the GIL: they queue a completion and ring the doorbell. The
//! loop, woken by the doorbell's descriptor, runs every queued completion in one callback,
//! so many streams that became ready together cost one wake-up.

use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::PyStopAsyncIteration;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::{intern, IntoPyObjectExt};

use crate::bridge::doorbell::Doorbell;

/// Work for the loop thread, run with the GIL held.
pub(crate) type Completion = Box<dyn FnOnce(Python<'_>) + Send>;

#[pyclass(frozen, name = "_LoopBridge", module = "pdproxy._pdproxy")]
pub(crate) struct LoopBridge {
    doorbell: Doorbell,
    queue: Mutex<Vec<Completion>>,
    event_loop: Py<PyAny>,
}

impl LoopBridge {
    /// A bridge to the running loop, registered with it.
    pub(crate) fn start(py: Python<'_>) -> PyResult<Py<Self>> {
        let event_loop = running_loop(py)?;
        let doorbell = Doorbell::new()?;
        let fd = doorbell.fd();
        let bridge =
            Py::new(py, Self { doorbell, queue: Mutex::new(Vec::new()), event_loop: event_loop.clone().unbind() })?;
        event_loop.call_method1(intern!(py, "add_reader"), (fd, bridge.clone_ref(py)))?;
        Ok(bridge)
    }

    /// Queues work for the loop thread. Callable from any thread, without the GIL.
    pub(crate) fn submit(&self, completion: Completion) {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).push(completion);
        self.doorbell.ring();
    }

    /// A new future of the bridge's loop.
    pub(crate) fn create_future<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.event_loop.bind(py).call_method0(intern!(py, "create_future"))
    }

    /// True when the running loop is this bridge's loop.
    pub(crate) fn serves_running_loop(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(running_loop(py)?.is(self.event_loop.bind(py)))
    }

    /// Stops watching the doorbell (the loop may already be closed).
    pub(crate) fn stop(&self, py: Python<'_>) {
        let _ = self.event_loop.bind(py).call_method1(intern!(py, "remove_reader"), (self.doorbell.fd(),));
    }
}

#[pymethods]
impl LoopBridge {
    /// The loop's reader callback: runs everything queued.
    fn __call__(&self, py: Python<'_>) {
        self.doorbell.answer();
        let work = std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner));
        for completion in work {
            completion(py);
        }
    }
}

fn running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    GET_RUNNING_LOOP.import(py, "asyncio", "get_running_loop")?.call0()
}

/// Completes `future` with `value`, unless it was cancelled meanwhile (then setting it
/// fails, which is the cheaper way to find out than asking first).
pub(crate) fn resolve(py: Python<'_>, future: &Py<PyAny>, value: PyResult<Py<PyAny>>) {
    let future = future.bind(py);
    let _ = match value {
        Ok(value) => future.call_method1(intern!(py, "set_result"), (value,)),
        Err(err) => future.call_method1(intern!(py, "set_exception"), (err.into_value(py),)),
    };
}

/// The exception that ends an `async for`.
pub(crate) fn end_of_iteration() -> PyErr {
    PyStopAsyncIteration::new_err(())
}

/// Converts any Python-convertible value, for `resolve`.
pub(crate) fn to_object<'py, T: IntoPyObjectExt<'py>>(py: Python<'py>, value: T) -> PyResult<Py<PyAny>> {
    value.into_py_any(py)
}

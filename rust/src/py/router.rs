//! `Router`: the node table, selection and forwarding, as one Python object.

use std::sync::Arc;

use http::Method;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use std::sync::OnceLock;
use std::time::Instant;

use pyo3::exceptions::PyRuntimeError;

use super::bridge::{resolve, LoopBridge};
use super::config::RouterConfig;
use super::errors::{node_not_found, to_pyerr};
use super::response::{Head, Response};
use crate::error::Kind;
use crate::exchange::{pump, Exchange};
use crate::forward::{ForwardConfig, ForwardRequest, Forwarder, ResponseBody, UpstreamResponse};
use crate::inspect::inspect;
use crate::node::Node;
use crate::permit::InFlightPermit;
use crate::registry::Registry;
use crate::runtime;
use crate::select::{policy_from_name, select, Policy};

#[pyclass(frozen, name = "Router", module = "pdproxy._pdproxy")]
pub struct Router {
    registry: Registry,
    policy: Box<dyn Policy>,
    forwarder: Arc<Forwarder>,
    config: ForwardConfig,
    runtime: &'static tokio::runtime::Runtime,
    /// The event loop this router serves, bound on first use.
    bridge: OnceLock<Py<LoopBridge>>,
}

#[pymethods]
impl Router {
    #[new]
    fn new(config: RouterConfig) -> PyResult<Self> {
        let policy = policy_from_name(&config.policy).map_err(|e| PyValueError::new_err(e.message().to_owned()))?;
        let forward_config = config.forward_config()?;
        let forwarder = Arc::new(Forwarder::new(forward_config.clone()));
        // Built on first use; the first router's thread count wins.
        let runtime =
            runtime::get(config.runtime_threads).map_err(|e| PyRuntimeError::new_err(e.message().to_owned()))?;
        Ok(Self {
            registry: Registry::new(),
            policy,
            forwarder,
            config: forward_config,
            runtime,
            bridge: OnceLock::new(),
        })
    }

    /// The routing policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.policy.name()
    }

    #[pyo3(signature = (url, models=None))]
    fn add_node(&self, url: &str, models: Option<Vec<String>>) -> PyResult<String> {
        let node = self.registry.add(url, models.unwrap_or_default()).map_err(|e| to_pyerr(&e))?;
        Ok(node.url().to_owned())
    }

    fn remove_node(&self, url: &str) -> PyResult<String> {
        match self.registry.remove(url) {
            Ok(node) => Ok(node.url().to_owned()),
            Err(e) if e.kind() == Kind::InvalidNode && e.message().starts_with("no node") => Err(node_not_found(&e)),
            Err(e) => Err(to_pyerr(&e)),
        }
    }

    /// Models served by the registered nodes, deduplicated.
    fn models(&self) -> Vec<String> {
        self.registry.load().models().into_iter().map(str::to_owned).collect()
    }

    /// One snapshot of every node and its counters.
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let set = self.registry.load();
        let list = PyList::empty(py);
        for node in set.nodes() {
            list.append(node_stats(py, node)?)?;
        }
        Ok(list)
    }

    /// Selects a node for the request in `body` and forwards it. Returns a future of the
    /// running loop that resolves to a `Response` once the node's response head has arrived;
    /// cancelling it cancels the upstream request.
    #[pyo3(signature = (path, body, headers=Vec::new(), method="POST"))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        path: String,
        body: &[u8],
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        method: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid HTTP method {method:?}")))?;
        let info = inspect(body).map_err(|e| to_pyerr(&e))?;
        let bridge = self.bridge(py)?;
        let node =
            select(&self.registry.load(), info.model.as_deref(), self.policy.as_ref()).map_err(|e| to_pyerr(&e))?;
        // Counted from selection on, so concurrent selections see it.
        let permit = InFlightPermit::acquire(node.counters());
        let request =
            ForwardRequest { method, path_and_query: path, headers, body: bytes::Bytes::copy_from_slice(body) };

        let future = bridge.get().create_future(py)?;
        let exchange = Arc::new(Exchange::new(self.config.stream_buffer_limit));
        let reply = Reply { future: future.clone().unbind(), bridge_for_response: bridge.clone_ref(py), bridge };
        let task = self.runtime.spawn(exchange_task(
            Arc::clone(&self.forwarder),
            node,
            permit,
            request,
            Arc::clone(&exchange),
            reply,
            self.config.stream_idle_timeout,
        ));
        exchange.set_task(task.abort_handle());
        future.call_method1(pyo3::intern!(py, "add_done_callback"), (AbortOnCancel(exchange),))?;
        Ok(future)
    }

    /// Stops serving the event loop. Requests in flight end with it.
    fn close(&self, py: Python<'_>) {
        if let Some(bridge) = self.bridge.get() {
            bridge.get().stop(py);
        }
    }
}

impl Router {
    /// The bridge to the running loop; the first call binds the router to it.
    fn bridge(&self, py: Python<'_>) -> PyResult<Py<LoopBridge>> {
        if let Some(bridge) = self.bridge.get() {
            if !bridge.get().serves_running_loop(py)? {
                return Err(PyRuntimeError::new_err("this Router serves another event loop"));
            }
            return Ok(bridge.clone_ref(py));
        }
        let bridge = LoopBridge::start(py)?;
        if let Err(bridge) = self.bridge.set(bridge) {
            bridge.get().stop(py);
        }
        self.bridge.get().map(|b| b.clone_ref(py)).ok_or_else(|| PyRuntimeError::new_err("router has no event loop"))
    }
}

/// Where the task reports: the future to complete and the bridge to its loop (twice: one
/// to submit with, one for the `Response`, since `Py` handles are cloned only under the GIL).
struct Reply {
    future: Py<PyAny>,
    bridge: Py<LoopBridge>,
    bridge_for_response: Py<LoopBridge>,
}

/// Forwards one request, hands the head to Python, then pumps the body.
async fn exchange_task(
    forwarder: Arc<Forwarder>,
    node: Arc<Node>,
    permit: InFlightPermit,
    request: ForwardRequest,
    exchange: Arc<Exchange>,
    reply: Reply,
    idle_timeout: std::time::Duration,
) {
    let started = Instant::now();
    let Reply { future, bridge, bridge_for_response } = reply;
    let response = match forwarder.forward(node, permit, request).await {
        Ok(response) => response,
        Err(e) => {
            bridge.get().submit(Box::new(move |py| resolve(py, &future, Err(to_pyerr(&e)))));
            return;
        }
    };
    let UpstreamResponse { status, headers, node, body } = response;
    let (complete, stream) = match body {
        ResponseBody::Complete(bytes) => (Some(bytes), None),
        ResponseBody::Streaming(stream) => (None, Some(stream)),
    };
    let for_python = stream.is_some().then(|| Arc::clone(&exchange));
    bridge.get().submit(Box::new(move |py| {
        let head = Head { status, headers: &headers, node: node.url(), complete: complete.as_deref() };
        let built =
            Response::build(py, &head, for_python, bridge_for_response).and_then(|r| Ok(Py::new(py, r)?.into_any()));
        resolve(py, &future, built);
    }));
    if let Some(stream) = stream {
        pump(&exchange, stream, started, idle_timeout).await;
    }
}

/// Cancels the upstream request when the forward future is cancelled.
#[pyclass(frozen)]
struct AbortOnCancel(Arc<Exchange>);

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0(pyo3::intern!(future.py(), "cancelled"))?.is_truthy()? {
            drop(self.0.close());
        }
        Ok(())
    }
}

fn node_stats<'py>(py: Python<'py>, node: &Arc<Node>) -> PyResult<Bound<'py, PyDict>> {
    let c = node.counters().snapshot();
    let stats = PyDict::new(py);
    stats.set_item("url", node.url())?;
    stats.set_item("generation", node.generation())?;
    stats.set_item("models", node.models())?;
    stats.set_item("in_flight", c.in_flight)?;
    stats.set_item("requests", c.requests)?;
    stats.set_item("succeeded", c.succeeded)?;
    stats.set_item("failed", c.failed)?;
    stats.set_item("cancelled", c.cancelled)?;
    #[allow(clippy::cast_precision_loss)] // microsecond sums stay far below 2^52
    let mean = (c.succeeded > 0).then(|| c.latency_us_sum as f64 / c.succeeded as f64 / 1e6);
    stats.set_item("mean_latency", mean)?;
    Ok(stats)
}

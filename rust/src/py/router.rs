//! `Router`: the node table, selection and forwarding, as one Python object.

use std::sync::Arc;

use http::Method;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::config::RouterConfig;
use super::errors::{node_not_found, to_pyerr};
use super::response::ResponseOut;
use crate::error::Kind;
use crate::forward::{ForwardRequest, Forwarder};
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
}

#[pymethods]
impl Router {
    #[new]
    fn new(config: RouterConfig) -> PyResult<Self> {
        let policy = policy_from_name(&config.policy).map_err(|e| PyValueError::new_err(e.message().to_owned()))?;
        let forwarder = Arc::new(Forwarder::new(config.forward_config()?));
        // The runtime is built on first use; the first router's thread count wins.
        pyo3_async_runtimes::tokio::init(runtime::builder(config.runtime_threads));
        Ok(Self { registry: Registry::new(), policy, forwarder })
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

    /// Selects a node for the request in `body` and forwards it. Returns an awaitable that
    /// resolves to a `Response` once the node's response head has arrived.
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
        let node =
            select(&self.registry.load(), info.model.as_deref(), self.policy.as_ref()).map_err(|e| to_pyerr(&e))?;
        // Counted from selection on, so concurrent selections see it.
        let permit = InFlightPermit::acquire(node.counters());
        let request =
            ForwardRequest { method, path_and_query: path, headers, body: bytes::Bytes::copy_from_slice(body) };
        let forwarder = Arc::clone(&self.forwarder);
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            match forwarder.forward(node, permit, request).await {
                Ok(response) => Ok(ResponseOut(response)),
                Err(e) => Err(to_pyerr(&e)),
            }
        })
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

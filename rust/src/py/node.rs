//! A node's record between the two planes: read by attribute from the control plane's
//! `NodeRecord` (`pdproxy/fleet/node_record.py`), and shown back as a dict. What a node is lives in
//! `node::NodeSpec`; this file only carries it across.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{Error, Kind};
use crate::node::registry::{check_api_key, check_speed};
use crate::node::{Node, NodeSpec, NodeUrl, Role};

/// The attributes of `pdproxy.fleet.node_record.NodeRecord`, as the data plane takes them.
#[derive(FromPyObject)]
pub(crate) struct NodeRecord {
    pub(crate) url: String,
    models: Option<Vec<String>>,
    role: String,
    speed: Option<f64>,
    max_concurrency: Option<u32>,
    api_key: Option<String>,
    bootstrap_port: Option<u16>,
    lease_ttl: Option<f64>,
    labels: BTreeMap<String, String>,
}

impl NodeRecord {
    /// The node's canonical URL, once every rule of the node table holds for the record.
    pub(crate) fn check(&self) -> PyResult<String> {
        let url = NodeUrl::parse(&self.url)?;
        Role::parse(&self.role)?;
        check_speed(self.speed)?;
        check_api_key(self.api_key.as_deref())?;
        Ok(url.normalized)
    }

    /// The spec the node table keeps, reached at `address` (`HOST:PORT`) when given.
    pub(crate) fn into_spec(self, address: Option<&str>) -> PyResult<NodeSpec> {
        let address = address
            .map(str::parse::<SocketAddr>)
            .transpose()
            .map_err(|_| PyErr::from(Error::new(Kind::InvalidNode, "a node's address must read HOST:PORT")))?;
        Ok(NodeSpec {
            models: self.models.clone().unwrap_or_default(),
            declared_models: self.models,
            role: Role::parse(&self.role)?,
            speed: self.speed,
            max_concurrency: self.max_concurrency.filter(|&m| m > 0),
            api_key: self.api_key.filter(|k| !k.is_empty()),
            bootstrap_port: self.bootstrap_port,
            lease_ttl: self.lease_ttl,
            labels: self.labels,
            address,
        })
    }
}

/// What a node was registered with (its API key only when `with_key`: status shows whether
/// it has one, never the key), plus the models it serves and where it is reached.
pub(crate) fn record_dict<'py>(py: Python<'py>, node: &Node, with_key: bool) -> PyResult<Bound<'py, PyDict>> {
    let spec = node.spec();
    let out = PyDict::new(py);
    out.set_item("url", node.url())?;
    out.set_item("generation", node.generation())?;
    out.set_item("role", node.role().name())?;
    out.set_item("models", node.models())?;
    out.set_item("declared_models", &spec.declared_models)?;
    out.set_item("speed", spec.speed)?;
    out.set_item("max_concurrency", node.counters().max_concurrency())?;
    out.set_item("has_api_key", spec.api_key.is_some())?;
    if with_key {
        out.set_item("api_key", &spec.api_key)?;
    }
    out.set_item("bootstrap_port", spec.bootstrap_port)?;
    out.set_item("lease_ttl", spec.lease_ttl)?;
    out.set_item("labels", &spec.labels)?;
    out.set_item("address", spec.address.map(|a| a.to_string()))?;
    Ok(out)
}

//! Data-plane errors raised as the exception classes defined once in `pdproxy/errors.py`.
//! The exception's message is safe to show a client; the node and the underlying cause (which
//! name addresses or OS errors) go to its `detail` attribute only.

use std::error::Error as _;

use pyo3::prelude::*;

use crate::engine::Refusal;
use crate::error::{Error, Kind};

pyo3::import_exception!(pdproxy.errors, ConfigError);
pyo3::import_exception!(pdproxy.errors, InvalidRequest);
pyo3::import_exception!(pdproxy.errors, InvalidNode);
pyo3::import_exception!(pdproxy.errors, NodeUnresolvable);
pyo3::import_exception!(pdproxy.errors, NodeNotFound);
pyo3::import_exception!(pdproxy.errors, NoNodeAvailable);
pyo3::import_exception!(pdproxy.errors, ModelNotFound);
pyo3::import_exception!(pdproxy.errors, Overloaded);
pyo3::import_exception!(pdproxy.errors, UpstreamError);
pyo3::import_exception!(pdproxy.errors, InvalidAnswer);
pyo3::import_exception!(pdproxy.errors, UpstreamConnectError);
pyo3::import_exception!(pdproxy.errors, UpstreamTimeout);
pyo3::import_exception!(pdproxy.errors, Draining);
pyo3::import_exception!(pdproxy.errors, ProxyOverloaded);
pyo3::import_exception!(pdproxy.errors, LinkFailed);
pyo3::import_exception!(pdproxy.errors, Unauthorized);

impl From<Error> for PyErr {
    fn from(err: Error) -> Self {
        exception(&err)
    }
}

/// The most specific Python exception for a data-plane error.
fn exception(err: &Error) -> PyErr {
    let detail = match (err.node(), err.source()) {
        (Some(node), Some(cause)) => Some(format!("node {node}: {cause}")),
        (Some(node), None) => Some(format!("node {node}")),
        (None, cause) => cause.map(ToString::to_string),
    };
    let args = (err.message().to_owned(), detail, err.retry_after(), err.param());
    match err.kind() {
        Kind::InvalidRequest => InvalidRequest::new_err(args),
        Kind::InvalidNode => InvalidNode::new_err(args),
        Kind::NodeUnresolvable => NodeUnresolvable::new_err(args),
        Kind::NodeNotFound => NodeNotFound::new_err(args),
        Kind::ModelNotFound => ModelNotFound::new_err(args),
        Kind::NoNodes | Kind::NoHealthyNode => NoNodeAvailable::new_err(args),
        Kind::Overloaded => Overloaded::new_err(args),
        Kind::Connect => UpstreamConnectError::new_err(args),
        Kind::Timeout => UpstreamTimeout::new_err(args),
        Kind::Upstream | Kind::Cancelled => UpstreamError::new_err(args),
        Kind::InvalidAnswer => InvalidAnswer::new_err(args),
        Kind::Resources => ProxyOverloaded::new_err(args),
        Kind::Config => ConfigError::new_err(args),
        Kind::LinkFailed => LinkFailed::new_err(args),
    }
}

/// The gate's refusal as the exception the control plane answers with.
pub(crate) fn refusal_to_pyerr(refusal: Refusal, max_requests: usize) -> PyErr {
    match refusal {
        Refusal::Draining => Draining::new_err("the proxy is draining and takes no new requests"),
        Refusal::Full => ProxyOverloaded::new_err(format!("the proxy is serving its limit of {max_requests} requests")),
    }
}

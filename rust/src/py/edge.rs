//! `EdgeListener` and `Edge`: the public listener, bound before anything else starts, and the
//! edge serving it with a router's engine.

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::config::seconds;
use super::router::Router;
use crate::edge::cors::Cors;
use crate::edge::{self, EdgeConfig, PdProtocol};
use crate::observe::access::Format;
use crate::tls;

#[pyclass(frozen, name = "EdgeListener", module = "pdproxy._pdproxy")]
pub(crate) struct EdgeListener {
    listener: Mutex<Option<std::net::TcpListener>>,
    #[pyo3(get)]
    host: String,
    #[pyo3(get)]
    port: u16,
}

#[pymethods]
impl EdgeListener {
    /// Binds `host:port` now (raises `ConfigError` when the port is taken).
    #[new]
    fn new(host: &str, port: u16, backlog: i32) -> PyResult<Self> {
        let listener = edge::bind(host, port, backlog)?;
        let address = listener.local_addr().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Self { listener: Mutex::new(Some(listener)), host: address.ip().to_string(), port: address.port() })
    }
}

/// The settings the edge reads from `Settings`: the groups it needs, each by attribute (no
/// defaults here).
#[derive(FromPyObject)]
pub(crate) struct EdgeSettings {
    security: EdgeSecurity,
    limits: EdgeLimits,
    timeouts: EdgeTimeouts,
    pd: EdgePd,
    observability: EdgeLog,
}

/// `settings.security`: keys, CORS, TLS.
#[derive(FromPyObject)]
struct EdgeSecurity {
    api_keys: Vec<String>,
    allow_origins: Vec<String>,
    allow_credentials: bool,
    allow_methods: Vec<String>,
    allow_headers: Vec<String>,
    ssl: bool,
    ssl_certfile: PathBuf,
    ssl_keyfile: PathBuf,
}

/// `settings.limits`.
#[derive(FromPyObject)]
struct EdgeLimits {
    max_body_size: usize,
}

/// `settings.timeouts`.
#[derive(FromPyObject)]
struct EdgeTimeouts {
    body: f64,
    first_byte: f64,
    header_read: f64,
}

/// `settings.pd`.
#[derive(FromPyObject)]
struct EdgePd {
    serving_strategy: String,
    protocol: String,
    link_timeout: f64,
}

/// `settings.observability`: the access log.
#[derive(FromPyObject)]
struct EdgeLog {
    access_log: bool,
    access_log_format: String,
}

#[pyclass(frozen, name = "Edge", module = "pdproxy._pdproxy")]
pub(crate) struct Edge {
    inner: edge::Edge,
}

#[pymethods]
impl Edge {
    /// Starts serving `listener` on `threads` threads, at most `max_connections` client
    /// connections at once: inference requests with `router`'s engine, everything else through
    /// the control plane at `control_socket`, which counts as stuck after `control_stale_after`
    /// seconds without a `heartbeat`.
    #[new]
    fn new(
        router: PyRef<'_, Router>,
        listener: PyRef<'_, EdgeListener>,
        settings: EdgeSettings,
        threads: usize,
        max_connections: usize,
        control_socket: PathBuf,
        control_stale_after: f64,
    ) -> PyResult<Self> {
        let listener = listener
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this listener already serves an edge"))?;
        let config = edge_config(settings, control_socket, control_stale_after, max_connections)?;
        let inner = edge::Edge::start(router.engine.clone(), &listener, config, threads)?;
        Ok(Self { inner })
    }

    /// The control plane's loop is alive.
    fn heartbeat(&self) {
        self.inner.heartbeat();
    }

    /// Stops accepting and ends what still runs (streams get a terminal `draining` event);
    /// returns once the connections have closed (within about two seconds), with the number of
    /// those that did not.
    fn shutdown(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.shutdown());
        self.inner.connections()
    }

    /// Client connections open now.
    #[getter]
    fn connections(&self) -> usize {
        self.inner.connections()
    }
}

/// The edge's settings from the control plane's.
pub(crate) fn edge_config(
    settings: EdgeSettings,
    control_socket: PathBuf,
    control_stale_after: f64,
    max_connections: usize,
) -> PyResult<EdgeConfig> {
    let EdgeSettings { security, limits, timeouts, pd, observability } = settings;
    let disaggregation = match pd.serving_strategy.as_str() {
        "DistServe" => Some(PdProtocol::parse(&pd.protocol)?),
        _ => None,
    };
    Ok(EdgeConfig {
        api_keys: security.api_keys,
        max_body_size: limits.max_body_size,
        body_timeout: seconds("body_timeout", timeouts.body)?,
        disaggregation,
        access_log: observability.access_log.then_some(if observability.access_log_format == "json" {
            Format::Json
        } else {
            Format::Text
        }),
        header_read_timeout: seconds("header_read_timeout", timeouts.header_read)?,
        control_socket,
        control_timeout: seconds("first_byte_timeout", timeouts.first_byte)?,
        control_stale_after: seconds("control_stale_after", control_stale_after)?,
        pd_probe_timeout: seconds("pd_link_timeout", pd.link_timeout)?,
        cors: Cors::new(
            &security.allow_origins,
            security.allow_credentials,
            &security.allow_methods,
            &security.allow_headers,
        ),
        tls: security.ssl.then(|| tls::server_config(&security.ssl_certfile, &security.ssl_keyfile)).transpose()?,
        max_connections: max_connections.max(1),
    })
}

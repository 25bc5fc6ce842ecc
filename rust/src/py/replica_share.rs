//! `ReplicaShare`: the control plane starts and reads the sharing of load with other replicas
//! (`replica_share`), on its router's runtime.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::router::Router;
use crate::replica_share;

#[pyclass(frozen, name = "ReplicaShare", module = "pdproxy._pdproxy")]
pub(crate) struct ReplicaShare {
    inner: replica_share::ReplicaShare,
}

#[pymethods]
impl ReplicaShare {
    /// Binds `listen` (`HOST:PORT`, raises `ConfigError` when it cannot) and sends `router`'s
    /// own load on its nodes to `peers` every `interval_ms`, until `close` (or the router's).
    #[new]
    fn new(router: PyRef<'_, Router>, listen: &str, peers: Vec<String>, interval_ms: u64) -> PyResult<Self> {
        if interval_ms == 0 {
            return Err(PyValueError::new_err("replica_share_interval_ms must be at least 1"));
        }
        let inner = replica_share::ReplicaShare::start(
            &router.engine,
            listen,
            peers,
            Duration::from_millis(interval_ms),
            router.runtime,
            router.shutdown.child_token(),
        )?;
        Ok(Self { inner })
    }

    /// The address it listens on, `HOST:PORT` (the port chosen, when asked for 0).
    #[getter]
    fn listen(&self) -> String {
        self.inner.local.to_string()
    }

    /// Datagrams sent, received and refused (not this protocol), and the peers live now.
    fn stats(&self) -> (u64, u64, u64, u64) {
        let s = &self.inner.stats;
        (
            s.sent.load(Ordering::Relaxed),
            s.received.load(Ordering::Relaxed),
            s.malformed.load(Ordering::Relaxed),
            s.live_peers.load(Ordering::Relaxed),
        )
    }

    /// Stops sharing; the peers' load leaves the nodes' counters.
    fn close(&self) {
        self.inner.stop();
    }
}

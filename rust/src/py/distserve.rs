//! `DistServeCore`: LMDeploy DistServe's data-plane state as the control plane sees it. The
//! control plane makes the links (`connect` is its callback, run on its loop when a request's
//! pair is not connected) and sweeps the ledger; the data plane preserves, consumes and frees
//! the sessions.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use tokio::sync::oneshot;

use super::bridge::{resolve, to_object, LoopBridge};
use super::config::seconds;
use crate::distserve::{DistServe, DistServeConfig, LinkMaker, SessionHandle};
use crate::engine::Engine;
use crate::error::{Error, Kind, Result};
use crate::node::Node;

/// What the control plane gives when it starts LMDeploy's flow.
#[derive(FromPyObject)]
pub(crate) struct DistServeSettings {
    migration_protocol: u8,
    dummy_prefill: bool,
    free_timeout: f64,
    free_attempts: u32,
    journal: Option<PathBuf>,
}

#[pyclass(frozen, name = "DistServeCore", module = "pdproxy._pdproxy")]
pub(crate) struct DistServeCore {
    engine: Arc<Engine>,
    inner: Arc<DistServe>,
    runtime: &'static tokio::runtime::Runtime,
    bridge: Py<LoopBridge>,
}

impl DistServeCore {
    /// Starts the flow on `engine`: from now on its requests read `connect`'s links.
    pub(crate) fn start(
        py: Python<'_>,
        engine: &Arc<Engine>,
        runtime: &'static tokio::runtime::Runtime,
        bridge: Py<LoopBridge>,
        settings: DistServeSettings,
        connect: Py<PyAny>,
    ) -> PyResult<Self> {
        let config = DistServeConfig {
            migration_protocol: settings.migration_protocol,
            dummy_prefill: settings.dummy_prefill,
            free_timeout: seconds("pd_free_timeout", settings.free_timeout)?,
            free_attempts: settings.free_attempts,
            journal: settings.journal,
        };
        let maker = ControlPlaneLinks { bridge: bridge.clone_ref(py), connect: Arc::new(connect) };
        let inner = Arc::new(DistServe::new(config, Box::new(maker)));
        engine.distserve.store(Some(Arc::clone(&inner)));
        Ok(Self { engine: Arc::clone(engine), inner, runtime, bridge })
    }

    fn session(&self, id: u64) -> PyResult<Arc<crate::distserve::Session>> {
        self.inner.sessions.get(id).ok_or_else(|| PyKeyError::new_err(format!("no preserved session {id}")))
    }
}

#[pymethods]
impl DistServeCore {
    /// Records a session preserved on `prefill` for `decode`; its id. A prefill node no longer
    /// registered is reached with `api_key` to free it.
    #[pyo3(signature = (prefill, session_id, decode=None, api_key=None))]
    fn add(&self, prefill: &str, session_id: u64, decode: Option<&str>, api_key: Option<String>) -> PyResult<u64> {
        let node = match self.engine.node(prefill) {
            Ok(node) => node,
            Err(_) => Arc::new(Node::detached(prefill, api_key)?),
        };
        Ok(self.inner.sessions.add(node, session_id, decode).id)
    }

    /// Records the session a prefill answer (`answer`, its body) preserved on `prefill` for
    /// `decode`: its id, and the decode's `migration_request` (JSON). Raises `InvalidAnswer`
    /// when the answer names no session.
    #[pyo3(signature = (prefill, answer, decode, api_key=None))]
    fn preserve(&self, prefill: &str, answer: &[u8], decode: &str, api_key: Option<String>) -> PyResult<(u64, String)> {
        let handle = SessionHandle::from_answer(answer)?;
        let id = self.add(prefill, handle.session_id, Some(decode), api_key)?;
        Ok((id, self.inner.migration(prefill, &handle)))
    }

    /// The `migration_request` of a dummy prefill (JSON).
    fn dummy_migration(&self) -> String {
        self.inner.dummy_migration()
    }

    /// Session `id` as a log names it, while it is held.
    fn describe(&self, id: u64) -> Option<String> {
        let session = self.inner.sessions.get(id)?;
        Some(format!("prefill session {} on {}", session.session_id, session.prefill.url()))
    }

    /// Decode took session `id` over (nothing when it already ended).
    fn consume(&self, id: u64) {
        if let Some(session) = self.inner.sessions.get(id) {
            self.inner.sessions.consume(&session);
        }
    }

    /// Frees session `id` on its prefill node (once, whatever the number of callers); resolves
    /// to the state it ended in: `freed`, `lost`, `consumed`, or with `keep_if_unreachable`
    /// `preserved` when the node could not be reached.
    #[pyo3(signature = (id, keep_if_unreachable=false))]
    fn free<'py>(&self, py: Python<'py>, id: u64, keep_if_unreachable: bool) -> PyResult<Bound<'py, PyAny>> {
        let session = self.session(id)?;
        let future = self.bridge.get().create_future(py)?;
        let (reply, bridge) = (future.clone().unbind(), self.bridge.clone_ref(py));
        let (sessions, engine) = (Arc::clone(&self.inner.sessions), Arc::clone(&self.engine));
        self.runtime.spawn(async move {
            let state = sessions.free(&session, &engine.forwarder, keep_if_unreachable).await;
            bridge.get().submit(Box::new(move |py| resolve(py, &reply, to_object(py, state.name()))));
        });
        Ok(future)
    }

    /// The sessions still preserved, older than `older_than` seconds, and on `prefill` when
    /// given: (id, prefill node, session id) each.
    #[pyo3(signature = (older_than=0.0, prefill=None))]
    fn preserved(&self, older_than: f64, prefill: Option<&str>) -> Vec<(u64, String, u64)> {
        let sessions = self.inner.sessions.select(|s| {
            s.created.elapsed().as_secs_f64() >= older_than && prefill.is_none_or(|url| s.prefill.url() == url)
        });
        sessions.iter().map(|s| (s.id, s.prefill.url().to_owned(), s.session_id)).collect()
    }

    /// (held now, the oldest one's age in seconds, consumed, freed, could not be freed).
    fn counts(&self) -> (usize, Option<f64>, u64, u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let sessions = &self.inner.sessions;
        let (held, oldest) = sessions.held();
        (
            held,
            oldest,
            sessions.consumed.load(Relaxed),
            sessions.freed.load(Relaxed),
            sessions.free_failures.load(Relaxed),
        )
    }

    /// Why the last session that could not be freed was not, once.
    fn take_last_failure(&self) -> Option<String> {
        self.inner.sessions.take_last_failure()
    }

    /// The links of `url` were dropped: requests ask for them again.
    fn forget_links(&self, url: &str) {
        self.inner.forget_links(url);
    }

    /// Ends the flow: requests no longer find it.
    fn stop(&self) {
        self.engine.distserve.store(None);
    }
}

/// The control plane's link maker: `connect(prefill, decode, done)` runs on its loop and calls
/// `done(None)` once the pair is connected, `done(reason)` when it could not be.
struct ControlPlaneLinks {
    bridge: Py<LoopBridge>,
    connect: Arc<Py<PyAny>>,
}

impl LinkMaker for ControlPlaneLinks {
    fn connect(&self, prefill: &str, decode: &str) -> oneshot::Receiver<Result<()>> {
        let (sender, receiver) = oneshot::channel();
        let done = LinkDone(Mutex::new(Some(sender)));
        let (prefill, decode) = (prefill.to_owned(), decode.to_owned());
        let connect = Arc::clone(&self.connect);
        self.bridge.get().submit(Box::new(move |py| {
            if let Err(e) = connect.bind(py).call1((prefill, decode, done)) {
                // `done` went with the failed call: the request learns of it as a dropped answer.
                e.print(py);
            }
        }));
        receiver
    }
}

/// The answer to one link request.
#[pyclass(frozen, name = "LinkDone", module = "pdproxy._pdproxy")]
pub(crate) struct LinkDone(Mutex<Option<oneshot::Sender<Result<()>>>>);

#[pymethods]
impl LinkDone {
    /// `None`: connected; else why the pair could not be connected.
    #[pyo3(signature = (error=None))]
    fn __call__(&self, error: Option<String>) {
        if let Some(sender) = self.0.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = sender.send(error.map_or(Ok(()), |message| Err(Error::new(Kind::LinkFailed, message))));
        }
    }
}

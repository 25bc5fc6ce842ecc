//! LMDeploy DistServe's state in the data plane, shared by the edge and the embedded `Router`:
//! which prefill-decode links are connected, and the ledger of preserved prefill sessions.
//!
//! Links are made by the control plane (its handshakes, retries and worker-group markers); a
//! request reads whether its pair is connected here, without a call, and asks the control
//! plane (`LinkMaker`) only when it is not. Between a prefill's answer and its decode's first
//! byte the request's KV cache lives on the prefill node and nobody but the proxy knows it is
//! still needed: a `Preserved` handle frees it on the prefill node (`/distserve/free_cache`),
//! exactly once, unless decode consumed it. The control plane sweeps what outlives its TTL.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::oneshot;

use crate::error::{Error, Kind, Result};
use crate::node::Node;
use crate::upstream::forward::{Forwarder, ResponseBody};
use crate::upstream::ForwardRequest;

/// The settings of LMDeploy's flow, from the control plane.
#[derive(Debug, Clone)]
pub(crate) struct DistServeConfig {
    /// LMDeploy's `MigrationProtocol` number (`--migration-protocol`).
    pub(crate) migration_protocol: u8,
    /// No prefill: decode runs from a dummy migration (LMDeploy's benchmark mode).
    pub(crate) dummy_prefill: bool,
    /// Longest wait for one `free_cache` call.
    pub(crate) free_timeout: Duration,
    pub(crate) free_attempts: u32,
    /// In a worker group: where this worker journals its sessions (one small file each).
    pub(crate) journal: Option<PathBuf>,
}

/// The control plane's side of a link: connects `prefill` to `decode` (sharing a handshake in
/// flight) and answers once it is connected, or why it could not be.
pub(crate) trait LinkMaker: Send + Sync {
    fn connect(&self, prefill: &str, decode: &str) -> oneshot::Receiver<Result<()>>;
}

pub(crate) struct DistServe {
    pub(crate) config: DistServeConfig,
    /// Decode nodes connected to each prefill node.
    connected: Mutex<HashMap<String, HashSet<String>>>,
    maker: Box<dyn LinkMaker>,
    pub(crate) sessions: Arc<Sessions>,
}

impl std::fmt::Debug for DistServe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistServe").field("config", &self.config).finish_non_exhaustive()
    }
}

impl DistServe {
    pub(crate) fn new(config: DistServeConfig, maker: Box<dyn LinkMaker>) -> Self {
        let sessions = Arc::new(Sessions::new(&config));
        Self { config, connected: Mutex::default(), maker, sessions }
    }

    fn is_connected(&self, prefill: &str, decode: &str) -> bool {
        let connected = self.connected.lock().unwrap_or_else(PoisonError::into_inner);
        connected.get(prefill).is_some_and(|decodes| decodes.contains(decode))
    }

    /// Returns once `prefill` and `decode` are linked: at once when they are, else when the
    /// control plane has connected them.
    pub(crate) async fn link(&self, prefill: &str, decode: &str) -> Result<()> {
        if self.is_connected(prefill, decode) {
            return Ok(());
        }
        let answer = self.maker.connect(prefill, decode).await;
        answer.map_err(|_| Error::new(Kind::LinkFailed, "the control plane dropped the link request"))??;
        let mut connected = self.connected.lock().unwrap_or_else(PoisonError::into_inner);
        connected.entry(prefill.to_owned()).or_default().insert(decode.to_owned());
        Ok(())
    }

    /// Forgets every link of `url` (the control plane dropped them).
    pub(crate) fn forget_links(&self, url: &str) {
        let mut connected = self.connected.lock().unwrap_or_else(PoisonError::into_inner);
        connected.remove(url);
        for decodes in connected.values_mut() {
            decodes.remove(url);
        }
    }

    /// LMDeploy's `MigrationRequest` for a session preserved on `prefill` (JSON).
    pub(crate) fn migration(&self, prefill: &str, handle: &SessionHandle) -> String {
        self.migration_json(prefill, handle.session_id, handle.token_id, &handle.block_ids, false)
    }

    /// The migration of a dummy prefill: decode starts from nothing.
    pub(crate) fn dummy_migration(&self) -> String {
        self.migration_json("dummy:dummy", 0, 0, &[], true)
    }

    fn migration_json(&self, engine: &str, session: u64, token: i64, blocks: &[i64], dummy: bool) -> String {
        let migration = MigrationRequest {
            protocol: self.config.migration_protocol,
            remote_engine_id: engine,
            remote_session_id: session,
            remote_token_id: token,
            remote_block_ids: blocks,
            is_dummy_prefill: dummy,
        };
        // Written straight from the struct: a `json!` map cost twice the instructions.
        serde_json::to_string(&migration).expect("a migration request serializes")
    }
}

/// LMDeploy's `MigrationRequest`, as the decode's body carries it.
#[derive(Serialize)]
struct MigrationRequest<'a> {
    protocol: u8,
    remote_engine_id: &'a str,
    remote_session_id: u64,
    remote_token_id: i64,
    remote_block_ids: &'a [i64],
    is_dummy_prefill: bool,
}

/// What a prefill answer says of the session it preserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SessionHandle {
    /// The engine's own id of the session (`id` is the proxy's).
    pub(crate) session_id: u64,
    pub(crate) block_ids: Vec<i64>,
    /// The last of `remote_token_ids` (0 when there is none).
    pub(crate) token_id: i64,
}

/// The members of a prefill answer the handle is read from, kept as raw JSON; anything else
/// (the whole completion) is skipped unparsed.
#[derive(Deserialize)]
struct PrefillAnswer<'a> {
    #[serde(borrow)]
    cache_session_id: Option<&'a RawValue>,
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_block_ids: Option<&'a RawValue>,
    #[serde(borrow)]
    remote_token_ids: Option<&'a RawValue>,
}

impl SessionHandle {
    /// The handle in a prefill answer: `cache_session_id` when it is a non-negative integer,
    /// else an `id` that is a string of digits (LMDeploy's contract changed between versions;
    /// anything else is refused rather than guessed).
    pub(crate) fn from_answer(body: &[u8]) -> Result<Self> {
        let invalid = |message: &str| Error::new(Kind::InvalidAnswer, message.to_owned());
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            let json = serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok();
            return Err(invalid(if json {
                "the prefill node's answer is not a JSON object"
            } else {
                "the prefill node's answer is not JSON"
            }));
        }
        let answer: PrefillAnswer<'_> =
            serde_json::from_slice(body).map_err(|_| invalid("the prefill node's answer is not JSON"))?;
        let from_id = || {
            let id: String = serde_json::from_str(answer.id?.get()).ok()?;
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            id.parse().ok()
        };
        let session_id = answer
            .cache_session_id
            .and_then(|raw| serde_json::from_str::<u64>(raw.get()).ok())
            .or_else(from_id)
            .ok_or_else(|| invalid("the prefill node's answer names no session (cache_session_id or an integer id)"))?;
        let block_ids = integers(answer.cache_block_ids, "cache_block_ids")?;
        let tokens = integers(answer.remote_token_ids, "remote_token_ids")?;
        Ok(Self { session_id, block_ids, token_id: tokens.last().copied().unwrap_or(0) })
    }
}

/// A list of integers of a prefill answer (absent, null or empty: none).
fn integers(raw: Option<&RawValue>, name: &str) -> Result<Vec<i64>> {
    let Some(raw) = raw else { return Ok(Vec::new()) };
    serde_json::from_str::<Option<Vec<i64>>>(raw.get())
        .map(Option::unwrap_or_default)
        .map_err(|_| Error::new(Kind::InvalidAnswer, format!("{name} is not a list of integers")))
}

/// Where a preserved session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum SessionState {
    Preserved = 0,
    Freeing = 1,
    /// Decode took it over: it frees it on the prefill node itself.
    Consumed = 2,
    Freed = 3,
    /// Could not be freed: the prefill node keeps its KV blocks until it restarts.
    Lost = 4,
}

impl SessionState {
    fn from_u8(raw: u8) -> Self {
        match raw {
            0 => Self::Preserved,
            1 => Self::Freeing,
            2 => Self::Consumed,
            3 => Self::Freed,
            _ => Self::Lost,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Preserved => "preserved",
            Self::Freeing => "freeing",
            Self::Consumed => "consumed",
            Self::Freed => "freed",
            Self::Lost => "lost",
        }
    }
}

/// One session preserved on a prefill node.
#[derive(Debug)]
#[allow(clippy::struct_field_names)] // `session_id`: the engine's name for it
pub(crate) struct Session {
    pub(crate) id: u64,
    /// The prefill node (kept: the session is freed there even after the node was removed).
    pub(crate) prefill: Arc<Node>,
    pub(crate) session_id: u64,
    pub(crate) created: Instant,
    state: AtomicU8,
}

impl Session {
    pub(crate) fn state(&self) -> SessionState {
        SessionState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves the session from `from` to `to`; false when it was not in `from` (another caller
    /// got there first).
    fn advance(&self, from: SessionState, to: SessionState) -> bool {
        self.state.compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

/// The ledger: every session preserved now, and how the others ended.
#[derive(Debug)]
pub(crate) struct Sessions {
    entries: Mutex<HashMap<u64, Arc<Session>>>,
    next_id: AtomicU64,
    free_timeout: Duration,
    free_attempts: u32,
    journal: Option<PathBuf>,
    pub(crate) consumed: AtomicU64,
    pub(crate) freed: AtomicU64,
    pub(crate) free_failures: AtomicU64,
    /// Why the last session that could not be freed was not (for the control plane's log).
    last_failure: Mutex<Option<String>>,
}

impl Sessions {
    fn new(config: &DistServeConfig) -> Self {
        if let Some(journal) = &config.journal {
            let _ = std::fs::create_dir_all(journal);
        }
        Self {
            entries: Mutex::default(),
            next_id: AtomicU64::new(1),
            free_timeout: config.free_timeout,
            free_attempts: config.free_attempts.max(1),
            journal: config.journal.clone(),
            consumed: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            free_failures: AtomicU64::new(0),
            last_failure: Mutex::default(),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a session preserved on `prefill` for `decode` (in the journal).
    pub(crate) fn add(&self, prefill: Arc<Node>, session_id: u64, decode: Option<&str>) -> Arc<Session> {
        let session = Arc::new(Session {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            prefill,
            session_id,
            created: Instant::now(),
            state: AtomicU8::new(SessionState::Preserved as u8),
        });
        if let Some(journal) = &self.journal {
            let record =
                serde_json::json!({"prefill": session.prefill.url(), "session_id": session_id, "decode": decode});
            let _ = std::fs::write(journal.join(format!("{}.json", session.id)), record.to_string());
        }
        self.entries().insert(session.id, Arc::clone(&session));
        session
    }

    fn settle(&self, session: &Session) {
        self.entries().remove(&session.id);
        if let Some(journal) = &self.journal {
            let _ = std::fs::remove_file(journal.join(format!("{}.json", session.id)));
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<Session>> {
        self.entries().get(&id).cloned()
    }

    /// Decode has taken the session over.
    pub(crate) fn consume(&self, session: &Session) {
        if session.advance(SessionState::Preserved, SessionState::Consumed) {
            self.consumed.fetch_add(1, Ordering::Relaxed);
            self.settle(session);
        }
    }

    /// The sessions still preserved that match `keep`.
    pub(crate) fn select(&self, keep: impl Fn(&Session) -> bool) -> Vec<Arc<Session>> {
        self.entries().values().filter(|s| s.state() == SessionState::Preserved && keep(s)).cloned().collect()
    }

    /// (sessions held now, the oldest one's age in seconds).
    pub(crate) fn held(&self) -> (usize, Option<f64>) {
        let entries = self.entries();
        let oldest = entries.values().map(|s| s.created.elapsed().as_secs_f64()).reduce(f64::max);
        (entries.len(), oldest)
    }

    pub(crate) fn take_last_failure(&self) -> Option<String> {
        self.last_failure.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Frees `session` on its prefill node, once whatever the number of callers, with bounded
    /// retries. A session that cannot be freed is given up (`Lost`), or with
    /// `keep_if_unreachable` kept preserved, for the sweep to try again. Returns its state after.
    pub(crate) async fn free(
        &self,
        session: &Arc<Session>,
        forwarder: &Forwarder,
        keep_if_unreachable: bool,
    ) -> SessionState {
        if !session.advance(SessionState::Preserved, SessionState::Freeing) {
            return session.state();
        }
        let body = serde_json::json!({
            "remote_engine_id": session.prefill.url(),
            "remote_session_id": session.session_id,
        });
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let request = ForwardRequest {
            method: Method::POST,
            path_and_query: "/distserve/free_cache".to_owned(),
            headers,
            extra: Vec::new(),
            body: Bytes::from(body.to_string()),
        };
        let mut why = String::new();
        for attempt in 0..self.free_attempts {
            match tokio::time::timeout(self.free_timeout, free_once(forwarder, &session.prefill, &request)).await {
                Ok(Ok(())) => {
                    session.state.store(SessionState::Freed as u8, Ordering::Release);
                    self.freed.fetch_add(1, Ordering::Relaxed);
                    self.settle(session);
                    return SessionState::Freed;
                }
                Ok(Err(e)) => e.message().clone_into(&mut why),
                Err(_) => why = format!("no answer within {}s", self.free_timeout.as_secs_f64()),
            }
            if attempt + 1 < self.free_attempts {
                tokio::time::sleep(Duration::from_millis(100 << attempt.min(6))).await;
            }
        }
        if keep_if_unreachable {
            session.state.store(SessionState::Preserved as u8, Ordering::Release);
            return SessionState::Preserved;
        }
        session.state.store(SessionState::Lost as u8, Ordering::Release);
        self.free_failures.fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(format!("could not free prefill session {} on {}: {why}", session.session_id, session.prefill.url()));
        self.settle(session);
        SessionState::Lost
    }
}

async fn free_once(forwarder: &Forwarder, node: &Node, request: &ForwardRequest) -> Result<()> {
    let answer = forwarder.forward(node, request, true, None).await?;
    if let ResponseBody::Streaming(stream) = answer.body {
        forwarder.read_answer(stream.body).await?;
    }
    if answer.status == StatusCode::OK {
        Ok(())
    } else {
        Err(Error::new(Kind::Upstream, format!("free_cache answered {}", answer.status.as_u16())))
    }
}

/// A request's session between its prefill's answer and its decode's first byte: consumed then,
/// or freed on its prefill node when dropped before (decode refused or failed, the link failed,
/// the client left, the proxy shut down).
pub(crate) struct Preserved {
    session: Arc<Session>,
    sessions: Arc<Sessions>,
    /// Boxed: a request's answer carries the handle, and most answers have none.
    forwarder: Box<Forwarder>,
}

impl Preserved {
    pub(crate) fn new(sessions: &Arc<Sessions>, session: Arc<Session>, forwarder: Forwarder) -> Self {
        Self { session, sessions: Arc::clone(sessions), forwarder: Box::new(forwarder) }
    }

    pub(crate) fn consume(self) {
        self.sessions.consume(&self.session);
    }
}

impl Drop for Preserved {
    fn drop(&mut self) {
        if self.session.state() != SessionState::Preserved {
            return;
        }
        let (session, sessions, forwarder) =
            (Arc::clone(&self.session), Arc::clone(&self.sessions), (*self.forwarder).clone());
        // Without a runtime (the proxy is gone) it is left to the node's restart.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { sessions.free(&session, &forwarder, false).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handle_is_read_as_lmdeploy_writes_it() {
        let answer = br#"{"id": "7", "cache_block_ids": [1, 2], "remote_token_ids": [5, 9], "choices": []}"#;
        let handle = SessionHandle::from_answer(answer).unwrap();
        assert_eq!(handle, SessionHandle { session_id: 7, block_ids: vec![1, 2], token_id: 9 });
        let answer = br#"{"id": "chatcmpl-x", "cache_session_id": 12, "cache_block_ids": null}"#;
        let handle = SessionHandle::from_answer(answer).unwrap();
        assert_eq!(handle, SessionHandle { session_id: 12, block_ids: vec![], token_id: 0 });
    }

    #[test]
    fn a_handle_that_is_not_one_is_refused() {
        for (answer, message) in [
            (&br"[1]"[..], "not a JSON object"),
            (b"nope", "not JSON"),
            (br#"{"id": "chatcmpl-x"}"#, "names no session"),
            (br#"{"cache_session_id": -1}"#, "names no session"),
            (br#"{"cache_session_id": true}"#, "names no session"),
            (br#"{"cache_session_id": 1, "cache_block_ids": [1, "2"]}"#, "cache_block_ids is not a list"),
            (br#"{"cache_session_id": 1, "remote_token_ids": 3}"#, "remote_token_ids is not a list"),
        ] {
            let error = SessionHandle::from_answer(answer).unwrap_err();
            assert_eq!(error.kind(), Kind::InvalidAnswer);
            assert!(error.message().contains(message), "{}: {}", String::from_utf8_lossy(answer), error.message());
        }
    }
}

//! The edge: the public HTTP/1.1 listener inside the data plane. Inference requests (Hybrid,
//! and the vLLM and SGLang prefill/decode legs) are served here end to end with no Python call;
//! everything else goes to the control plane unchanged (`control`).

pub(crate) mod answer;
pub(crate) mod body;
pub(crate) mod control;
mod control_body;
pub(crate) mod cors;
mod error_answer;
mod hybrid;
pub(crate) mod keys;
mod notes;
mod pd;
mod pipeline;
mod request;
mod server;
#[cfg(test)]
mod tests;
mod worker;

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use http::header::HeaderValue;
use http::request::Parts;
use http::HeaderMap;
use socket2::{Domain, Socket, Type};
use tokio_util::sync::CancellationToken;

use self::control::ControlPlane;
use self::cors::Cors;
use self::keys::Keys;
// What the Python module reaches the edge's parts through.
#[cfg(feature = "python")]
pub(crate) use self::pd::prefill_body;
pub(crate) use self::pipeline::Strategy;
#[cfg(feature = "python")]
pub(crate) use self::request::{request_id, BodyError};
use crate::engine::Engine;
use crate::error::{Error, Kind, Result};
use crate::observe::access::{AccessLog, Format, Record};
use crate::tenants::Tenant;

/// Inference endpoints, routed by the body's model; other POSTs under `/v1/` are served too
/// when their body names a model (as `pdproxy/server/app.py` routes them).
pub(crate) const INFERENCE_PATHS: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/generate",
    "/pooling",
];

/// The prefill/decode protocol of a DistServe deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PdProtocol {
    /// LMDeploy's DistServe: prefill preserving its KV, decode migrating it (the control plane
    /// makes the links and sweeps the session ledger).
    Lmdeploy,
    Vllm,
    Sglang,
}

impl PdProtocol {
    pub(crate) fn parse(raw: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|protocol| protocol.name() == raw)
            .ok_or_else(|| Error::new(Kind::Config, format!("unknown pd_protocol {raw:?}")))
    }

    pub(crate) const ALL: [Self; 3] = [Self::Lmdeploy, Self::Vllm, Self::Sglang];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Lmdeploy => "lmdeploy",
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }

    /// The paths that go through prefill and decode nodes.
    pub(crate) fn paths(self) -> &'static [&'static str] {
        match self {
            Self::Lmdeploy | Self::Vllm => &["/v1/chat/completions", "/v1/completions"],
            Self::Sglang => &["/v1/chat/completions", "/v1/completions", "/generate"],
        }
    }
}

/// The edge's settings. Values come from the control plane's settings; no defaults here.
#[derive(Debug, Clone)]
pub(crate) struct EdgeConfig {
    pub(crate) api_keys: Vec<String>,
    pub(crate) max_body_size: usize,
    pub(crate) body_timeout: Duration,
    /// `None`: Hybrid serving; else the protocol of DistServe.
    pub(crate) disaggregation: Option<PdProtocol>,
    pub(crate) access_log: Option<Format>,
    pub(crate) header_read_timeout: Duration,
    pub(crate) control_socket: PathBuf,
    /// Longest wait for the control plane's response head.
    pub(crate) control_timeout: Duration,
    /// Silence after which the control plane counts as stuck.
    pub(crate) control_stale_after: Duration,
    /// SGLang: longest wait for a prefill node's `/server_info`.
    pub(crate) pd_probe_timeout: Duration,
    /// CORS on the inference routes; `None`: off.
    pub(crate) cors: Option<cors::Cors>,
    /// HTTPS (`--ssl`): the certificate clients get; `None`: plain HTTP.
    pub(crate) tls: Option<Arc<rustls::ServerConfig>>,
    /// Client connections open at once; past it a new one is answered 503 at accept and closed.
    pub(crate) max_connections: usize,
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Through the pipeline, its nodes chosen by the strategy.
    Inference(Strategy),
    ControlPlane,
}

/// What every edge thread shares.
pub(crate) struct EdgeState {
    pub(crate) engine: Arc<Engine>,
    pub(crate) config: EdgeConfig,
    keys: Keys,
    pub(crate) control: ControlPlane,
    access: Option<Arc<AccessLog>>,
    /// Set when the edge shuts down: the listener closes, streams still running end.
    pub(crate) shutdown: Arc<Stop>,
    /// Client connections open now.
    pub(crate) connections: AtomicUsize,
}

impl EdgeState {
    fn new(engine: Arc<Engine>, config: EdgeConfig) -> Self {
        Self {
            keys: Keys::new(&config.api_keys),
            control: ControlPlane::new(
                config.control_socket.clone(),
                config.control_timeout,
                config.control_stale_after,
            ),
            access: config.access_log.map(AccessLog::start),
            engine,
            config,
            shutdown: Arc::new(Stop::default()),
            connections: AtomicUsize::new(0),
        }
    }

    /// Where a POST to `path` goes.
    pub(crate) fn route(&self, path: &str) -> Route {
        let known = INFERENCE_PATHS.contains(&path);
        if !known && !path.starts_with("/v1/") {
            return Route::ControlPlane;
        }
        match self.config.disaggregation {
            Some(protocol) if protocol.paths().contains(&path) => Route::Inference(Strategy::Disaggregated(protocol)),
            _ => Route::Inference(Strategy::Hybrid { require_model: !known }),
        }
    }

    /// Whether the request may be served, and its tenant: with tenants configured, a tenant's
    /// key (or an API key, for no tenant) is required; without, an API key when any is set.
    pub(crate) fn authorize(&self, headers: &HeaderMap) -> Result<Option<Arc<Tenant>>, Unauthorized> {
        let tenants = &self.engine.tenants;
        if !tenants.configured() {
            return if self.keys.allows(headers) { Ok(None) } else { Err(Unauthorized) };
        }
        if let Some(tenant) = keys::client_key(headers).and_then(|key| tenants.by_key(key)) {
            return Ok(Some(tenant));
        }
        if self.keys.configured() && self.keys.allows(headers) {
            Ok(None)
        } else {
            Err(Unauthorized)
        }
    }

    fn record(&self, id: &HeaderValue, parts: &Parts, peer: SocketAddr) -> Option<Box<Record>> {
        let log = self.access.as_ref()?;
        Some(Record::new(log, peer.ip(), id.to_str().unwrap_or_default(), parts.method.as_str(), parts.uri.path()))
    }
}

/// A request without a valid key.
#[derive(Debug)]
pub(crate) struct Unauthorized;

/// A stop signal read on every poll of a stream: the flag is one atomic load (the token's own
/// check takes a lock); the token wakes whoever waits.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    flag: AtomicBool,
    token: CancellationToken,
}

impl Stop {
    pub(crate) fn set(&self) {
        self.flag.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }
}

/// Binds the public address now (so a busy port fails before anything else starts). No
/// `SO_REUSEPORT`: a second proxy on the same port is refused, not handed half the traffic.
pub(crate) fn bind(host: &str, port: u16, backlog: i32) -> Result<TcpListener> {
    let address: SocketAddr = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::with_source(Kind::Config, format!("cannot resolve {host}"), e))?
        .next()
        .ok_or_else(|| Error::new(Kind::Config, format!("{host} resolves to no address")))?;
    let failed = |what: &str, e: std::io::Error| {
        let reason = if e.kind() == std::io::ErrorKind::AddrInUse {
            "the address is already in use (is another pdproxy running?)".to_owned()
        } else {
            e.to_string()
        };
        Error::new(Kind::Config, format!("cannot {what} {address}: {reason}"))
    };
    let socket =
        Socket::new(Domain::for_address(address), Type::STREAM, None).map_err(|e| failed("open a socket for", e))?;
    socket.set_reuse_address(true).map_err(|e| failed("set SO_REUSEADDR on", e))?;
    socket.bind(&address.into()).map_err(|e| failed("listen on", e))?;
    socket.listen(backlog).map_err(|e| failed("listen on", e))?;
    socket.set_nonblocking(true).map_err(|e| failed("listen on", e))?;
    Ok(socket.into())
}

/// A running edge: `threads` threads, each with its own event loop, serving its connections
/// start to end (as nginx's workers do): a request never changes thread, and each thread keeps
/// its own pool of connections to the nodes. The first thread also accepts, handing each new
/// connection to the thread that serves the fewest.
pub(crate) struct Edge {
    state: Arc<EdgeState>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Edge {
    pub(crate) fn start(
        engine: Arc<Engine>,
        listener: &TcpListener,
        config: EdgeConfig,
        threads: usize,
    ) -> Result<Self> {
        listener.local_addr().map_err(|e| Error::with_source(Kind::Config, "listener has no address", e))?;
        let state = Arc::new(EdgeState::new(engine, config));
        let listener =
            listener.try_clone().map_err(|e| Error::with_source(Kind::Config, "cannot use the listener", e))?;
        let (inboxes, starts) = server::inboxes(threads.max(1));
        let mut acceptor = Some((listener, inboxes));
        let mut handles = Vec::with_capacity(starts.len());
        for (i, start) in starts.into_iter().enumerate() {
            let state = Arc::clone(&state);
            let acceptor = acceptor.take();
            let handle = std::thread::Builder::new()
                .name(format!("pdproxy-edge-{i}"))
                .spawn(move || server::run_thread(&state, start, acceptor))
                .map_err(|e| Error::with_source(Kind::Config, "cannot start an edge thread", e))?;
            handles.push(handle);
        }
        Ok(Self { state, threads: Mutex::new(handles) })
    }

    /// The control plane is alive.
    pub(crate) fn heartbeat(&self) {
        self.state.control.beat();
    }

    /// Stops accepting; streams still running end with a terminal `draining` event, and
    /// connections close; returns once every edge thread has ended.
    pub(crate) fn shutdown(&self) {
        self.state.shutdown.set();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        for thread in threads {
            let _ = thread.join();
        }
    }

    pub(crate) fn connections(&self) -> usize {
        self.state.connections.load(Ordering::Relaxed)
    }
}

/// The pipeline for inference requests another server took: the control plane's ASGI app,
/// served by granian (`--edge granian`) or mounted in someone's own server. The same phases,
/// strategies and answers as the edge's own requests.
pub(crate) struct Embedded {
    worker: Arc<worker::Worker>,
}

impl Embedded {
    /// `config`'s control-plane fields are not used: the caller is the control plane.
    pub(crate) fn new(engine: Arc<Engine>, config: EdgeConfig) -> Self {
        let forwarder = engine.forwarder.clone();
        Self { worker: Arc::new(worker::Worker::serving_for(Arc::new(EdgeState::new(engine, config)), forwarder)) }
    }

    /// How a POST to `path` is served: through the pipeline, or not an inference request.
    pub(crate) fn strategy(&self, path: &str) -> Option<Strategy> {
        match self.worker.state.route(path) {
            Route::Inference(strategy) => Some(strategy),
            Route::ControlPlane => None,
        }
    }

    /// Serves one request whose body the caller read (or failed to read).
    pub(crate) async fn serve(
        &self,
        parts: Parts,
        body: std::result::Result<bytes::Bytes, request::BodyError>,
        peer: SocketAddr,
        strategy: Strategy,
    ) -> http::Response<body::EdgeBody> {
        let (id, had_id) = request::request_id(&parts.headers);
        let peer = request::Peer::new(peer);
        let body = pipeline::ClientBody::Read(body);
        pipeline::serve(&self.worker, &peer, parts, body, id, had_id, strategy).await
    }

    /// Whether a request with these headers may be served (its key, or its tenant's).
    pub(crate) fn authorizes(&self, headers: &HeaderMap) -> bool {
        self.worker.state.authorize(headers).is_ok()
    }

    /// Whether browsers' requests get CORS answers at all (some origin is allowed).
    pub(crate) fn cors_enabled(&self) -> bool {
        self.worker.state.config.cors.is_some()
    }

    /// The answer to a CORS preflight for `path`, when the request is one and CORS applies.
    pub(crate) fn preflight(
        &self,
        method: &http::Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<http::Response<body::EdgeBody>> {
        let cors = self.worker.state.config.cors.as_ref().filter(|_| Cors::applies_to(path))?;
        Cors::is_preflight(method, headers).then(|| cors.preflight(headers, &request::request_id(headers).0))
    }

    /// The CORS permission an answer to a request for `path` carries (none for an origin not
    /// allowed, or no origin).
    pub(crate) fn cors_headers(&self, path: &str, headers: &HeaderMap) -> HeaderMap {
        let mut out = HeaderMap::new();
        let cors = self.worker.state.config.cors.as_ref().filter(|_| Cors::applies_to(path));
        if let (Some(cors), Some(origin)) = (cors, headers.get(http::header::ORIGIN)) {
            cors.decorate(&mut out, origin);
        }
        out
    }

    /// Streams still running end (the proxy shuts down).
    pub(crate) fn shutdown(&self) {
        self.worker.state.shutdown.set();
    }
}

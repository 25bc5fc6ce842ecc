//! A node: one upstream inference server, with counters that outlive any snapshot.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::Uri;

use crate::circuit::Circuit;
use crate::engine_report::{CountsThen, EngineFigures, EngineLoad, EngineReport};
use crate::engine_speed::EngineSpeed;
use crate::error::{Error, Kind, Result};
use crate::hidden_load::HiddenLoad;
use crate::histogram::{Gap, Histogram, Latency};
use crate::shared::{Binding, SharedTable};
use crate::upstream::Target;

/// What a node does in a disaggregated deployment (LMDeploy's `EngineRole`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    #[default]
    Hybrid,
    Prefill,
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Hybrid, Role::Prefill, Role::Decode];

    /// The role's place in tables indexed by role.
    pub fn index(self) -> usize {
        match self {
            Role::Hybrid => 0,
            Role::Prefill => 1,
            Role::Decode => 2,
        }
    }

    /// Accepts LMDeploy's integers (Hybrid=1, Prefill=2, Decode=3) and names, any case.
    pub fn parse(raw: &str) -> Result<Self> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "hybrid" | "1" => Ok(Role::Hybrid),
            "prefill" | "2" => Ok(Role::Prefill),
            "decode" | "3" => Ok(Role::Decode),
            _ => Err(Error::new(Kind::InvalidNode, format!("unknown role {raw:?}: use hybrid, prefill or decode"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Hybrid => "hybrid",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Whether a node may take new requests. Only `Healthy` nodes are selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NodeState {
    Healthy = 0,
    Unhealthy = 1,
    /// Finishing its requests; takes no new ones.
    Draining = 2,
    /// Up but not serving (an LMDeploy engine put to sleep).
    Sleeping = 3,
    /// Starting up: not serving yet.
    Initializing = 4,
}

impl NodeState {
    pub fn parse(raw: &str) -> Result<Self> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "healthy" => Ok(NodeState::Healthy),
            "unhealthy" => Ok(NodeState::Unhealthy),
            "draining" => Ok(NodeState::Draining),
            "sleeping" => Ok(NodeState::Sleeping),
            "initializing" => Ok(NodeState::Initializing),
            _ => Err(Error::new(
                Kind::InvalidNode,
                format!("unknown node state {raw:?}: use healthy, unhealthy, draining, sleeping or initializing"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            NodeState::Healthy => "healthy",
            NodeState::Unhealthy => "unhealthy",
            NodeState::Draining => "draining",
            NodeState::Sleeping => "sleeping",
            NodeState::Initializing => "initializing",
        }
    }

    fn from_u8(raw: u8) -> Self {
        match raw {
            0 => NodeState::Healthy,
            1 => NodeState::Unhealthy,
            2 => NodeState::Draining,
            3 => NodeState::Sleeping,
            _ => NodeState::Initializing,
        }
    }
}

/// How many recent requests the latency window keeps (LMDeploy keeps 15).
pub const LATENCY_WINDOW: usize = 15;

/// Per-node counters and mutable attributes. Plain fixed-size atomics with no pointers
/// inside, all zero when new, so that they can live in the shared table of a worker group.
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub in_flight: AtomicU64,
    pub requests: AtomicU64,
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    /// Requests the node refused as the client's error (4xx but 429).
    pub client_errors: AtomicU64,
    /// Requests that never reached the node (connect refused or timed out): passive health.
    pub connect_failures: AtomicU64,
    pub cancelled: AtomicU64,
    pub latency_us_sum: AtomicU64,
    /// Server-sent events forwarded from this node.
    pub events: AtomicU64,
    pub ttft_us_sum: AtomicU64,
    pub ttft_count: AtomicU64,
    /// Exponentially weighted mean of time to first byte, microseconds (0: none yet).
    pub ttft_us_ewma: AtomicU64,
    /// When the engine should be done prefilling the requests sent to it that have not had
    /// their first byte (µs, `now_us`'s clock): each adds its predicted prefill after the
    /// ones before, and the last one's first byte sets it to now. The time left on it is the
    /// wait ahead of the next request (the pending bytes alone would count a prefill half
    /// done as whole, and send the next request to a node about to be busy rather than to
    /// one about to be free).
    pub prefill_done_at_us: AtomicU64,
    /// How fast the node's engine prefills and decodes, learnt from the requests sent to it.
    pub speed: EngineSpeed,
    /// How much later than priced its first tokens came lately: work there pdproxy did not price.
    pub hidden: HiddenLoad,
    /// Requests sent to the node that have not had the first byte of their answer yet: waiting
    /// in the engine's queue, or being prefilled.
    pub unanswered: AtomicU64,
    /// Prompt bytes the routing policy expected the node to find in its cache, summed over
    /// the requests that had their first byte (so the engine has looked them up by then).
    pub predicted_cached_bytes: AtomicU64,
    /// Of the answers that said what the engine found in its cache: the hits the policy had
    /// predicted (bytes), and those the engine reported (tokens).
    pub answered_predicted_bytes: AtomicU64,
    pub answered_cached_tokens: AtomicU64,
    /// The last `LATENCY_WINDOW` successful requests: latency (µs) and events served.
    recent_latency_us: [AtomicU32; LATENCY_WINDOW],
    recent_events: [AtomicU32; LATENCY_WINDOW],
    recent_cursor: AtomicU64,
    /// Hard cap on `in_flight`; 0 means none.
    pub max_concurrency: AtomicU32,
    pub circuit: Circuit,
    state: AtomicU8,
    /// Whole requests, from admission to the end of the body.
    pub duration: Histogram<Latency>,
    /// Streams: from sending the request to the first body byte.
    pub ttft: Histogram<Latency>,
    /// Streams: gaps between consecutive chunks (inter-token latency).
    pub itl: Histogram<Gap>,
    /// What the node's engine last said about itself (its `/metrics`).
    pub engine: EngineReport,
}

/// One point-in-time copy of a node's counters.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CountersSnapshot {
    pub in_flight: u64,
    pub requests: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub client_errors: u64,
    pub connect_failures: u64,
    pub cancelled: u64,
    pub latency_us_sum: u64,
    pub events: u64,
    pub mean_ttft_us: Option<f64>,
    pub ttft_us_ewma: Option<f64>,
    /// Mean latency of the recent window, microseconds.
    pub recent_latency_us: Option<f64>,
    /// Mean of latency per event over the recent window, microseconds.
    pub recent_latency_per_event_us: Option<f64>,
    pub max_concurrency: Option<u32>,
    pub state: Option<&'static str>,
    pub circuit: &'static str,
}

impl NodeCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        let ttft_count = self.ttft_count.load(Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        let mean_ttft_us =
            (ttft_count > 0).then(|| self.ttft_us_sum.load(Ordering::Relaxed) as f64 / ttft_count as f64);
        let ewma = f64::from_bits(self.ttft_us_ewma.load(Ordering::Relaxed));
        CountersSnapshot {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            client_errors: self.client_errors.load(Ordering::Relaxed),
            connect_failures: self.connect_failures.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            latency_us_sum: self.latency_us_sum.load(Ordering::Relaxed),
            events: self.events.load(Ordering::Relaxed),
            mean_ttft_us,
            ttft_us_ewma: (ewma > 0.0).then_some(ewma),
            recent_latency_us: self.recent_mean(false),
            recent_latency_per_event_us: self.recent_mean(true),
            max_concurrency: self.max_concurrency(),
            state: Some(self.state().name()),
            circuit: self.circuit.name(),
        }
    }

    /// Back to new (a recycled shared slot).
    pub(crate) fn reset(&self) {
        for counter in [
            &self.in_flight,
            &self.requests,
            &self.succeeded,
            &self.failed,
            &self.client_errors,
            &self.connect_failures,
            &self.cancelled,
            &self.latency_us_sum,
            &self.events,
            &self.ttft_us_sum,
            &self.ttft_count,
            &self.ttft_us_ewma,
            &self.prefill_done_at_us,
            &self.unanswered,
            &self.predicted_cached_bytes,
            &self.answered_predicted_bytes,
            &self.answered_cached_tokens,
            &self.recent_cursor,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        for value in self.recent_latency_us.iter().chain(&self.recent_events) {
            value.store(0, Ordering::Relaxed);
        }
        self.max_concurrency.store(0, Ordering::Relaxed);
        self.circuit.reset();
        self.state.store(0, Ordering::Relaxed);
        self.duration.reset();
        self.ttft.reset();
        self.itl.reset();
        self.engine.reset();
        self.speed.reset();
        self.hidden.reset();
    }

    /// Records a reading of the node's engine taken now (`now_ms`), with its own counters.
    pub fn record_engine_report(&self, figures: &EngineFigures, now_ms: u64) {
        let then = CountsThen {
            in_flight: self.in_flight(),
            requests: self.requests.load(Ordering::Relaxed),
            predicted_cached: self.predicted_cached_bytes.load(Ordering::Relaxed),
        };
        self.engine.record(figures, then, now_ms);
        self.speed.reported(figures.running, figures.waiting);
    }

    pub fn state(&self) -> NodeState {
        NodeState::from_u8(self.state.load(Ordering::Acquire))
    }

    pub fn set_state(&self, state: NodeState) {
        self.state.store(state as u8, Ordering::Release);
    }

    pub fn max_concurrency(&self) -> Option<u32> {
        Some(self.max_concurrency.load(Ordering::Relaxed)).filter(|&m| m > 0)
    }

    pub fn set_max_concurrency(&self, max: Option<u32>) {
        self.max_concurrency.store(max.unwrap_or(0), Ordering::Relaxed);
    }

    /// Adds `us` of prefill after what the node already owes (from now, if it owes nothing).
    pub fn owe_prefill(&self, us: u64, now_us: u64) {
        let _ = self
            .prefill_done_at_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |done| Some(done.max(now_us).saturating_add(us)));
    }

    /// The prefill the node still owes, by its clock (ms).
    pub fn prefill_left_ms(&self, now_us: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let left = self.prefill_done_at_us.load(Ordering::Relaxed).saturating_sub(now_us) as f64;
        left / 1000.0
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// True when the node may be selected now: healthy, its circuit not open, below its cap.
    pub fn is_available(&self) -> bool {
        self.state() == NodeState::Healthy
            && self.circuit.allows()
            && self.max_concurrency().is_none_or(|max| self.in_flight() < u64::from(max))
    }

    /// The recent window's latencies in microseconds, oldest first.
    pub fn recent_latencies(&self) -> Vec<f64> {
        let cursor = usize::try_from(self.recent_cursor.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        let filled = cursor.min(LATENCY_WINDOW);
        (0..filled)
            .map(|k| (cursor - filled + k) % LATENCY_WINDOW)
            .map(|i| f64::from(self.recent_latency_us[i].load(Ordering::Relaxed)))
            .collect()
    }

    /// Mean latency over the recent window (optionally per event served); `None` before any.
    pub fn recent_mean(&self, per_event: bool) -> Option<f64> {
        let filled =
            usize::try_from(self.recent_cursor.load(Ordering::Relaxed)).unwrap_or(usize::MAX).min(LATENCY_WINDOW);
        if filled == 0 {
            return None;
        }
        let sum: f64 = (0..filled)
            .map(|i| {
                let latency = f64::from(self.recent_latency_us[i].load(Ordering::Relaxed));
                if per_event {
                    latency / f64::from(self.recent_events[i].load(Ordering::Relaxed).max(1))
                } else {
                    latency
                }
            })
            .sum();
        #[allow(clippy::cast_precision_loss)]
        Some(sum / filled as f64)
    }

    pub(crate) fn record_success(&self, latency: Duration, first_byte: Option<Duration>, events: u64) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency_us_sum.fetch_add(micros, Ordering::Relaxed);
        let slot =
            usize::try_from(self.recent_cursor.fetch_add(1, Ordering::Relaxed) % LATENCY_WINDOW as u64).unwrap_or(0);
        self.recent_latency_us[slot].store(u32::try_from(micros).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.recent_events[slot].store(u32::try_from(events).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.events.fetch_add(events, Ordering::Relaxed);
        if let Some(first) = first_byte {
            if events > 1 {
                // A stream: its first byte was its first token, and the rest its decoding.
                self.speed.decoded((latency.saturating_sub(first)).as_secs_f64() * 1000.0);
            }
            self.ttft.observe(first);
            #[allow(clippy::cast_precision_loss)]
            let ttft = first.as_micros() as f64;
            self.ttft_us_sum.fetch_add(u64::try_from(first.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
            self.ttft_count.fetch_add(1, Ordering::Relaxed);
            // A lost update under a race only skews a statistic; no lock for it.
            let old = f64::from_bits(self.ttft_us_ewma.load(Ordering::Relaxed));
            let new = if old > 0.0 { old + 0.2 * (ttft - old) } else { ttft };
            self.ttft_us_ewma.store(new.to_bits(), Ordering::Relaxed);
        }
    }
}

/// A node's counters: in this process, or in a slot of the worker group's shared table.
/// Taking and releasing in-flight units goes through here, so that in a group each worker's
/// share is counted too (see `shared`).
#[derive(Debug, Clone)]
pub struct Counters(Place);

#[derive(Debug, Clone)]
enum Place {
    Local(Arc<NodeCounters>),
    Shared { table: Arc<SharedTable>, binding: Binding, worker: usize },
}

impl Default for Counters {
    fn default() -> Self {
        Self(Place::Local(Arc::default()))
    }
}

impl Deref for Counters {
    type Target = NodeCounters;

    fn deref(&self) -> &NodeCounters {
        match &self.0 {
            Place::Local(counters) => counters,
            Place::Shared { table, binding, .. } => table.counters(binding.0),
        }
    }
}

impl Counters {
    pub(crate) fn shared(table: Arc<SharedTable>, binding: Binding, worker: usize) -> Self {
        Self(Place::Shared { table, binding, worker })
    }

    /// The shared slot and generation, in a worker group.
    pub fn binding(&self) -> Option<Binding> {
        match &self.0 {
            Place::Local(_) => None,
            Place::Shared { binding, .. } => Some(*binding),
        }
    }

    /// Whether both are the same counters.
    pub fn same(&self, other: &Counters) -> bool {
        std::ptr::eq(std::ptr::from_ref::<NodeCounters>(self), std::ptr::from_ref::<NodeCounters>(other))
    }

    /// Takes one in-flight unit unless `cap` is reached: check and increment are one atomic
    /// step, so concurrent callers (threads or worker processes) never pass the cap.
    pub fn try_enter(&self, cap: Option<u32>) -> bool {
        let taken = match cap {
            None => {
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                true
            }
            Some(max) => self
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < u64::from(max)).then_some(n + 1))
                .is_ok(),
        };
        if taken {
            // After the total: a crash in between over-counts (reclaim misses it), never under.
            self.my_share().map(|share| share.fetch_add(1, Ordering::AcqRel));
        }
        taken
    }

    /// Gives back one in-flight unit.
    pub fn exit(&self) {
        // Before the total, for the same reason as in `try_enter`.
        self.my_share().map(|share| share.fetch_sub(1, Ordering::AcqRel));
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn my_share(&self) -> Option<&AtomicU32> {
        match &self.0 {
            Place::Local(_) => None,
            Place::Shared { table, binding, worker } => Some(table.share(binding.0, *worker)),
        }
    }
}

/// What a node is registered with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSpec {
    /// Models the node serves; empty when unknown (the node is then eligible for any model).
    pub models: Vec<String>,
    pub role: Role,
    /// Relative throughput (LMDeploy's `speed`); `None` when not declared.
    pub speed: Option<f64>,
    pub max_concurrency: Option<u32>,
    /// The node's own API key, sent to it as `Authorization: Bearer` (never the client's).
    pub api_key: Option<String>,
    /// SGLang prefill nodes: the port of their bootstrap server, when declared.
    pub bootstrap_port: Option<u16>,
    /// The models it was registered with (`None`: none declared, discovery asks it); `models`
    /// is what it serves, as discovery learnt it.
    pub declared_models: Option<Vec<String>>,
    /// Seconds its registration lasts unless renewed (`None`: no lease). The control plane
    /// keeps the timer; the node keeps what it was registered with.
    pub lease_ttl: Option<f64>,
    /// The operator's labels (`zone=a`): shown in status, never used for routing.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Where the node is reached: the address its name resolved to when it was checked, so
    /// that a name whose answer changes later cannot send requests elsewhere. `None`: resolve.
    pub address: Option<std::net::SocketAddr>,
}

/// An immutable description of a node plus its shared counters. Changing a node's spec
/// builds a new `Node` that shares the same counters and generation.
#[derive(Debug)]
pub struct Node {
    url: String,
    scheme: Scheme,
    authority: Authority,
    /// `scheme://host:port`, the port always written (the pool's key).
    origin: String,
    /// `host:port` to resolve and connect to (the scheme's port when the URL names none).
    dial: String,
    base_path: String,
    generation: u64,
    spec: NodeSpec,
    counters: Counters,
}

impl Node {
    pub(crate) fn new(url: &NodeUrl, generation: u64, spec: NodeSpec, counters: Counters) -> Self {
        counters.set_max_concurrency(spec.max_concurrency);
        let port = url.authority.port_u16().unwrap_or(if url.scheme == Scheme::HTTPS { 443 } else { 80 });
        let dial = format!("{}:{port}", url.authority.host());
        Self {
            url: url.normalized.clone(),
            scheme: url.scheme.clone(),
            authority: url.authority.clone(),
            origin: format!("{}://{dial}", url.scheme),
            dial,
            base_path: url.base_path.clone(),
            generation,
            spec,
            counters,
        }
    }

    /// A node outside the table, to reach once more (a removed node that still holds something
    /// of the proxy's, such as a preserved session).
    pub fn detached(url: &str, api_key: Option<String>) -> Result<Self> {
        let spec = NodeSpec { api_key, ..NodeSpec::default() };
        Ok(Self::new(&NodeUrl::parse(url)?, 0, spec, Counters::default()))
    }

    /// The normalised base URL, e.g. `http://127.0.0.1:8001`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Distinguishes successive registrations of the same URL.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    pub fn models(&self) -> &[String] {
        &self.spec.models
    }

    pub fn role(&self) -> Role {
        self.spec.role
    }

    pub fn speed(&self) -> Option<f64> {
        self.spec.speed
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The engine's report if it is younger than `max_age_ms`, with pdproxy's traffic since.
    pub fn engine_load(&self, max_age_ms: u64, now_ms: u64) -> Option<EngineLoad> {
        let c = &self.counters;
        c.engine.fresh(max_age_ms, now_ms, c.in_flight(), c.requests.load(Ordering::Relaxed))
    }

    /// `host:port` of the node, as its URL writes it.
    pub fn authority(&self) -> &str {
        self.authority.as_str()
    }

    /// Where the upstream client sends this node's requests (TLS for `https://` nodes).
    pub fn target(&self) -> Target<'_> {
        Target {
            origin: &self.origin,
            authority: self.authority.as_str(),
            dial: &self.dial,
            pinned: self.spec.address,
            tls_name: (self.scheme == Scheme::HTTPS).then(|| self.host()),
        }
    }

    /// The path on the node for a request's `path_and_query` (below the node's base path).
    pub fn path_for(&self, path_and_query: &str) -> String {
        let mut joined = String::with_capacity(self.base_path.len() + path_and_query.len());
        joined.push_str(&self.base_path);
        joined.push_str(path_and_query);
        joined
    }

    /// The node's host, without brackets around an IPv6 address.
    pub fn host(&self) -> &str {
        self.authority.host().trim_start_matches('[').trim_end_matches(']')
    }

    /// The absolute URI of `path_and_query` on this node.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri> {
        let mut joined = String::with_capacity(self.base_path.len() + path_and_query.len());
        joined.push_str(&self.base_path);
        joined.push_str(path_and_query);
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(joined)
            .build()
            .map_err(|e| Error::with_source(Kind::InvalidRequest, "invalid request path", e))
    }
}

/// A node URL after normalisation: scheme and host lower-cased, default scheme `http`,
/// no trailing slash, so that the same server is always the same node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUrl {
    pub normalized: String,
    scheme: Scheme,
    authority: Authority,
    base_path: String,
}

impl NodeUrl {
    pub fn parse(raw: &str) -> Result<Self> {
        let raw = raw.trim();
        let with_scheme = if raw.contains("://") { raw.to_owned() } else { format!("http://{raw}") };
        let uri: Uri = with_scheme
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid node URL {raw:?}"), e))?;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(Error::new(
                Kind::InvalidNode,
                format!("unsupported scheme in node URL {raw:?}: use http or https"),
            ));
        }
        let authority =
            uri.authority().ok_or_else(|| Error::new(Kind::InvalidNode, format!("node URL {raw:?} has no host")))?;
        if uri.query().is_some() {
            return Err(Error::new(Kind::InvalidNode, format!("node URL {raw:?} must not have a query")));
        }
        if authority.as_str().contains('@') {
            // A key goes to a node as `api_key` (a header), never in its URL (logs, status).
            return Err(Error::new(
                Kind::InvalidNode,
                "credentials in a node URL are refused; register the node with an api_key",
            ));
        }
        let authority: Authority = authority
            .as_str()
            .to_ascii_lowercase()
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid host in node URL {raw:?}"), e))?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let normalized = format!("{scheme}://{authority}{base_path}");
        Ok(Self { normalized, scheme, authority, base_path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_urls() {
        for (raw, want) in [
            ("127.0.0.1:8001", "http://127.0.0.1:8001"),
            ("http://127.0.0.1:8001/", "http://127.0.0.1:8001"),
            ("HTTP://LocalHost:8001", "http://localhost:8001"),
            (" http://h:1/base/ ", "http://h:1/base"),
            ("HTTPS://Node.Example/", "https://node.example"),
        ] {
            assert_eq!(NodeUrl::parse(raw).unwrap().normalized, want, "{raw}");
        }
        assert!(NodeUrl::parse("http://user:pw@h:1").is_err(), "credentials are refused");
    }

    #[test]
    fn https_nodes_are_reached_with_tls_on_the_schemes_port() {
        let node = |raw: &str| Node::new(&NodeUrl::parse(raw).unwrap(), 1, NodeSpec::default(), Counters::default());
        let secure = node("https://node.example");
        let target = secure.target();
        assert_eq!(
            (target.origin, target.dial, target.authority),
            ("https://node.example:443", "node.example:443", "node.example")
        );
        assert_eq!(target.tls_name, Some("node.example"));
        let plain = node("http://[::1]:8001");
        assert_eq!((plain.target().dial, plain.target().tls_name), ("[::1]:8001", None));
        assert_eq!(node("http://h").target().origin, "http://h:80");
    }

    #[test]
    fn rejects_unusable_urls() {
        for raw in ["ftp://h:1", "http://", "http://h:1/?a=1", "http://h h"] {
            assert_eq!(NodeUrl::parse(raw).unwrap_err().kind(), Kind::InvalidNode, "{raw}");
        }
    }

    #[test]
    fn joins_base_path() {
        let url = NodeUrl::parse("http://h:1/base/").unwrap();
        let node = Node::new(&url, 1, NodeSpec::default(), Counters::default());
        assert_eq!(node.uri_for("/v1/models?x=1").unwrap().to_string(), "http://h:1/base/v1/models?x=1");
    }

    #[test]
    fn roles_and_states_parse_like_lmdeploy() {
        assert_eq!(Role::parse("2").unwrap(), Role::Prefill);
        assert_eq!(Role::parse("Decode").unwrap(), Role::Decode);
        assert!(Role::parse("4").is_err());
        assert_eq!(NodeState::parse("Sleeping").unwrap(), NodeState::Sleeping);
    }

    #[test]
    fn recent_window_keeps_the_last_fifteen() {
        let c = NodeCounters::default();
        assert_eq!(c.recent_mean(false), None);
        for ms in 1..=20u64 {
            c.record_success(Duration::from_millis(ms), None, 2);
        }
        // 6..=20 ms remain: mean 13 ms; per event: 6.5 ms.
        assert_eq!(c.recent_mean(false), Some(13_000.0));
        let window = c.recent_latencies();
        assert_eq!((window.len(), window[0], window[14]), (15, 6_000.0, 20_000.0));
        assert_eq!(c.recent_mean(true), Some(6_500.0));
    }

    #[test]
    fn availability_follows_state_and_cap() {
        let c = NodeCounters::default();
        assert!(c.is_available());
        c.set_max_concurrency(Some(1));
        c.in_flight.store(1, Ordering::Relaxed);
        assert!(!c.is_available());
        c.in_flight.store(0, Ordering::Relaxed);
        c.set_state(NodeState::Draining);
        assert!(!c.is_available());
    }
}

//! A node's record between the two planes: read by attribute from the control plane's
//! `NodeRecord` (`pdproxy/fleet/node_record.py`), and shown back as a frozen `NodeView` (or, for
//! `Router.node`, which carries the key, a dict). What a node is lives in `node::NodeSpec`, and the rules it must
//! pass in `NodeSpec::check`, `NodeUrl::parse` and `node::address`; this file only carries
//! them across.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::clock::{now_ms, now_us};
use crate::error::{Error, Kind};
use crate::node::address::{AddressRules, Network};
use crate::node::{Node, NodeSpec, NodeUrl, Role};
use crate::observe::histogram::HistogramSnapshot;

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
    /// The node's parsed URL and the spec the node table keeps (reached at `address`, `HOST:PORT`,
    /// when given), once every rule of the node table holds for them (`NodeSpec::check`).
    pub(crate) fn checked(self, address: Option<&str>) -> PyResult<(NodeUrl, NodeSpec)> {
        let url = NodeUrl::parse(&self.url)?;
        let spec = self.into_spec(address)?;
        spec.check()?;
        Ok((url, spec))
    }

    fn into_spec(self, address: Option<&str>) -> PyResult<NodeSpec> {
        let address = address
            .map(str::parse::<SocketAddr>)
            .transpose()
            .map_err(|_| PyErr::from(Error::new(Kind::InvalidNode, "a node's address must read HOST:PORT")))?;
        Ok(NodeSpec {
            role: Role::parse(&self.role)?,
            models: self.models.clone().unwrap_or_default(),
            declared_models: self.models,
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

/// What a node was registered with, its API key included (`Router.node`; views show only
/// whether it has one), plus the models it serves and where it is reached.
pub(crate) fn record_dict<'py>(py: Python<'py>, node: &Node) -> PyResult<Bound<'py, PyDict>> {
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
    out.set_item("api_key", &spec.api_key)?;
    out.set_item("bootstrap_port", spec.bootstrap_port)?;
    out.set_item("lease_ttl", spec.lease_ttl)?;
    out.set_item("labels", &spec.labels)?;
    out.set_item("address", spec.address.map(|a| a.to_string()))?;
    Ok(out)
}

/// Where nodes may be: the allowed networks and this proxy's own port (`Fleet` makes one from
/// the settings, `allow_node_cidrs` and `port`). Parsed once; `Router.add_node` resolves a
/// node's host by them.
#[pyclass(frozen, name = "NodeAddressRules", module = "pdproxy._pdproxy")]
pub(crate) struct NodeAddressRules {
    pub(crate) rules: AddressRules,
}

#[pymethods]
impl NodeAddressRules {
    #[new]
    #[pyo3(signature = (allowed=Vec::new(), own_port=None))]
    fn new(allowed: Vec<String>, own_port: Option<u16>) -> PyResult<Self> {
        let allowed = allowed
            .iter()
            .map(|cidr| Network::parse(cidr).map_err(|e| PyValueError::new_err(e.message().to_owned())))
            .collect::<PyResult<_>>()?;
        Ok(Self { rules: AddressRules { allowed, own_port } })
    }

    /// The canonical URL of `record` and the address (`HOST:PORT`) its host resolves to, once
    /// every rule of the node table holds for it (`Router.add_node` checks the same, as it
    /// adds). Blocks while the name resolves (with the GIL released): call it off the event loop.
    fn check(&self, py: Python<'_>, record: NodeRecord) -> PyResult<(String, String)> {
        let (url, _) = record.checked(None)?;
        let address = py.detach(|| self.rules.resolve(&url))?;
        Ok((url.normalized, address.to_string()))
    }

    /// Raises `InvalidNode` for a node whose host is an address the rules refuse, without
    /// resolving a name (that waits for the node's registration).
    fn check_literal(&self, url: &str) -> PyResult<()> {
        Ok(self.rules.check_literal(&NodeUrl::parse(url)?)?)
    }
}

/// A histogram, copied: per-bucket (not cumulative) `counts`, one more than `bounds` (+Inf
/// last), in seconds; `sum` and `count` of the observations.
#[pyclass(frozen, get_all, name = "HistogramReading", module = "pdproxy._pdproxy")]
#[derive(Clone)]
pub(crate) struct HistogramView {
    pub(crate) bounds: Vec<f64>,
    pub(crate) counts: Vec<u64>,
    pub(crate) sum: f64,
    pub(crate) count: u64,
}

impl From<HistogramSnapshot> for HistogramView {
    fn from(h: HistogramSnapshot) -> Self {
        Self { bounds: h.bounds, counts: h.counts, sum: h.sum, count: h.count }
    }
}

/// A node's histograms: seconds from admission to the end of the body, to the first byte, and
/// between chunks.
#[pyclass(frozen, get_all, name = "LatencyHistograms", module = "pdproxy._pdproxy")]
#[derive(Clone)]
pub(crate) struct HistogramsView {
    pub(crate) duration: HistogramView,
    pub(crate) ttft: HistogramView,
    pub(crate) itl: HistogramView,
}

/// What pdproxy learnt of a node's engine from its answers (`scored` prices with it).
#[pyclass(frozen, get_all, name = "LearntReading", module = "pdproxy._pdproxy")]
#[derive(Clone)]
pub(crate) struct LearntView {
    pub(crate) prefill_seconds_per_kib: Option<f64>,
    pub(crate) first_token_seconds: Option<f64>,
    pub(crate) decode_seconds: Option<f64>,
    pub(crate) decode_spread_seconds: Option<f64>,
    pub(crate) batch_slots: Option<f64>,
    pub(crate) seconds_per_request_in_flight: Option<f64>,
    pub(crate) prefill_bound_seconds_per_kib: Option<f64>,
    pub(crate) samples: f64,
    pub(crate) predicted_cached_bytes: u64,
    pub(crate) reported_cached_tokens: u64,
    /// The first bytes the policy priced: seconds after the time priced for them.
    pub(crate) first_token_lateness: HistogramView,
}

/// What a node's engine last reported about itself, and how fresh it is.
#[pyclass(frozen, get_all, name = "EngineReading", module = "pdproxy._pdproxy")]
#[derive(Clone)]
pub(crate) struct EngineView {
    pub(crate) running: Option<u64>,
    pub(crate) waiting: Option<u64>,
    pub(crate) kv_usage: Option<f64>,
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) kv_capacity_tokens: Option<u64>,
    pub(crate) transferred_tokens: Option<u64>,
    pub(crate) age: Option<f64>,
    pub(crate) fresh: bool,
    pub(crate) sent_since: Option<u64>,
    pub(crate) requests_estimate: Option<f64>,
    /// Requests the engine had at the reading that pdproxy cannot have sent, at least.
    pub(crate) others: Option<u64>,
    pub(crate) restarts: u32,
    /// Times pdproxy was told its prefix cache was flushed (`POST /flush_cache`, `Router.cache_flushed`).
    pub(crate) flushes: u32,
    pub(crate) failures: u64,
    pub(crate) failing: u32,
    pub(crate) learnt: LearntView,
}

impl EngineView {
    /// The node's engine as the status pages show it (`max_age_ms`: how long a reading is fresh).
    pub(crate) fn of(node: &Node, max_age_ms: u64) -> Self {
        let now = now_ms();
        let counters = node.counters();
        let report = counters.engine.snapshot(now);
        let figures = report.figures.unwrap_or_default();
        let known = report.figures.is_some();
        let load = node.engine_load(max_age_ms, now);
        let speed = counters.speed.speed();
        let seconds = |ms: Option<f64>| ms.map(|ms| ms / 1e3);
        Self {
            running: known.then_some(figures.running),
            waiting: known.then_some(figures.waiting),
            kv_usage: figures.kv_usage,
            prompt_tokens: figures.prompt_tokens,
            cached_tokens: figures.cached_tokens,
            kv_capacity_tokens: figures.kv_capacity_tokens,
            transferred_tokens: figures.transferred_tokens,
            #[allow(clippy::cast_precision_loss)]
            age: report.age_ms.map(|ms| ms as f64 / 1e3),
            fresh: load.is_some(),
            sent_since: load.map(|l| l.sent_since),
            requests_estimate: load.map(|l| l.requests()),
            others: load.map(|l| l.others),
            restarts: report.restarts,
            flushes: report.flushes,
            failures: report.failures,
            failing: report.failing,
            learnt: LearntView {
                prefill_seconds_per_kib: seconds(speed.prefill_ms_per_kib),
                first_token_seconds: seconds(speed.first_token_ms),
                decode_seconds: seconds(speed.decode_ms),
                decode_spread_seconds: seconds(speed.decode_spread_ms),
                batch_slots: speed.slots,
                seconds_per_request_in_flight: seconds(speed.ms_per_in_flight),
                prefill_bound_seconds_per_kib: seconds(speed.prefill_bound_ms_per_kib),
                samples: speed.samples,
                predicted_cached_bytes: counters.answered_predicted_bytes.load(Ordering::Relaxed),
                reported_cached_tokens: counters.answered_cached_tokens.load(Ordering::Relaxed),
                first_token_lateness: counters.first_token_lateness.snapshot().into(),
            },
        }
    }
}

/// One node as the control plane shows it: what it was registered with (never its key: only
/// whether it has one), its state and counters, and its engine. A copy taken at one moment.
#[pyclass(frozen, get_all, name = "NodeView", module = "pdproxy._pdproxy")]
pub(crate) struct NodeView {
    pub(crate) url: String,
    pub(crate) generation: u64,
    pub(crate) role: &'static str,
    pub(crate) models: Vec<String>,
    pub(crate) declared_models: Option<Vec<String>>,
    pub(crate) speed: Option<f64>,
    pub(crate) max_concurrency: Option<u32>,
    pub(crate) has_api_key: bool,
    pub(crate) bootstrap_port: Option<u16>,
    pub(crate) lease_ttl: Option<f64>,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) address: Option<String>,
    pub(crate) state: &'static str,
    pub(crate) circuit: &'static str,
    pub(crate) in_flight: u64,
    pub(crate) requests: u64,
    pub(crate) succeeded: u64,
    pub(crate) failed: u64,
    pub(crate) client_errors: u64,
    pub(crate) connect_failures: u64,
    pub(crate) cancelled: u64,
    pub(crate) events: u64,
    pub(crate) mean_latency: Option<f64>,
    pub(crate) recent_latency: Option<f64>,
    pub(crate) recent_latencies: Vec<f64>,
    pub(crate) recent_latency_per_token: Option<f64>,
    pub(crate) mean_ttft: Option<f64>,
    pub(crate) ttft_ewma: Option<f64>,
    pub(crate) histograms: HistogramsView,
    pub(crate) engine: EngineView,
    /// The other replicas' requests here still waiting for their first byte (`replica_share`).
    pub(crate) peer_unanswered: u64,
    /// The prefill they expect the node to still owe them, milliseconds.
    pub(crate) peer_prefill_ms_left: f64,
    /// Their requests here not yet ended.
    pub(crate) peer_in_flight: u64,
}

impl NodeView {
    pub(crate) fn of(node: &Arc<Node>, max_age_ms: u64) -> Self {
        let spec = node.spec();
        let counters = node.counters();
        let c = counters.snapshot();
        Self {
            url: node.url().to_owned(),
            generation: node.generation(),
            role: node.role().name(),
            models: node.models().to_vec(),
            declared_models: spec.declared_models.clone(),
            speed: spec.speed,
            max_concurrency: counters.max_concurrency(),
            has_api_key: spec.api_key.is_some(),
            bootstrap_port: spec.bootstrap_port,
            lease_ttl: spec.lease_ttl,
            labels: spec.labels.clone(),
            address: spec.address.map(|a| a.to_string()),
            state: c.state,
            circuit: c.circuit,
            in_flight: c.in_flight,
            requests: c.requests,
            succeeded: c.succeeded,
            failed: c.failed,
            client_errors: c.client_errors,
            connect_failures: c.connect_failures,
            cancelled: c.cancelled,
            events: c.events,
            #[allow(clippy::cast_precision_loss)] // microsecond sums stay far below 2^52
            mean_latency: (c.succeeded > 0).then(|| c.latency_us_sum as f64 / c.succeeded as f64 / 1e6),
            recent_latency: c.recent_latency_us.map(|us| us / 1e6),
            recent_latencies: counters.recent_latencies().iter().map(|us| us / 1e6).collect(),
            recent_latency_per_token: c.recent_latency_per_event_us.map(|us| us / 1e6),
            mean_ttft: c.mean_ttft_us.map(|us| us / 1e6),
            ttft_ewma: c.ttft_us_ewma.map(|us| us / 1e6),
            histograms: HistogramsView {
                duration: counters.duration.snapshot().into(),
                ttft: counters.ttft.snapshot().into(),
                itl: counters.itl.snapshot().into(),
            },
            engine: EngineView::of(node, max_age_ms),
            peer_unanswered: counters.peer_unanswered.load(Ordering::Relaxed),
            peer_prefill_ms_left: counters.peer_prefill_left_ms(now_us()),
            peer_in_flight: counters.peer_in_flight.load(Ordering::Relaxed),
        }
    }
}

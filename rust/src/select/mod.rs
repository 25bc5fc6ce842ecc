//! The routing policies: one small trait, one file per policy. The engine takes the chosen
//! node's permit (`engine::select`).

mod consistent_hash;
pub(crate) mod kv_index;
mod least_engine_load;
mod least_requests;
mod min_cache_usage;
mod min_expected_latency;
mod min_observed_latency;
mod prefix;
mod prefix_table;
mod random;
mod round_robin;
mod scored;
mod seen_prompts;

use std::hash::{Hash, Hasher};
use std::sync::Arc;

pub(crate) use consistent_hash::ConsistentHash;
pub(crate) use least_engine_load::LeastEngineLoad;
pub(crate) use least_requests::LeastRequests;
pub(crate) use min_cache_usage::MinCacheUsage;
pub(crate) use min_expected_latency::MinExpectedLatency;
pub(crate) use min_observed_latency::MinObservedLatency;
pub(crate) use prefix::Prefix;
pub use prefix::PrefixConfig;
pub use prefix_table::PrefixTableConfig;
pub(crate) use random::Random;
pub(crate) use round_robin::RoundRobin;
pub use scored::ScoreWeights;
pub(crate) use scored::Scored;

use crate::node::{Node, Role};
use crate::observe::trace::Traced;
use crate::tenants::Class;

/// What policies may look at besides the nodes.
#[derive(Debug, Clone, Copy, Default)]
pub struct SelectCtx<'a> {
    pub role: Role,
    pub model: Option<&'a str>,
    /// Session or user key for affinity (`consistent_hash`).
    pub affinity: Option<&'a str>,
    /// The prompt's raw bytes (`messages` or `prompt`), for cache-aware routing.
    pub prompt: Option<&'a [u8]>,
    /// The client asked for a stream: the answer's first byte is its first token.
    pub stream: bool,
    /// Priority and tenant, for the wait queue when every candidate is full.
    pub class: Class,
    /// Where the selection's span goes, when the request is traced.
    pub trace: Option<Traced<'a>>,
}

/// What a routing policy expects a node to do for a request (prompt bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prediction {
    /// To prefill: not in the node's cache.
    pub(crate) prefill: u64,
    /// To be found in its cache.
    pub(crate) cached: u64,
    /// How long the node takes to prefill `prefill` (µs, at the rate the policy priced it).
    pub(crate) prefill_us: u64,
    /// When the first token should come (µs after the selection; 0: not priced): all the
    /// policy knows of, so that coming later shows work there it did not know of.
    pub(crate) first_token_us: u64,
    /// Whether the policy weighs the node's recent lateness (`HiddenLoad`): only then is it kept.
    pub(crate) weighs_lateness: bool,
}

/// A routing policy picks one of the candidates that are available now.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The name users configure.
    fn name(&self) -> &'static str;
    /// Index into `candidates` of the chosen node, among those for which
    /// `available(node)` holds; `None` when none is.
    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize>;
    /// Told which node took the request (policies that learn from traffic). Returns what the
    /// policy expects the node to prefill and to find in its cache (nothing, if it does not
    /// predict), which the request's permit counts on the node.
    fn selected(&self, _node: &Arc<Node>, _ctx: &SelectCtx<'_>) -> Prediction {
        Prediction::default()
    }
    /// The engines' KV index to price cache hits from, where it is live (policies that
    /// predict them; the others ignore it).
    fn use_kv_index(&self, _index: Option<Arc<kv_index::KvIndex>>) {}
}

/// True when `node` may take a request now: healthy and below its cap.
pub(crate) fn available(node: &Node) -> bool {
    node.counters().is_available()
}

/// Indices of the available candidates.
pub(crate) fn available_indices(candidates: &[Arc<Node>]) -> impl Iterator<Item = usize> + '_ {
    candidates.iter().enumerate().filter(|(_, n)| available(n)).map(|(i, _)| i)
}

/// The available candidate with the lowest `score`; ties broken at random.
pub(crate) fn argmin_by(candidates: &[Arc<Node>], score: impl Fn(&Node) -> f64) -> Option<usize> {
    let mut best = f64::INFINITY;
    let mut chosen = None;
    let mut ties = 0u32;
    for i in available_indices(candidates) {
        let s = score(&candidates[i]);
        if s < best {
            best = s;
            chosen = Some(i);
            ties = 1;
        } else if s.total_cmp(&best).is_eq() {
            // Reservoir sampling: each tied node ends up chosen with equal probability.
            ties += 1;
            if fastrand::u32(0..ties) == 0 {
                chosen = Some(i);
            }
        }
    }
    chosen
}

/// Speeds of the candidates, with undeclared speeds replaced by the mean of the declared
/// ones (all 1 when none is declared), as LMDeploy's proxy does.
pub(crate) fn effective_speed(candidates: &[Arc<Node>]) -> impl Fn(&Node) -> f64 {
    let declared: Vec<f64> = candidates.iter().filter_map(|n| n.speed()).collect();
    #[allow(clippy::cast_precision_loss)]
    let mean = if declared.is_empty() { 1.0 } else { declared.iter().sum::<f64>() / declared.len() as f64 };
    move |node: &Node| node.speed().unwrap_or(mean)
}

/// A stable 64-bit hash (the same in every process and run).
pub(crate) fn stable_hash(parts: impl Hash) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    parts.hash(&mut hasher);
    hasher.finish()
}

/// A routing policy and its own knobs, as the settings give it (`settings.routing.policies`,
/// read once at the boundary: `py::config`); `policy_from_spec` builds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicySpec {
    RoundRobin,
    Random,
    LeastRequests,
    MinExpectedLatency,
    MinObservedLatency,
    MinObservedLatencyPerToken,
    MinCacheUsage,
    LeastEngineLoad,
    /// A node takes a key's requests while its in-flight count stays below `load_factor` times
    /// the average.
    ConsistentHash {
        load_factor: f64,
    },
    Prefix(PrefixConfig),
    /// The weights of its terms, and the prefix table it keeps.
    Scored {
        weights: ScoreWeights,
        table: PrefixTableConfig,
    },
}

impl PolicySpec {
    /// The policy named `name` among those without knobs of their own.
    pub fn basic(name: &str) -> Option<Self> {
        Some(match name {
            "round_robin" => Self::RoundRobin,
            "random" => Self::Random,
            "least_requests" => Self::LeastRequests,
            "min_expected_latency" => Self::MinExpectedLatency,
            "min_observed_latency" => Self::MinObservedLatency,
            "min_observed_latency_per_token" => Self::MinObservedLatencyPerToken,
            "min_cache_usage" => Self::MinCacheUsage,
            "least_engine_load" => Self::LeastEngineLoad,
            _ => return None,
        })
    }

    /// The policy named `name` (any of `POLICY_NAMES`) with knobs made up for tests; the served
    /// ones come from the settings.
    #[doc(hidden)]
    pub fn for_tests(name: &str) -> Option<Self> {
        Self::basic(name).or(match name {
            "consistent_hash" => Some(Self::ConsistentHash { load_factor: 1.25 }),
            "prefix" => Some(Self::Prefix(PrefixConfig::default())),
            "scored" => Some(Self::Scored {
                weights: ScoreWeights { prefix: 2.0, queue: 1.0, hidden: 0.0, reported: 0.0, future: 0.0 },
                table: PrefixTableConfig { block_bytes: 256, max_blocks: 1024, entries: 1 << 16, bytes_per_token: 4.0 },
            }),
            _ => None,
        })
    }
}

/// Builds the policy `spec` says; those that read the engines' reports ignore reports older
/// than `engine_max_age_ms`.
pub fn policy_from_spec(spec: &PolicySpec, engine_max_age_ms: u64) -> Arc<dyn Policy> {
    let max_age_ms = engine_max_age_ms;
    match *spec {
        PolicySpec::RoundRobin => Arc::new(RoundRobin::default()),
        PolicySpec::Random => Arc::new(Random),
        PolicySpec::LeastRequests => Arc::new(LeastRequests),
        PolicySpec::MinExpectedLatency => Arc::new(MinExpectedLatency),
        PolicySpec::MinObservedLatency => Arc::new(MinObservedLatency { per_event: false }),
        PolicySpec::MinObservedLatencyPerToken => Arc::new(MinObservedLatency { per_event: true }),
        PolicySpec::MinCacheUsage => Arc::new(MinCacheUsage { max_age_ms }),
        PolicySpec::LeastEngineLoad => Arc::new(LeastEngineLoad { max_age_ms }),
        PolicySpec::ConsistentHash { load_factor } => Arc::new(ConsistentHash { load_factor }),
        PolicySpec::Prefix(config) => Arc::new(Prefix::new(config)),
        PolicySpec::Scored { weights, table } => Arc::new(Scored::new(weights, table, max_age_ms)),
    }
}

/// Every policy's name, as users configure it (`Policy::name`); the control plane's settings
/// know the same ones (`pdproxy/config/policies.py`, checked by its tests).
pub const POLICY_NAMES: [&str; 11] = [
    "round_robin",
    "random",
    "least_requests",
    "min_expected_latency",
    "min_observed_latency",
    "min_observed_latency_per_token",
    "min_cache_usage",
    "least_engine_load",
    "consistent_hash",
    "prefix",
    "scored",
];

#[cfg(test)]
pub(crate) mod testing {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::clock::now_ms;
    use crate::node::engine_report::EngineFigures;
    use crate::node::registry::Registry;
    use crate::node::NodeSpec;

    /// `n` hybrid nodes `h:1..=n` serving model `m`.
    pub(crate) fn nodes(n: usize) -> (Registry, Vec<Arc<Node>>) {
        let reg = Registry::new();
        let nodes = (1..=n)
            .map(|i| reg.add(&format!("h:{i}"), NodeSpec { models: vec!["m".into()], ..NodeSpec::default() }).unwrap())
            .collect();
        (reg, nodes)
    }

    pub(crate) fn set_in_flight(node: &Node, n: u64) {
        node.counters().in_flight.store(n, Ordering::Relaxed);
    }

    pub(crate) fn figures(running: u64, waiting: u64, kv_usage: f64) -> EngineFigures {
        EngineFigures { running, waiting, kv_usage: Some(kv_usage), ..EngineFigures::default() }
    }

    /// Records a fresh engine report for `node`, taken with its counters as they are now.
    pub(crate) fn report(node: &Node, running: u64, waiting: u64, kv_usage: f64) {
        node.counters().record_engine_report(&figures(running, waiting, kv_usage), now_ms());
    }

    /// How often each node is picked in `rounds` picks.
    pub(crate) fn histogram(
        policy: &dyn Policy,
        nodes: &[Arc<Node>],
        ctx: &SelectCtx<'_>,
        rounds: usize,
    ) -> Vec<usize> {
        let mut counts = vec![0; nodes.len()];
        for _ in 0..rounds {
            counts[policy.pick(nodes, ctx).unwrap()] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::engine::select;
    use crate::error::Kind;
    use crate::node::{NodeSpec, NodeState};

    fn ctx() -> SelectCtx<'static> {
        SelectCtx { model: Some("m"), ..SelectCtx::default() }
    }

    #[test]
    fn reports_why_nothing_is_eligible() {
        let (reg, nodes) = nodes(2);
        let policy = RoundRobin::default();
        let kind = |ctx: &SelectCtx<'_>| select(&reg.load(), ctx, &policy, None).unwrap_err().kind();
        assert_eq!(kind(&SelectCtx { model: Some("x"), ..ctx() }), Kind::ModelNotFound);
        assert_eq!(kind(&SelectCtx { role: Role::Decode, ..ctx() }), Kind::NoNodes);
        for n in &nodes {
            n.counters().set_max_concurrency(Some(1));
        }
        let _a = select(&reg.load(), &ctx(), &policy, None).unwrap();
        let _b = select(&reg.load(), &ctx(), &policy, None).unwrap();
        assert_eq!(kind(&ctx()), Kind::Overloaded);
        for n in &nodes {
            n.counters().set_state(NodeState::Unhealthy);
        }
        assert_eq!(kind(&ctx()), Kind::NoHealthyNode);
    }

    #[test]
    fn unavailable_nodes_are_never_selected() {
        let (reg, nodes) = nodes(4);
        nodes[0].counters().set_state(NodeState::Unhealthy);
        nodes[1].counters().set_state(NodeState::Draining);
        nodes[2].counters().set_state(NodeState::Sleeping);
        for name in POLICY_NAMES {
            let policy = policy_from_spec(&PolicySpec::for_tests(name).unwrap(), 10_000);
            assert_eq!(policy.name(), name);
            for _ in 0..50 {
                let ctx = SelectCtx { affinity: Some("user-1"), prompt: Some(b"[{\"content\":\"hi\"}]"), ..ctx() };
                let permit = select(&reg.load(), &ctx, policy.as_ref(), None).unwrap();
                assert_eq!(permit.node().url(), "http://h:4", "{name}");
            }
        }
        assert_eq!(PolicySpec::for_tests("fastest"), None);
    }

    #[test]
    fn speeds_default_to_the_mean_of_declared_ones() {
        let (reg, _) = nodes(0);
        let a = reg.add("h:1", NodeSpec { speed: Some(1.0), ..NodeSpec::default() }).unwrap();
        let b = reg.add("h:2", NodeSpec { speed: Some(3.0), ..NodeSpec::default() }).unwrap();
        let c = reg.add("h:3", NodeSpec::default()).unwrap();
        let speed = effective_speed(&[a, b, Arc::clone(&c)]);
        assert!((speed(&c) - 2.0).abs() < f64::EPSILON);
    }
}

//! `scored`: the node with the lowest cost, in KiB of prompt prefill (time the engine spends
//! before the request's first token, or takes from the requests after it):
//!
//! ```text
//! cost = prefix_weight * KiB of the prompt not in the node's cache (its own prefill there)
//!      +                 KiB of prompts pdproxy sent there still to prefill (see below)
//!      + queue_weight  * requests waiting there for a place in the engine's batch
//!      + kv_weight     * the engine's KV-cache usage (0 to 1)
//!      + load_weight   * requests pdproxy has in flight there (decoding ones included)
//! ```
//!
//! A prefix weight above 1 counts a request's own prefill twice over: it delays its first
//! token, and it is work added to the node that every later request there waits for (and
//! cache space it takes), so a node that already holds the prompt keeps it unless the wait
//! there is long.
//!
//! The prompt a node holds comes from the prefix table (what pdproxy routed there and the
//! engine has not evicted since, see `prefix_table`); the prefill a request will cost is
//! counted on the node from its selection to its first byte (`prefill_pending_bytes`), worked
//! off evenly over the time a prompt usually stays pending there (`prefill_remaining_bytes`):
//! when every node is prefilling, the one that got its prompt longest ago is nearest to done. The
//! engine's waiting requests and KV usage come from its fresh report adjusted by pdproxy's
//! traffic since (see `EngineLoad::waiting`); without one, the requests pdproxy sent there
//! that have not had their first byte (`unanswered`) stand in for the queue, and the KV term
//! is left out. Nodes within a tenth of the lowest cost count as equally ready: the one with
//! the fewest requests in flight, then the one sent the fewest, then one at random. They share
//! the decoding evenly and take turns, and round robin's even spacing of each node's arrivals
//! is worth more to the first token than a few hundredths of KV usage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::prefix_table::{PrefixTable, PrefixTableConfig};
use super::{available_indices, Policy, SelectCtx};
use crate::circuit::now_ms;
use crate::error::{Error, Kind, Result};
use crate::node::Node;
use crate::permit::Prediction;

/// Costs this close to the lowest count as equal (a tenth of a KiB of prefill, or of the
/// whole KV cache).
const TIE_TOLERANCE: f64 = 0.1;

/// The weights of the three terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreWeights {
    pub prefix: f64,
    pub queue: f64,
    pub kv: f64,
    pub load: f64,
}

impl ScoreWeights {
    /// `weights` with the overrides of `spec` applied: `prefix=2,kv=0.5` (any of `prefix`,
    /// `queue`, `kv`, each a non-negative number).
    pub fn with_overrides(self, spec: &str) -> Result<Self> {
        let mut out = self;
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, raw) = part.split_once('=').ok_or_else(|| invalid(spec))?;
            let value: f64 = raw.trim().parse().map_err(|_| invalid(spec))?;
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(spec));
            }
            match key.trim() {
                "prefix" => out.prefix = value,
                "queue" => out.queue = value,
                "kv" => out.kv = value,
                "load" => out.load = value,
                _ => return Err(invalid(spec)),
            }
        }
        Ok(out)
    }
}

fn invalid(spec: &str) -> Error {
    Error::new(
        Kind::Config,
        format!(
            "scored weights {spec:?}: use prefix=N, queue=N, kv=N, load=N separated by commas (non-negative numbers)"
        ),
    )
}

#[derive(Debug)]
pub struct Scored {
    weights: ScoreWeights,
    table: PrefixTable,
    /// Older engine reports are ignored.
    max_age_ms: u64,
    /// The median KV capacity (tokens) the candidates' engines report, for the nodes whose
    /// engines do not (a fleet is mostly alike); 0 when none does.
    typical_capacity: AtomicU64,
}

impl Scored {
    pub fn new(weights: ScoreWeights, table: PrefixTableConfig, max_age_ms: u64) -> Self {
        Self { weights, table: PrefixTable::new(table), max_age_ms, typical_capacity: AtomicU64::new(0) }
    }

    fn note_capacities(&self, candidates: &[Arc<Node>]) {
        let mut reported: Vec<u64> = candidates
            .iter()
            .filter_map(|n| n.engine_load(u64::MAX, now_ms()).and_then(|l| l.kv_capacity_tokens))
            .collect();
        if !reported.is_empty() {
            let mid = reported.len() / 2;
            self.typical_capacity.store(*reported.select_nth_unstable(mid).1, Ordering::Relaxed);
        }
    }

    pub fn weights(&self) -> ScoreWeights {
        self.weights
    }

    /// Bytes of the prompt a node holding `matched` leading blocks would still prefill.
    fn uncached(&self, ctx: &SelectCtx<'_>, matched: usize) -> usize {
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        prompt - (matched * self.table.block_bytes()).min(self.table.considered_bytes(ctx))
    }

    /// Each available candidate's cost for the request (`None`: not available).
    pub fn costs(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<f64>> {
        let hashes = self.table.block_hashes(ctx);
        let matched = self.table.matched(&hashes, candidates);
        let now = now_ms();
        let w = self.weights;
        let mut out = vec![None; candidates.len()];
        for i in available_indices(candidates) {
            let node = &candidates[i];
            let pending_kib = node.counters().prefill_remaining_bytes(now) / 1024.0;
            #[allow(clippy::cast_precision_loss)]
            let own_kib = self.uncached(ctx, matched[i]) as f64 / 1024.0;
            let load = node.engine_load(self.max_age_ms, now);
            let kv = load.and_then(|l| l.kv_usage_estimate()).unwrap_or(0.0);
            #[allow(clippy::cast_precision_loss)]
            let unanswered = node.counters().unanswered.load(Ordering::Relaxed) as f64;
            let queue = load.map_or(unanswered, |l| l.waiting());
            #[allow(clippy::cast_precision_loss)]
            let in_flight = node.counters().in_flight() as f64;
            out[i] = Some(w.prefix * own_kib + pending_kib + w.queue * queue + w.kv * kv + w.load * in_flight);
        }
        out
    }
}

impl Policy for Scored {
    fn name(&self) -> &'static str {
        "scored"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        self.note_capacities(candidates);
        let all = self.costs(candidates, ctx);
        let best = all.iter().flatten().copied().fold(f64::INFINITY, f64::min);
        // Of the nodes within a hair of the best, the one with the fewest requests in flight,
        // then the one sent the fewest: nodes equally ready share the decoding evenly and take
        // turns, so each one's arrivals are spaced as round robin's are.
        let mut chosen = None;
        let mut fewest = (u64::MAX, u64::MAX);
        let mut ties = 0u32;
        for (i, cost) in all.into_iter().enumerate() {
            if cost.is_none_or(|c| c > best + TIE_TOLERANCE) {
                continue;
            }
            let counters = candidates[i].counters();
            let key = (counters.in_flight(), counters.requests.load(Ordering::Relaxed));
            if key < fewest {
                (fewest, chosen, ties) = (key, Some(i), 1);
            } else if key == fewest {
                ties += 1;
                if fastrand::u32(0..ties) == 0 {
                    chosen = Some(i);
                }
            }
        }
        chosen
    }

    fn selected(&self, node: &Arc<Node>, ctx: &SelectCtx<'_>) -> Prediction {
        let hashes = self.table.block_hashes(ctx);
        let matched = self.table.matched(&hashes, std::slice::from_ref(node))[0];
        let capacity = node
            .engine_load(u64::MAX, now_ms())
            .and_then(|l| l.kv_capacity_tokens)
            .or(Some(self.typical_capacity.load(Ordering::Relaxed)).filter(|&c| c > 0));
        let uncached = self.uncached(ctx, matched);
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        self.table.learn(node, &hashes, capacity);
        Prediction {
            prefill: u64::try_from(uncached).unwrap_or(u64::MAX),
            cached: u64::try_from(prompt - uncached).unwrap_or(u64::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::testing::*;
    use super::*;

    const WEIGHTS: ScoreWeights = ScoreWeights { prefix: 1.0, queue: 1.0, kv: 1.0, load: 0.0 };

    fn scored(weights: ScoreWeights) -> Scored {
        let table = PrefixTableConfig { block_bytes: 256, max_blocks: 64, entries: 1 << 16, bytes_per_token: 4.0 };
        Scored::new(weights, table, 10_000)
    }

    fn ctx(prompt: &[u8]) -> SelectCtx<'_> {
        SelectCtx { model: Some("m"), prompt: Some(prompt), ..SelectCtx::default() }
    }

    fn route(policy: &Scored, nodes: &[Arc<Node>], prompt: &[u8]) -> usize {
        let i = policy.pick(nodes, &ctx(prompt)).unwrap();
        policy.selected(&nodes[i], &ctx(prompt));
        i
    }

    #[test]
    fn a_cached_prompt_outweighs_a_small_queue_not_a_long_one() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let system = "You are a helpful assistant. ".repeat(280); // about 8 KiB
        let home = route(&policy, &nodes, format!("{system} first").as_bytes());
        // Five requests wait at the home node for their first token: 5 < 8 KiB of prefill.
        nodes[home].counters().unanswered.fetch_add(5, Ordering::Relaxed);
        assert_eq!(route(&policy, &nodes, format!("{system} second").as_bytes()), home);
        // 10: now another node is cheaper, and learns the prompt too.
        nodes[home].counters().unanswered.fetch_add(5, Ordering::Relaxed);
        let other = route(&policy, &nodes, format!("{system} third").as_bytes());
        assert_ne!(other, home);
        let costs = policy.costs(&nodes, &ctx(format!("{system} fourth").as_bytes()));
        let third = (0..3).find(|&i| i != home && i != other).unwrap();
        assert!(costs[other].unwrap() < costs[third].unwrap(), "{costs:?}");
    }

    #[test]
    fn engine_reports_count_and_weights_are_configurable() {
        let (_reg, nodes) = nodes(2);
        report(&nodes[0], 6, 2, 0.6);
        report(&nodes[1], 7, 0, 0.1);
        // Two waiting and 0.6 of the cache, against none waiting and 0.1.
        assert_eq!(scored(WEIGHTS).pick(&nodes, &ctx(b"x")), Some(1));
        let kv_blind = WEIGHTS.with_overrides("kv=0, queue=1").unwrap();
        assert!(kv_blind.kv.abs() < f64::EPSILON);
        let queue_blind = WEIGHTS.with_overrides("queue=0").unwrap();
        // Only the KV term is left: node 1 still.
        assert_eq!(scored(queue_blind).pick(&nodes, &ctx(b"x")), Some(1));
        report(&nodes[1], 7, 0, 1.0);
        assert_eq!(scored(queue_blind).pick(&nodes, &ctx(b"x")), Some(0));
        // With a load weight, requests in flight through pdproxy count too: node 1 has two more.
        nodes[1].counters().in_flight.fetch_add(2, Ordering::Relaxed);
        assert_eq!(scored(WEIGHTS).pick(&nodes, &ctx(b"x")), Some(1), "no load weight: unchanged");
        let loaded = WEIGHTS.with_overrides("queue=0,kv=0,load=1").unwrap();
        assert_eq!(scored(loaded).pick(&nodes, &ctx(b"x")), Some(0));
        for bad in ["prefix", "prefix=-1", "speed=2", "kv=x", "queue=inf"] {
            assert!(WEIGHTS.with_overrides(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nodes_equally_ready_take_turns() {
        let (_reg, nodes) = nodes(4);
        for (i, node) in nodes.iter().enumerate() {
            // Nodes 0-2 within a hair of each other; node 3 a request behind, never sent any.
            report(node, 4, u64::from(i == 3), 0.30 + 0.01 * f64::from(u8::try_from(i).unwrap()));
        }
        nodes[0].counters().requests.fetch_add(5, Ordering::Relaxed);
        let policy = scored(WEIGHTS);
        let mut order = Vec::new();
        for _ in 0..6 {
            let i = policy.pick(&nodes, &ctx(b"x")).unwrap();
            nodes[i].counters().requests.fetch_add(1, Ordering::Relaxed);
            order.push(i);
        }
        // The ready ones that were sent the fewest, in turn; never the one with a queue.
        let count = |n: usize| order.iter().filter(|&&i| i == n).count();
        assert_eq!([count(0), count(1), count(2), count(3)], [0, 3, 3, 0], "{order:?}");
        assert!(order.chunks(2).all(|round| round[0] != round[1]), "{order:?}");
        // Requests in flight come first: node 0, sent the most, but the only one not busy.
        nodes[1].counters().in_flight.fetch_add(1, Ordering::Relaxed);
        nodes[2].counters().in_flight.fetch_add(1, Ordering::Relaxed);
        assert_eq!(policy.pick(&nodes, &ctx(b"x")), Some(0));
    }

    #[test]
    fn without_a_prompt_or_reports_it_balances_requests_not_yet_answered() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let mut picks = [0; 3];
        for _ in 0..30 {
            let i = policy.pick(&nodes, &SelectCtx::default()).unwrap();
            picks[i] += 1;
            nodes[i].counters().unanswered.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(picks, [10, 10, 10]);
    }

    #[test]
    fn when_every_node_is_prefilling_the_one_sent_its_prompt_longest_ago_is_chosen() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let now = now_ms();
        for (node, age_ms) in nodes.iter().zip([50, 400, 100]) {
            let counters = node.counters();
            counters.record_prefill(1024, 100); // about 10 bytes per ms
            counters.prefill_pending_bytes.fetch_add(8 * 1024, Ordering::Relaxed);
            counters.prefill_pending_byte_ms.fetch_add((8 * 1024u64).wrapping_mul(now - age_ms), Ordering::Relaxed);
        }
        let prompt = "c".repeat(1024);
        assert_eq!(policy.pick(&nodes, &ctx(prompt.as_bytes())), Some(1));
    }

    #[test]
    fn prefill_sent_and_not_yet_answered_counts_until_the_first_byte() {
        let (reg, nodes) = nodes(2);
        let policy = scored(WEIGHTS);
        let long = "a".repeat(8 * 1024);
        // Two different 8 KiB prompts: the second avoids the node still prefilling the first.
        let first = crate::select::select(&reg.load(), &ctx(long.as_bytes()), &policy, None).unwrap();
        let pending = first.node().counters().prefill_pending_bytes.load(Ordering::Relaxed);
        assert_eq!(pending, 8 * 1024);
        let other = "b".repeat(8 * 1024);
        let second = crate::select::select(&reg.load(), &ctx(other.as_bytes()), &policy, None).unwrap();
        assert_ne!(second.node().url(), first.node().url());
        first.first_byte_seen();
        first.first_byte_seen();
        assert_eq!(first.node().counters().prefill_pending_bytes.load(Ordering::Relaxed), 0, "released once");
        let node = Arc::clone(second.node());
        drop(second);
        assert_eq!(node.counters().prefill_pending_bytes.load(Ordering::Relaxed), 0, "and at the end at the latest");
        for node in [first.node(), &node] {
            assert_eq!(node.counters().prefill_pending_byte_ms.load(Ordering::Relaxed), 0, "their send times too");
        }
        assert_eq!(nodes.len(), 2);
    }
}

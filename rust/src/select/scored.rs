//! `scored`: the node with the lowest cost, a weighted sum of what each candidate would make
//! the request wait for:
//!
//! ```text
//! cost = prefix_weight * KiB of the prompt the node would have to prefill (not in its cache)
//!      + queue_weight  * requests the node's engine has (running and waiting)
//!      + kv_weight     * the engine's KV-cache usage (0 to 1)
//! ```
//!
//! The prompt a node holds comes from the prefix table (what pdproxy routed there and the
//! engine has not evicted since, see `prefix_table`). The engine's requests and KV usage come
//! from its fresh report adjusted by pdproxy's traffic since; without a report, pdproxy's own
//! requests in flight stand in for the queue and the KV term is left out. So with the default
//! weights (1, 1, 1) a node whose cache holds 4 KiB more of the prompt (about a thousand
//! tokens) takes the request unless it has 4 more requests than another. Ties go at random.

use std::sync::Arc;

use super::least_engine_load::engine_requests;
use super::prefix_table::{PrefixTable, PrefixTableConfig};
use super::{available_indices, Policy, SelectCtx};
use crate::circuit::now_ms;
use crate::error::{Error, Kind, Result};
use crate::node::Node;

/// The weights of the three terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreWeights {
    pub prefix: f64,
    pub queue: f64,
    pub kv: f64,
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
                _ => return Err(invalid(spec)),
            }
        }
        Ok(out)
    }
}

fn invalid(spec: &str) -> Error {
    Error::new(
        Kind::Config,
        format!("scored weights {spec:?}: use prefix=N, queue=N, kv=N separated by commas (non-negative numbers)"),
    )
}

#[derive(Debug)]
pub struct Scored {
    weights: ScoreWeights,
    table: PrefixTable,
    /// Older engine reports are ignored.
    max_age_ms: u64,
}

impl Scored {
    pub fn new(weights: ScoreWeights, table: PrefixTableConfig, max_age_ms: u64) -> Self {
        Self { weights, table: PrefixTable::new(table), max_age_ms }
    }

    pub fn weights(&self) -> ScoreWeights {
        self.weights
    }

    /// Each available candidate's cost for the request (`None`: not available).
    pub fn costs(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<f64>> {
        let hashes = self.table.block_hashes(ctx);
        let matched = self.table.matched(&hashes, candidates);
        let considered = self.table.considered_bytes(ctx);
        let now = now_ms();
        let mut out = vec![None; candidates.len()];
        for i in available_indices(candidates) {
            let node = &candidates[i];
            let held = (matched[i] * self.table.block_bytes()).min(considered);
            #[allow(clippy::cast_precision_loss)]
            let uncached_kib = (considered - held) as f64 / 1024.0;
            let kv = node.engine_load(self.max_age_ms, now).and_then(|l| l.kv_usage_estimate()).unwrap_or(0.0);
            let w = self.weights;
            let queue = engine_requests(node, self.max_age_ms, now);
            out[i] = Some(w.prefix * uncached_kib + w.queue * queue + w.kv * kv);
        }
        out
    }
}

impl Policy for Scored {
    fn name(&self) -> &'static str {
        "scored"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        let mut best = f64::INFINITY;
        let mut chosen = None;
        let mut ties = 0u32;
        for (i, cost) in self.costs(candidates, ctx).into_iter().enumerate() {
            let Some(cost) = cost else { continue };
            if cost < best {
                (best, chosen, ties) = (cost, Some(i), 1);
            } else if cost.total_cmp(&best).is_eq() {
                ties += 1;
                if fastrand::u32(0..ties) == 0 {
                    chosen = Some(i);
                }
            }
        }
        chosen
    }

    fn selected(&self, node: &Arc<Node>, ctx: &SelectCtx<'_>) {
        let capacity = node.engine_load(u64::MAX, now_ms()).and_then(|l| l.kv_capacity_tokens);
        self.table.learn(node, &self.table.block_hashes(ctx), capacity);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::testing::*;
    use super::*;

    const WEIGHTS: ScoreWeights = ScoreWeights { prefix: 1.0, queue: 1.0, kv: 1.0 };

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
        // The home node has 5 more requests than the others: 5 < 8 KiB of prefill.
        nodes[home].counters().in_flight.fetch_add(5, Ordering::Relaxed);
        assert_eq!(route(&policy, &nodes, format!("{system} second").as_bytes()), home);
        // 10 more: now another node is cheaper, and learns the prompt too.
        nodes[home].counters().in_flight.fetch_add(5, Ordering::Relaxed);
        let other = route(&policy, &nodes, format!("{system} third").as_bytes());
        assert_ne!(other, home);
        let costs = policy.costs(&nodes, &ctx(format!("{system} fourth").as_bytes()));
        let third = (0..3).find(|&i| i != home && i != other).unwrap();
        assert!(costs[other].unwrap() < costs[third].unwrap(), "{costs:?}");
    }

    #[test]
    fn engine_reports_count_and_weights_are_configurable() {
        let (_reg, nodes) = nodes(2);
        report(&nodes[0], 6, 2, 0.9);
        report(&nodes[1], 7, 0, 0.1);
        // Queue 8 + 0.9 against 7 + 0.1.
        assert_eq!(scored(WEIGHTS).pick(&nodes, &ctx(b"x")), Some(1));
        let kv_blind = WEIGHTS.with_overrides("kv=0, queue=1").unwrap();
        assert_eq!(kv_blind.kv, 0.0);
        let queue_blind = WEIGHTS.with_overrides("queue=0").unwrap();
        // Only the KV term is left: node 1 still.
        assert_eq!(scored(queue_blind).pick(&nodes, &ctx(b"x")), Some(1));
        report(&nodes[1], 7, 0, 1.0);
        assert_eq!(scored(queue_blind).pick(&nodes, &ctx(b"x")), Some(0));
        for bad in ["prefix", "prefix=-1", "speed=2", "kv=x", "queue=inf"] {
            assert!(WEIGHTS.with_overrides(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_a_prompt_or_reports_it_balances_in_flight() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let mut picks = [0; 3];
        for _ in 0..30 {
            let i = policy.pick(&nodes, &SelectCtx::default()).unwrap();
            picks[i] += 1;
            nodes[i].counters().in_flight.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(picks, [10, 10, 10]);
    }
}

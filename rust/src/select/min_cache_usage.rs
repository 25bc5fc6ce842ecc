//! `min_cache_usage`: the node whose engine reports the least KV-cache usage
//! (`lmdeploy:gpu_cache_usage_perc` and its vLLM and SGLang equivalents), the cache-usage
//! policy of LMDeploy's proxy under its name. (The LMDeploy snapshot read for this work,
//! commit 1263d5cd8, still routes by `random`, `min_expected_latency` and `min_observed_latency`
//! only, so the policy follows the description, not that proxy's code.) Only nodes
//! whose report is fresh are considered; with none, `min_expected_latency` decides.
//!
//! Between two readings the requests pdproxy started since count too (each as a running
//! request's average share of the cache), and ties (idle engines all at 0) go to the node
//! with the fewest requests in flight: without that, every request between two readings would
//! go to the same node.

use std::sync::Arc;

use super::{argmin_by, available_indices, MinExpectedLatency, Policy, SelectCtx};
use crate::clock::now_ms;
use crate::node::Node;

#[derive(Debug)]
pub(crate) struct MinCacheUsage {
    /// Older engine reports are ignored.
    pub(crate) max_age_ms: u64,
}

impl Policy for MinCacheUsage {
    fn name(&self) -> &'static str {
        "min_cache_usage"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        let now = now_ms();
        let usage = |node: &Node| node.engine_load(self.max_age_ms, now).and_then(|load| load.kv_usage_estimate());
        if !available_indices(candidates).any(|i| usage(&candidates[i]).is_some()) {
            return MinExpectedLatency.pick(candidates, ctx);
        }
        // In-flight requests break ties: a millionth of the cache each, below any real difference.
        #[allow(clippy::cast_precision_loss)]
        argmin_by(candidates, |n| usage(n).map_or(f64::INFINITY, |u| u + n.counters().in_flight() as f64 * 1e-6))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn picks_the_least_used_cache_among_fresh_reports() {
        let (_reg, nodes) = nodes(3);
        let policy = MinCacheUsage { max_age_ms: 10_000 };
        report(&nodes[0], 4, 0, 0.8);
        report(&nodes[1], 4, 0, 0.3);
        // Node 2 has no report: not considered while others have one (as LMDeploy).
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(1));
        nodes[1].counters().set_state(crate::node::NodeState::Draining);
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(0));
    }

    #[test]
    fn without_fresh_reports_it_is_min_expected_latency() {
        let (_reg, nodes) = nodes(2);
        let policy = MinCacheUsage { max_age_ms: 10_000 };
        set_in_flight(&nodes[0], 5);
        set_in_flight(&nodes[1], 2);
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(1));
        // A report older than the max age is as good as none.
        nodes[0].counters().record_engine_report(&figures(0, 0, 0.0), 1);
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(1));
    }

    #[test]
    fn requests_sent_since_the_reading_spread_the_load() {
        let (_reg, nodes) = nodes(2);
        let policy = MinCacheUsage { max_age_ms: 10_000 };
        report(&nodes[0], 0, 0, 0.0);
        report(&nodes[1], 0, 0, 0.0);
        let mut picks = [0; 2];
        for _ in 0..10 {
            let i = policy.pick(&nodes, &SelectCtx::default()).unwrap();
            picks[i] += 1;
            nodes[i].counters().in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        assert_eq!(picks, [5, 5]);
        // A running request's share of the cache counts for each request started since.
        report(&nodes[0], 2, 0, 0.2);
        report(&nodes[1], 2, 0, 0.3);
        for _ in 0..2 {
            nodes[0].counters().in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Node 0: 0.2 + 2 * 0.1 = 0.4 > 0.3.
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(1));
    }
}

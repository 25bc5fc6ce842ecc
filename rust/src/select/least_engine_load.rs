//! `least_engine_load`: the node whose engine has the fewest requests running and waiting,
//! as it last reported them, adjusted by the requests pdproxy started and finished since (so
//! that requests between two readings do not all go to the same node). A node without a fresh
//! report counts its requests in flight through pdproxy. Ties are broken at random.

use std::sync::Arc;

use super::{argmin_by, Policy, SelectCtx};
use crate::clock::now_ms;
use crate::node::Node;

#[derive(Debug)]
pub(crate) struct LeastEngineLoad {
    /// Older engine reports are ignored.
    pub(crate) max_age_ms: u64,
}

/// Requests a node's engine has now: its fresh report with pdproxy's traffic since, else
/// pdproxy's requests in flight on it.
pub(crate) fn engine_requests(node: &Node, max_age_ms: u64, now_ms: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    node.engine_load(max_age_ms, now_ms).map_or(node.counters().in_flight() as f64, |load| load.requests())
}

impl Policy for LeastEngineLoad {
    fn name(&self) -> &'static str {
        "least_engine_load"
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        let now = now_ms();
        argmin_by(candidates, |n| engine_requests(n, self.max_age_ms, now))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::testing::*;
    use super::*;

    #[test]
    fn the_engines_queues_decide() {
        let (_reg, nodes) = nodes(3);
        let policy = LeastEngineLoad { max_age_ms: 10_000 };
        // Other clients keep node 0's engine busy: pdproxy sees nothing in flight there.
        report(&nodes[0], 8, 4, 0.9);
        report(&nodes[1], 2, 0, 0.2);
        set_in_flight(&nodes[2], 5); // no report: its in-flight count stands in
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(1));
        // Four requests started on node 1 since its reading: 6 > 5.
        nodes[1].counters().in_flight.fetch_add(4, Ordering::Relaxed);
        assert_eq!(policy.pick(&nodes, &SelectCtx::default()), Some(2));
    }

    #[test]
    fn requests_between_two_readings_spread() {
        let (_reg, nodes) = nodes(3);
        let policy = LeastEngineLoad { max_age_ms: 10_000 };
        for node in &nodes {
            report(node, 1, 0, 0.1);
        }
        let mut picks = [0; 3];
        for _ in 0..9 {
            let i = policy.pick(&nodes, &SelectCtx::default()).unwrap();
            picks[i] += 1;
            nodes[i].counters().in_flight.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(picks, [3, 3, 3]);
    }
}

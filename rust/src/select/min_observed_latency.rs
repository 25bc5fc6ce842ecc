//! `min_observed_latency`: the lowest mean latency over each node's last 15 requests
//! (LMDeploy's policy); `min_observed_latency_per_token` divides each latency by the events
//! (tokens) it served, so long answers do not make a node look slow. Nodes without history
//! score zero and are tried first.

use std::sync::Arc;

use super::{argmin_by, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub(crate) struct MinObservedLatency {
    pub(crate) per_event: bool,
}

impl Policy for MinObservedLatency {
    fn name(&self) -> &'static str {
        if self.per_event {
            "min_observed_latency_per_token"
        } else {
            "min_observed_latency"
        }
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        argmin_by(candidates, |n| n.counters().recent_mean(self.per_event).unwrap_or(0.0))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::testing::*;
    use super::*;

    #[test]
    fn prefers_the_fastest_recent_history() {
        let (_reg, nodes) = nodes(2);
        nodes[0].counters().record_success(Duration::from_millis(100), None, 100);
        nodes[1].counters().record_success(Duration::from_millis(20), None, 4);
        let ctx = SelectCtx::default();
        assert_eq!(MinObservedLatency { per_event: false }.pick(&nodes, &ctx), Some(1));
        // Per token, node 0 is faster: 1 ms against 5 ms.
        assert_eq!(MinObservedLatency { per_event: true }.pick(&nodes, &ctx), Some(0));
    }

    #[test]
    fn unknown_nodes_are_tried_first() {
        let (_reg, nodes) = nodes(2);
        nodes[0].counters().record_success(Duration::from_millis(1), None, 1);
        assert_eq!(MinObservedLatency::default().pick(&nodes, &SelectCtx::default()), Some(1));
    }
}

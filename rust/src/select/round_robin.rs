//! `round_robin`: each available candidate in turn.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{available, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub(crate) struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..candidates.len()).map(|k| (start + k) % candidates.len()).find(|&i| available(&candidates[i]))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::node::NodeState;

    #[test]
    fn cycles_through_available_candidates() {
        let (_reg, nodes) = nodes(3);
        let policy = RoundRobin::default();
        let ctx = SelectCtx::default();
        let picks: Vec<usize> = (0..6).map(|_| policy.pick(&nodes, &ctx).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        nodes[1].counters().set_state(NodeState::Unhealthy);
        assert_eq!(histogram(&policy, &nodes, &ctx, 100)[1], 0);
    }
}

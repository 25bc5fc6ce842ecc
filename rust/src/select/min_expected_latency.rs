//! `min_expected_latency`: the lowest in-flight / speed, random among ties (LMDeploy's
//! default policy).

use std::sync::Arc;

use super::{argmin_by, effective_speed, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub(crate) struct MinExpectedLatency;

impl Policy for MinExpectedLatency {
    fn name(&self) -> &'static str {
        "min_expected_latency"
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        let speed = effective_speed(candidates);
        #[allow(clippy::cast_precision_loss)]
        argmin_by(candidates, |n| n.counters().in_flight() as f64 / speed(n))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::node::registry::Registry;
    use crate::node::NodeSpec;

    #[test]
    fn balances_load_against_speed() {
        let reg = Registry::new();
        let slow = reg.add("h:1", NodeSpec { speed: Some(1.0), ..NodeSpec::default() }).unwrap();
        let fast = reg.add("h:2", NodeSpec { speed: Some(4.0), ..NodeSpec::default() }).unwrap();
        let nodes = [slow, fast];
        set_in_flight(&nodes[0], 1);
        set_in_flight(&nodes[1], 3); // 1/1 = 1 > 3/4
        assert_eq!(MinExpectedLatency.pick(&nodes, &SelectCtx::default()), Some(1));
        set_in_flight(&nodes[1], 5); // 5/4 > 1
        assert_eq!(MinExpectedLatency.pick(&nodes, &SelectCtx::default()), Some(0));
    }

    #[test]
    fn ties_are_broken_at_random() {
        let (_reg, nodes) = nodes(3);
        let counts = histogram(&MinExpectedLatency, &nodes, &SelectCtx::default(), 3_000);
        assert!(counts.iter().all(|&c| c > 500), "{counts:?}");
    }
}

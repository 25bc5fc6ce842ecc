//! `random`: a random available candidate, weighted by speed (LMDeploy's `random`).

use std::sync::Arc;

use super::{available_indices, effective_speed, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub(crate) struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        let speed = effective_speed(candidates);
        let total: f64 = available_indices(candidates).map(|i| speed(&candidates[i])).sum();
        let mut point = fastrand::f64() * total;
        let mut last = None;
        for i in available_indices(candidates) {
            point -= speed(&candidates[i]);
            last = Some(i);
            if point < 0.0 {
                break;
            }
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::node::registry::Registry;
    use crate::node::NodeSpec;

    #[test]
    fn weighted_by_speed() {
        let reg = Registry::new();
        let nodes: Vec<_> = [1.0, 3.0]
            .iter()
            .enumerate()
            .map(|(i, s)| reg.add(&format!("h:{i}"), NodeSpec { speed: Some(*s), ..NodeSpec::default() }).unwrap())
            .collect();
        let counts = histogram(&Random, &nodes, &SelectCtx::default(), 20_000);
        // Expect 25% / 75%; allow a wide margin so the test never flakes.
        assert!((4_000..6_000).contains(&counts[0]), "{counts:?}");
    }
}

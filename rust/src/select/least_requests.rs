//! `least_requests`: power of two choices on in-flight requests.

use std::sync::Arc;

use super::{available_indices, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub(crate) struct LeastRequests;

/// Two distinct random available candidates (reservoir-sampled in one pass, so nodes
/// changing state meanwhile cannot make the sample inconsistent); the one with fewer
/// requests in flight, at random on a tie.
pub(crate) fn power_of_two(candidates: &[Arc<Node>]) -> Option<usize> {
    let mut picks: [Option<usize>; 2] = [None, None];
    let mut seen = 0usize;
    for i in available_indices(candidates) {
        seen += 1;
        if seen <= 2 {
            picks[seen - 1] = Some(i);
        } else {
            let j = fastrand::usize(0..seen);
            if j < 2 {
                picks[j] = Some(i);
            }
        }
    }
    let load = |i: usize| candidates[i].counters().in_flight();
    match picks {
        [Some(a), Some(b)] => Some(match load(a).cmp(&load(b)) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal => {
                if fastrand::bool() {
                    a
                } else {
                    b
                }
            }
        }),
        [a, _] => a,
    }
}

impl Policy for LeastRequests {
    fn name(&self) -> &'static str {
        "least_requests"
    }

    fn pick(&self, candidates: &[Arc<Node>], _ctx: &SelectCtx<'_>) -> Option<usize> {
        power_of_two(candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn prefers_the_less_loaded_of_two() {
        let (_reg, nodes) = nodes(2);
        set_in_flight(&nodes[0], 10);
        // With two candidates both are always compared: the idle one always wins.
        assert_eq!(histogram(&LeastRequests, &nodes, &SelectCtx::default(), 200), [0, 200]);
        let (_reg, nodes) = nodes_one();
        assert_eq!(LeastRequests.pick(&nodes, &SelectCtx::default()), Some(0));
    }

    fn nodes_one() -> (crate::node::registry::Registry, Vec<Arc<Node>>) {
        nodes(1)
    }
}

//! `least_requests`: power of two choices on in-flight requests.

use std::sync::Arc;

use super::{available_indices, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug, Default)]
pub struct LeastRequests;

/// Two distinct random available candidates; the one with fewer requests in flight.
pub(crate) fn power_of_two(candidates: &[Arc<Node>]) -> Option<usize> {
    let count = available_indices(candidates).count();
    let a = available_indices(candidates).nth(fastrand::usize(0..count.max(1)))?;
    if count == 1 {
        return Some(a);
    }
    let mut k = fastrand::usize(0..count - 1);
    if available_indices(candidates).nth(k) == Some(a) {
        k += 1;
    }
    let b = available_indices(candidates).nth(k)?;
    let load = |i: usize| candidates[i].counters().in_flight();
    Some(if load(b) < load(a) { b } else { a })
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

    fn nodes_one() -> (crate::registry::Registry, Vec<Arc<Node>>) {
        nodes(1)
    }
}

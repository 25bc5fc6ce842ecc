//! `consistent_hash`: requests with the same affinity key (session or user) go to the same
//! node, chosen by rendezvous hashing so that adding or removing a node moves only its
//! share of keys. Bounded load: a node whose in-flight count reaches `load_factor` times the
//! average is passed over for the key's next-best node, so one hot key cannot overload a
//! node. Requests without a key fall back to `least_requests`.

use std::sync::Arc;

use super::least_requests::power_of_two;
use super::{available_indices, stable_hash, Policy, SelectCtx};
use crate::node::Node;

#[derive(Debug)]
pub(crate) struct ConsistentHash {
    pub(crate) load_factor: f64,
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        let Some(key) = ctx.affinity else {
            return power_of_two(candidates);
        };
        let (count, total) = available_indices(candidates)
            .fold((0u64, 0u64), |(c, t), i| (c + 1, t + candidates[i].counters().in_flight()));
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bound = ((total + 1) as f64 / count.max(1) as f64 * self.load_factor).ceil() as u64;
        let mut ranked: Vec<(u64, usize)> =
            available_indices(candidates).map(|i| (stable_hash((key, candidates[i].url())), i)).collect();
        ranked.sort_unstable_by_key(|&(score, _)| std::cmp::Reverse(score));
        ranked.iter().find(|(_, i)| candidates[*i].counters().in_flight() < bound).or(ranked.first()).map(|&(_, i)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    fn ctx(key: &str) -> SelectCtx<'_> {
        SelectCtx { affinity: Some(key), ..SelectCtx::default() }
    }

    #[test]
    fn same_key_same_node_and_keys_spread() {
        let (_reg, nodes) = nodes(4);
        let policy = ConsistentHash { load_factor: 1.25 };
        let first = policy.pick(&nodes, &ctx("user-7")).unwrap();
        assert!((0..20).all(|_| policy.pick(&nodes, &ctx("user-7")) == Some(first)));
        let mut used = [false; 4];
        for k in 0..200 {
            used[policy.pick(&nodes, &ctx(&format!("user-{k}"))).unwrap()] = true;
        }
        assert!(used.iter().all(|&u| u), "keys spread over every node");
    }

    #[test]
    fn removing_a_node_moves_only_its_keys() {
        let (_reg, nodes) = nodes(4);
        let policy = ConsistentHash { load_factor: 1.25 };
        let before: Vec<usize> = (0..200).map(|k| policy.pick(&nodes, &ctx(&format!("k{k}"))).unwrap()).collect();
        let fewer = &nodes[..3];
        for (k, &was) in before.iter().enumerate() {
            if was < 3 {
                assert_eq!(policy.pick(fewer, &ctx(&format!("k{k}"))), Some(was));
            }
        }
    }

    #[test]
    fn a_hot_key_spills_over_under_load() {
        let (_reg, nodes) = nodes(2);
        let policy = ConsistentHash { load_factor: 1.25 };
        let home = policy.pick(&nodes, &ctx("hot")).unwrap();
        set_in_flight(&nodes[home], 10);
        assert_eq!(policy.pick(&nodes, &ctx("hot")), Some(1 - home));
    }
}

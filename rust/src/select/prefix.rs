//! `prefix`: cache-aware routing. A request whose prompt starts like one a node served
//! recently goes to that node, where the prefix is likely still in its KV cache, unless the
//! node is busier than the least busy candidate by more than `balance_threshold` requests;
//! then (and on a miss) the least busy candidate takes it.
//!
//! The prompt is cut into blocks of `block_bytes` and each block's hash chains the previous
//! one, so a hash stands for the whole prefix up to its block. The table from prefix hash to
//! node is bounded: two generations of at most `cache_entries / 2` entries each; when the
//! young one fills, the old one is dropped (an approximate LRU without per-entry bookkeeping).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::prefix_table::prompt_block_hashes;
use super::{argmin_by, available_indices, Policy, SelectCtx};
use crate::node::Node;
use crate::select::Prediction;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixConfig {
    pub(crate) block_bytes: usize,
    pub(crate) max_blocks: usize,
    pub(crate) cache_entries: usize,
    pub(crate) balance_threshold: u64,
}

impl Default for PrefixConfig {
    /// Test defaults only; the served values come from the settings.
    fn default() -> Self {
        Self { block_bytes: 64, max_blocks: 32, cache_entries: 1024, balance_threshold: 4 }
    }
}

#[derive(Debug, Default)]
struct Table {
    young: HashMap<u64, u64>,
    old: HashMap<u64, u64>,
}

#[derive(Debug)]
pub(crate) struct Prefix {
    config: PrefixConfig,
    table: Mutex<Table>,
}

impl Prefix {
    pub(crate) fn new(config: PrefixConfig) -> Self {
        Self { config, table: Mutex::default() }
    }

    fn block_hashes(&self, ctx: &SelectCtx<'_>) -> Vec<u64> {
        prompt_block_hashes(ctx, self.config.block_bytes, self.config.max_blocks)
    }

    /// Entries in the table now (for tests and stats).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> usize {
        let table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        table.young.len() + table.old.len()
    }
}

impl Policy for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        let hashes = self.block_hashes(ctx);
        let cached = {
            let table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            hashes.iter().rev().find_map(|h| table.young.get(h).or_else(|| table.old.get(h)).copied())
        };
        let least_busy = available_indices(candidates).map(|i| candidates[i].counters().in_flight()).min()?;
        if let Some(generation) = cached {
            let home = available_indices(candidates).find(|&i| candidates[i].generation() == generation);
            if let Some(i) = home {
                if candidates[i].counters().in_flight() <= least_busy + self.config.balance_threshold {
                    return Some(i);
                }
            }
        }
        #[allow(clippy::cast_precision_loss)]
        argmin_by(candidates, |n| n.counters().in_flight() as f64)
    }

    fn selected(&self, node: &Arc<Node>, ctx: &SelectCtx<'_>) -> Prediction {
        let hashes = self.block_hashes(ctx);
        if hashes.is_empty() {
            return Prediction::default();
        }
        let half = (self.config.cache_entries / 2).max(1);
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        for h in hashes {
            if table.young.len() >= half {
                table.old = std::mem::take(&mut table.young);
            }
            table.young.insert(h, node.generation());
        }
        Prediction::default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    fn ctx(prompt: &[u8]) -> SelectCtx<'_> {
        SelectCtx { model: Some("m"), prompt: Some(prompt), ..SelectCtx::default() }
    }

    fn route(policy: &Prefix, nodes: &[Arc<Node>], prompt: &[u8]) -> usize {
        let i = policy.pick(nodes, &ctx(prompt)).unwrap();
        policy.selected(&nodes[i], &ctx(prompt));
        i
    }

    #[test]
    fn shared_prefixes_stick_to_one_node() {
        let (_reg, nodes) = nodes(4);
        let policy = Prefix::new(PrefixConfig::default());
        let system = "You are a helpful assistant. ".repeat(10);
        let home = route(&policy, &nodes, format!("{system} question one").as_bytes());
        for q in 0..20 {
            assert_eq!(route(&policy, &nodes, format!("{system} question {q}").as_bytes()), home);
        }
    }

    #[test]
    fn an_overloaded_home_is_passed_over() {
        let (_reg, nodes) = nodes(2);
        let policy = Prefix::new(PrefixConfig::default());
        let prompt = "x".repeat(500);
        let home = route(&policy, &nodes, prompt.as_bytes());
        set_in_flight(&nodes[home], 10);
        assert_eq!(route(&policy, &nodes, prompt.as_bytes()), 1 - home);
    }

    #[test]
    fn memory_is_bounded() {
        let (_reg, nodes) = nodes(2);
        let policy = Prefix::new(PrefixConfig { cache_entries: 100, ..PrefixConfig::default() });
        for i in 0..1000 {
            route(&policy, &nodes, format!("{i:>200}").as_bytes());
        }
        assert!(policy.entries() <= 100, "{}", policy.entries());
    }
}

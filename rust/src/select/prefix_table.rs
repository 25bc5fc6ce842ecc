//! Which nodes recently took which prompt prefixes, and so likely hold them in their KV
//! caches. The table learns from the routes pdproxy chose and forgets as the engines do:
//!
//! - each node keeps at most as many blocks as its engine's KV cache holds, when the engine
//!   reports its capacity (else an equal share of `entries`), least recently routed first and,
//!   within one prompt, its deepest blocks first (an engine's LRU frees a finished sequence's
//!   last blocks first, so its head outlives its tail);
//! - where the engine reports its prefix-cache hits (each answer's `usage`, or its metrics),
//!   the table checks its own predictions against them (what the policy expected the engine
//!   to find, for the requests it has answered): when the engine found less in its cache than the table
//!   expected, the table holds too much for that node (the engine evicted it), and the node's
//!   share shrinks to what the hits bear out; it grows back while predictions hold;
//! - a node whose engine restarted (its counters went back), whose cache pdproxy had flushed
//!   (`POST /flush_cache`), or whose engine found next to nothing of what the table expected
//!   it to (its cache was flushed by someone else), forgets everything.
//!
//! The prompt is cut into blocks of `block_bytes` and each block's hash chains the previous
//! one, so a hash names the whole prefix up to its block. Memory is bounded: about `entries`
//! blocks in all, and at most `MAX_NODES` nodes.

use std::collections::VecDeque;
use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use rustc_hash::{FxHashMap, FxHasher};

use super::{stable_hash, SelectCtx};
use crate::clock::now_ms;
use crate::node::Node;

/// The chained hashes of the first `max_blocks` blocks of `block_bytes` of the request's prompt
/// (the model's name seeds the chain): equal prompt heads give equal hashes, block by block.
/// rustc-hash's byte hash, each block's seeded with the hash of the ones before (fixed seeds:
/// the same in every process): a prompt of tens of KiB is hashed on every request, where the
/// standard `SipHash` cost 3-4 instructions a byte and this costs about two thirds of one (XXH3
/// measured more here: 256-byte blocks take its long path).
pub(crate) fn prompt_block_hashes(ctx: &SelectCtx<'_>, block_bytes: usize, max_blocks: usize) -> Vec<u64> {
    let Some(prompt) = ctx.prompt else { return Vec::new() };
    let mut hash = stable_hash(ctx.model.unwrap_or_default());
    prompt
        .chunks(block_bytes.max(1))
        .take(max_blocks)
        .map(|block| {
            let mut hasher = FxHasher::default();
            hasher.write_u64(hash);
            hasher.write(block);
            hash = hasher.finish();
            hash
        })
        .collect()
}

/// Nodes the table keeps blocks for; past it the least recently routed to is forgotten.
const MAX_NODES: usize = 1024;
/// Predicted hits (bytes) a check of a node's share waits for, so that one reading's noise
/// does not move it.
const CHECK_AFTER_BYTES: u64 = 64 << 10;
/// Hits found over hits predicted below which a node's share shrinks, and above which it grows.
const SHRINK_BELOW: f64 = 0.9;
const GROW_ABOVE: f64 = 0.97;
/// Hits found over hits predicted below which the engine is taken to have emptied its cache.
const FLUSHED_BELOW: f64 = 0.1;
/// Predicted hits (bytes) of answers in a row that found next to nothing of them, past which
/// the engine is taken to have emptied its cache without waiting for a whole check: about
/// three answers to long prompts. A check's window holds the hits from before the flush too.
const FLUSH_STREAK_BYTES: u64 = 24 << 10;
/// ... and the looks at the answers (each at least `STREAK_STEP_BYTES`, mostly one answer) they
/// came in: one long prompt whose blocks the engine evicted is no flush.
const FLUSH_STREAK_LOOKS: u32 = 3;
/// Predicted hits (bytes) the answers since the last look must add up to before they count in
/// a streak, so that one short prompt's miss does not.
const STREAK_STEP_BYTES: u64 = 4 << 10;
/// The smallest share a node is cut to (blocks).
const MIN_SHARE: usize = 16;

/// The table `scored` keeps of what each node holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixTableConfig {
    pub(crate) block_bytes: usize,
    /// Blocks of a prompt considered (its head).
    pub(crate) max_blocks: usize,
    /// Blocks remembered in all.
    pub(crate) entries: usize,
    /// Prompt bytes per engine token: converts an engine's reported KV capacity to blocks.
    pub(crate) bytes_per_token: f64,
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    generation: u64,
    /// When the node last took a prompt with this block; an older copy of it in the node's
    /// `order` is stale.
    stamp: u64,
    /// Until when (ms) the engine is not expected to have reported the block yet (its KV
    /// events): a route still pending, which only the table knows of.
    pending_until_ms: u64,
}

#[derive(Debug, Default)]
struct NodeBlocks {
    /// The node's blocks, least recently used first; entries whose stamp is not the holder's
    /// current one are stale and skipped.
    order: VecDeque<(u64, u64)>,
    live: usize,
    /// The engine's cache losses (restarts, flushes pdproxy asked for) when the blocks were learned.
    losses: u32,
    last_used: u64,
    /// What the engine's hits bear out (blocks); None until a check found too few hits.
    share: Option<usize>,
    /// At the engine's reading `checked_at`: its cumulative prefix-cache hits (tokens), and
    /// the node's `predicted_cached_bytes`.
    checked_at: u64,
    checked_hits: Option<u64>,
    checked_predicted: u64,
    /// The answers at the last check on their reports.
    answers_checked: AnswersMark,
    /// The answers at the last look, and the predicted hits of the answers since the last that
    /// found a good part of its prediction (see `FLUSH_STREAK_BYTES`), in how many looks.
    answers_seen: AnswersMark,
    missed_in_a_row: u64,
    missed_looks: u32,
}

/// Where the node's answer counters (`answered_predicted_bytes`, `answered_cached_tokens`)
/// stood when last taken into account.
#[derive(Debug, Default, Clone, Copy)]
struct AnswersMark {
    predicted: u64,
    tokens: u64,
}

impl AnswersMark {
    /// The hits predicted (bytes) and found (bytes, at `bytes_per_token`) since the mark, once
    /// at least `at_least` bytes were predicted; the mark then moves to the counters `now`.
    fn advance(&mut self, now: AnswersMark, at_least: u64, bytes_per_token: f64) -> Option<(u64, f64)> {
        let predicted = now.predicted.saturating_sub(self.predicted);
        if predicted < at_least {
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let found = now.tokens.saturating_sub(self.tokens) as f64 * bytes_per_token;
        *self = now;
        Some((predicted, found))
    }
}

impl NodeBlocks {
    /// Compares the hits predicted since the last check with those the engine found, once
    /// enough were predicted: from the answers that said what they found (each at once), else
    /// from the engine's readings (its cumulative hits, every few seconds). Moves the node's
    /// share accordingly. True when the engine found next to nothing of what it was predicted
    /// to hold: its cache was emptied (a flush: vLLM's `/reset_prefix_cache`, SGLang's
    /// `/flush_cache`), and the node's blocks are all to be forgotten.
    fn check(&mut self, node: &Node, bytes_per_token: f64, ceiling: usize) -> bool {
        let counters = node.counters();
        let answered = counters.answered_predicted_bytes.load(Ordering::Relaxed);
        if answered > 0 {
            let now =
                AnswersMark { predicted: answered, tokens: counters.answered_cached_tokens.load(Ordering::Relaxed) };
            if self.missed_in_a_row(now, bytes_per_token) {
                self.answers_checked = now;
                return true;
            }
            let Some((predicted, found)) = self.answers_checked.advance(now, CHECK_AFTER_BYTES, bytes_per_token) else {
                return false;
            };
            #[allow(clippy::cast_precision_loss)]
            return self.judge(found / predicted as f64, ceiling);
        }
        let (read_at, hits, predicted_now) = counters.engine.cached_tokens_read();
        if read_at == self.checked_at {
            return false;
        }
        let Some(hits) = hits else { return false };
        let mut flushed = false;
        if let Some(before) = self.checked_hits {
            let predicted = predicted_now.saturating_sub(self.checked_predicted);
            if predicted < CHECK_AFTER_BYTES && hits >= before {
                return false; // wait for more predictions, from this reading on
            }
            #[allow(clippy::cast_precision_loss)]
            let found = hits.saturating_sub(before) as f64 * bytes_per_token;
            #[allow(clippy::cast_precision_loss)]
            let ratio = found / (predicted.max(1)) as f64;
            flushed = self.judge(ratio, ceiling);
        }
        self.checked_at = read_at;
        self.checked_hits = Some(hits);
        self.checked_predicted = predicted_now;
        flushed
    }

    /// Follows the answers since the last look (the counters `now`); true when those in a row
    /// that found next to nothing of what they were predicted to find add up to
    /// `FLUSH_STREAK_BYTES` in `FLUSH_STREAK_LOOKS` looks.
    fn missed_in_a_row(&mut self, now: AnswersMark, bytes_per_token: f64) -> bool {
        let Some((predicted, found)) = self.answers_seen.advance(now, STREAK_STEP_BYTES, bytes_per_token) else {
            return false;
        };
        #[allow(clippy::cast_precision_loss)]
        let missed = found < FLUSHED_BELOW * predicted as f64;
        (self.missed_in_a_row, self.missed_looks) =
            if missed { (self.missed_in_a_row + predicted, self.missed_looks + 1) } else { (0, 0) };
        if self.missed_in_a_row < FLUSH_STREAK_BYTES || self.missed_looks < FLUSH_STREAK_LOOKS {
            return false;
        }
        (self.missed_in_a_row, self.missed_looks) = (0, 0);
        true
    }

    /// Moves the node's share after a check found `ratio` of the predicted hits; true: flushed.
    fn judge(&mut self, ratio: f64, ceiling: usize) -> bool {
        let current = self.share.unwrap_or(ceiling).min(ceiling);
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        if ratio < SHRINK_BELOW {
            let held = self.live.min(current) as f64;
            self.share = Some(((held * ratio.max(0.5)) as usize).max(MIN_SHARE));
        } else if ratio > GROW_ABOVE && self.share.is_some() {
            let grown = (current as f64 * 1.1) as usize + 1;
            self.share = (grown < ceiling).then_some(grown);
        }
        ratio < FLUSHED_BELOW
    }
}

#[derive(Debug, Default)]
struct Inner {
    holders: FxHashMap<u64, Vec<Holder>>,
    nodes: FxHashMap<u64, NodeBlocks>,
    clock: u64,
}

impl Inner {
    fn holds(&self, hash: u64, generation: u64, stamp: Option<u64>) -> bool {
        self.holders
            .get(&hash)
            .is_some_and(|hs| hs.iter().any(|h| h.generation == generation && stamp.is_none_or(|s| h.stamp == s)))
    }

    fn drop_block(&mut self, hash: u64, generation: u64) {
        if let Some(hs) = self.holders.get_mut(&hash) {
            hs.retain(|h| h.generation != generation);
            if hs.is_empty() {
                self.holders.remove(&hash);
            }
        }
    }

    /// Drops the node and its blocks.
    fn forget(&mut self, generation: u64) {
        if let Some(node) = self.nodes.remove(&generation) {
            self.drop_blocks(generation, node.order);
        }
    }

    /// Drops the node's blocks (its engine lost its cache, now `losses` times, or emptied it
    /// unasked), keeping where its checks are: the answers and readings before it are not judged again.
    fn clear(&mut self, generation: u64, losses: u32) {
        if let Some(node) = self.nodes.get_mut(&generation) {
            let order = std::mem::take(&mut node.order);
            (node.live, node.share, node.losses) = (0, None, losses);
            (node.missed_in_a_row, node.missed_looks) = (0, 0);
            self.drop_blocks(generation, order);
        }
    }

    fn drop_blocks(&mut self, generation: u64, order: VecDeque<(u64, u64)>) {
        for (hash, stamp) in order {
            if self.holds(hash, generation, Some(stamp)) {
                self.drop_block(hash, generation);
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct PrefixTable {
    config: PrefixTableConfig,
    inner: Mutex<Inner>,
}

impl PrefixTable {
    pub(crate) fn new(config: PrefixTableConfig) -> Self {
        Self { config, inner: Mutex::default() }
    }

    /// The chained hashes of the head of the request's prompt, one per full or last block.
    pub(crate) fn block_hashes(&self, ctx: &SelectCtx<'_>) -> Vec<u64> {
        prompt_block_hashes(ctx, self.config.block_bytes, self.config.max_blocks)
    }

    /// Bytes of the prompt the table looks at (its head).
    pub(crate) fn considered_bytes(&self, ctx: &SelectCtx<'_>) -> usize {
        ctx.prompt.map_or(0, |p| p.len().min(self.config.block_bytes * self.config.max_blocks))
    }

    pub(crate) fn block_bytes(&self) -> usize {
        self.config.block_bytes
    }

    /// For each candidate, how many leading blocks of `hashes` it holds.
    pub(crate) fn matched(&self, hashes: &[u64], candidates: &[Arc<Node>]) -> Vec<usize> {
        self.matched_pending(hashes, candidates, None).0
    }

    /// `matched`, and with `now_ms`, also how many leading blocks each candidate was sent so
    /// lately that its engine's KV events cannot have told of them yet (see `learn`): one walk.
    pub(crate) fn matched_pending(
        &self,
        hashes: &[u64],
        candidates: &[Arc<Node>],
        now_ms: Option<u64>,
    ) -> (Vec<usize>, Vec<usize>) {
        let mut out = vec![0; candidates.len()];
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        for node in candidates {
            let losses = node.counters().engine.cache_losses();
            if inner.nodes.get(&node.generation()).is_some_and(|n| n.losses != losses) {
                inner.clear(node.generation(), losses);
            }
        }
        let mut pending = vec![0; if now_ms.is_some() { candidates.len() } else { 0 }];
        let mut matching: Vec<usize> = (0..candidates.len()).collect();
        let mut recent: Vec<usize> = if now_ms.is_some() { matching.clone() } else { Vec::new() };
        for (depth, hash) in hashes.iter().enumerate() {
            let Some(holders) = inner.holders.get(hash) else { break };
            let holder = |i: usize| holders.iter().find(|h| h.generation == candidates[i].generation());
            matching.retain(|&i| holder(i).is_some());
            recent.retain(|&i| holder(i).is_some_and(|h| now_ms.is_some_and(|now| h.pending_until_ms >= now)));
            if matching.is_empty() {
                break; // the recent ones are among them
            }
            for &i in &matching {
                out[i] = depth + 1;
            }
            for &i in &recent {
                pending[i] = depth + 1;
            }
        }
        (out, pending)
    }

    /// Records that `node` took a prompt with these blocks. `capacity_tokens`: what its
    /// engine's KV cache holds, when it says; `pending_until_ms`: when its engine will have
    /// computed them and said so in its KV events (0: no events are followed).
    pub(crate) fn learn(&self, node: &Node, hashes: &[u64], capacity_tokens: Option<u64>, pending_until_ms: u64) {
        if hashes.is_empty() {
            return;
        }
        let generation = node.generation();
        let losses = node.counters().engine.cache_losses();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if inner.nodes.get(&generation).is_some_and(|n| n.losses != losses) {
            inner.clear(generation, losses);
        }
        if !inner.nodes.contains_key(&generation) && inner.nodes.len() >= MAX_NODES {
            let oldest = inner.nodes.iter().min_by_key(|(_, n)| n.last_used).map(|(g, _)| *g);
            if let Some(oldest) = oldest {
                inner.forget(oldest);
            }
        }
        let share = self.config.entries / (inner.nodes.len() + usize::from(!inner.nodes.contains_key(&generation)));
        let reported = capacity_tokens.map(|tokens| {
            #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let blocks = (tokens as f64 * self.config.bytes_per_token / self.config.block_bytes.max(1) as f64) as usize;
            blocks
        });
        let ceiling = reported.map_or(share, |blocks| blocks.min(share)).max(1);

        let bytes_per_token = self.config.bytes_per_token;
        if inner.nodes.get_mut(&generation).is_some_and(|b| b.check(node, bytes_per_token, ceiling)) {
            inner.clear(generation, losses);
        }
        let Inner { holders, nodes, clock } = &mut *inner;
        let blocks = nodes.entry(generation).or_insert_with(|| NodeBlocks { losses, ..NodeBlocks::default() });
        blocks.check(node, bytes_per_token, ceiling);
        let capacity = blocks.share.unwrap_or(ceiling).min(ceiling);
        // A prompt the node took lately (its deepest block among the newest eighth of what it
        // holds) is near the young end of its order already: a refresh would change little and
        // cost a write per block on every request of a hot prompt.
        let deepest = hashes[hashes.len() - 1];
        let fresh = holders.get(&deepest).and_then(|hs| hs.iter().find(|h| h.generation == generation));
        // A pending route ran out (its blocks should be in the engine's events by now): a new
        // one is pending again.
        let refresh = fresh.is_none_or(|h| {
            *clock - h.stamp > (blocks.live as u64 / 8).max(hashes.len() as u64)
                || (pending_until_ms > 0 && h.pending_until_ms < now_ms())
        });
        // Deepest first, so that the head of the prompt is the most recently used.
        for &hash in hashes.iter().rev().filter(|_| refresh) {
            *clock += 1;
            let entry = holders.entry(hash).or_default();
            if let Some(holder) = entry.iter_mut().find(|h| h.generation == generation) {
                holder.stamp = *clock;
                holder.pending_until_ms = holder.pending_until_ms.max(pending_until_ms);
            } else {
                entry.push(Holder { generation, stamp: *clock, pending_until_ms });
                blocks.live += 1;
            }
            blocks.order.push_back((hash, *clock));
        }
        blocks.last_used = *clock;
        while blocks.live > capacity {
            let Some((hash, stamp)) = blocks.order.pop_front() else { break };
            let current = holders.get(&hash).and_then(|hs| hs.iter().position(|h| h.generation == generation));
            let Some(at) = current else { continue };
            let Some(hs) = holders.get_mut(&hash) else { continue };
            if hs[at].stamp == stamp {
                hs.swap_remove(at);
                if hs.is_empty() {
                    holders.remove(&hash);
                }
                blocks.live -= 1;
            }
        }
        // Re-used blocks leave stale entries behind: drop them once they outnumber the live ones.
        if blocks.order.len() > 2 * blocks.live + 64 {
            blocks.order.retain(|&(hash, stamp)| {
                holders.get(&hash).is_some_and(|hs| hs.iter().any(|h| h.generation == generation && h.stamp == stamp))
            });
        }
    }

    /// Blocks remembered for the node with this generation.
    #[cfg(test)]
    pub(crate) fn blocks_of(&self, generation: u64) -> usize {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.nodes.get(&generation).map_or(0, |n| n.live)
    }

    /// Blocks remembered in all (each node's copy counted).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.holders.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::node::engine_report::EngineFigures;

    fn table(entries: usize) -> PrefixTable {
        PrefixTable::new(PrefixTableConfig { block_bytes: 16, max_blocks: 64, entries, bytes_per_token: 4.0 })
    }

    fn hashes(table: &PrefixTable, prompt: &str) -> Vec<u64> {
        table.block_hashes(&SelectCtx { model: Some("m"), prompt: Some(prompt.as_bytes()), ..SelectCtx::default() })
    }

    #[test]
    fn matches_the_longest_prefix_each_node_took() {
        let (_reg, nodes) = nodes(3);
        let t = table(1000);
        let system = "s".repeat(64); // four blocks
        t.learn(&nodes[0], &hashes(&t, &format!("{system}{}", "a".repeat(32))), None, 0);
        t.learn(&nodes[1], &hashes(&t, &system[..32]), None, 0);
        let asked = hashes(&t, &format!("{system}{}", "a".repeat(48)));
        assert_eq!(t.matched(&asked, &nodes), vec![6, 2, 0]);
    }

    #[test]
    fn a_route_is_pending_until_its_engine_can_have_told_of_it() {
        let (_reg, nodes) = nodes(2);
        let t = table(1000);
        let prompt = hashes(&t, &"p".repeat(64));
        let now = now_ms();
        t.learn(&nodes[0], &prompt, None, now + 5_000);
        t.learn(&nodes[1], &prompt, None, now - 1);
        assert_eq!(t.matched_pending(&prompt, &nodes, Some(now)), (vec![4, 4], vec![4, 0]));
        assert_eq!(t.matched_pending(&prompt, &nodes, None).1, Vec::<usize>::new(), "not asked for");
        // Learnt again once its pending time ran out, a route is pending again.
        t.learn(&nodes[1], &prompt, None, now + 5_000);
        assert_eq!(t.matched_pending(&prompt, &nodes, Some(now)).1, vec![4, 4]);
    }

    #[test]
    fn a_node_keeps_what_its_engine_can_hold_head_first() {
        let (_reg, nodes) = nodes(1);
        let t = table(1000);
        // Ten blocks; a capacity of 20 tokens of 4 bytes is five blocks of 16 bytes.
        let a = hashes(&t, &"a".repeat(160));
        t.learn(&nodes[0], &a, Some(20), 0);
        assert_eq!(t.blocks_of(nodes[0].generation()), 5);
        assert_eq!(t.matched(&a, &nodes), vec![5], "the head stays, the tail went first");
        let b = hashes(&t, &"b".repeat(48));
        t.learn(&nodes[0], &b, Some(20), 0);
        assert_eq!(t.matched(&b, &nodes), vec![3]);
        assert_eq!(t.matched(&a, &nodes), vec![2], "the least recently routed prompt gives way");
    }

    #[test]
    fn a_restarted_engine_forgets_everything() {
        let (_reg, nodes) = nodes(2);
        let t = table(1000);
        let a = hashes(&t, &"a".repeat(64));
        t.learn(&nodes[0], &a, None, 0);
        t.learn(&nodes[1], &a, None, 0);
        let counters = nodes[0].counters();
        let reading = |prompt| EngineFigures { prompt_tokens: Some(prompt), ..EngineFigures::default() };
        counters.record_engine_report(&reading(100), 1);
        counters.record_engine_report(&reading(5), 2);
        assert_eq!(t.matched(&a, &nodes), vec![0, 4]);
        assert_eq!(t.blocks_of(nodes[0].generation()), 0);
    }

    #[test]
    fn a_node_whose_cache_pdproxy_had_flushed_forgets_everything() {
        let (_reg, nodes) = nodes(2);
        let t = table(1000);
        let a = hashes(&t, &"a".repeat(64));
        t.learn(&nodes[0], &a, None, 0);
        t.learn(&nodes[1], &a, None, 0);
        nodes[1].counters().engine.flushed();
        assert_eq!(t.matched(&a, &nodes), vec![4, 0]);
        // What it takes after the flush, it holds.
        t.learn(&nodes[1], &a, None, 0);
        assert_eq!(t.matched(&a, &nodes), vec![4, 4]);
    }

    #[test]
    fn a_node_whose_engine_finds_nothing_it_was_predicted_to_hold_forgets_everything() {
        let (_reg, nodes) = nodes(1);
        let node = &nodes[0];
        let t = table(1 << 16);
        let reading = |hits| EngineFigures {
            prompt_tokens: Some(1 << 30),
            cached_tokens: Some(hits),
            ..EngineFigures::default()
        };
        node.counters().record_engine_report(&reading(1000), 1);
        let a = hashes(&t, &"a".repeat(1024));
        t.learn(node, &a, None, 0);
        assert_eq!(t.matched(&a, &nodes), vec![64]);
        // 128 KiB predicted since, and the engine found 100 tokens (400 bytes) of it: flushed.
        node.counters().predicted_cached_bytes.fetch_add(128 << 10, std::sync::atomic::Ordering::Relaxed);
        node.counters().record_engine_report(&reading(1100), 2);
        let b = hashes(&t, &"b".repeat(64));
        t.learn(node, &b, None, 0);
        assert_eq!(t.matched(&a, &nodes), vec![0], "the flushed cache holds none of it");
        assert_eq!(t.blocks_of(node.generation()), 4, "only what it took since");
    }

    #[test]
    fn the_answers_reports_tell_a_flushed_cache_at_once() {
        use std::sync::atomic::Ordering::Relaxed;
        let (_reg, nodes) = nodes(1);
        let node = &nodes[0];
        let t = table(1 << 16);
        let a = hashes(&t, &"a".repeat(1024));
        t.learn(node, &a, None, 0);
        // Answers predicted to find 64 KiB found 16 KiB (4096 tokens of 4 bytes): the share shrinks.
        node.counters().answered_predicted_bytes.fetch_add(64 << 10, Relaxed);
        node.counters().answered_cached_tokens.fetch_add(4096, Relaxed);
        t.learn(node, &a, None, 0);
        assert_eq!(t.matched(&a, &nodes), vec![32], "cut by half at most");
        // Then answers predicted to find 64 KiB more found nothing: flushed, forgotten.
        node.counters().answered_predicted_bytes.fetch_add(64 << 10, Relaxed);
        let b = hashes(&t, &"b".repeat(64));
        t.learn(node, &b, None, 0);
        assert_eq!(t.matched(&a, &nodes), vec![0]);
        assert_eq!(t.blocks_of(node.generation()), 4, "only what it took since");
    }

    #[test]
    fn answers_in_a_row_that_found_nothing_tell_a_flush_before_a_whole_check() {
        use std::sync::atomic::Ordering::Relaxed;
        let (_reg, nodes) = nodes(1);
        let node = &nodes[0];
        let t = table(1 << 16);
        let a = hashes(&t, &"a".repeat(1024));
        let answer = |predicted: u64, found_tokens: u64| {
            node.counters().answered_predicted_bytes.fetch_add(predicted, Relaxed);
            node.counters().answered_cached_tokens.fetch_add(found_tokens, Relaxed);
            t.learn(node, &a, None, 0);
        };
        t.learn(node, &a, None, 0);
        // Misses between hits (an eviction here and there) are no flush.
        for found in [0, 0, 2048, 0, 0, 2048] {
            answer(8 << 10, found);
        }
        assert_eq!(t.matched(&a, &nodes), vec![64], "still held");
        // One long prompt that found nothing (its blocks evicted) is no flush either.
        answer(48 << 10, 0);
        assert!(t.matched(&a, &nodes)[0] > 0, "still held after one long miss");
        answer(8 << 10, 2048);
        // Three long prompts in a row found nothing: flushed, long before 64 KiB of them.
        for _ in 0..3 {
            node.counters().answered_predicted_bytes.fetch_add(8 << 10, Relaxed);
            let b = hashes(&t, &"b".repeat(64));
            t.learn(node, &b, None, 0);
        }
        assert_eq!(t.matched(&a, &nodes), vec![0], "forgotten");
        assert_eq!(t.blocks_of(node.generation()), 4, "only what it took since");
    }

    #[test]
    fn memory_stays_bounded_however_prompts_repeat() {
        let (_reg, nodes) = nodes(4);
        let t = table(200);
        for i in 0..2000 {
            let prompt = format!("{:>100}", i % 37);
            t.learn(&nodes[i % 4], &hashes(&t, &prompt), None, 0);
        }
        assert!(t.entries() <= 200, "{}", t.entries());
        let inner = t.inner.lock().unwrap();
        for node in inner.nodes.values() {
            assert!(node.order.len() <= 2 * node.live + 64 + 7, "{}", node.order.len());
        }
    }

    #[test]
    fn a_node_whose_engine_finds_less_than_predicted_is_trimmed() {
        let (_reg, nodes) = nodes(1);
        let node = &nodes[0];
        let t = table(1 << 16);
        let reading = |hits| EngineFigures {
            prompt_tokens: Some(1 << 30),
            cached_tokens: Some(hits),
            ..EngineFigures::default()
        };
        node.counters().record_engine_report(&reading(0), 1);
        let prompts: Vec<Vec<u64>> =
            (0..200).map(|i| hashes(&t, &format!("prompt {i:03} ").repeat(94)[..1024])).collect();
        for prompt in &prompts {
            t.learn(node, prompt, None, 0); // no capacity reported: all 200 KiB kept
        }
        assert_eq!(t.blocks_of(node.generation()), 200 * 64);
        // Requests the table expected to hit 128 KiB; the engine found 8192 tokens, 32 KiB.
        let predicted = &node.counters().predicted_cached_bytes;
        predicted.fetch_add(128 << 10, std::sync::atomic::Ordering::Relaxed);
        node.counters().record_engine_report(&reading(8192), 2);
        t.learn(node, &prompts[199], None, 0);
        assert_eq!(t.blocks_of(node.generation()), 100 * 64, "cut by half at most at once");
        assert_eq!(t.matched(&prompts[0], &nodes), vec![0], "the oldest went");
        // Predictions the engine bears out let the share grow back.
        t.learn(node, &prompts[0], None, 0);
        predicted.fetch_add(128 << 10, std::sync::atomic::Ordering::Relaxed);
        node.counters().record_engine_report(&reading(8192 + 32768), 3);
        t.learn(node, &prompts[1], None, 0);
        t.learn(node, &prompts[2], None, 0);
        assert_eq!(t.blocks_of(node.generation()), 100 * 64 + 128, "{}", t.blocks_of(node.generation()));
    }
}

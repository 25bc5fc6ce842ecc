//! Which node holds which KV blocks, from the engines' own events (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`, decoded by the control plane's subscribers): exact where
//! the approximate prefix table guesses, and the same in every replica of pdproxy, since each
//! follows the engines itself.
//!
//! A block is keyed by the text of its whole chain: its key hashes its parent's key with its
//! own text (its token ids through the model's `Detokenizer`). A request's prompt, rendered as
//! the engine renders it (`text::render`), is then matched by walking from the root: at each
//! key, the lengths of the blocks known to extend it say which slices of the prompt to hash
//! next. Matching costs a hash of the prompt's bytes (once per distinct block length at each
//! step) and a lookup a block; it never tokenizes.
//!
//! Each engine rank is a stream: its own map from the engine's block hashes to keys (removals
//! name blocks by the engine's hash). A node holds a block when one of its ranks does.
//! Memory is bounded by `max_blocks`: past it, the blocks least recently stored or matched
//! go first (the engines' own removals keep it well below, when none is missed).

pub(crate) mod text;

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};

use rustc_hash::{FxHashMap, FxHasher};

use crate::clock::now_ms;
use crate::node::recent_work::{faded, FADE_MS};

pub(crate) use text::{render, ChatTemplate, Detokenizer};

/// The key of the empty chain, which first blocks extend.
const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;

/// A stream's index among the index's streams.
type Slot = u32;

/// A block known to some stream.
#[derive(Debug)]
struct Block {
    parent: u64,
    /// Bytes of its text.
    len: u32,
    /// Tokens in it.
    tokens: u32,
    /// The streams that hold it (few: the ranks of the nodes that computed this prefix).
    holders: Vec<Slot>,
    /// When it was last stored or matched (the index's clock).
    touched: AtomicU64,
}

/// One engine rank's events.
#[derive(Debug, Default)]
struct Stream {
    node: String,
    rank: u32,
    /// The engine's block hashes, to their keys.
    keys: FxHashMap<u64, u64>,
    /// Blocks its events stored whose parent it did not know (their text cannot be placed).
    orphans: u64,
    /// Token ids not in the vocabulary.
    unknown_tokens: u64,
    events: u64,
    /// Its subscriber follows it with no gap: what it holds is known.
    live: bool,
    /// Bytes of text in the blocks it stored lately (faded, `recent_work::faded`, as of
    /// `stored_at_ms`): the prefill its engine did, whoever sent the requests.
    stored_bytes: f64,
    stored_at_ms: u64,
}

#[derive(Debug, Default)]
struct Inner {
    blocks: FxHashMap<u64, Block>,
    /// For each key, the lengths (bytes) of the blocks extending it, and how many of each.
    extensions: FxHashMap<u64, Vec<(u32, u32)>>,
    streams: Vec<Option<Stream>>,
    evicted: u64,
}

/// What one stream's `/nodes/status` entry shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamStats {
    pub(crate) node: String,
    pub(crate) rank: u32,
    pub(crate) blocks: usize,
    pub(crate) events: u64,
    pub(crate) orphans: u64,
    pub(crate) unknown_tokens: u64,
    pub(crate) live: bool,
}

/// What a node holds of a prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Match {
    pub(crate) tokens: u64,
    /// Bytes of the rendered prompt.
    pub(crate) bytes: u64,
    /// Bytes of the last block held (0: none).
    pub(crate) last_block_bytes: u64,
}

impl Match {
    /// Whether the node holds all of a prompt of `prompt_bytes` (rendered) an engine caches:
    /// what is left is shorter than a block.
    pub(crate) fn is_whole(&self, prompt_bytes: usize) -> bool {
        self.tokens > 0 && (prompt_bytes as u64).saturating_sub(self.bytes) < self.last_block_bytes
    }
}

/// A stored event: `hashes` (the engine's) of consecutive blocks of `block_size` tokens each,
/// the first extending `parent`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stored<'a> {
    pub(crate) hashes: &'a [u64],
    pub(crate) parent: Option<u64>,
    pub(crate) token_ids: &'a [u64],
    pub(crate) block_size: usize,
}

#[derive(Debug)]
pub struct KvIndex {
    inner: RwLock<Inner>,
    detokenizer: Detokenizer,
    template: ChatTemplate,
    max_blocks: usize,
    clock: AtomicU64,
    /// Selections that priced a candidate from the index, and from the approximate table
    /// because the index was not live for it.
    pub(crate) used: AtomicU64,
    pub(crate) fell_back: AtomicU64,
}

impl KvIndex {
    pub(crate) fn new(detokenizer: Detokenizer, template: ChatTemplate, max_blocks: usize) -> Self {
        Self {
            inner: RwLock::default(),
            detokenizer,
            template,
            max_blocks: max_blocks.max(1),
            clock: AtomicU64::new(0),
            used: AtomicU64::new(0),
            fell_back: AtomicU64::new(0),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// The slot of `node`'s rank `rank` and its stream, made on first use.
    fn stream<'s>(streams: &'s mut Vec<Option<Stream>>, node: &str, rank: u32) -> (Slot, &'s mut Stream) {
        let found = streams.iter().position(|s| s.as_ref().is_some_and(|s| s.node == node && s.rank == rank));
        let i = found.unwrap_or_else(|| {
            let free = streams.iter().position(Option::is_none).unwrap_or_else(|| {
                streams.push(None);
                streams.len() - 1
            });
            streams[free] = Some(Stream { node: node.to_owned(), rank, ..Stream::default() });
            free
        });
        (slot_of(i), streams[i].get_or_insert_with(Stream::default))
    }

    /// Blocks stored on `node`'s rank `rank`.
    pub(crate) fn stored(&self, node: &str, rank: u32, event: Stored<'_>) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let inner = &mut *inner;
        let (slot, stream) = Self::stream(&mut inner.streams, node, rank);
        stream.events += 1;
        let mut parent = ROOT;
        if let Some(hash) = event.parent {
            let Some(&key) = stream.keys.get(&hash) else {
                stream.orphans += event.hashes.len() as u64;
                return;
            };
            parent = key;
        }
        let now = self.tick();
        let mut text = Vec::new();
        let mut new_bytes = 0usize;
        for (i, &hash) in event.hashes.iter().enumerate() {
            let Some(ids) = event.token_ids.get(i * event.block_size..(i + 1) * event.block_size) else {
                break;
            };
            text.clear();
            if !self.detokenizer.append(ids, &mut text) {
                stream.unknown_tokens += 1;
                break;
            }
            let key = chain(parent, &text);
            stream.keys.insert(hash, key);
            let block = inner.blocks.entry(key).or_insert_with(|| {
                let len = u32::try_from(text.len()).unwrap_or(u32::MAX);
                add_extension(&mut inner.extensions, parent, len);
                Block {
                    parent,
                    len,
                    tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
                    holders: Vec::new(),
                    touched: AtomicU64::new(now),
                }
            });
            if !block.holders.contains(&slot) {
                block.holders.push(slot);
                new_bytes += text.len();
            }
            block.touched.store(now, Ordering::Relaxed);
            parent = key;
        }
        let at = now_ms();
        #[allow(clippy::cast_precision_loss)]
        let bytes = faded(stream.stored_bytes, stream.stored_at_ms, at) + new_bytes as f64;
        (stream.stored_bytes, stream.stored_at_ms) = (bytes, at);
        if inner.blocks.len() > self.max_blocks {
            evict_oldest(inner, self.max_blocks);
        }
    }

    /// Blocks removed from `node`'s rank `rank` (named by the engine's hashes).
    pub(crate) fn removed(&self, node: &str, rank: u32, hashes: &[u64]) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let inner = &mut *inner;
        let (slot, stream) = Self::stream(&mut inner.streams, node, rank);
        stream.events += 1;
        let keys: Vec<u64> = hashes.iter().filter_map(|h| stream.keys.remove(h)).collect();
        for key in keys {
            release(inner, key, slot);
        }
    }

    /// Everything `node`'s rank `rank` held is gone (a cache reset), or no longer known (a gap
    /// in its events, a restart).
    pub(crate) fn cleared(&self, node: &str, rank: u32) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let inner = &mut *inner;
        let (slot, stream) = Self::stream(&mut inner.streams, node, rank);
        stream.events += 1;
        let keys: Vec<u64> = stream.keys.drain().map(|(_, key)| key).collect();
        for key in keys {
            release(inner, key, slot);
        }
    }

    /// Whether `node`'s rank `rank` is followed with no gap (its subscriber says).
    pub(crate) fn set_live(&self, node: &str, rank: u32, live: bool) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        Self::stream(&mut inner.streams, node, rank).1.live = live;
    }

    /// Forgets `node` altogether (every rank): it left the fleet.
    pub(crate) fn forget_node(&self, node: &str) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let inner = &mut *inner;
        for i in 0..inner.streams.len() {
            let Some(stream) = inner.streams[i].take_if(|s| s.node == node) else { continue };
            for key in stream.keys.into_values() {
                release(inner, key, slot_of(i));
            }
        }
    }

    /// For each of `nodes`, the tokens and bytes of `prompt` (rendered) its engine holds: the
    /// leading blocks one of its ranks holds, each after the one before. `None` for a node
    /// whose ranks are not all followed live (what it holds is not known).
    #[cfg(test)]
    pub(crate) fn matched(&self, prompt: &[u8], nodes: &[&str]) -> Vec<Option<Match>> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let slots = live_slots(&inner, nodes);
        self.walk(&inner, prompt, &slots)
    }

    /// What each candidate (its live slots, see `live_slots`) holds of `prompt`.
    fn walk(&self, inner: &Inner, prompt: &[u8], slots: &[Option<Vec<Slot>>]) -> Vec<Option<Match>> {
        let mut out: Vec<Option<Match>> = slots.iter().map(|s| s.as_ref().map(|_| Match::default())).collect();
        let mut following: Vec<bool> = slots.iter().map(Option::is_some).collect();
        let now = self.tick();
        let (mut key, mut at) = (ROOT, 0usize);
        while following.iter().any(|&f| f) {
            let Some(lengths) = inner.extensions.get(&key) else { break };
            let next = lengths.iter().find_map(|&(len, _)| {
                let end = at + len as usize;
                let slice = prompt.get(at..end)?;
                let next = chain(key, slice);
                inner.blocks.get(&next).map(|block| (next, block, end))
            });
            let Some((next, block, end)) = next else { break };
            block.touched.store(now, Ordering::Relaxed);
            for (i, node_slots) in slots.iter().enumerate() {
                let holds = node_slots.as_ref().is_some_and(|s| s.iter().any(|s| block.holders.contains(s)));
                match out[i].as_mut() {
                    Some(m) if following[i] && holds => {
                        m.tokens += u64::from(block.tokens);
                        m.bytes += u64::from(block.len);
                        m.last_block_bytes = u64::from(block.len);
                    }
                    _ => following[i] = false,
                }
            }
            (key, at) = (next, end);
        }
        out
    }

    /// Tokens only (tests): 0 for a node not live.
    #[cfg(test)]
    pub(crate) fn matched_tokens(&self, prompt: &[u8], nodes: &[&str]) -> Vec<u64> {
        self.matched(prompt, nodes).into_iter().map(|m| m.map_or(0, |m| m.tokens)).collect()
    }

    /// What each of `nodes` holds of the request's prompt (raw `messages` or `prompt` JSON);
    /// `None` when the prompt cannot be rendered.
    pub(crate) fn matched_request(&self, raw_prompt: &[u8], nodes: &[&str]) -> Option<Vec<Option<Match>>> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let slots = live_slots(&inner, nodes);
        if slots.iter().all(Option::is_none) {
            // Nothing to match against: the prompt is not even rendered.
            return Some(vec![None; nodes.len()]);
        }
        let prompt = render(raw_prompt, &self.template)?;
        Some(self.walk(&inner, &prompt, &slots))
    }

    /// What each of `nodes` holds of the request's prompt, and the rendered prompt's length
    /// (for traces: it renders even when no node is live); `None` when it cannot be rendered.
    pub(crate) fn held_of_request(&self, raw_prompt: &[u8], nodes: &[&str]) -> Option<(usize, Vec<Option<Match>>)> {
        let prompt = render(raw_prompt, &self.template)?;
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let slots = live_slots(&inner, nodes);
        Some((prompt.len(), self.walk(&inner, &prompt, &slots)))
    }

    /// For each of `nodes`, the KiB of prompt its engine has prefilled a millisecond lately,
    /// from the blocks its events stored (whoever sent the requests: other replicas, traffic
    /// that bypasses pdproxy); `None` for a node not followed live.
    pub(crate) fn prefilled_kib_per_ms(&self, nodes: &[&str], now_ms: u64) -> Vec<Option<f64>> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        live_slots(&inner, nodes)
            .into_iter()
            .map(|slots| {
                let streams = slots?.into_iter().filter_map(|slot| inner.streams[slot as usize].as_ref());
                let bytes: f64 = streams.map(|s| faded(s.stored_bytes, s.stored_at_ms, now_ms)).sum();
                Some(bytes / 1024.0 / FADE_MS)
            })
            .collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).blocks.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks dropped to keep within `max_blocks`.
    pub(crate) fn evicted(&self) -> u64 {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).evicted
    }

    pub(crate) fn streams(&self) -> Vec<StreamStats> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        inner
            .streams
            .iter()
            .flatten()
            .map(|s| StreamStats {
                node: s.node.clone(),
                rank: s.rank,
                blocks: s.keys.len(),
                events: s.events,
                orphans: s.orphans,
                unknown_tokens: s.unknown_tokens,
                live: s.live,
            })
            .collect()
    }
}

/// Each node's slots, when all its ranks are followed live (`None`: what it holds is not known).
fn live_slots(inner: &Inner, nodes: &[&str]) -> Vec<Option<Vec<Slot>>> {
    nodes
        .iter()
        .map(|node| {
            let mine: Vec<(Slot, bool)> = inner
                .streams
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().filter(|s| s.node == *node).map(|s| (slot_of(i), s.live)))
                .collect();
            (!mine.is_empty() && mine.iter().all(|&(_, live)| live)).then(|| mine.into_iter().map(|(s, _)| s).collect())
        })
        .collect()
}

fn slot_of(index: usize) -> Slot {
    Slot::try_from(index).expect("fewer than 2^32 engine ranks")
}

/// The key of the chain `parent` extended by a block of text `text`.
fn chain(parent: u64, text: &[u8]) -> u64 {
    let mut hasher = FxHasher::default();
    hasher.write_u64(parent);
    hasher.write(text);
    hasher.finish()
}

fn add_extension(extensions: &mut FxHashMap<u64, Vec<(u32, u32)>>, parent: u64, len: u32) {
    let lengths = extensions.entry(parent).or_default();
    match lengths.iter_mut().find(|(l, _)| *l == len) {
        Some((_, count)) => *count += 1,
        None => lengths.push((len, 1)),
    }
}

fn remove_extension(extensions: &mut FxHashMap<u64, Vec<(u32, u32)>>, parent: u64, len: u32) {
    let Some(lengths) = extensions.get_mut(&parent) else { return };
    if let Some(i) = lengths.iter().position(|(l, _)| *l == len) {
        lengths[i].1 -= 1;
        if lengths[i].1 == 0 {
            lengths.swap_remove(i);
        }
    }
    if lengths.is_empty() {
        extensions.remove(&parent);
    }
}

/// `slot` no longer holds `key`; the block goes once nobody does.
fn release(inner: &mut Inner, key: u64, slot: Slot) {
    let Some(block) = inner.blocks.get_mut(&key) else { return };
    block.holders.retain(|&s| s != slot);
    if !block.holders.is_empty() {
        return;
    }
    if let Some(block) = inner.blocks.remove(&key) {
        remove_extension(&mut inner.extensions, block.parent, block.len);
    }
}

/// Drops the least recently touched eighth of the blocks (one pass, rarely: the engines'
/// removals keep the index below its bound while none is missed).
fn evict_oldest(inner: &mut Inner, max_blocks: usize) {
    let target = max_blocks - max_blocks / 8;
    let excess = inner.blocks.len().saturating_sub(target);
    if excess == 0 {
        return;
    }
    let mut stamps: Vec<u64> = inner.blocks.values().map(|b| b.touched.load(Ordering::Relaxed)).collect();
    let cut = *stamps.select_nth_unstable(excess - 1).1;
    let old: Vec<u64> = inner
        .blocks
        .iter()
        .filter(|(_, b)| b.touched.load(Ordering::Relaxed) <= cut)
        .map(|(&k, _)| k)
        .take(excess)
        .collect();
    for key in old {
        if let Some(block) = inner.blocks.remove(&key) {
            remove_extension(&mut inner.extensions, block.parent, block.len);
            inner.evicted += 1;
        }
    }
    // The streams' maps may name evicted blocks; their removals then find nothing to do.
    for stream in inner.streams.iter_mut().flatten() {
        stream.keys.retain(|_, key| inner.blocks.contains_key(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mock engine's ids: four bytes of text each.
    fn ids(text: &str) -> Vec<u64> {
        text.as_bytes().chunks(4).map(|c| u64::from(u32::from_le_bytes(c.try_into().unwrap()))).collect()
    }

    fn index(max_blocks: usize) -> KvIndex {
        let index = KvIndex::new(Detokenizer::FixedWidth(4), ChatTemplate::mock(), max_blocks);
        for node in ["a", "b"] {
            index.set_live(node, 0, true);
        }
        index
    }

    /// Stores `text` (a whole number of 8-byte blocks of 2 tokens) on `node` as one chain,
    /// the engine's hashes `first`, `first + 1`...
    fn store(index: &KvIndex, node: &str, text: &str, first: u64) {
        let tokens = ids(text);
        let hashes: Vec<u64> = (first..).take(tokens.len() / 2).collect();
        index.stored(node, 0, Stored { hashes: &hashes, parent: None, token_ids: &tokens, block_size: 2 });
    }

    #[test]
    fn a_node_holds_the_leading_blocks_its_events_stored() {
        let index = index(1000);
        store(&index, "a", "the cat sat on the mat!!", 0); // 24 bytes: 3 blocks of 8
        store(&index, "b", "the cat ", 100);
        let prompt = b"the cat sat on the mat!! and more";
        assert_eq!(index.matched_tokens(prompt, &["a", "b", "c"]), vec![6, 2, 0]);
        assert_eq!(index.matched_tokens(b"the dog sat", &["a", "b"]), vec![0, 0]);
        assert_eq!(index.matched_tokens(b"the ca", &["a"]), vec![0], "a partial block is not held");
    }

    #[test]
    fn a_block_stored_after_its_parent_extends_it_and_removals_follow_the_engine() {
        let index = index(1000);
        store(&index, "a", "the cat ", 0);
        let tokens = ids("sat on t");
        index.stored("a", 0, Stored { hashes: &[1], parent: Some(0), token_ids: &tokens, block_size: 2 });
        assert_eq!(index.matched_tokens(b"the cat sat on the mat", &["a"]), vec![4]);
        index.removed("a", 0, &[1]);
        assert_eq!(index.matched_tokens(b"the cat sat on the mat", &["a"]), vec![2]);
        // A block whose parent was never seen cannot be placed.
        index.stored("a", 0, Stored { hashes: &[9], parent: Some(77), token_ids: &tokens, block_size: 2 });
        assert_eq!(index.streams()[0].orphans, 1);
        index.cleared("a", 0);
        assert!(index.is_empty());
        assert_eq!(index.matched_tokens(b"the cat sat on the mat", &["a"]), vec![0]);
    }

    #[test]
    fn the_bytes_a_node_newly_stored_lately_tell_how_fast_it_prefilled() {
        let index = index(1000);
        store(&index, "a", "the cat sat on the mat!!", 0);
        store(&index, "a", "the cat sat on the mat!!", 0); // held already: no new work
        store(&index, "b", "the cat ", 100);
        let now = now_ms();
        let rates = index.prefilled_kib_per_ms(&["a", "b", "c"], now);
        let kib = |bytes: f64| bytes / 1024.0 / FADE_MS;
        assert!((rates[0].unwrap() - kib(24.0)).abs() < kib(1.0), "{rates:?}");
        assert!((rates[1].unwrap() - kib(8.0)).abs() < kib(1.0), "{rates:?}");
        assert_eq!(rates[2], None, "not followed");
        let later = index.prefilled_kib_per_ms(&["a"], now + 16_000)[0].unwrap();
        assert!(later < kib(1.0), "it fades: {later}");
    }

    #[test]
    fn a_block_two_nodes_hold_stays_until_both_removed_it() {
        let index = index(1000);
        store(&index, "a", "shared p", 0);
        store(&index, "b", "shared p", 50);
        index.removed("a", 0, &[0]);
        assert_eq!(index.matched_tokens(b"shared prompt", &["a", "b"]), vec![0, 2]);
        index.forget_node("b");
        assert!(index.is_empty());
    }

    #[test]
    fn any_rank_of_a_node_counts_for_it() {
        let index = index(1000);
        let tokens = ids("rank one");
        index.stored("a", 1, Stored { hashes: &[5], parent: None, token_ids: &tokens, block_size: 2 });
        assert_eq!(index.matched(b"rank one!", &["a"]), vec![None], "rank 1 is not followed live yet");
        index.set_live("a", 1, true);
        assert_eq!(index.matched_tokens(b"rank one!", &["a"]), vec![2]);
        index.cleared("a", 0);
        assert_eq!(index.matched_tokens(b"rank one!", &["a"]), vec![2], "rank 0's reset leaves rank 1's blocks");
    }

    #[test]
    fn the_bound_drops_the_least_recently_used_blocks() {
        let index = index(16);
        store(&index, "a", "keep me!", 0);
        for i in 0..40u64 {
            // Each touch of the kept prompt makes it the most recent.
            assert_eq!(index.matched_tokens(b"keep me!", &["a"]), vec![2]);
            store(&index, "a", &format!("other{i:03}"), 1000 + i);
        }
        assert!(index.len() <= 16, "{}", index.len());
        assert!(index.evicted() > 0);
        assert_eq!(index.matched_tokens(b"keep me!", &["a"]), vec![2], "the block in use was kept");
    }

    #[test]
    fn chat_requests_are_matched_as_the_engine_renders_them() {
        let index = index(1000);
        let rendered = "<|user|>hello there, engine!<|end|><|assistant|>";
        let whole = rendered.len() / 8 * 8;
        store(&index, "a", &rendered[..whole], 0);
        let raw = br#"[{"role":"user","content":"hello there, engine!"}]"#;
        let held = Match { tokens: whole as u64 / 4, bytes: whole as u64, last_block_bytes: 8 };
        assert_eq!(index.matched_request(raw, &["a"]), Some(vec![Some(held)]));
        assert_eq!(index.matched_request(b"[1,2]", &["a"]), None);
        let (len, found) = index.held_of_request(raw, &["a"]).expect("rendered");
        assert_eq!(len, rendered.len());
        assert!(found[0].expect("live").is_whole(len), "all but a partial block is held");
        let longer = br#"[{"role":"user","content":"hello there, engine! And more words after it."}]"#;
        let (len, found) = index.held_of_request(longer, &["a"]).expect("rendered");
        assert!(!found[0].expect("live").is_whole(len));
    }
}

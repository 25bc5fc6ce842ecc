//! Which prompts the fleet was sent lately, whether or not a cache still holds them: the
//! prefix table forgets a prompt when its engine evicts it, and then cannot tell a session's
//! next turn, whose cache was lost, from a new session's first. `scored`'s future term counts
//! only the part of a prompt never sent (a new session commits its followers to the node it
//! goes to; an evicted one was priced when it started).
//!
//! A direct-mapped set of block hashes (`prefix_table::prompt_block_hashes`' chain, so one hash
//! names a whole prefix), one per routed request: its last whole block. A later prompt that
//! extends it holds that hash among its own. Bounded: a new hash overwrites whatever shared
//! its slot, so the set remembers about the last `SLOTS` requests.

use std::sync::atomic::{AtomicU64, Ordering};

/// log2 of the slots: 64k hashes, 512 KiB.
const SLOT_BITS: u32 = 16;
const SLOTS: usize = 1 << SLOT_BITS;

pub(crate) struct SeenPrompts {
    slots: Box<[AtomicU64]>,
}

impl std::fmt::Debug for SeenPrompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeenPrompts").field("slots", &self.slots.len()).finish()
    }
}

impl Default for SeenPrompts {
    fn default() -> Self {
        Self { slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect() }
    }
}

/// The slot of a hash: its high bits after a multiply, since a chained hash's low bits alone
/// may be poorly mixed.
fn slot(hash: u64) -> usize {
    usize::try_from(hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOT_BITS)).unwrap_or(0)
}

/// 0 marks an empty slot: a hash of 0 is stored as 1 (one prompt in 2^64 matches wrongly).
fn stored(hash: u64) -> u64 {
    hash.max(1)
}

impl SeenPrompts {
    /// Remembers a routed prompt by the hash of its last whole block (`hashes`: its blocks of
    /// `block_bytes`, the last possibly partial, of `prompt_bytes` in all).
    pub(crate) fn remember(&self, hashes: &[u64], prompt_bytes: usize, block_bytes: usize) {
        let whole = (prompt_bytes / block_bytes.max(1)).min(hashes.len());
        if let Some(&hash) = whole.checked_sub(1).and_then(|last| hashes.get(last)) {
            self.slots[slot(hash)].store(stored(hash), Ordering::Relaxed);
        }
    }

    /// How many leading blocks of the prompt an earlier prompt sent began with: the end of the
    /// deepest block remembered, looking only past the first `from` (those a node holds
    /// already; 0: none past them).
    pub(crate) fn seen_blocks(&self, hashes: &[u64], from: usize) -> usize {
        (from..hashes.len())
            .rev()
            .find(|&i| self.slots[slot(hashes[i])].load(Ordering::Relaxed) == stored(hashes[i]))
            .map_or(0, |i| i + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_that_extends_one_sent_before_is_seen_up_to_its_end() {
        let seen = SeenPrompts::default();
        // Three whole blocks and a partial one: the third is the last whole block.
        seen.remember(&[11, 12, 13, 14], 3 * 256 + 10, 256);
        assert_eq!(seen.seen_blocks(&[11, 12, 13, 15, 16, 17], 0), 3);
        assert_eq!(seen.seen_blocks(&[11, 12, 13, 15, 16, 17], 1), 3);
        // Past what the caller already counts as held, nothing more.
        assert_eq!(seen.seen_blocks(&[11, 12, 13, 15], 3), 0);
        // A prompt that only shares a head shorter than the one remembered: not seen.
        assert_eq!(seen.seen_blocks(&[11, 12, 20, 21], 0), 0);
    }

    #[test]
    fn a_prompt_shorter_than_a_block_leaves_nothing_to_remember() {
        let seen = SeenPrompts::default();
        seen.remember(&[7], 100, 256);
        assert_eq!(seen.seen_blocks(&[7, 8], 0), 0);
        seen.remember(&[], 0, 256);
    }
}

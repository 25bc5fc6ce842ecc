//! When a node's latest requests began decoding (their first tokens came), so that the wait
//! for a place in its full batch can tell when the requests holding the places end. Requests
//! that began together end together where their answers are alike in length: the wait is then
//! the time left to the oldest, not a share of a whole decoding per place.
//!
//! Plain atomics in a ring, no lock: it lives in `NodeCounters`, in shared memory. A start
//! written while another pick reads the ring only moves that pick's estimate by one request.

use std::sync::atomic::{AtomicU64, Ordering};

/// Starts kept. Where more requests than this decode at a node (vLLM's and SGLang's batches
/// run up to 256), the oldest of them are not kept, and a full batch's wait is the share of a
/// decoding per place.
pub(crate) const KEPT: usize = 32;

#[derive(Debug, Default)]
pub(crate) struct DecodeStarts {
    /// Starts recorded so far (the next one goes to `next % KEPT`).
    next: AtomicU64,
    at_ms: [AtomicU64; KEPT],
}

impl DecodeStarts {
    /// A request's first token came at `now_ms`.
    pub(crate) fn record(&self, now_ms: u64) {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.at_ms[slot(i)].store(now_ms, Ordering::Relaxed);
    }

    /// Of the `latest` starts recorded last, the `k`-th oldest (1: the oldest); `None` where
    /// fewer were recorded or kept.
    pub(crate) fn kth_oldest(&self, latest: usize, k: usize) -> Option<u64> {
        let next = usize::try_from(self.next.load(Ordering::Relaxed)).ok()?;
        if k == 0 || k > latest || latest > KEPT || latest > next {
            return None;
        }
        let mut starts = [0u64; KEPT];
        for (j, start) in starts.iter_mut().take(latest).enumerate() {
            *start = self.at_ms[(next - 1 - j) % KEPT].load(Ordering::Relaxed);
        }
        let starts = &mut starts[..latest];
        let (_, kth, _) = starts.select_nth_unstable(k - 1);
        Some(*kth)
    }

    /// Back to new (a recycled shared slot, or a restarted engine).
    pub(crate) fn reset(&self) {
        self.next.store(0, Ordering::Relaxed);
        for at in &self.at_ms {
            at.store(0, Ordering::Relaxed);
        }
    }
}

fn slot(i: u64) -> usize {
    // KEPT fits any index; the remainder is below it.
    usize::try_from(i % KEPT as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kth_oldest_of_the_latest_starts() {
        let starts = DecodeStarts::default();
        for at in [100, 400, 200, 300] {
            starts.record(at);
        }
        // The three latest are 400, 200, 300.
        assert_eq!(starts.kth_oldest(3, 1), Some(200));
        assert_eq!(starts.kth_oldest(3, 2), Some(300));
        assert_eq!(starts.kth_oldest(4, 1), Some(100));
        assert_eq!(starts.kth_oldest(5, 1), None, "only four recorded");
        assert_eq!(starts.kth_oldest(3, 4), None);
        assert_eq!(starts.kth_oldest(3, 0), None);
    }

    #[test]
    fn the_ring_keeps_the_latest_starts_only() {
        let starts = DecodeStarts::default();
        for at in 1..=(KEPT as u64 + 5) {
            starts.record(at);
        }
        assert_eq!(starts.kth_oldest(KEPT, 1), Some(6));
        assert_eq!(starts.kth_oldest(KEPT + 1, 1), None);
        starts.reset();
        assert_eq!(starts.kth_oldest(1, 1), None);
    }
}

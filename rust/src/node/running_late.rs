//! How late a node runs on the first tokens it owes: how long ago the oldest of its requests
//! still waiting for a first token was due by the node's prefill clock. Every request queued
//! behind it waits that much longer than the clock says. A node whose cache was lost (flushed,
//! restarted) without pdproxy knowing yet has its prompts priced as hits while it prefills them
//! whole: its clock runs out while they still wait, and a request priced by the clock alone
//! meets all of it.
//!
//! The latest `KEPT` requests' due times, in a ring of plain atomics (it lives in
//! `NodeCounters`, in shared memory): each entry is tagged with the request's turn, so that the
//! request takes out its own entry and never a later one that reused the place. A request
//! older than the `KEPT` latest is not seen, and the lateness is then that of the oldest seen.

use std::sync::atomic::{AtomicU64, Ordering};

/// Entries kept (the requests last sent there).
pub(crate) const KEPT: usize = 32;
/// An entry: the request's turn (modulo 2^`TURN_BITS`) above its due time (Unix ms).
const DUE_BITS: u32 = 44;
const DUE_MASK: u64 = (1 << DUE_BITS) - 1;
const TURN_BITS: u32 = 64 - DUE_BITS;

#[derive(Debug, Default)]
pub(crate) struct RunningLate {
    /// Requests entered so far (the next goes to `next % KEPT`).
    next: AtomicU64,
    /// 0: empty.
    entries: [AtomicU64; KEPT],
}

/// A request's place in the ring, to take it out with (never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry(u64);

impl Entry {
    pub(crate) fn bits(self) -> u64 {
        self.0
    }

    /// `None` for 0 (no entry).
    pub(crate) fn from_bits(bits: u64) -> Option<Self> {
        (bits != 0).then_some(Self(bits))
    }

    fn slot(self) -> usize {
        // The turn modulo KEPT (a power of two dividing 2^TURN_BITS): below KEPT.
        usize::try_from((self.0 >> DUE_BITS) % KEPT as u64).unwrap_or(0)
    }
}

impl RunningLate {
    /// A request due (its first token, by the node's prefill clock) at `due_ms` waits for it.
    pub(crate) fn enter(&self, due_ms: u64) -> Entry {
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % (1 << TURN_BITS);
        // A due time of 0 would read as empty (only a clock at the epoch gives one).
        let entry = Entry((turn << DUE_BITS) | (due_ms & DUE_MASK).max(1));
        self.entries[entry.slot()].store(entry.0, Ordering::Relaxed);
        entry
    }

    /// The request of `entry` has its first token, or is gone (its place may hold a later one's
    /// by now: then nothing changes).
    pub(crate) fn leave(&self, entry: Entry) {
        let _ = self.entries[entry.slot()].compare_exchange(entry.0, 0, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// How long ago (ms) the oldest request still waiting was due; 0 when none is past due.
    pub(crate) fn overdue_ms(&self, now_ms: u64) -> f64 {
        let oldest =
            self.entries.iter().map(|e| e.load(Ordering::Relaxed)).filter(|&e| e != 0).map(|e| e & DUE_MASK).min();
        #[allow(clippy::cast_precision_loss)]
        oldest.map_or(0.0, |due| now_ms.saturating_sub(due) as f64)
    }

    /// Back to new (a recycled shared slot).
    pub(crate) fn reset(&self) {
        self.next.store(0, Ordering::Relaxed);
        for entry in &self.entries {
            entry.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_request_still_waiting_sets_the_lateness() {
        let late = RunningLate::default();
        assert!(late.overdue_ms(1_000).abs() < f64::EPSILON, "none waits");
        let first = late.enter(1_000);
        let second = late.enter(1_200);
        assert!(late.overdue_ms(900).abs() < f64::EPSILON, "none due yet");
        assert!((late.overdue_ms(1_400) - 400.0).abs() < 1e-9);
        late.leave(first);
        assert!((late.overdue_ms(1_400) - 200.0).abs() < 1e-9, "the later one alone waits");
        late.leave(second);
        assert!(late.overdue_ms(5_000).abs() < f64::EPSILON, "none waits");
    }

    #[test]
    fn a_request_takes_out_its_own_entry_only() {
        let late = RunningLate::default();
        let old = late.enter(100);
        // KEPT requests later, the old one's place holds the newest.
        for due in 1..=KEPT as u64 {
            late.enter(1_000 + due);
        }
        late.leave(old);
        assert!((late.overdue_ms(2_000) - 999.0).abs() < 1e-9, "the oldest kept is due at 1,001");
        assert_eq!(Entry::from_bits(old.bits()), Some(old));
        assert_eq!(Entry::from_bits(0), None);
    }

    #[test]
    fn a_reset_forgets_them() {
        let late = RunningLate::default();
        late.enter(10);
        late.reset();
        assert!(late.overdue_ms(1_000).abs() < f64::EPSILON);
    }
}

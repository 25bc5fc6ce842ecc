//! The signal that this replica routed a fresh prompt's prefill to a node, from the request path
//! to whatever shares its load (`replica_share`): a module of its own below both, so that
//! neither depends on the other.
//!
//! Replicas sharing their load every few milliseconds all see the same figures in between: two
//! fresh prompts routed by two replicas within one interval went to the same engine, and made
//! the tail of the first turns of new conversations (see `replica_share`). Only prefills priced
//! at `CLAIM_PREFILL_US` or more signal, not every request: a prompt mostly held is cheap to
//! meet twice.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// The least prefill (µs, as priced) whose route goes out to the other replicas at once: a long
/// fresh prompt, whose wait is what another replica's choice would add to.
pub(crate) const CLAIM_PREFILL_US: u64 = 20_000;

/// Shares running in this process (the request path signals only while one does).
static RUNNING: AtomicU64 = AtomicU64::new(0);
/// Signalled when a long prefill was routed.
static ROUTED: Notify = Notify::const_new();

/// Counts a share in `RUNNING` while it lives, however its task ends (dropped with its runtime).
pub(crate) struct Running;

impl Running {
    pub(crate) fn new() -> Self {
        RUNNING.fetch_add(1, Ordering::Relaxed);
        Self
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request was priced onto a node with `prefill_us` of prefill: if that is long, the shares
/// running send their snapshot now rather than at their next tick.
#[inline]
pub(crate) fn prefill_routed(prefill_us: u64) {
    if prefill_us >= CLAIM_PREFILL_US && RUNNING.load(Ordering::Relaxed) > 0 {
        ROUTED.notify_waiters();
    }
}

/// A wait for the next long prefill routed (enable it before the work it must not miss one
/// during).
pub(crate) fn routed() -> Notified<'static> {
    ROUTED.notified()
}

//! The signal that this replica's load on a node changed (a request priced onto it, its first
//! byte back), from the request path to whatever shares that load (`replica_share`): a module
//! of its own below both, so that neither depends on the other.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// Shares running in this process (the request path signals only while one does).
static RUNNING: AtomicU64 = AtomicU64::new(0);
/// Signalled when a request changed this replica's load on a node.
static CHANGED: Notify = Notify::const_new();

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

/// A request changed this replica's load on a node (priced onto it, or its first byte came):
/// the shares running send their snapshot now rather than at their next tick.
#[inline]
pub(crate) fn load_changed() {
    if RUNNING.load(Ordering::Relaxed) > 0 {
        CHANGED.notify_waiters();
    }
}

/// A wait for the next change (enable it before the work it must not miss changes during).
pub(crate) fn changed() -> Notified<'static> {
    CHANGED.notified()
}

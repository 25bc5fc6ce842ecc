//! One edge thread's share of the edge: the edge's state and its own pool of connections to
//! the nodes.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use super::EdgeState;
use crate::upstream::forward::Forwarder;

/// One edge thread: its own event loop and its own pool of connections to the nodes.
pub(crate) struct Worker {
    pub(crate) state: Arc<EdgeState>,
    pub(crate) forwarder: Forwarder,
    /// Connections this thread serves now.
    pub(super) open: Arc<AtomicUsize>,
}

impl Worker {
    /// A worker for requests another server took (the control plane's): no connections of its own.
    pub(crate) fn serving_for(state: Arc<EdgeState>, forwarder: Forwarder) -> Self {
        Self { state, forwarder, open: Arc::default() }
    }
}

//! Where a node's counters live: in this process, or in a slot of the worker group's shared
//! table.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::counters::NodeCounters;
use super::shared::{Binding, SharedTable};

/// A node's counters: in this process, or in a slot of the worker group's shared table.
/// Taking and releasing in-flight units goes through here, so that in a group each worker's
/// share is counted too (see `shared`).
#[derive(Debug, Clone)]
pub struct Counters(Place);

#[derive(Debug, Clone)]
enum Place {
    Local(Arc<NodeCounters>),
    Shared { table: Arc<SharedTable>, binding: Binding, worker: usize },
}

impl Default for Counters {
    fn default() -> Self {
        Self(Place::Local(Arc::default()))
    }
}

impl Deref for Counters {
    type Target = NodeCounters;

    fn deref(&self) -> &NodeCounters {
        match &self.0 {
            Place::Local(counters) => counters,
            Place::Shared { table, binding, .. } => table.counters(binding.0),
        }
    }
}

impl Counters {
    pub(crate) fn shared(table: Arc<SharedTable>, binding: Binding, worker: usize) -> Self {
        Self(Place::Shared { table, binding, worker })
    }

    /// The shared slot and generation, in a worker group.
    pub(crate) fn binding(&self) -> Option<Binding> {
        match &self.0 {
            Place::Local(_) => None,
            Place::Shared { binding, .. } => Some(*binding),
        }
    }

    /// Whether both are the same counters.
    #[cfg(test)]
    pub(crate) fn same(&self, other: &Counters) -> bool {
        std::ptr::eq(std::ptr::from_ref::<NodeCounters>(self), std::ptr::from_ref::<NodeCounters>(other))
    }

    /// Takes one in-flight unit unless `cap` is reached: check and increment are one atomic
    /// step, so concurrent callers (threads or worker processes) never pass the cap.
    pub(crate) fn try_enter(&self, cap: Option<u32>) -> bool {
        let taken = match cap {
            None => {
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                true
            }
            Some(max) => self
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < u64::from(max)).then_some(n + 1))
                .is_ok(),
        };
        if taken {
            // After the total: a crash in between over-counts (reclaim misses it), never under.
            self.my_share().map(|share| share.fetch_add(1, Ordering::AcqRel));
        }
        taken
    }

    /// Gives back one in-flight unit.
    pub(crate) fn exit(&self) {
        // Before the total, for the same reason as in `try_enter`.
        self.my_share().map(|share| share.fetch_sub(1, Ordering::AcqRel));
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn my_share(&self) -> Option<&AtomicU32> {
        match &self.0 {
            Place::Local(_) => None,
            Place::Shared { table, binding, worker } => Some(table.share(binding.0, *worker)),
        }
    }
}

//! The in-flight permit: counted when taken, released exactly once when dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::node::NodeCounters;

/// How a request ended, as recorded in the node's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The whole response was received from the node.
    Succeeded,
    /// The node failed: connect error, timeout, reset, broken body.
    Failed,
    /// The caller gave up first (client disconnect, body dropped unread).
    Cancelled,
}

/// What a streamed body showed, recorded into the node's statistics at release.
#[derive(Debug, Clone, Copy, Default)]
pub struct Report {
    /// Time from sending the request to the first body byte.
    pub first_byte: Option<Duration>,
    /// Server-sent events forwarded.
    pub events: u64,
}

/// Holds one unit of a node's in-flight count. It travels with the request and then with
/// the response body, so the count drops on whichever exit comes first; an unfinished
/// permit counts as cancelled.
#[derive(Debug)]
pub struct InFlightPermit {
    counters: Arc<NodeCounters>,
    started: Instant,
    outcome: Outcome,
    report: Report,
}

impl InFlightPermit {
    pub fn acquire(counters: &Arc<NodeCounters>) -> Self {
        counters.in_flight.fetch_add(1, Ordering::AcqRel);
        counters.requests.fetch_add(1, Ordering::Relaxed);
        Self {
            counters: Arc::clone(counters),
            started: Instant::now(),
            outcome: Outcome::Cancelled,
            report: Report::default(),
        }
    }

    /// Sets the outcome recorded at release.
    pub fn set_outcome(&mut self, outcome: Outcome) {
        self.outcome = outcome;
    }

    pub fn set_report(&mut self, report: Report) {
        self.report = report;
    }

    /// When the request was admitted.
    pub fn started(&self) -> Instant {
        self.started
    }
}

impl Drop for InFlightPermit {
    fn drop(&mut self) {
        let counters = &self.counters;
        match self.outcome {
            Outcome::Succeeded => {
                counters.succeeded.fetch_add(1, Ordering::Relaxed);
                counters.record_latency(self.started.elapsed());
            }
            Outcome::Failed => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Cancelled => {
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        counters.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_once_per_exit() {
        let counters = Arc::new(NodeCounters::default());
        let mut ok = InFlightPermit::acquire(&counters);
        let dropped = InFlightPermit::acquire(&counters);
        assert_eq!(counters.snapshot().in_flight, 2);
        ok.set_outcome(Outcome::Succeeded);
        drop(ok);
        drop(dropped);
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.requests, snap.succeeded, snap.cancelled), (0, 2, 1, 1));
    }
}

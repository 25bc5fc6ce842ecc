//! The circuit breaker of one node: after `threshold` consecutive failures the node takes no
//! traffic for `cooldown`; then one request probes it (half-open): a success closes the
//! circuit, a failure opens it again. Plain atomics, like the rest of the node's counters.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use crate::clock::now_ms;

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;

#[derive(Debug, Default)]
pub(crate) struct Circuit {
    state: AtomicU8,
    failures: AtomicU32,
    open_until_ms: AtomicU64,
    /// Consecutive failures that open the circuit; 0 turns the breaker off.
    threshold: AtomicU32,
    cooldown_ms: AtomicU64,
}

impl Circuit {
    pub(crate) fn configure(&self, threshold: u32, cooldown: Duration) {
        self.threshold.store(threshold, Ordering::Relaxed);
        self.cooldown_ms.store(u64::try_from(cooldown.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub(crate) fn name(&self) -> &'static str {
        match self.state.load(Ordering::Acquire) {
            OPEN => "open",
            HALF_OPEN => "half_open",
            _ => "closed",
        }
    }

    /// Whether the node may be chosen now (a cooled-down open circuit may take its probe).
    pub(crate) fn allows(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            CLOSED => true,
            OPEN => now_ms() >= self.open_until_ms.load(Ordering::Acquire),
            _ => false,
        }
    }

    /// Takes the right to send: always when closed; once, as the probe, when open and cooled down.
    pub(crate) fn admit(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            CLOSED => true,
            OPEN if now_ms() >= self.open_until_ms.load(Ordering::Acquire) => {
                self.state.compare_exchange(OPEN, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire).is_ok()
            }
            _ => false,
        }
    }

    pub(crate) fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.state.store(CLOSED, Ordering::Release);
    }

    pub(crate) fn failure(&self) {
        let threshold = self.threshold.load(Ordering::Relaxed);
        if threshold == 0 {
            return;
        }
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if self.state.load(Ordering::Acquire) == HALF_OPEN || failures >= threshold {
            self.open_until_ms.store(now_ms() + self.cooldown_ms.load(Ordering::Relaxed), Ordering::Release);
            self.state.store(OPEN, Ordering::Release);
        }
    }

    pub(crate) fn reset(&self) {
        self.state.store(CLOSED, Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
        self.open_until_ms.store(0, Ordering::Relaxed);
        self.threshold.store(0, Ordering::Relaxed);
        self.cooldown_ms.store(0, Ordering::Relaxed);
    }

    /// The request gave up without telling anything about the node: a probe slot is freed.
    pub(crate) fn abandon(&self) {
        let _ = self.state.compare_exchange(HALF_OPEN, OPEN, Ordering::AcqRel, Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_probes_and_closes() {
        let c = Circuit::default();
        c.configure(3, Duration::ZERO);
        c.failure();
        c.failure();
        assert_eq!(c.name(), "closed");
        c.failure();
        assert_eq!(c.name(), "open");
        assert!(c.admit(), "cooled down: one probe");
        assert!(!c.admit(), "only one probe at a time");
        assert!(!c.allows());
        c.failure();
        assert_eq!(c.name(), "open", "a failed probe opens it again");
        assert!(c.admit());
        c.success();
        assert_eq!(c.name(), "closed");
        assert!(c.admit());
    }

    #[test]
    fn cooldown_keeps_traffic_away() {
        let c = Circuit::default();
        c.configure(1, Duration::from_secs(3600));
        c.failure();
        assert!(!c.allows());
        assert!(!c.admit());
    }

    #[test]
    fn off_when_threshold_is_zero() {
        let c = Circuit::default();
        for _ in 0..100 {
            c.failure();
        }
        assert_eq!(c.name(), "closed");
    }
}

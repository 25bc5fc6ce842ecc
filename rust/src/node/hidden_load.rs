//! How much later than priced a node's first tokens have come lately: the work queued there
//! that pdproxy did not send, or that this replica did not (other replicas in front of the same
//! engines, traffic that bypasses the router). A replica's prefill clock and its count of
//! unanswered requests hold only its own routes; between two readings of the engine's metrics,
//! which show a queue only once requests wait for a place in the batch, the lateness of its own
//! first tokens is the one sign of the others' work.
//!
//! A mean of the signed lateness, each first token weighing `WEIGHT`, that fades towards zero
//! with time (`FADE_MS`): with no first token since, what was hidden has been served. Plain
//! atomics (the counters live in shared memory); a reader may see a value and a time of two
//! updates mixed, which the next corrects.

use std::sync::atomic::{AtomicU64, Ordering};

/// The weight of each new first token in the mean.
const WEIGHT: f64 = 0.25;
/// The mean's time constant: it falls to a third of itself in that long without a sample.
const FADE_MS: f64 = 1000.0;

#[derive(Debug, Default)]
pub(crate) struct HiddenLoad {
    /// f64 bits of the mean lateness (ms) as of `at_ms`; 0 bits: 0.0.
    mean_ms: AtomicU64,
    at_ms: AtomicU64,
}

impl HiddenLoad {
    /// Lateness now: the mean, faded for the time since its last sample (may be negative:
    /// first tokens came early).
    pub(crate) fn ms(&self, now_ms: u64) -> f64 {
        let at = self.at_ms.load(Ordering::Relaxed);
        let mean = f64::from_bits(self.mean_ms.load(Ordering::Relaxed));
        #[allow(clippy::cast_precision_loss)]
        let age = now_ms.saturating_sub(at) as f64;
        mean * (-age / FADE_MS).exp()
    }

    /// A first token came `late_ms` after the time priced for it (negative: before).
    pub(crate) fn observe(&self, late_ms: f64, now_ms: u64) {
        if !late_ms.is_finite() {
            return;
        }
        let mean = self.ms(now_ms);
        let mean = mean + WEIGHT * (late_ms - mean);
        self.mean_ms.store(mean.to_bits(), Ordering::Relaxed);
        self.at_ms.store(now_ms, Ordering::Relaxed);
    }

    pub(crate) fn reset(&self) {
        self.mean_ms.store(0, Ordering::Relaxed);
        self.at_ms.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_first_tokens_raise_the_mean_and_it_fades_without_more() {
        let load = HiddenLoad::default();
        assert!(load.ms(1_000).abs() < f64::EPSILON, "nothing seen: nothing hidden");
        for i in 0..20 {
            load.observe(400.0, 1_000 + i * 10);
        }
        let now = 1_190;
        let mean = load.ms(now);
        assert!(mean > 350.0 && mean < 400.0, "{mean}");
        let faded = load.ms(now + 1_000) / mean;
        assert!((faded - (-1.0f64).exp()).abs() < 0.01, "a third after FADE_MS: {faded}");
        assert!(load.ms(now + 10_000) < 1.0);
        load.observe(-100.0, now + 10_000);
        assert!(load.ms(now + 10_000) < 0.0, "early first tokens pull it below zero");
        load.reset();
        assert!(load.ms(now).abs() < f64::EPSILON);
    }
}

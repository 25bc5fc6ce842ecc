//! Fixed-bucket histograms of atomics: recorded from any thread without a lock, read in one
//! snapshot when metrics are scraped. The bounds are part of the type, not a pointer, so a
//! histogram is plain atomics that several processes can share (see `shared`).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The upper bounds (seconds) of a histogram's buckets, at most 15 (plus +Inf).
pub(crate) trait Bounds {
    const BOUNDS: &'static [f64];
}

/// Request durations and times to first token.
#[derive(Debug)]
pub(crate) struct Latency;
impl Bounds for Latency {
    const BOUNDS: &'static [f64] =
        &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
}

/// How much later than priced a first token came (negative: earlier): `scored`'s prices checked.
#[derive(Debug)]
pub(crate) struct Lateness;
impl Bounds for Lateness {
    const BOUNDS: &'static [f64] = &[-1.0, -0.3, -0.1, -0.03, -0.01, -0.003, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0];
}

/// Gaps between streamed chunks (inter-token latency).
#[derive(Debug)]
pub(crate) struct Gap;
impl Bounds for Gap {
    const BOUNDS: &'static [f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0];
}

#[derive(Debug)]
pub(crate) struct Histogram<B: Bounds> {
    buckets: [AtomicU64; 16],
    /// Microseconds, an `i64` in two's complement (observations may be negative: `Lateness`).
    sum_us: AtomicU64,
    count: AtomicU64,
    bounds: PhantomData<B>,
}

impl<B: Bounds> Default for Histogram<B> {
    fn default() -> Self {
        const { assert!(B::BOUNDS.len() < 16, "at most 15 bounded buckets") };
        Self {
            buckets: [const { AtomicU64::new(0) }; 16],
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
            bounds: PhantomData,
        }
    }
}

/// A copy of a histogram: per-bucket (not cumulative) counts, the +Inf bucket last.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HistogramSnapshot {
    pub(crate) bounds: Vec<f64>,
    pub(crate) counts: Vec<u64>,
    pub(crate) sum: f64,
    pub(crate) count: u64,
}

impl<B: Bounds> Histogram<B> {
    /// `n` observations of zero (events that arrived together), in two atomic steps.
    pub(crate) fn observe_zeros(&self, n: u64) {
        if n > 0 {
            self.buckets[0].fetch_add(n, Ordering::Relaxed);
            self.count.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn observe(&self, value: Duration) {
        self.observe_seconds(value.as_secs_f64());
    }

    /// An observation that may be negative (seconds; not finite: ignored).
    pub(crate) fn observe_seconds(&self, seconds: f64) {
        if !seconds.is_finite() {
            return;
        }
        let bucket = B::BOUNDS.iter().position(|&b| seconds <= b).unwrap_or(B::BOUNDS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // Wrapping adds of two's complement: a negative one subtracts. (`as` saturates.)
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        self.sum_us.fetch_add((seconds * 1e6).round() as i64 as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reset(&self) {
        for bucket in &self.buckets {
            bucket.store(0, Ordering::Relaxed);
        }
        self.sum_us.store(0, Ordering::Relaxed);
        self.count.store(0, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> HistogramSnapshot {
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_wrap)]
        let sum = self.sum_us.load(Ordering::Relaxed) as i64 as f64 / 1e6;
        HistogramSnapshot {
            bounds: B::BOUNDS.to_vec(),
            counts: self.buckets[..=B::BOUNDS.len()].iter().map(|b| b.load(Ordering::Relaxed)).collect(),
            sum,
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_by_upper_bound() {
        struct Two;
        impl Bounds for Two {
            const BOUNDS: &'static [f64] = &[0.01, 0.1];
        }
        let h = Histogram::<Two>::default();
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(10));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_secs(3));
        let s = h.snapshot();
        assert_eq!(s.counts, [2, 1, 1]);
        assert_eq!(s.count, 4);
        assert!((s.sum - 3.065).abs() < 1e-9);
    }

    #[test]
    fn negative_observations_fall_below_zero_and_subtract_from_the_sum() {
        let h = Histogram::<Lateness>::default();
        h.observe_seconds(-2.0);
        h.observe_seconds(-0.05);
        h.observe_seconds(0.002);
        h.observe_seconds(f64::NAN);
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.counts[0], 1, "-2 s: at most the lowest bound, -1 s");
        assert_eq!(s.counts[3], 1, "-0.05 s: above -0.1 s, at most -0.03 s");
        let zero = Lateness::BOUNDS.iter().position(|&b| b > 0.0).unwrap();
        assert_eq!(s.counts[zero], 1, "0.002 s: the first bucket above zero");
        assert!((s.sum - (-2.048)).abs() < 1e-9, "{}", s.sum);
    }
}

//! Fixed-bucket histograms of atomics: recorded from any thread without a lock, read in one
//! snapshot when metrics are scraped. No pointers inside, like the rest of a node's counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of request durations and times to first token.
pub const LATENCY_BOUNDS: [f64; 15] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// Upper bounds (seconds) of gaps between streamed chunks (inter-token latency).
pub const GAP_BOUNDS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0];

/// `N` bounded buckets plus the +Inf one.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    bounds: &'static [f64; N],
    buckets: [AtomicU64; 16],
    sum_us: AtomicU64,
    count: AtomicU64,
}

/// A copy of a histogram: per-bucket (not cumulative) counts, the +Inf bucket last.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub bounds: Vec<f64>,
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl<const N: usize> Histogram<N> {
    pub const fn new(bounds: &'static [f64; N]) -> Self {
        const { assert!(N < 16, "at most 15 bounded buckets") };
        Self { bounds, buckets: [const { AtomicU64::new(0) }; 16], sum_us: AtomicU64::new(0), count: AtomicU64::new(0) }
    }

    pub fn observe(&self, value: Duration) {
        let seconds = value.as_secs_f64();
        let bucket = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(N);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(u64::try_from(value.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        HistogramSnapshot {
            bounds: self.bounds.to_vec(),
            counts: self.buckets[..=N].iter().map(|b| b.load(Ordering::Relaxed)).collect(),
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
        static BOUNDS: [f64; 2] = [0.01, 0.1];
        let h = Histogram::new(&BOUNDS);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(10));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_secs(3));
        let s = h.snapshot();
        assert_eq!(s.counts, [2, 1, 1]);
        assert_eq!(s.count, 4);
        assert!((s.sum - 3.065).abs() < 1e-9);
    }
}

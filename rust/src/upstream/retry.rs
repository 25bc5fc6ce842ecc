//! The retry budget: retries may add at most `ratio` of the recent requests, plus a small
//! floor, so a failing fleet is never hit by a storm of retries (as linkerd budgets them).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Budgets are counted over windows of this length.
const WINDOW_MS: u64 = 10_000;

#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    floor: u64,
    epoch: Instant,
    window_start_ms: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    /// Every retry taken since the start (for metrics).
    total: AtomicU64,
}

impl RetryBudget {
    pub fn new(ratio: f64, floor: u64) -> Self {
        Self {
            ratio,
            floor,
            epoch: Instant::now(),
            window_start_ms: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    fn roll(&self) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let start = self.window_start_ms.load(Ordering::Relaxed);
        if now.saturating_sub(start) >= WINDOW_MS
            && self.window_start_ms.compare_exchange(start, now, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            self.requests.store(0, Ordering::Relaxed);
            self.retries.store(0, Ordering::Relaxed);
        }
    }

    /// Counts a first attempt.
    pub(crate) fn request(&self) {
        self.roll();
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry from the budget, if any is left.
    pub(crate) fn spend(&self) -> bool {
        self.roll();
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let allowed = self.floor + (self.requests.load(Ordering::Relaxed) as f64 * self.ratio) as u64;
        let spent =
            self.retries.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |r| (r < allowed).then_some(r + 1)).is_ok();
        if spent {
            self.total.fetch_add(1, Ordering::Relaxed);
        }
        spent
    }

    /// Retries taken since the start (for metrics).
    pub(crate) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_then_ratio() {
        let budget = RetryBudget::new(0.2, 2);
        assert!(budget.spend());
        assert!(budget.spend());
        assert!(!budget.spend(), "the floor is spent");
        for _ in 0..10 {
            budget.request();
        }
        assert!(budget.spend());
        assert!(budget.spend());
        assert!(!budget.spend(), "20% of 10 requests is 2 more");
    }
}

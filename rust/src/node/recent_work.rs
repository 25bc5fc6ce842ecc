//! The prefill work sent to a node lately, as a rate: how busy the traffic that comes there
//! keeps it. The prefill clock tells the wait a request meets now; this tells the waits the
//! requests that follow it there will meet, which is what a choice that brings more requests
//! after it (a session's first turn: its next turns follow its cache) commits them to.
//!
//! Exponentially faded sums of the work (ms) and of the requests, with time constant `FADE_MS`:
//! for requests coming at a steady rate, the work's sum is the rate times `FADE_MS`, so that
//! their quotient is the share of time the node's prefill is busy. Plain atomics (the counters
//! live in shared memory); a reader may see a sum and a time of two updates mixed, which the
//! next corrects.

use std::sync::atomic::{AtomicU64, Ordering};

/// The sums' time constant: longer than a session's pause between turns, so that its sessions
/// count between their turns, and short enough to follow a fleet's changes within seconds.
pub(crate) const FADE_MS: f64 = 4000.0;
/// The busy share is held below this: at 1 the wait it predicts has no bound.
const MAX_BUSY: f64 = 0.9;

/// `value` summed as of `at_ms`, faded to `now_ms`.
pub(crate) fn faded(value: f64, at_ms: u64, now_ms: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let age = now_ms.saturating_sub(at_ms) as f64;
    value * (-age / FADE_MS).exp()
}

/// The mean wait (ms) in a queue with random arrivals that keep its server `busy` (a share of
/// the time) with requests of `mean_ms` each: busy / (1 - busy) requests' worth.
pub(crate) fn queue_wait_ms(busy: f64, mean_ms: f64) -> f64 {
    let busy = busy.clamp(0.0, MAX_BUSY);
    busy / (1.0 - busy) * mean_ms
}

#[derive(Debug, Default)]
pub(crate) struct RecentWork {
    /// f64 bits of the faded sums as of `at_ms`: prefill ms, and requests.
    work_ms: AtomicU64,
    requests: AtomicU64,
    at_ms: AtomicU64,
}

impl RecentWork {
    fn faded(&self, now_ms: u64) -> (f64, f64) {
        let at = self.at_ms.load(Ordering::Relaxed);
        let work = f64::from_bits(self.work_ms.load(Ordering::Relaxed));
        let requests = f64::from_bits(self.requests.load(Ordering::Relaxed));
        (faded(work, at, now_ms), faded(requests, at, now_ms))
    }

    /// A request that will cost the node `ms` of prefill was sent there.
    pub(crate) fn add(&self, ms: f64, now_ms: u64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        let (work, requests) = self.faded(now_ms);
        self.work_ms.store((work + ms).to_bits(), Ordering::Relaxed);
        self.requests.store((requests + 1.0).to_bits(), Ordering::Relaxed);
        self.at_ms.store(now_ms, Ordering::Relaxed);
    }

    /// The share of the time this traffic keeps the node's prefill busy, and its mean
    /// request's prefill (ms; 0: none lately).
    pub(crate) fn busy_and_mean(&self, now_ms: u64) -> (f64, f64) {
        let (work, requests) = self.faded(now_ms);
        if requests < f64::EPSILON {
            return (0.0, 0.0);
        }
        (work / FADE_MS, work / requests)
    }

    /// The mean wait (ms) for the node's prefill that its recent traffic, kept up, makes a
    /// request meet (`scored` composes it from `busy_and_mean`; the tests read it whole).
    #[cfg(test)]
    pub(crate) fn wait_ms(&self, now_ms: u64) -> f64 {
        let (busy, mean) = self.busy_and_mean(now_ms);
        queue_wait_ms(busy, mean)
    }

    pub(crate) fn reset(&self) {
        self.work_ms.store(0, Ordering::Relaxed);
        self.requests.store(0, Ordering::Relaxed);
        self.at_ms.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busier_stream_of_the_same_requests_predicts_a_longer_wait() {
        let (light, heavy) = (RecentWork::default(), RecentWork::default());
        // 100 ms prefills, one every 500 ms (20% busy) and one every 200 ms (50% busy).
        for i in 0..100u64 {
            light.add(100.0, i * 500);
        }
        for i in 0..250u64 {
            heavy.add(100.0, i * 200);
        }
        let light_wait = light.wait_ms(50_000);
        let heavy_wait = heavy.wait_ms(50_000);
        assert!((light_wait - 25.0).abs() < 5.0, "20% busy: a quarter of a request's prefill, {light_wait}");
        assert!((heavy_wait - 100.0).abs() < 15.0, "50% busy: one request's prefill, {heavy_wait}");
        assert!(heavy.wait_ms(70_000) < 1.0, "it fades when the traffic stops");
        heavy.reset();
        assert!(heavy.wait_ms(50_000).abs() < f64::EPSILON);
    }

    #[test]
    fn an_overloaded_node_predicts_a_bounded_wait() {
        let work = RecentWork::default();
        for i in 0..200u64 {
            work.add(100.0, i * 50);
        }
        let wait = work.wait_ms(10_000);
        assert!(wait.is_finite() && wait <= 100.0 * MAX_BUSY / (1.0 - MAX_BUSY) + 1e-9, "{wait}");
    }
}

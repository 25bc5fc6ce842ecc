//! What a node's engine says about itself: requests running and waiting, KV-cache usage and
//! capacity, prefix-cache counters. The control plane reads each engine's `/metrics` off the
//! request path and records the figures here, next to the node's own counters; policies read
//! them only while they are fresh, and count the requests pdproxy itself started and finished
//! since the figures were taken.
//!
//! Plain atomics, no pointers: the report lives in `NodeCounters`, which a worker group keeps
//! in shared memory. A reader may see fields of two successive reports mixed: each is a
//! heuristic input, and the next report corrects it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// One reading of an engine's metrics (what the scraper found; `None`: not exported).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct EngineFigures {
    pub(crate) running: u64,
    pub(crate) waiting: u64,
    /// Fraction of the KV cache held by running requests (0 to 1).
    pub(crate) kv_usage: Option<f64>,
    /// Cumulative prompt tokens looked up in the prefix cache, and those found there.
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) cached_tokens: Option<u64>,
    /// Tokens the KV cache holds in all.
    pub(crate) kv_capacity_tokens: Option<u64>,
    /// Cumulative prompt tokens whose KV came from another engine (a decode node's KV
    /// connector: vLLM counts them apart from its prefix-cache hits).
    pub(crate) transferred_tokens: Option<u64>,
}

/// The node's own counters when a reading is recorded, to tell what changed since.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CountsThen {
    pub(crate) in_flight: u64,
    pub(crate) requests: u64,
    /// The node's `predicted_cached_bytes`.
    pub(crate) predicted_cached: u64,
}

/// A node's last engine report, in shared-memory-safe atomics.
#[derive(Debug, Default)]
pub(crate) struct EngineReport {
    /// Wall-clock milliseconds of the last good reading (0: never). Written last.
    read_at_ms: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    /// f64 bits; NaN bits when not exported.
    kv_usage: AtomicU64,
    /// The KV-cache share of one running request, from the last reading that had any (f64 bits;
    /// NaN: none yet): what a request sent to an engine that read idle is taken to add.
    kv_per_request: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    kv_capacity_tokens: AtomicU64,
    transferred_tokens: AtomicU64,
    /// The node's in-flight count when the reading was recorded.
    in_flight_then: AtomicU64,
    /// The node's in-flight count plus one and its request count when the reading was asked
    /// for (0: not marked): what pdproxy could have had at the engine when it counted.
    in_flight_asked: AtomicU64,
    requests_asked: AtomicU64,
    /// Requests the engine had at the last reading that pdproxy did not send, at least.
    others_then: AtomicU64,
    /// The node's request count when the reading was recorded.
    requests_then: AtomicU64,
    /// The node's `predicted_cached_bytes` when the reading was recorded.
    predicted_then: AtomicU64,
    /// Times the engine's counters went back: it restarted with an empty cache.
    restarts: AtomicU32,
    /// Times pdproxy was told the engine's prefix cache was flushed (`POST /flush_cache`,
    /// `Router.cache_flushed`).
    flushes: AtomicU32,
    failures: AtomicU64,
    /// Consecutive failed readings since the last good one.
    failing: AtomicU32,
}

/// The report as a policy uses it: fresh figures, with pdproxy's own traffic since.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EngineLoad {
    pub(crate) running: u64,
    pub(crate) waiting: u64,
    pub(crate) kv_usage: Option<f64>,
    pub(crate) kv_capacity_tokens: Option<u64>,
    /// The KV-cache share of one running request: this reading's, or the last reading's that
    /// had any running.
    pub(crate) kv_per_request: Option<f64>,
    /// Requests pdproxy sent to the node since the reading.
    pub(crate) sent_since: u64,
    /// pdproxy's in-flight count on the node now, minus then.
    pub(crate) in_flight_change: i64,
    /// Requests the engine had at the reading that pdproxy did not send, at least.
    pub(crate) others: u64,
}

impl EngineLoad {
    /// Requests the engine has now (running and waiting), as it reported them adjusted by
    /// those pdproxy started and finished since.
    pub(crate) fn requests(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let reported = (self.running + self.waiting) as f64;
        #[allow(clippy::cast_precision_loss)]
        let change = self.in_flight_change as f64;
        (reported + change).max(0.0)
    }

    /// Requests waiting for a place in the engine's batch now: none if none waited at the
    /// reading (the batch had room), else those plus the ones pdproxy started since (each
    /// waits too) minus those it finished (each freed a place).
    pub(crate) fn waiting(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let change = self.in_flight_change as f64;
        #[allow(clippy::cast_precision_loss)]
        let waiting = self.waiting as f64;
        if self.waiting > 0 {
            (waiting + change).max(0.0)
        } else {
            0.0
        }
    }

    /// Whether the reading showed requests pdproxy did not send (another replica's, or traffic
    /// that bypasses pdproxy): more than `OTHERS_SHARE` of what the engine had. Below that, the
    /// difference is the skew between the reading and pdproxy's count, taken a moment apart.
    pub(crate) fn shows_others(&self) -> bool {
        #[allow(clippy::cast_precision_loss)]
        let share = self.others as f64 / (self.running + self.waiting).max(1) as f64;
        self.others > 0 && share > OTHERS_SHARE
    }

    /// KV-cache usage now: as reported, plus the share of a running request for each request
    /// pdproxy added since (`kv_per_request`: this reading's share, or the last one seen when
    /// it read idle; else every request would go to the engines that happened to be idle then).
    pub(crate) fn kv_usage_estimate(&self) -> Option<f64> {
        let usage = self.kv_usage?;
        let Some(per_request) = self.kv_per_request.filter(|_| self.in_flight_change > 0) else {
            return Some(usage);
        };
        #[allow(clippy::cast_precision_loss)]
        Some((usage + per_request * self.in_flight_change as f64).min(1.0))
    }
}

/// The share of an engine's requests beyond any pdproxy could have had there above which a
/// reading is taken to show other senders (see `EngineLoad::shows_others`): a few requests
/// pdproxy cancelled may still run there.
const OTHERS_SHARE: f64 = 0.2;

/// Everything recorded, for status pages (stale figures included).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct EngineReportSnapshot {
    pub(crate) figures: Option<EngineFigures>,
    /// Milliseconds since the last good reading.
    pub(crate) age_ms: Option<u64>,
    pub(crate) restarts: u32,
    pub(crate) flushes: u32,
    pub(crate) failures: u64,
    pub(crate) failing: u32,
}

fn option_bits(value: Option<f64>) -> u64 {
    value.unwrap_or(f64::NAN).to_bits()
}

fn from_bits(bits: u64) -> Option<f64> {
    Some(f64::from_bits(bits)).filter(|v| !v.is_nan())
}

/// `u64::MAX` stands for "not exported".
fn option_u64(value: Option<u64>) -> u64 {
    value.unwrap_or(u64::MAX)
}

fn from_u64(raw: u64) -> Option<u64> {
    Some(raw).filter(|&v| v != u64::MAX)
}

impl EngineReport {
    /// Records a good reading taken now (`now_ms`, wall clock), with the node's own counters then.
    pub(crate) fn record(&self, figures: &EngineFigures, then: CountsThen, now_ms: u64) {
        let old_prompt = from_u64(self.prompt_tokens.load(Ordering::Relaxed));
        if let (Some(old), Some(new)) = (old_prompt, figures.prompt_tokens) {
            if new < old {
                self.restarts.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.running.store(figures.running, Ordering::Relaxed);
        self.waiting.store(figures.waiting, Ordering::Relaxed);
        self.kv_usage.store(option_bits(figures.kv_usage.map(|u| u.clamp(0.0, 1.0))), Ordering::Relaxed);
        if let Some(usage) = figures.kv_usage.filter(|_| figures.running > 0) {
            #[allow(clippy::cast_precision_loss)]
            let share = usage.clamp(0.0, 1.0) / figures.running as f64;
            self.kv_per_request.store(share.to_bits(), Ordering::Relaxed);
        }
        self.prompt_tokens.store(option_u64(figures.prompt_tokens), Ordering::Relaxed);
        self.cached_tokens.store(option_u64(figures.cached_tokens), Ordering::Relaxed);
        self.kv_capacity_tokens.store(option_u64(figures.kv_capacity_tokens), Ordering::Relaxed);
        self.transferred_tokens.store(option_u64(figures.transferred_tokens), Ordering::Relaxed);
        // At most pdproxy's in-flight count when the reading was asked for plus those it sent
        // while the engine answered (without the mark: its count now) can have been among the
        // engine's; the rest came from elsewhere.
        let asked = self.in_flight_asked.swap(0, Ordering::Relaxed);
        let sent_while = then.requests.saturating_sub(self.requests_asked.load(Ordering::Relaxed));
        let own_at_most = if asked == 0 { then.in_flight } else { (asked - 1).saturating_add(sent_while) };
        let others = (figures.running + figures.waiting).saturating_sub(own_at_most);
        self.others_then.store(others, Ordering::Relaxed);
        self.in_flight_then.store(then.in_flight, Ordering::Relaxed);
        self.requests_then.store(then.requests, Ordering::Relaxed);
        self.predicted_then.store(then.predicted_cached, Ordering::Relaxed);
        self.failing.store(0, Ordering::Relaxed);
        self.read_at_ms.store(now_ms.max(1), Ordering::Release);
    }

    /// Marks the moment a reading is asked for, with the node's counts then (see `record`).
    pub(crate) fn mark_asked(&self, in_flight: u64, requests: u64) {
        self.requests_asked.store(requests, Ordering::Relaxed);
        self.in_flight_asked.store(in_flight.saturating_add(1), Ordering::Relaxed);
    }

    /// Counts a reading that failed (the figures already recorded age on).
    pub(crate) fn record_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.failing.fetch_add(1, Ordering::Relaxed);
    }

    /// Times the engine restarted (its prefix cache then starts empty).
    pub(crate) fn restarts(&self) -> u32 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// The engine's prefix cache was flushed, and pdproxy told so.
    pub(crate) fn flushed(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }

    /// Times the engine's prefix cache was lost, restarted or flushed: what pdproxy knows of
    /// what it holds is void each time this changes.
    pub(crate) fn cache_losses(&self) -> u32 {
        self.restarts().wrapping_add(self.flushes.load(Ordering::Relaxed))
    }

    /// When the last good reading was taken (wall-clock ms, 0: never), the engine's
    /// cumulative prefix-cache hits (tokens) then if it exports them, and the node's
    /// `predicted_cached_bytes` then.
    pub(crate) fn cached_tokens_read(&self) -> (u64, Option<u64>, u64) {
        let read_at = self.read_at_ms.load(Ordering::Acquire);
        let hits = from_u64(self.cached_tokens.load(Ordering::Relaxed)).filter(|_| read_at != 0);
        (read_at, hits, self.predicted_then.load(Ordering::Relaxed))
    }

    /// The figures if read less than `max_age_ms` ago, with pdproxy's traffic since.
    pub(crate) fn fresh(&self, max_age_ms: u64, now_ms: u64, in_flight: u64, requests: u64) -> Option<EngineLoad> {
        let read_at = self.read_at_ms.load(Ordering::Acquire);
        if read_at == 0 || now_ms.saturating_sub(read_at) > max_age_ms {
            return None;
        }
        let in_flight_then = self.in_flight_then.load(Ordering::Relaxed);
        #[allow(clippy::cast_possible_wrap)] // in-flight counts stay far below 2^63
        let in_flight_change = in_flight as i64 - in_flight_then as i64;
        Some(EngineLoad {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_usage: from_bits(self.kv_usage.load(Ordering::Relaxed)),
            kv_capacity_tokens: from_u64(self.kv_capacity_tokens.load(Ordering::Relaxed)),
            kv_per_request: from_bits(self.kv_per_request.load(Ordering::Relaxed)),
            sent_since: requests.saturating_sub(self.requests_then.load(Ordering::Relaxed)),
            in_flight_change,
            others: self.others_then.load(Ordering::Relaxed),
        })
    }

    pub(crate) fn snapshot(&self, now_ms: u64) -> EngineReportSnapshot {
        let read_at = self.read_at_ms.load(Ordering::Acquire);
        let figures = (read_at != 0).then(|| EngineFigures {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_usage: from_bits(self.kv_usage.load(Ordering::Relaxed)),
            prompt_tokens: from_u64(self.prompt_tokens.load(Ordering::Relaxed)),
            cached_tokens: from_u64(self.cached_tokens.load(Ordering::Relaxed)),
            kv_capacity_tokens: from_u64(self.kv_capacity_tokens.load(Ordering::Relaxed)),
            transferred_tokens: from_u64(self.transferred_tokens.load(Ordering::Relaxed)),
        });
        EngineReportSnapshot {
            figures,
            age_ms: (read_at != 0).then(|| now_ms.saturating_sub(read_at)),
            restarts: self.restarts.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            failing: self.failing.load(Ordering::Relaxed),
        }
    }

    /// Back to new (a recycled shared slot).
    pub(crate) fn reset(&self) {
        for value in [
            &self.read_at_ms,
            &self.running,
            &self.waiting,
            &self.in_flight_then,
            &self.requests_then,
            &self.others_then,
            &self.in_flight_asked,
            &self.requests_asked,
            &self.predicted_then,
            &self.failures,
        ] {
            value.store(0, Ordering::Relaxed);
        }
        self.kv_usage.store(option_bits(None), Ordering::Relaxed);
        self.kv_per_request.store(option_bits(None), Ordering::Relaxed);
        for value in [&self.prompt_tokens, &self.cached_tokens, &self.kv_capacity_tokens, &self.transferred_tokens] {
            value.store(option_u64(None), Ordering::Relaxed);
        }
        self.restarts.store(0, Ordering::Relaxed);
        self.flushes.store(0, Ordering::Relaxed);
        self.failing.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn then(in_flight: u64, requests: u64) -> CountsThen {
        CountsThen { in_flight, requests, predicted_cached: 0 }
    }

    fn figures(running: u64, waiting: u64, usage: f64, prompt: u64) -> EngineFigures {
        EngineFigures {
            running,
            waiting,
            kv_usage: Some(usage),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(prompt / 2),
            kv_capacity_tokens: Some(1 << 16),
            transferred_tokens: None,
        }
    }

    #[test]
    fn a_new_report_has_nothing_fresh() {
        let report = EngineReport::default();
        assert_eq!(report.fresh(10_000, 5_000, 0, 0), None);
        assert_eq!(report.snapshot(5_000).figures, None);
    }

    #[test]
    fn requests_sent_to_an_engine_that_read_idle_count_at_the_share_seen_before() {
        let report = EngineReport::default();
        report.record(&figures(4, 0, 0.2, 100), then(4, 4), 1_000);
        report.record(&figures(0, 0, 0.0, 200), then(0, 8), 2_000);
        // Three sent since it read idle: each holds what one of the four held before.
        let load = report.fresh(10_000, 2_100, 3, 11).unwrap();
        assert!((load.kv_usage_estimate().unwrap() - 0.15).abs() < 1e-9);
        assert!((report.fresh(10_000, 2_100, 0, 11).unwrap().kv_usage_estimate().unwrap()).abs() < 1e-9);
    }

    #[test]
    fn a_reading_shows_others_requests_beyond_any_pdproxy_could_have_had_there() {
        let report = EngineReport::default();
        // Asked with five in flight; three more sent and six finished while the engine answered.
        report.mark_asked(5, 100);
        report.record(&figures(8, 1, 0.5, 100), then(2, 103), 1_000);
        let load = report.fresh(10_000, 1_000, 2, 103).unwrap();
        assert_eq!(load.others, 1, "nine at the engine, eight of them possibly pdproxy's");
        assert!(!load.shows_others(), "one in nine: a request pdproxy cancelled may still run");
        report.mark_asked(5, 100);
        report.record(&figures(8, 6, 0.5, 100), then(2, 103), 2_000);
        let load = report.fresh(10_000, 2_000, 2, 103).unwrap();
        assert!(load.others == 6 && load.shows_others(), "{load:?}");
        // Unmarked, the count at the recording stands in for it.
        report.record(&figures(8, 6, 0.5, 100), then(2, 103), 3_000);
        assert_eq!(report.fresh(10_000, 3_000, 2, 103).unwrap().others, 12);
    }

    #[test]
    fn figures_expire_after_their_max_age() {
        let report = EngineReport::default();
        report.record(&figures(3, 1, 0.5, 100), then(2, 10), 1_000);
        assert!(report.fresh(500, 1_400, 2, 10).is_some());
        assert!(report.fresh(500, 1_600, 2, 10).is_none(), "stale figures are not used");
        assert_eq!(report.snapshot(1_600).age_ms, Some(600), "but they are still shown, with their age");
    }

    #[test]
    fn pdproxys_traffic_since_the_reading_counts() {
        let report = EngineReport::default();
        report.record(&figures(4, 2, 0.4, 100), then(3, 50), 1_000);
        // Five more requests sent since, two of them (and one older) finished: in flight 3 -> 5.
        let load = report.fresh(10_000, 1_100, 5, 55).unwrap();
        assert_eq!((load.sent_since, load.in_flight_change), (5, 2));
        assert!((load.requests() - 8.0).abs() < 1e-9);
        // Each running request held 0.1 of the cache: two more hold about 0.2 more.
        assert!((load.kv_usage_estimate().unwrap() - 0.6).abs() < 1e-9);
        // Fewer in flight than then: the engine has fewer too, never below nothing.
        assert!((report.fresh(10_000, 1_100, 0, 55).unwrap().requests() - 3.0).abs() < 1e-9);
        report.record(&figures(0, 0, 0.0, 120), then(3, 55), 1_200);
        assert!(report.fresh(10_000, 1_300, 0, 55).unwrap().requests().abs() < 1e-9);
    }

    #[test]
    fn waiting_requests_follow_pdproxys_traffic_while_the_batch_is_full() {
        let report = EngineReport::default();
        report.record(&figures(10, 0, 0.5, 100), then(10, 10), 1_000);
        // The batch had room: new requests are taken to join it.
        assert!(report.fresh(10_000, 1_100, 30, 30).unwrap().waiting().abs() < 1e-9);
        report.record(&figures(16, 4, 0.9, 200), then(20, 30), 2_000);
        let load = report.fresh(10_000, 2_100, 23, 33).unwrap();
        assert!((load.waiting() - 7.0).abs() < 1e-9, "4 waited, 3 more came");
        assert!(report.fresh(10_000, 2_100, 12, 33).unwrap().waiting().abs() < 1e-9, "8 finished: none waits");
    }

    #[test]
    fn counters_going_back_mean_a_restart() {
        let report = EngineReport::default();
        report.record(&figures(0, 0, 0.0, 100), then(0, 0), 1_000);
        report.record(&figures(0, 0, 0.0, 150), then(0, 0), 2_000);
        assert_eq!(report.restarts(), 0);
        report.record(&figures(0, 0, 0.0, 10), then(0, 0), 3_000);
        assert_eq!(report.restarts(), 1);
    }

    #[test]
    fn failures_are_counted_and_a_good_reading_ends_a_run_of_them() {
        let report = EngineReport::default();
        report.record_failure();
        report.record_failure();
        assert_eq!((report.snapshot(0).failures, report.snapshot(0).failing), (2, 2));
        report.record(&figures(0, 0, 0.0, 1), then(0, 0), 1_000);
        assert_eq!((report.snapshot(0).failures, report.snapshot(0).failing), (2, 0));
        report.reset();
        assert_eq!(report.snapshot(0), EngineReportSnapshot::default());
    }
}

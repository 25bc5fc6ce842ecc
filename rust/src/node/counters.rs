//! A node's counters: plain fixed-size atomics that outlive any snapshot of the node, and can
//! live in the shared table of a worker group.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use super::circuit::Circuit;
use super::decode_starts::DecodeStarts;
use super::engine_report::{CountsThen, EngineFigures, EngineReport};
use super::engine_speed::EngineSpeed;
use super::hidden_load::HiddenLoad;
use super::recent_work::RecentWork;
use super::running_late::RunningLate;
use super::state::NodeState;
use crate::observe::histogram::{Gap, Histogram, Latency, Lateness};

/// How a request ended, as recorded in the node's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The whole response was received from the node.
    Succeeded,
    /// The node failed: connect error, timeout, reset, broken body, or a gateway error
    /// (502/503/504): counts toward its circuit.
    Failed,
    /// The node answered with another server error (a 500 a client's request can provoke):
    /// counted as failed, but it says nothing of the node's health, so its circuit ignores it.
    Errored,
    /// The node refused the request as the client's error (a 4xx other than 429): neither its
    /// success (a quick refusal would flatter its latency) nor its failure.
    Rejected,
    /// The caller gave up first (client disconnect, body dropped unread).
    Cancelled,
    /// Selected but never sent (a dry-run selection): recorded nowhere.
    Unused,
}

/// How many recent requests the latency window keeps (LMDeploy keeps 15).
pub(crate) const LATENCY_WINDOW: usize = 15;

/// Per-node counters and mutable attributes. Plain fixed-size atomics with no pointers
/// inside, all zero when new, so that they can live in the shared table of a worker group.
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub(crate) in_flight: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) succeeded: AtomicU64,
    pub(crate) failed: AtomicU64,
    /// Requests the node refused as the client's error (4xx but 429).
    pub(crate) client_errors: AtomicU64,
    /// Requests that never reached the node (connect refused or timed out): passive health.
    pub(crate) connect_failures: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) latency_us_sum: AtomicU64,
    /// Server-sent events forwarded from this node.
    pub(crate) events: AtomicU64,
    pub(crate) ttft_us_sum: AtomicU64,
    pub(crate) ttft_count: AtomicU64,
    /// Exponentially weighted mean of time to first byte, microseconds (0: none yet).
    pub(crate) ttft_us_ewma: AtomicU64,
    /// When the engine should be done prefilling the requests sent to it that have not had
    /// their first byte (µs, `now_us`'s clock): each adds its predicted prefill after the
    /// ones before, and the last one's first byte sets it to now. The time left on it is the
    /// wait ahead of the next request (the pending bytes alone would count a prefill half
    /// done as whole, and send the next request to a node about to be busy rather than to
    /// one about to be free).
    pub(crate) prefill_done_at_us: AtomicU64,
    /// How fast the node's engine prefills and decodes, learnt from the requests sent to it.
    pub(crate) speed: EngineSpeed,
    /// When the requests lately answered began decoding: when the places of a full batch free.
    pub(crate) decode_starts: DecodeStarts,
    /// How much later than priced its first tokens came lately: work there pdproxy did not price.
    pub(crate) hidden: HiddenLoad,
    /// How long ago, by the prefill clock, the oldest request still waiting for its first token
    /// there was due.
    pub(crate) running_late: RunningLate,
    /// The prefill work sent to the node lately, as the wait it makes the next requests meet.
    pub(crate) recent_work: RecentWork,
    /// Requests sent to the node that have not had the first byte of their answer yet: waiting
    /// in the engine's queue, or being prefilled.
    pub(crate) unanswered: AtomicU64,
    /// The other replicas' `unanswered` here, summed over those still sending (`replica_share`;
    /// 0 without it).
    pub(crate) peer_unanswered: AtomicU64,
    /// When the node should be done with the prefill the other replicas expect it to owe them,
    /// summed (µs, `now_us`'s clock; 0: nothing).
    pub(crate) peer_prefill_done_at_us: AtomicU64,
    /// The other replicas' requests in flight here, summed (`replica_share`; 0 without it):
    /// only `scored`'s choice among nodes equally ready reads it, never a cap. (Engine readings
    /// stay adjusted by this replica's own traffic: adjusted by every replica's, four replicas
    /// on `bench/fleet.py`'s `multi_turn` had a TTFT p99 1.09-1.30x one replica's over six
    /// seeds, against 1.01-1.27x.)
    pub(crate) peer_in_flight: AtomicU64,
    /// The other replicas routing here that said so lately (`replica_share`; 0 without it):
    /// their choices, made on the same figures a datagram's trip apart, may coincide with this
    /// one's (`scored` spreads long prefills then).
    pub(crate) peer_replicas: AtomicU64,
    /// Prompt bytes the routing policy expected the node to find in its cache, summed over
    /// the requests that had their first byte (so the engine has looked them up by then).
    pub(crate) predicted_cached_bytes: AtomicU64,
    /// Of the answers that said what the engine found in its cache: the hits the policy had
    /// predicted (bytes), and those the engine reported (tokens).
    pub(crate) answered_predicted_bytes: AtomicU64,
    pub(crate) answered_cached_tokens: AtomicU64,
    /// The last `LATENCY_WINDOW` successful requests: latency (µs) and events served.
    recent_latency_us: [AtomicU32; LATENCY_WINDOW],
    recent_events: [AtomicU32; LATENCY_WINDOW],
    recent_cursor: AtomicU64,
    /// Hard cap on `in_flight`; 0 means none.
    pub(crate) max_concurrency: AtomicU32,
    pub(crate) circuit: Circuit,
    state: AtomicU8,
    /// Whole requests, from admission to the end of the body.
    pub(crate) duration: Histogram<Latency>,
    /// Streams: from sending the request to the first body byte.
    pub(crate) ttft: Histogram<Latency>,
    /// Streams: gaps between consecutive chunks (inter-token latency).
    pub(crate) itl: Histogram<Gap>,
    /// First bytes priced by the policy (`scored`): how much later than priced they came.
    pub(crate) first_token_lateness: Histogram<Lateness>,
    /// What the node's engine last said about itself (its `/metrics`).
    pub(crate) engine: EngineReport,
}

/// One point-in-time copy of a node's counters.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CountersSnapshot {
    pub in_flight: u64,
    pub requests: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub client_errors: u64,
    pub connect_failures: u64,
    pub cancelled: u64,
    pub latency_us_sum: u64,
    pub events: u64,
    pub mean_ttft_us: Option<f64>,
    pub ttft_us_ewma: Option<f64>,
    /// Mean latency of the recent window, microseconds.
    pub recent_latency_us: Option<f64>,
    /// Mean of latency per event over the recent window, microseconds.
    pub recent_latency_per_event_us: Option<f64>,
    pub max_concurrency: Option<u32>,
    pub state: &'static str,
    pub circuit: &'static str,
}

impl NodeCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        let ttft_count = self.ttft_count.load(Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        let mean_ttft_us =
            (ttft_count > 0).then(|| self.ttft_us_sum.load(Ordering::Relaxed) as f64 / ttft_count as f64);
        let ewma = f64::from_bits(self.ttft_us_ewma.load(Ordering::Relaxed));
        CountersSnapshot {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            client_errors: self.client_errors.load(Ordering::Relaxed),
            connect_failures: self.connect_failures.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            latency_us_sum: self.latency_us_sum.load(Ordering::Relaxed),
            events: self.events.load(Ordering::Relaxed),
            mean_ttft_us,
            ttft_us_ewma: (ewma > 0.0).then_some(ewma),
            recent_latency_us: self.recent_mean(false),
            recent_latency_per_event_us: self.recent_mean(true),
            max_concurrency: self.max_concurrency(),
            state: self.state().name(),
            circuit: self.circuit.name(),
        }
    }

    /// Back to new (a recycled shared slot).
    pub(crate) fn reset(&self) {
        for counter in [
            &self.in_flight,
            &self.requests,
            &self.succeeded,
            &self.failed,
            &self.client_errors,
            &self.connect_failures,
            &self.cancelled,
            &self.latency_us_sum,
            &self.events,
            &self.ttft_us_sum,
            &self.ttft_count,
            &self.ttft_us_ewma,
            &self.prefill_done_at_us,
            &self.unanswered,
            &self.peer_unanswered,
            &self.peer_prefill_done_at_us,
            &self.peer_in_flight,
            &self.peer_replicas,
            &self.predicted_cached_bytes,
            &self.answered_predicted_bytes,
            &self.answered_cached_tokens,
            &self.recent_cursor,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        for value in self.recent_latency_us.iter().chain(&self.recent_events) {
            value.store(0, Ordering::Relaxed);
        }
        self.max_concurrency.store(0, Ordering::Relaxed);
        self.circuit.reset();
        self.state.store(0, Ordering::Relaxed);
        self.duration.reset();
        self.ttft.reset();
        self.first_token_lateness.reset();
        self.itl.reset();
        self.engine.reset();
        self.speed.reset();
        self.decode_starts.reset();
        self.running_late.reset();
        self.hidden.reset();
        self.recent_work.reset();
    }

    /// Marks that a reading of the node's engine is being asked for (see `EngineReport::record`).
    pub(crate) fn engine_reading_asked(&self) {
        self.engine.mark_asked(self.in_flight(), self.requests.load(Ordering::Relaxed));
    }

    /// Records a reading of the node's engine taken now (`now_ms`), with its own counters.
    pub(crate) fn record_engine_report(&self, figures: &EngineFigures, now_ms: u64) {
        let then = CountsThen {
            in_flight: self.in_flight(),
            requests: self.requests.load(Ordering::Relaxed),
            predicted_cached: self.predicted_cached_bytes.load(Ordering::Relaxed),
        };
        self.engine.record(figures, then, now_ms);
        self.speed.reported(figures.running, figures.waiting);
    }

    pub(crate) fn state(&self) -> NodeState {
        NodeState::from_u8(self.state.load(Ordering::Acquire))
    }

    pub fn set_state(&self, state: NodeState) {
        self.state.store(state as u8, Ordering::Release);
    }

    pub fn max_concurrency(&self) -> Option<u32> {
        Some(self.max_concurrency.load(Ordering::Relaxed)).filter(|&m| m > 0)
    }

    pub fn set_max_concurrency(&self, max: Option<u32>) {
        self.max_concurrency.store(max.unwrap_or(0), Ordering::Relaxed);
    }

    /// Adds `us` of prefill after what the node already owes (from now, if it owes nothing);
    /// returns when the node should be done with it.
    pub(crate) fn owe_prefill(&self, us: u64, now_us: u64) -> u64 {
        let after = |done: u64| done.max(now_us).saturating_add(us);
        let before = self
            .prefill_done_at_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |done| Some(after(done)))
            .unwrap_or_else(|done| done);
        after(before)
    }

    /// The prefill the node still owes, by its clock (ms).
    pub(crate) fn prefill_left_ms(&self, now_us: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let left = self.prefill_done_at_us.load(Ordering::Relaxed).saturating_sub(now_us) as f64;
        left / 1000.0
    }

    /// How late the node runs on the first tokens it owes (ms, see `RunningLate`): its ring
    /// is read only where a request waits for one (it is empty otherwise).
    pub(crate) fn running_late_ms(&self, now_ms: u64) -> f64 {
        if self.unanswered.load(Ordering::Relaxed) == 0 {
            return 0.0;
        }
        self.running_late.overdue_ms(now_ms)
    }

    /// The prefill the other replicas expect the node to still owe them (ms; 0 without them).
    pub(crate) fn peer_prefill_left_ms(&self, now_us: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let left = self.peer_prefill_done_at_us.load(Ordering::Relaxed).saturating_sub(now_us) as f64;
        left / 1000.0
    }

    /// Requests in flight here from every replica that says so (`replica_share`).
    pub(crate) fn fleet_in_flight(&self) -> u64 {
        self.in_flight().saturating_add(self.peer_in_flight.load(Ordering::Relaxed))
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// This replica's requests decoding there: answered (a first byte came) and not yet done.
    pub(crate) fn decoding(&self) -> u64 {
        self.in_flight().saturating_sub(self.unanswered.load(Ordering::Relaxed))
    }

    /// True when the node may be selected now: healthy, its circuit not open, below its cap.
    pub(crate) fn is_available(&self) -> bool {
        self.state() == NodeState::Healthy
            && self.circuit.allows()
            && self.max_concurrency().is_none_or(|max| self.in_flight() < u64::from(max))
    }

    /// The recent window's latencies in microseconds, oldest first.
    pub(crate) fn recent_latencies(&self) -> Vec<f64> {
        let cursor = usize::try_from(self.recent_cursor.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        let filled = cursor.min(LATENCY_WINDOW);
        (0..filled)
            .map(|k| (cursor - filled + k) % LATENCY_WINDOW)
            .map(|i| f64::from(self.recent_latency_us[i].load(Ordering::Relaxed)))
            .collect()
    }

    /// Mean latency over the recent window (optionally per event served); `None` before any.
    pub(crate) fn recent_mean(&self, per_event: bool) -> Option<f64> {
        let filled =
            usize::try_from(self.recent_cursor.load(Ordering::Relaxed)).unwrap_or(usize::MAX).min(LATENCY_WINDOW);
        if filled == 0 {
            return None;
        }
        let sum: f64 = (0..filled)
            .map(|i| {
                let latency = f64::from(self.recent_latency_us[i].load(Ordering::Relaxed));
                if per_event {
                    latency / f64::from(self.recent_events[i].load(Ordering::Relaxed).max(1))
                } else {
                    latency
                }
            })
            .sum();
        #[allow(clippy::cast_precision_loss)]
        Some(sum / filled as f64)
    }

    pub(crate) fn record_success(&self, latency: Duration, first_byte: Option<Duration>, events: u64) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency_us_sum.fetch_add(micros, Ordering::Relaxed);
        let slot =
            usize::try_from(self.recent_cursor.fetch_add(1, Ordering::Relaxed) % LATENCY_WINDOW as u64).unwrap_or(0);
        self.recent_latency_us[slot].store(u32::try_from(micros).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.recent_events[slot].store(u32::try_from(events).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.events.fetch_add(events, Ordering::Relaxed);
        if let Some(first) = first_byte {
            if events > 1 {
                // A stream: its first byte was its first token, and the rest its decoding.
                self.speed.decoded((latency.saturating_sub(first)).as_secs_f64() * 1000.0);
            }
            self.ttft.observe(first);
            #[allow(clippy::cast_precision_loss)]
            let ttft = first.as_micros() as f64;
            self.ttft_us_sum.fetch_add(u64::try_from(first.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
            self.ttft_count.fetch_add(1, Ordering::Relaxed);
            // A lost update under a race only skews a statistic; no lock for it.
            let old = f64::from_bits(self.ttft_us_ewma.load(Ordering::Relaxed));
            let new = if old > 0.0 { old + 0.2 * (ttft - old) } else { ttft };
            self.ttft_us_ewma.store(new.to_bits(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_window_keeps_the_last_fifteen() {
        let c = NodeCounters::default();
        assert_eq!(c.recent_mean(false), None);
        for ms in 1..=20u64 {
            c.record_success(Duration::from_millis(ms), None, 2);
        }
        // 6..=20 ms remain: mean 13 ms; per event: 6.5 ms.
        assert_eq!(c.recent_mean(false), Some(13_000.0));
        let window = c.recent_latencies();
        assert_eq!((window.len(), window[0], window[14]), (15, 6_000.0, 20_000.0));
        assert_eq!(c.recent_mean(true), Some(6_500.0));
    }

    #[test]
    fn availability_follows_state_and_cap() {
        let c = NodeCounters::default();
        assert!(c.is_available());
        c.set_max_concurrency(Some(1));
        c.in_flight.store(1, Ordering::Relaxed);
        assert!(!c.is_available());
        c.in_flight.store(0, Ordering::Relaxed);
        c.set_state(NodeState::Draining);
        assert!(!c.is_available());
    }
}

//! The in-flight permit: counted when taken, released exactly once when dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::admission::Admission;
use crate::clock::{now_ms, now_us};
use crate::node::running_late::Entry;
use crate::node::{Node, Outcome};
use crate::select::Prediction;

/// What a streamed body showed, recorded into the node's statistics at release.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Report {
    /// Time from sending the request to the first body byte.
    pub(crate) first_byte: Option<Duration>,
    /// Server-sent events forwarded.
    pub(crate) events: u64,
}

/// Holds one unit of a node's in-flight count. It travels with the request and then with
/// the response body, so the count drops on whichever exit comes first; an unfinished
/// permit counts as cancelled. Releasing one wakes a request queued for that node.
#[derive(Debug)]
pub struct InFlightPermit {
    node: Arc<Node>,
    admission: Option<Arc<Admission>>,
    started: Instant,
    outcome: Outcome,
    report: Report,
    /// Counted in the node's `unanswered` until the first byte comes.
    unanswered: AtomicBool,
    /// When the first byte should come (`now_us`'s clock; 0: not priced, or not a first token).
    first_token_due_us: AtomicU64,
    /// Its entry among the node's requests waiting for a first token (`RunningLate`; 0: none).
    late_entry: AtomicU64,
    /// Whether its lateness feeds the node's `hidden` mean (the policy weighs it).
    weighs_lateness: AtomicBool,
    /// Prompt bytes the policy expected in the node's cache, added to its
    /// `predicted_cached_bytes` at the first byte.
    predicted_cached: AtomicU64,
    /// When the answer's first byte is its first token and the request waits for no other's
    /// prefill, the prompt bytes the node prefills for it (plus one) and since when (Unix ms):
    /// the first byte then teaches the node's speed. Zero: not timed.
    timed_bytes: AtomicU64,
    timed_since_ms: AtomicU64,
    /// The node's in-flight count when the permit was taken (itself included).
    in_flight_then: u64,
    /// The prefill the policy predicted (bytes), and whether the first byte times a token.
    own_prefill: AtomicU64,
    timed: AtomicBool,
    /// The cache hits the policy predicted (bytes), kept to check against what the answer says
    /// the engine found (`usage.prompt_tokens_details.cached_tokens`, tokens; `u64::MAX`: not
    /// said yet).
    checked_cached: AtomicU64,
    reported_cached: AtomicU64,
}

/// Built once: a finder's setup costs more than a search of one answer.
static CACHED_TOKENS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"cached_tokens\""));

/// The number after a `"cached_tokens"` key in `chunk` (`None`: none, or not a number).
fn cached_tokens(chunk: &[u8]) -> Option<u64> {
    let at = CACHED_TOKENS.find(chunk)?;
    let rest = chunk[at + 15..].trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

impl InFlightPermit {
    /// Takes a permit unless the node is at its cap. The check and the increment are one
    /// atomic step, so concurrent callers can never push a node past its cap.
    pub fn try_acquire(node: &Arc<Node>, admission: Option<&Arc<Admission>>) -> Option<Self> {
        let counters = node.counters();
        if !counters.circuit.admit() {
            return None;
        }
        if !counters.try_enter(counters.max_concurrency()) {
            counters.circuit.abandon();
            return None;
        }
        Some(Self::entered(node, admission.cloned()))
    }

    /// Takes a permit whatever the cap (tests and tools that account by hand).
    #[cfg(test)]
    pub(crate) fn acquire(node: &Arc<Node>) -> Self {
        node.counters().try_enter(None);
        Self::entered(node, None)
    }

    /// The permit of a request that has just entered the node's in-flight count.
    fn entered(node: &Arc<Node>, admission: Option<Arc<Admission>>) -> Self {
        let counters = node.counters();
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters.unanswered.fetch_add(1, Ordering::Relaxed);
        Self {
            node: Arc::clone(node),
            admission,
            started: Instant::now(),
            outcome: Outcome::Cancelled,
            report: Report::default(),
            unanswered: AtomicBool::new(true),
            first_token_due_us: AtomicU64::new(0),
            late_entry: AtomicU64::new(0),
            weighs_lateness: AtomicBool::new(false),
            predicted_cached: AtomicU64::new(0),
            timed_bytes: AtomicU64::new(0),
            timed_since_ms: AtomicU64::new(0),
            in_flight_then: counters.in_flight(),
            own_prefill: AtomicU64::new(0),
            timed: AtomicBool::new(false),
            checked_cached: AtomicU64::new(0),
            reported_cached: AtomicU64::new(u64::MAX),
        }
    }

    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// Sets the outcome recorded at release.
    pub fn set_outcome(&mut self, outcome: Outcome) {
        self.outcome = outcome;
    }

    pub(crate) fn set_report(&mut self, report: Report) {
        self.report = report;
    }

    /// Releases a permit that was never used for a request.
    pub(crate) fn unused(mut self) {
        self.node.counters().requests.fetch_sub(1, Ordering::Relaxed);
        self.outcome = Outcome::Unused;
    }

    /// Records what the policy expects of the node for this request: `prefill` bytes of prompt
    /// to compute (its time owed on the node's prefill clock), and `cached` bytes to be found
    /// in its cache. Once per permit (the one
    /// selection that took it). `timed`: the answer's first byte will be its first token (a
    /// stream, or a prefill leg), so its wait teaches the node's speed, unless the engine's
    /// batch looks full now (the wait would then be for a place in it, not for the prefill).
    pub(crate) fn set_prediction(&self, prediction: Prediction, timed: bool) {
        let now = now_ms();
        let counters = self.node.counters();
        self.own_prefill.store(prediction.prefill, Ordering::Relaxed);
        self.timed.store(timed, Ordering::Relaxed);
        if timed && prediction.first_token_us > 0 {
            self.first_token_due_us.store(now_us() + prediction.first_token_us, Ordering::Relaxed);
            self.weighs_lateness.store(prediction.weighs_lateness, Ordering::Relaxed);
        }
        if timed {
            // In a cold fleet's first seconds, before a report shows the batch full, requests
            // sent beyond what it surely holds waited for a place: on bench/fleet.py's
            // `system_prompts` such samples made the fixed part 229-370 ms (15-25 ms once warm),
            // and the prefill clock, which adds it per request, priced first tokens seconds late.
            #[allow(clippy::cast_precision_loss)]
            let full = counters.fleet_in_flight() as f64 > counters.speed.places();
            // Only a request that waits for no other's prefill times the engine's own: one sent
            // behind others waits for what is left of theirs, which no count of their bytes
            // tells (half done, or sharing its step), and such samples flattened the fit's
            // slope and swelled its fixed part.
            // (Other replicas' requests there count too: `replica_share`.)
            let alone = counters.unanswered.load(Ordering::Relaxed) <= 1
                && counters.peer_unanswered.load(Ordering::Relaxed) == 0;
            if !full && alone {
                self.timed_bytes.store(prediction.prefill + 1, Ordering::Relaxed);
                self.timed_since_ms.store(now, Ordering::Relaxed);
            }
        }
        if prediction.prefill_us > 0 {
            let due_us = counters.owe_prefill(prediction.prefill_us, now_us());
            // Where the first byte is the first token, it tells whether the node runs late.
            if timed {
                let entry = counters.running_late.enter(due_us / 1000);
                if let Some(before) = Entry::from_bits(self.late_entry.swap(entry.bits(), Ordering::Relaxed)) {
                    counters.running_late.leave(before);
                }
            }
            #[allow(clippy::cast_precision_loss)]
            counters.recent_work.add(prediction.prefill_us as f64 / 1000.0, now);
        }
        // Tells the other replicas at once of a long prefill, where they share their load: once
        // it is owed (told before, the snapshot sent could miss it).
        crate::node::load_signal::prefill_routed(prediction.prefill_us);
        self.predicted_cached.store(prediction.cached, Ordering::Relaxed);
        self.checked_cached.store(prediction.cached, Ordering::Relaxed);
    }

    /// A piece of the node's answer: where the policy predicted cache hits, looks for what the
    /// engine says it found (once; a streamed answer says it in its last event, with
    /// `stream_options.include_usage`, a whole one in its body).
    pub(crate) fn saw(&self, chunk: &[u8]) {
        if self.checked_cached.load(Ordering::Relaxed) == 0 || self.reported_cached.load(Ordering::Relaxed) != u64::MAX
        {
            return;
        }
        if let Some(tokens) = cached_tokens(chunk) {
            self.reported_cached.store(tokens, Ordering::Relaxed);
        }
    }

    /// The node's answer came whole: its first byte, and all of it seen.
    pub(crate) fn answered_whole(&self, body: &[u8]) {
        self.first_byte_seen();
        self.saw(body);
    }

    /// The answer's first byte came: the node has prefilled the prompt (once; later calls do nothing).
    pub(crate) fn first_byte_seen(&self) {
        // Called for every chunk: after the first, a load instead of four swaps.
        if self.unanswered.load(Ordering::Relaxed) {
            self.settle_prefill(true);
        }
    }

    /// The answer's first token came (a stream's first event): when a full batch frees the
    /// place this request holds depends on it.
    pub(crate) fn decoding_began(&self) {
        self.node.counters().decode_starts.record(now_ms());
    }

    /// Takes this request out of the node's unanswered count (once); `answered`:
    /// its first byte came, so how long it was pending is worth learning.
    fn settle_prefill(&self, answered: bool) {
        let counters = self.node.counters();
        // The last request owed an answer has one: the node owes no prefill from now on.
        if self.unanswered.swap(false, Ordering::Relaxed) && counters.unanswered.fetch_sub(1, Ordering::Relaxed) == 1 {
            counters.prefill_done_at_us.store(now_us(), Ordering::Relaxed);
        }
        if let Some(entry) = Entry::from_bits(self.late_entry.swap(0, Ordering::Relaxed)) {
            counters.running_late.leave(entry);
        }
        let due = self.first_token_due_us.swap(0, Ordering::Relaxed);
        if answered && due > 0 {
            #[allow(clippy::cast_precision_loss)]
            let late_ms = (now_us() as f64 - due as f64) / 1000.0;
            counters.first_token_lateness.observe_seconds(late_ms / 1000.0);
            if self.weighs_lateness.load(Ordering::Relaxed) {
                counters.hidden.observe(late_ms, now_ms());
            }
        }
        if answered {
            // Those answered and not yet done decode there now (this one among them).
            counters.speed.seen_running(counters.decoding());
        }
        let timed = self.timed_bytes.swap(0, Ordering::Relaxed);
        if answered && timed > 0 {
            let waited_ms = now_ms().saturating_sub(self.timed_since_ms.load(Ordering::Relaxed));
            #[allow(clippy::cast_precision_loss)]
            counters.speed.first_token((timed - 1) as f64 / 1024.0, waited_ms as f64);
        }
        let cached = self.predicted_cached.swap(0, Ordering::Relaxed);
        if cached > 0 {
            counters.predicted_cached_bytes.fetch_add(cached, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlightPermit {
    fn drop(&mut self) {
        // Unanswered, the request may never have reached the engine's cache: no prediction to check.
        self.predicted_cached.store(0, Ordering::Relaxed);
        self.settle_prefill(false);
        let counters = self.node.counters();
        if self.outcome != Outcome::Unused {
            counters.duration.observe(self.started.elapsed());
        }
        match self.outcome {
            Outcome::Succeeded => {
                counters.succeeded.fetch_add(1, Ordering::Relaxed);
                let latency = self.started.elapsed();
                counters.record_success(latency, self.report.first_byte, self.report.events);
                #[allow(clippy::cast_precision_loss)]
                let untimed_kib = (!self.timed.load(Ordering::Relaxed))
                    .then(|| self.own_prefill.load(Ordering::Relaxed) as f64 / 1024.0);
                counters.speed.served(latency.as_secs_f64() * 1000.0, self.in_flight_then, untimed_kib);
                let reported = self.reported_cached.load(Ordering::Relaxed);
                let predicted = self.checked_cached.load(Ordering::Relaxed);
                if reported != u64::MAX && predicted > 0 {
                    counters.answered_predicted_bytes.fetch_add(predicted, Ordering::Relaxed);
                    counters.answered_cached_tokens.fetch_add(reported, Ordering::Relaxed);
                }
                counters.circuit.success();
            }
            Outcome::Failed => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                counters.circuit.failure();
            }
            Outcome::Errored => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                counters.circuit.abandon();
            }
            Outcome::Rejected => {
                counters.client_errors.fetch_add(1, Ordering::Relaxed);
                counters.circuit.abandon();
            }
            Outcome::Cancelled => {
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
                counters.circuit.abandon();
            }
            Outcome::Unused => counters.circuit.abandon(),
        }
        counters.exit();
        if let Some(admission) = &self.admission {
            admission.released(&self.node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::registry::Registry;
    use crate::node::NodeSpec;

    #[test]
    fn counts_once_per_exit() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let mut ok = InFlightPermit::acquire(&node);
        let dropped = InFlightPermit::acquire(&node);
        assert_eq!(node.counters().snapshot().in_flight, 2);
        ok.set_outcome(Outcome::Succeeded);
        drop(ok);
        drop(dropped);
        let snap = node.counters().snapshot();
        assert_eq!((snap.in_flight, snap.requests, snap.succeeded, snap.cancelled), (0, 2, 1, 1));
    }

    #[test]
    fn the_prefill_clock_runs_on_until_the_last_request_is_answered() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let counters = node.counters();
        let first = InFlightPermit::acquire(&node);
        let second = InFlightPermit::acquire(&node);
        first.set_prediction(
            Prediction { prefill: 1024, cached: 0, prefill_us: 400_000, ..Prediction::default() },
            true,
        );
        second.set_prediction(
            Prediction { prefill: 1024, cached: 0, prefill_us: 300_000, ..Prediction::default() },
            true,
        );
        let left = counters.prefill_left_ms(now_us());
        assert!((600.0..=700.0).contains(&left), "one prefill after the other: {left} ms");
        first.first_byte_seen();
        assert!(counters.prefill_left_ms(now_us()) > 600.0, "the second still owes its own");
        second.first_byte_seen();
        assert!(counters.prefill_left_ms(now_us()) <= 0.0, "nothing unanswered: nothing owed");
        // A request that predicts no prefill time leaves the clock alone.
        let quiet = InFlightPermit::acquire(&node);
        quiet.set_prediction(Prediction { prefill: 1024, cached: 0, prefill_us: 0, ..Prediction::default() }, true);
        assert!(counters.prefill_left_ms(now_us()) <= 0.0);
    }

    #[test]
    fn a_streamed_request_counts_in_how_late_the_node_runs_until_its_first_token() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let late = |in_ms: u64| node.counters().running_late.overdue_ms(crate::clock::now_ms() + in_ms);
        let priced = |timed: bool| {
            let permit = InFlightPermit::acquire(&node);
            permit.set_prediction(Prediction { prefill: 1024, prefill_us: 100_000, ..Prediction::default() }, timed);
            permit
        };
        // Due when its 100 ms on the clock end: a second later it is 900 ms overdue.
        let first = priced(true);
        assert!((late(1_000) - 900.0).abs() < 20.0, "{}", late(1_000));
        let second = priced(true);
        assert!((late(1_000) - 900.0).abs() < 20.0, "the oldest sets it: {}", late(1_000));
        first.first_byte_seen();
        assert!((late(1_000) - 800.0).abs() < 20.0, "due after the first: {}", late(1_000));
        // Gone unanswered, it is taken out as well.
        drop(second);
        assert!(late(1_000).abs() < f64::EPSILON);
        // A whole answer's first byte is its last: it tells nothing of the first token.
        let whole = priced(false);
        assert!(late(1_000).abs() < f64::EPSILON);
        drop((first, whole));
    }

    #[test]
    fn a_first_token_teaches_the_speed_only_within_the_places_sure_in_the_batch() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let samples = || node.counters().speed.samples().weight;
        let timed = || {
            let permit = InFlightPermit::acquire(&node);
            permit.set_prediction(Prediction { prefill: 1024, ..Prediction::default() }, true);
            permit
        };
        let first = timed();
        first.first_byte_seen();
        assert!((samples() - 1.0).abs() < 1e-9, "alone: a sample");
        // Sent while the first decodes: two in flight, and only one seen running there so far.
        let second = timed();
        second.first_byte_seen();
        assert!((samples() - 1.0).abs() < 1e-9, "it may have waited for a place: no sample");
        // Two were seen decoding at once: a batch holds two.
        drop(first);
        let third = timed();
        third.first_byte_seen();
        assert!(samples() > 1.5, "within the places seen: a sample");
        drop((second, third));
    }

    #[test]
    fn a_priced_first_byte_shows_how_far_off_its_price_was() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let lateness = &node.counters().first_token_lateness;
        // Priced a second out, answered at once: about a second early.
        let early = InFlightPermit::acquire(&node);
        early.set_prediction(Prediction { first_token_us: 1_000_000, ..Prediction::default() }, true);
        early.first_byte_seen();
        early.first_byte_seen();
        let seen = lateness.snapshot();
        assert_eq!(seen.count, 1, "once per request");
        assert!((-1.0..-0.9).contains(&seen.sum), "{}", seen.sum);
        let hidden = || node.counters().hidden.ms(crate::clock::now_ms());
        assert!(hidden().abs() < f64::EPSILON, "not weighed: no fading mean kept");
        let weighed = InFlightPermit::acquire(&node);
        weighed.set_prediction(
            Prediction { first_token_us: 1_000_000, weighs_lateness: true, ..Prediction::default() },
            true,
        );
        weighed.first_byte_seen();
        assert!(hidden() < -100.0, "weighed: the mean learns it was early, {}", hidden());
        assert_eq!(lateness.snapshot().count, 2);
        // Not priced, not timed (a whole answer's first byte is not its first token), or never
        // answered: nothing to set against.
        let unpriced = InFlightPermit::acquire(&node);
        unpriced.set_prediction(Prediction::default(), true);
        unpriced.first_byte_seen();
        let untimed = InFlightPermit::acquire(&node);
        untimed.set_prediction(Prediction { first_token_us: 1_000, ..Prediction::default() }, false);
        untimed.first_byte_seen();
        let cancelled = InFlightPermit::acquire(&node);
        cancelled.set_prediction(Prediction { first_token_us: 1_000, ..Prediction::default() }, true);
        drop(cancelled);
        assert_eq!(lateness.snapshot().count, 2);
    }

    #[test]
    fn the_hits_an_answer_reports_are_set_against_those_predicted() {
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let mut permit = InFlightPermit::acquire(&node);
        permit.set_prediction(Prediction { prefill: 100, cached: 4096, prefill_us: 0, ..Prediction::default() }, true);
        permit.saw(b"data: {\"choices\": []}\n\n");
        permit.saw(br#"data: {"usage": {"prompt_tokens": 1100, "prompt_tokens_details": {"cached_tokens" : 1024}}}"#);
        permit.saw(br#"{"cached_tokens": 5}"#);
        permit.set_outcome(Outcome::Succeeded);
        drop(permit);
        let counters = node.counters();
        let sums = (
            counters.answered_predicted_bytes.load(Ordering::Relaxed),
            counters.answered_cached_tokens.load(Ordering::Relaxed),
        );
        assert_eq!(sums, (4096, 1024), "the first report counts, once");
        // Nothing predicted, or nothing reported: nothing to set against.
        let mut quiet = InFlightPermit::acquire(&node);
        quiet.set_prediction(Prediction { prefill: 100, cached: 4096, prefill_us: 0, ..Prediction::default() }, true);
        quiet.set_outcome(Outcome::Succeeded);
        drop(quiet);
        assert_eq!(counters.answered_predicted_bytes.load(Ordering::Relaxed), 4096);
        assert_eq!(cached_tokens(b"\"cached_tokens\": null"), None);
    }

    #[test]
    fn the_cap_is_hard() {
        let node = Registry::new().add("h:1", NodeSpec { max_concurrency: Some(2), ..NodeSpec::default() }).unwrap();
        let a = InFlightPermit::try_acquire(&node, None).unwrap();
        let _b = InFlightPermit::try_acquire(&node, None).unwrap();
        assert!(InFlightPermit::try_acquire(&node, None).is_none());
        drop(a);
        assert!(InFlightPermit::try_acquire(&node, None).is_some());
    }

    #[test]
    fn the_cap_holds_across_a_worker_group() {
        use crate::node::shared::SharedTable;
        use std::sync::atomic::{AtomicU64, Ordering};

        let path = std::env::temp_dir().join(format!("pdproxy-permit-test-{}", std::process::id()));
        let table = Arc::new(SharedTable::create(&path).unwrap());
        let spec = NodeSpec { max_concurrency: Some(3), ..NodeSpec::default() };
        // Two workers' registries on one table, four threads each, racing for three places.
        let workers = [table.join(101).unwrap(), table.join(102).unwrap()];
        let nodes: Vec<_> = workers
            .iter()
            .map(|&w| Registry::in_group(Arc::clone(&table), w).add("h:1", spec.clone()).unwrap())
            .collect();
        let (holding, peak) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        std::thread::scope(|scope| {
            for t in 0..8 {
                let node = Arc::clone(&nodes[t % 2]);
                let (holding, peak) = (Arc::clone(&holding), Arc::clone(&peak));
                scope.spawn(move || {
                    for _ in 0..2000 {
                        if let Some(permit) = InFlightPermit::try_acquire(&node, None) {
                            let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                            peak.fetch_max(now, Ordering::SeqCst);
                            holding.fetch_sub(1, Ordering::SeqCst);
                            drop(permit);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::SeqCst) <= 3);
        assert_eq!(nodes[0].counters().in_flight(), 0);
        let worker_one = InFlightPermit::try_acquire(&nodes[1], None).unwrap();
        std::mem::forget(worker_one); // worker two dies holding it
        assert_eq!(nodes[0].counters().in_flight(), 1);
        assert_eq!(table.reclaim(workers[1], 102), Some(1));
        assert_eq!(nodes[0].counters().in_flight(), 0, "its permit was handed back");
        std::fs::remove_file(path).unwrap();
    }
}

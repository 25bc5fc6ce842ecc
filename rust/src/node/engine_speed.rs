//! How fast a node's engine works, learnt from the requests pdproxy sends it: the time its
//! first token takes as a function of the prompt it has to prefill (a fixed part and a part per
//! KiB), how long a request then decodes, and how many requests its batch holds before new
//! ones wait. The `scored` policy prices each choice in seconds with these figures, so an
//! engine twice as slow, or one whose batch is full, costs what it really costs.
//!
//! Plain atomics, no pointers: the figures live in `NodeCounters`, which a worker group keeps
//! in shared memory. Updates are read-modify-write without a lock: a lost update under a race
//! only skews an estimate by one sample.

use std::sync::atomic::{AtomicU64, Ordering};

/// Weight a sample keeps for each later one: the fit follows about the last 50 first tokens.
const DECAY: f64 = 0.98;
/// Samples (in weight) before the fit is trusted.
const MIN_WEIGHT: f64 = 4.0;
/// Spread of the samples' sizes (a variance, in KiB squared) below which the fit cannot tell the part per
/// KiB from the fixed part: the rate is then the samples' mean time over their mean size.
const MIN_SIZE_VARIANCE: f64 = 0.25;
/// The part per KiB is kept at least this share of the mean time over the mean size, so that
/// a noisy fit never makes prefill free (and every cache hit worthless).
const MIN_RATE_SHARE: f64 = 0.1;
/// Weight of a new decode time in its moving mean.
const DECODE_ALPHA: f64 = 0.1;
/// A batch running this share of the most seen counts as full when requests wait beside it.
const FULL_SHARE: f64 = 0.9;
/// Weight of a new reading of a full batch's size in its moving mean.
const SLOTS_ALPHA: f64 = 0.2;
/// Weight of a new whole request in the moving means of its time.
const REQUEST_ALPHA: f64 = 0.1;
/// Prefill (KiB) below which a whole request's time says nothing of the prefill's speed.
const BOUND_MIN_KIB: f64 = 1.0;

/// The learnt figures of one engine (`None`: not learnt yet).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Speed {
    /// Milliseconds of prefill per KiB of prompt not in the engine's cache (the prompts of the
    /// requests ahead of it included).
    pub(crate) prefill_ms_per_kib: Option<f64>,
    /// Milliseconds to a first token besides the prefill (a step of the batch, the network).
    pub(crate) first_token_ms: Option<f64>,
    /// Milliseconds from a request's first token to its end (its decoding).
    pub(crate) decode_ms: Option<f64>,
    /// How far a decoding's time is from that mean, on the mean (ms): near 0 where answers
    /// are alike in length, near `decode_ms` where they vary as chats' do.
    pub(crate) decode_spread_ms: Option<f64>,
    /// Requests the engine runs at once when others wait (its batch, or what its KV cache holds).
    pub(crate) slots: Option<f64>,
    /// A whole request's time per request the node had in flight when it was sent: with `n` in
    /// flight, a request sent now takes about `n + 1` times this (the engine shares its work).
    pub(crate) ms_per_in_flight: Option<f64>,
    /// Whole requests' time per KiB they prefilled, from answers that tell no first token (not
    /// streamed): prefill there is no slower than this, whatever else the time held.
    pub(crate) prefill_bound_ms_per_kib: Option<f64>,
    /// Samples behind the prefill fit (weighted: recent ones count more).
    pub(crate) samples: f64,
}

/// The exponentially weighted sums of a node's first-token samples (x: KiB prefilled before
/// the token, y: ms until it came). Sums add up: a fleet's are its nodes' added together.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Samples {
    pub(crate) weight: f64,
    pub(crate) x: f64,
    pub(crate) y: f64,
    pub(crate) xx: f64,
    pub(crate) xy: f64,
}

impl std::ops::AddAssign for Samples {
    fn add_assign(&mut self, other: Self) {
        self.weight += other.weight;
        self.x += other.x;
        self.y += other.y;
        self.xx += other.xx;
        self.xy += other.xy;
    }
}

/// A straight line through first-token samples: milliseconds per KiB, and the fixed part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Fit {
    pub(crate) ms_per_kib: f64,
    pub(crate) fixed_ms: f64,
}

impl Fit {
    /// The time the fit gives a first token after `kib` of prefill.
    pub(crate) fn ms(&self, kib: f64) -> f64 {
        self.fixed_ms + self.ms_per_kib * kib
    }
}

impl Samples {
    /// Least squares, once there are enough samples. With sizes too alike to tell the part
    /// per KiB from the fixed part, the mean time over the mean size; never below a tenth of
    /// that (a noisy fit must not make prefill free, and every cache hit worthless).
    pub(crate) fn fit(&self) -> Option<Fit> {
        let w = self.weight;
        if w < MIN_WEIGHT {
            return None;
        }
        let (mean_x, mean_y) = (self.x / w, self.y / w);
        if mean_x <= 0.0 {
            return None;
        }
        let variance = self.xx / w - mean_x * mean_x;
        let covariance = self.xy / w - mean_x * mean_y;
        let naive = mean_y / mean_x;
        let rate =
            if variance >= MIN_SIZE_VARIANCE { (covariance / variance).max(naive * MIN_RATE_SHARE) } else { naive };
        Some(Fit { ms_per_kib: rate, fixed_ms: (mean_y - rate * mean_x).max(0.0) })
    }
}

/// A node's learnt speed, in shared-memory-safe atomics (`f64` bits; 0 is "none yet").
#[derive(Debug, Default)]
pub(crate) struct EngineSpeed {
    /// Exponentially weighted sums of the first-token samples (x: KiB, y: ms): weight, x, y,
    /// x², xy.
    weight: AtomicU64,
    sum_x: AtomicU64,
    sum_y: AtomicU64,
    sum_xx: AtomicU64,
    sum_xy: AtomicU64,
    decode_ms: AtomicU64,
    decode_spread_ms: AtomicU64,
    slots: AtomicU64,
    /// The most requests seen running at once (a count, not f64 bits): in a report, or
    /// pdproxy's own requests decoding there.
    most_running: AtomicU64,
    ms_per_in_flight: AtomicU64,
    prefill_bound: AtomicU64,
}

fn load(value: &AtomicU64) -> f64 {
    f64::from_bits(value.load(Ordering::Relaxed))
}

fn store(value: &AtomicU64, x: f64) {
    value.store(x.to_bits(), Ordering::Relaxed);
}

fn moving_mean(value: &AtomicU64, sample: f64, alpha: f64) {
    let old = load(value);
    store(value, if old > 0.0 { old + alpha * (sample - old) } else { sample });
}

impl EngineSpeed {
    /// A request's first token came `ms` after it was sent, with `kib` of prompt to prefill
    /// before it (its own uncached part, and what the requests sent there before it still had).
    pub(crate) fn first_token(&self, kib: f64, ms: f64) {
        if !(kib.is_finite() && ms.is_finite() && kib >= 0.0 && ms >= 0.0) {
            return;
        }
        for (sum, sample) in [
            (&self.weight, 1.0),
            (&self.sum_x, kib),
            (&self.sum_y, ms),
            (&self.sum_xx, kib * kib),
            (&self.sum_xy, kib * ms),
        ] {
            store(sum, load(sum) * DECAY + sample);
        }
    }

    /// A request decoded for `ms` after its first token.
    pub(crate) fn decoded(&self, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            let mean = load(&self.decode_ms);
            if mean > 0.0 {
                // At least a microsecond: 0 is "not learnt yet", and alike answers are learnt.
                moving_mean(&self.decode_spread_ms, (ms - mean).abs().max(1e-3), DECODE_ALPHA);
            }
            moving_mean(&self.decode_ms, ms, DECODE_ALPHA);
        }
    }

    /// A whole request took `ms`, sent when the node had `in_flight` requests (itself included);
    /// `untimed_kib`: what it prefilled, when its answer told no first token.
    pub(crate) fn served(&self, ms: f64, in_flight: u64, untimed_kib: Option<f64>) {
        if !(ms.is_finite() && ms >= 0.0) || in_flight == 0 {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        moving_mean(&self.ms_per_in_flight, ms / in_flight as f64, REQUEST_ALPHA);
        if let Some(kib) = untimed_kib.filter(|&k| k >= BOUND_MIN_KIB) {
            moving_mean(&self.prefill_bound, ms / kib, REQUEST_ALPHA);
        }
    }

    /// The engine reported `running` requests in its batch and `waiting` more in its queue.
    /// A queue beside a batch as large as any seen says the batch was full. A queue beside a
    /// smaller one says nothing of the batch's size: the KV cache was full first (long
    /// prompts), or the step's token budget (prefills). A batch seen running more than the
    /// slots learnt holds more: they are forgotten until a full batch shows them again.
    pub(crate) fn reported(&self, running: u64, waiting: u64) {
        let most = self.most_running.fetch_max(running, Ordering::Relaxed).max(running);
        #[allow(clippy::cast_precision_loss)]
        let (running_f, most_f) = (running as f64, most as f64);
        if waiting > 0 && running > 0 && running_f >= FULL_SHARE * most_f {
            moving_mean(&self.slots, running_f, SLOTS_ALPHA);
        } else if FULL_SHARE * running_f > load(&self.slots) {
            store(&self.slots, 0.0);
        }
    }

    /// Requests the engine runs at once while others wait, once a report showed it full.
    pub(crate) fn slots(&self) -> Option<f64> {
        Some(load(&self.slots)).filter(|&s| s > 0.0)
    }

    /// `running` of pdproxy's requests were decoding there at once: its batch holds at least
    /// that many.
    pub(crate) fn seen_running(&self, running: u64) {
        // Once per request: a load, and a write only when the count is new (rarely, once warm).
        if running > self.most_running.load(Ordering::Relaxed) {
            self.most_running.fetch_max(running, Ordering::Relaxed);
        }
    }

    /// Requests the engine surely runs at once: its batch's size once learnt, else the most
    /// seen running (at least one). Before a report shows the batch full, a request sent
    /// beyond that may wait for a place, and its first token tells nothing of the prefill.
    pub(crate) fn places(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        self.slots().unwrap_or(self.most_running.load(Ordering::Relaxed).max(1) as f64)
    }

    /// The first-token samples' sums.
    pub(crate) fn samples(&self) -> Samples {
        Samples {
            weight: load(&self.weight),
            x: load(&self.sum_x),
            y: load(&self.sum_y),
            xx: load(&self.sum_xx),
            xy: load(&self.sum_xy),
        }
    }

    /// The node's figures, its first-token fit from its own samples alone.
    pub(crate) fn speed(&self) -> Speed {
        let positive = |x: f64| (x > 0.0).then_some(x);
        let samples = self.samples();
        let fit = samples.fit();
        Speed {
            prefill_ms_per_kib: fit.map(|f| f.ms_per_kib),
            first_token_ms: fit.map(|f| f.fixed_ms),
            decode_ms: positive(load(&self.decode_ms)),
            decode_spread_ms: positive(load(&self.decode_spread_ms)),
            slots: positive(load(&self.slots)),
            ms_per_in_flight: positive(load(&self.ms_per_in_flight)),
            prefill_bound_ms_per_kib: positive(load(&self.prefill_bound)),
            samples: samples.weight,
        }
    }

    /// Back to new (a recycled shared slot, or a restarted engine).
    pub(crate) fn reset(&self) {
        for value in [
            &self.weight,
            &self.sum_x,
            &self.sum_y,
            &self.sum_xx,
            &self.sum_xy,
            &self.decode_ms,
            &self.decode_spread_ms,
            &self.slots,
            &self.most_running,
            &self.ms_per_in_flight,
            &self.prefill_bound,
        ] {
            value.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-6 * b.max(1.0))
    }

    #[test]
    fn nothing_is_known_before_enough_samples() {
        let speed = EngineSpeed::default();
        assert_eq!(speed.speed(), Speed::default());
        speed.first_token(4.0, 200.0);
        assert_eq!(speed.speed().prefill_ms_per_kib, None);
    }

    #[test]
    fn the_fit_separates_the_part_per_kib_from_the_fixed_part() {
        let speed = EngineSpeed::default();
        // 50 ms per KiB and 12 ms besides, prompts of 1 to 8 KiB.
        for i in 0..40 {
            let kib = f64::from(i % 8 + 1);
            speed.first_token(kib, 12.0 + 50.0 * kib);
        }
        let s = speed.speed();
        assert!(close(s.prefill_ms_per_kib, 50.0), "{s:?}");
        assert!(close(s.first_token_ms, 12.0), "{s:?}");
    }

    #[test]
    fn it_follows_an_engine_that_slows_down() {
        let speed = EngineSpeed::default();
        for i in 0..100 {
            let kib = f64::from(i % 8 + 1);
            speed.first_token(kib, 10.0 + 50.0 * kib);
        }
        for i in 0..200 {
            let kib = f64::from(i % 8 + 1);
            speed.first_token(kib, 10.0 + 100.0 * kib);
        }
        let rate = speed.speed().prefill_ms_per_kib.unwrap();
        assert!((rate - 100.0).abs() < 2.0, "{rate}");
    }

    #[test]
    fn prompts_of_one_size_give_the_mean_rate_and_noise_never_makes_prefill_free() {
        let speed = EngineSpeed::default();
        for _ in 0..10 {
            speed.first_token(2.0, 100.0);
        }
        assert!(close(speed.speed().prefill_ms_per_kib, 50.0));
        assert!(close(speed.speed().first_token_ms, 0.0));
        // Larger prompts that happened to come back sooner: a negative slope, floored.
        let noisy = EngineSpeed::default();
        for i in 0..20 {
            let kib = f64::from(i % 4 + 1);
            noisy.first_token(kib, 200.0 - 10.0 * kib);
        }
        let s = noisy.speed();
        assert!(s.prefill_ms_per_kib.unwrap() > 0.0, "{s:?}");
    }

    #[test]
    fn decode_time_and_batch_size_are_moving_means() {
        let speed = EngineSpeed::default();
        speed.decoded(600.0);
        speed.reported(16, 3);
        assert!(close(speed.speed().decode_ms, 600.0));
        assert!(close(speed.speed().slots, 16.0));
        assert_eq!(speed.speed().decode_spread_ms, None, "one decoding says nothing of their spread");
        speed.decoded(700.0);
        assert!(close(speed.speed().decode_ms, 610.0));
        assert!(close(speed.speed().decode_spread_ms, 100.0));
        speed.decoded(610.0);
        assert!(speed.speed().decode_spread_ms.is_some_and(|s| s > 0.0), "alike, and learnt so");
        speed.reported(0, 2);
        assert!(close(speed.speed().slots, 16.0), "a reading of nothing running says nothing");
        speed.reset();
        assert_eq!(speed.speed(), Speed::default());
    }

    #[test]
    fn the_places_sure_are_the_batch_learnt_else_the_most_seen_running() {
        let speed = EngineSpeed::default();
        assert!((speed.places() - 1.0).abs() < 1e-9, "one, before anything is seen");
        speed.seen_running(5);
        speed.seen_running(3);
        assert!((speed.places() - 5.0).abs() < 1e-9);
        speed.reported(16, 2);
        assert!((speed.places() - 16.0).abs() < 1e-9, "a full batch reported");
        speed.reset();
        assert!((speed.places() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_queue_beside_a_small_batch_is_not_a_full_batch() {
        let speed = EngineSpeed::default();
        speed.reported(12, 0);
        // Requests that came since the engine's last step wait beside a batch with room.
        speed.reported(3, 1);
        assert_eq!(speed.speed().slots, None);
        speed.reported(16, 2);
        assert!(close(speed.speed().slots, 16.0));
        speed.reported(5, 1);
        assert!(close(speed.speed().slots, 16.0));
        // A first reading with a queue is taken as full, until a larger batch shows it was not.
        let early = EngineSpeed::default();
        early.reported(2, 1);
        assert!(close(early.speed().slots, 2.0));
        early.reported(9, 0);
        assert_eq!(early.speed().slots, None);
    }

    #[test]
    fn whole_requests_teach_the_time_per_request_in_flight_and_bound_the_prefill() {
        let speed = EngineSpeed::default();
        speed.served(400.0, 4, None);
        assert!(close(speed.speed().ms_per_in_flight, 100.0));
        assert_eq!(speed.speed().prefill_bound_ms_per_kib, None);
        speed.served(80.0, 1, Some(8.0));
        assert!(close(speed.speed().prefill_bound_ms_per_kib, 10.0));
        speed.served(80.0, 1, Some(0.5));
        assert!(close(speed.speed().prefill_bound_ms_per_kib, 10.0), "too little prefill to tell");
        speed.served(80.0, 0, Some(8.0));
        assert!(close(speed.speed().prefill_bound_ms_per_kib, 10.0), "an unaccounted request is ignored");
    }
}

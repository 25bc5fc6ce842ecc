//! `scored`: the node where the request's first token comes soonest, counting what the
//! request costs the requests there that still wait for theirs. Every term is a time, from what
//! pdproxy has learnt of the engines' speed (`engine_speed`) and what it knows of each engine's
//! queue:
//!
//! ```text
//! cost = queue  * ((1 + prefix) * the wait for a place in the engine's batch
//!                  + the prefill owed to the requests sent there before, at that engine's rate)
//!      + hidden * (how much later than so priced the node's first tokens came lately)
//!      + own    * (1 + prefix * (1 + the requests sent there still waiting for their first token))
//! ```
//!
//! where `own` is the request's own prefill there: its prompt not in that node's cache. It
//! delays its own first token, and, as each step of a batch that prefills a chunk of it holds
//! every request of the batch, the first tokens of the requests queued or prefilling there and
//! of the next one to come. The count of those is a measure of how busy the node is with first
//! tokens: with it, a miss goes where it delays nobody (a cold engine, restarted or flushed,
//! takes misses back at once), a prompt stays on the node that holds it until the wait there
//! outgrows a prefill elsewhere, and a popular prompt spreads as its own traffic fills the
//! queues of its nodes. (Counting only the requests waiting for a place in the batch, which a
//! prefill delays for sure, did worse on `bench/fleet.py`'s workloads.) `prefix` (2) and
//! `queue` (1) are the main weights; 2 was the best of 0.5, 1, 2 and 4 on the prefix-heavy
//! workloads.
//!
//! A wait for a place is counted the same way. The request takes its place when one frees and
//! holds it through its decoding, so each request that comes after it while the queue lasts
//! waits one place longer; as many places free before its own as it waits for, so what it adds
//! behind it is its own wait again, weighed by `prefix` as a prefill's delay to others is.
//! Counted once, a popular prompt's nodes kept a queue rather than pay a prefill elsewhere: on
//! `bench/fleet.py`'s `evict_restart` at 80% load the prompt stayed on two engines in some runs,
//! whose first tokens came up to 290 ms (a second's median) after their price, and the same
//! traces gave a TTFT p99 of 289 ms in one run and 816 in another; counted with what it adds,
//! 285-386 ms on seeds 1-4, with the other workloads better or within their run-to-run spread
//! (`multi_turn` 128-226 ms against 131-175; bench/results/2026-12-07-1618-fleet.md).
//!
//! - The prompt a node holds comes from the engines' own KV events where they are followed
//!   (`kv_index`), and from routes so recent their events cannot have come yet; elsewhere from
//!   the prefix table (what pdproxy routed there and the engine has not evicted since, see
//!   `prefix_table`).
//! - The prefill owed there is the time left on the node's prefill clock: each request sent
//!   there adds the first-token time priced for it (fixed part and own prefill) after what the
//!   node owed already, and the first byte of the last one unanswered sets the clock to now. A
//!   prefill half done counts half: of nodes all busy, the next request goes to the one about
//!   to be free (on `bench/fleet.py`'s `no_reuse` at 80% load, counting the pending prompts
//!   whole gave a TTFT p99 of 249 and 225 ms on two seeds against round robin's 164 and 157;
//!   with the clock, 176 and 165 against 164 and 156). With `replica_share`, the other replicas'
//!   clocks (as they last said, time left) count after this one's.
//! - Where the oldest request sent there still waiting for its first token is past its due time
//!   on that clock, the node runs late by as much, and so does all it owes (`running_late`): the
//!   clock runs out while requests still wait, and a request priced by it alone meets all of it.
//!   On `bench/fleet.py`'s `flush_restart`, the flushed engine's prompts were priced as hits
//!   (the table learns of a flush it did not send only from answers that end a second or more
//!   later) while it prefilled each whole: requests kept going there at a clock's 0-45 ms
//!   ahead, with their first tokens 1.0-1.6 s later; priced late, 190-1,100 ms ahead. They
//!   still went there (a prompt held nowhere else costs three times its prefill elsewhere),
//!   and that workload's TTFT p99 was the same over six seeds; on `system_prompts` and
//!   `unequal_engines`, where engines fall behind their prices under load, it was lower (seeds
//!   1-2: 159 and 66 ms against 624 and 124; 244 and 482 against 513 and 637), the other
//!   workloads within their run-to-run spread (bench/results/2026-12-08-0200-fleet-running-late.md).
//!   Due by their whole price instead (a wait for a place in the batch included, which the
//!   clock leaves out) was no better: `bursts` 883 and 575 ms against 760 and 525, TTFT p90
//!   433 and 310 against 387 and 229.
//! - The lateness (`hidden_load`) is the work there pdproxy did not send, or this replica did
//!   not: with four replicas in front of the same engines, each one's clock holds a quarter of
//!   the prefill owed. Off by default (`hidden` 0): on `bench/fleet.py` at 80% load (one
//!   replica, two seeds) it was within the run-to-run spread of 0 on most workloads and worse
//!   on `unequal_engines` and `flush_restart` (TTFT p99 1,033 and 1,116 ms against 812 and 761).
//! - The requests waiting for a first token are those pdproxy sent (`behind`), this replica and,
//!   with `replica_share`, the others that say so; with `reported`
//!   (`score_reported_weight`, 0 by default) also the queue the engine last reported, where it is
//!   longer and the reading showed requests pdproxy cannot have sent (`EngineLoad::shows_others`):
//!   replicas in front of the same engines each count only their own, and one replica's own count
//!   is fresher than a reading. On `bench/fleet.py` at 80% load, four replicas following the KV
//!   events, two seeds (bench/results/2026-12-06-0047-fleet-replicas-clean.md): TTFT p99 on
//!   `system_prompts` 980 ms against 3,281 without it, on `unequal_engines` 661 against 1,160; one
//!   replica 172 and 372. Not the default: one replica with it had a worse TTFT p99 on six of the
//!   nine workloads (bench/results/2026-12-06-0318-fleet-nine-workloads-peers.md; `flush_restart`
//!   960 ms against 585, `evict_restart` 510 against 319).
//! - The future wait (`future`, `score_future_weight`, 3 by default) is what the node's recent
//!   traffic, kept up, makes a request meet (`recent_work`: its prefill's busy share over the
//!   last seconds, from what pdproxy sent there or, where more, what the engine's KV events show
//!   it stored), for the share of the prompt new to the fleet: a new session's next turns
//!   follow its cache, so its first turn commits them to that node's queue, which the queue of
//!   this instant (engines between their sessions' turns look idle) does not tell. New means
//!   that no candidate holds it and no prompt sent lately began with it (`seen_prompts`): a
//!   session's turn whose cache an engine evicted, flushed or lost in a restart commits nothing
//!   its first turn did not, and the prefix table alone cannot tell it from a new session. It
//!   counts only where half the prompt or more is new (`FUTURE_MIN_FRESH`), and then as many
//!   followers as recent requests have had (`followed_share`: none where prompts share
//!   nothing). On `bench/fleet.py` at 80% load, seeds 1-2: without the seen prompts it halved
//!   `agent_sessions`' TTFT p99 but was worse where caches lose prompts (`evict_restart` 791 ms
//!   against 502 with weight 0, `flush_restart` 1,039 against 731:
//!   bench/results/2026-12-07-0024-fleet-nine-future-term.md); with them, 646 against 1,346,
//!   296 against 567 and 657 against 754 (bench/results/2026-12-07-0252-fleet-future-seen.md).
//! - Engine speeds are learnt only from requests that waited for no other's prefill, nor for a
//!   place in the batch (see `InFlightPermit::set_prediction`): fitted on every first token, the
//!   fixed part took in the queue waits of a cold fleet's first seconds (277-604 ms) and the
//!   clock then counted them twice, so that on `system_prompts` the backlog cleared about 2 s
//!   after the oracle's. Before a report shows an engine's batch full, only the requests it
//!   was seen running at once are sure of a place.
//! - The wait for a place in the batch: the requests the engine has (its last report adjusted
//!   by pdproxy's traffic since, and never fewer than pdproxy's own in flight there) beyond the
//!   number it runs at once, each freeing a place as it finishes decoding. Where answers are
//!   alike in length, requests that began decoding together end together, and the place comes
//!   when the oldest of those decoding ends (`decode_starts`); where they vary, ends spread
//!   out and each place frees after a share of a decoding; the two are weighed by how much
//!   decodings vary (`decode_spread_ms`). On `bench/fleet.py`'s `evict_restart` (seed 2) the
//!   popular prompt stayed on two engines running 14-20 requests on 16 places, a place priced
//!   0-94 ms (a sixteenth of a decoding, or nothing where a report read up to a second before
//!   showed 14 running) while the first tokens sent there came 360-440 ms later: the batch had
//!   begun together (bench/results/2026-12-07-2300-fleet-batch-ends.md). Before that number is
//!   learnt, a reported queue beside a batch is a wait for a place in it: vLLM's and SGLang's
//!   gauges count a request as waiting only once a step left it out (the batch or the KV cache
//!   full).
//!   (The mock engine once counted the requests come since its last step too: one beside six
//!   running, at `no_reuse`'s 0.8 s decode, priced an engine 270 ms too dear until the next
//!   reading, and one first token in twenty came 100 ms or more before its price.)
//! - First tokens are fitted on the samples of all the candidates together, each node scaled by
//!   how its own samples compare (`speeds`); figures not learnt yet are the candidates' median,
//!   or, before any, `PRIOR_MS_PER_KIB` and `PRIOR_DECODE_MS`.
//! - Every first token priced is checked against its price, weighed or not: per node, a
//!   histogram of how much later than priced they came (`first_token_lateness`, in
//!   `/nodes/status` and `/metrics`), where a price wrong in one direction shows.
//!
//! Nodes within `TIE_SHARE` of the lowest cost count as equally ready: the one with the
//! fewest requests in flight, then the one sent the fewest, then one at random, so that they
//! share the decoding evenly and take turns. With other replicas routing to the same nodes, a
//! long prefill goes at random to any node within a quarter of its own prefill of the best
//! (`spread_among_peers`): replicas deciding on the same figures otherwise send new
//! conversations to the same engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use super::kv_index::KvIndex;
use super::prefix_table::{PrefixTable, PrefixTableConfig};
use super::seen_prompts::SeenPrompts;
use super::{available_indices, Policy, SelectCtx};
use crate::clock::{now_ms, now_us};
use crate::node::engine_report::EngineLoad;
use crate::node::engine_speed::{Fit, Samples, Speed};
use crate::node::load_signal;
use crate::node::recent_work::queue_wait_ms;
use crate::node::Node;
use crate::select::Prediction;

/// Costs within this share of the lowest (or `TIE_MS`, whichever is more) count as equal.
const TIE_SHARE: f64 = 0.02;
const TIE_MS: f64 = 1.0;
/// How long after an engine computes a block its KV event may take to reach the index (the
/// engine's step, ZMQ, the subscriber's turn): a route that recent still counts as held.
const EVENTS_LAG_MS: u64 = 1000;
/// Prefill time per KiB of prompt assumed before any engine's is learnt: about 10,000 tokens a
/// second at 4 bytes a token. Only the first requests see it; it sets no ratio that matters,
/// since the prefill owed and the request's own are both priced with it.
const PRIOR_MS_PER_KIB: f64 = 25.0;
/// The least share of a prompt no candidate holds for the future term to count it (see
/// `committed_share`).
const FUTURE_MIN_FRESH: f64 = 0.5;
/// The weight of each request in the share of recent requests that followed a prompt already
/// held (`followed_share`): about the last hundred count.
const FOLLOWED_ALPHA: f64 = 1.0 / 64.0;

/// How long a request holds its place in an engine's batch, before any answer has shown it
/// (only the first seconds of a fleet see it): a queue must count from the start, or the first
/// requests all go where their prompts are, whatever waits there.
const PRIOR_DECODE_MS: f64 = 1000.0;

/// The weights of the terms (`scored:prefix=2,queue=0.5` overrides the settings' for one role:
/// `pdproxy/config/policies.py`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreWeights {
    /// Times the request's own prefill counts for each request whose first token it delays.
    pub(crate) prefix: f64,
    /// Times the waits ahead of it count.
    pub(crate) queue: f64,
    /// Times the node's recent lateness counts (work there pdproxy did not price).
    pub(crate) hidden: f64,
    /// Times the queue an engine reports counts among the requests behind, where it is longer
    /// than pdproxy's own count.
    pub(crate) reported: f64,
    /// Times the wait that the node's recent traffic, kept up, makes a request meet counts
    /// (`recent_work`): what the requests that follow this one there will meet.
    pub(crate) future: f64,
}

/// The figures a cost is made of for one candidate, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    /// Waiting for a place in the engine's batch.
    pub(crate) slot_wait: f64,
    /// Prefill still owed to the requests sent there before (the node's prefill clock).
    pub(crate) ahead: f64,
    /// The engine's fixed time to a first token.
    pub(crate) first_token: f64,
    /// The request's own prefill there.
    pub(crate) own: f64,
    /// Requests sent there still waiting for their first token (queued, or prefilling).
    pub(crate) behind: f64,
    /// How much later than priced the node's first tokens have come lately (`hidden_load`):
    /// work queued there that others sent.
    pub(crate) hidden: f64,
    /// The wait for the node's prefill that its recent traffic makes a request meet.
    pub(crate) future: f64,
}

impl Estimate {
    /// When the request's first token would come (ms after now), by what pdproxy sent.
    pub(crate) fn first_token_in_ms(&self) -> f64 {
        self.slot_wait + self.ahead + self.first_token + self.own
    }

    /// The fixed first-token part is left out: the fit puts there what its samples have in
    /// common whatever the node (a step of the batch, and waits it does not see), and a node's
    /// own speed shows in its other terms.
    fn cost(&self, w: ScoreWeights) -> f64 {
        w.queue * ((1.0 + w.prefix) * self.slot_wait + self.ahead)
            + w.hidden * self.hidden
            + w.queue * w.future * self.future
            + self.own * (1.0 + w.prefix * (1.0 + self.behind))
    }
}

#[derive(Debug)]
pub(crate) struct Scored {
    weights: ScoreWeights,
    table: PrefixTable,
    /// Older engine reports are ignored.
    max_age_ms: u64,
    /// The median KV capacity (tokens) the candidates' engines report, for the nodes whose
    /// engines do not (a fleet is mostly alike); 0 when none does.
    typical_capacity: AtomicU64,
    /// The engines' own account of their caches (`kv_index`), where their events are followed:
    /// for a node it is live for, what the node holds comes from it instead of the table.
    kv_index: ArcSwapOption<KvIndex>,
    /// f64 bits: the share of recent requests whose prompt was mostly held somewhere already
    /// (`committed_share` 0), faded by `FOLLOWED_ALPHA`; 1 until requests tell.
    followed: AtomicU64,
    /// The prompts sent lately, held anywhere or not: the future term counts only what is new
    /// to them (none where the term is off: 512 KiB for nothing).
    seen: Option<SeenPrompts>,
}

/// The median of the values given (`None`: none).
fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mid = values.len() / 2;
    Some(*values.select_nth_unstable_by(mid, f64::total_cmp).1)
}

/// Each candidate's speed as the policy prices it. First tokens: one fit of the samples of all
/// the candidates together (a fleet is mostly alike, and few samples of one node, taken in
/// whatever state its queue was, fit poorly), scaled for each node by how its own samples
/// compare with the fit (`speed_factor`): an engine twice as slow takes twice the time. Other
/// gaps filled with the candidates' medians (computed only for a figure some candidate lacks).
fn speeds(candidates: &[Arc<Node>]) -> Vec<Speed> {
    let samples: Vec<Samples> = candidates.iter().map(|n| n.counters().speed.samples()).collect();
    let mut pooled = Samples::default();
    for s in &samples {
        pooled += *s;
    }
    let fleet = pooled.fit();
    let factors: Vec<f64> =
        fleet.map_or_else(Vec::new, |fit| samples.iter().map(|s| speed_factor(s, &pooled, fit)).collect());
    // The typical node's factor: the others' are taken relative to it.
    let typical = median(factors.clone()).unwrap_or(1.0);
    let mut learnt: Vec<Speed> = candidates.iter().map(|n| n.counters().speed.speed()).collect();
    for (i, speed) in learnt.iter_mut().enumerate() {
        match fleet {
            Some(fit) => {
                let factor = typical * alike(factors[i] / typical);
                speed.prefill_ms_per_kib = Some(fit.ms_per_kib * factor);
                speed.first_token_ms = Some(fit.fixed_ms * factor);
            }
            // Before any stream taught a prefill rate, whole answers bound it: no slower than they took.
            None => {
                speed.prefill_ms_per_kib = speed.prefill_bound_ms_per_kib.map(|bound| bound.min(PRIOR_MS_PER_KIB));
            }
        }
    }
    let fields: [fn(&mut Speed) -> &mut Option<f64>; 6] = [
        |s| &mut s.prefill_ms_per_kib,
        |s| &mut s.first_token_ms,
        |s| &mut s.decode_ms,
        |s| &mut s.decode_spread_ms,
        |s| &mut s.slots,
        |s| &mut s.ms_per_in_flight,
    ];
    for field in fields {
        if learnt.iter_mut().all(|s| field(s).is_some()) {
            continue;
        }
        let typical = median(learnt.iter_mut().filter_map(|s| *field(s)).collect());
        for speed in &mut learnt {
            let value = field(speed);
            *value = value.or(typical);
        }
    }
    learnt
}

/// Samples a node's factor starts from, as if that many of its first tokens had come exactly
/// as the fleet's fit says: a node with few samples is taken to be like the others.
const FACTOR_PRIOR_SAMPLES: f64 = 8.0;
/// Factors this close to the typical node's (either way) are taken as equal to it: nodes'
/// samples scatter about that much around the fleet's fit with equal engines (queues they met,
/// prompts they got), and pricing noise as speed would send misses to whichever node it flattered.
const FACTOR_ALIKE: f64 = 1.5;
/// How far a node's factor may stray from the fleet's.
const FACTOR_RANGE: (f64, f64) = (0.25, 4.0);

/// How much slower than the fleet's fit a node's own first tokens came: the time they took
/// over the time the fit gives them, shrunk towards 1 while the node has few samples.
fn speed_factor(own: &Samples, pooled: &Samples, fit: Fit) -> f64 {
    let typical = fit.ms(pooled.x / pooled.weight.max(f64::MIN_POSITIVE));
    let predicted = fit.fixed_ms * own.weight + fit.ms_per_kib * own.x;
    let prior = FACTOR_PRIOR_SAMPLES * typical;
    let factor = (own.y + prior) / (predicted + prior);
    if factor.is_finite() {
        factor.clamp(FACTOR_RANGE.0, FACTOR_RANGE.1)
    } else {
        1.0
    }
}

/// A node's factor relative to the typical node's, with the scatter of equal engines taken as 1.
fn alike(relative: f64) -> f64 {
    if (1.0 / FACTOR_ALIKE..=FACTOR_ALIKE).contains(&relative) {
        1.0
    } else {
        relative
    }
}

/// With other replicas routing to the same nodes, a long prefill may go to any node priced within
/// this share of its own prefill of the best (`spread_among_peers`).
const PEERS_SPREAD: f64 = 0.25;

/// With other replicas routing to the candidates (`replica_share`), a long prefill (a prompt new
/// to the fleet: at least `CLAIM_PREFILL_US` of its own at the best node) goes at random to any
/// node priced within `PEERS_SPREAD` of its own prefill of the best (`None`: otherwise).
/// Replicas deciding a datagram's trip apart see the same figures, so that two new
/// conversations' first turns routed by two of them went to the same engine, one waiting for the
/// other's whole prefill: the tail of four replicas' first turns. A node priced a quarter of a
/// prefill worse costs that, once; two prefills on one engine cost a whole one. On
/// `bench/fleet.py`'s `multi_turn` at 80% load, four replicas against one, the requests of seeds
/// 1-6 pooled: TTFT p99 124 ms against one replica's 133 (first turns 110 against 104); without
/// it (seeds 1-4) 133 against 127 (first turns 131 against 99):
/// bench/results/2026-12-07-0615-fleet-replicas-spread.md.
fn spread_among_peers(
    candidates: &[Arc<Node>],
    costs: &[Option<f64>],
    estimates: &[Option<Estimate>],
    best: f64,
    tolerance: f64,
) -> Option<usize> {
    let peers = candidates.iter().any(|n| n.counters().peer_replicas.load(Ordering::Relaxed) > 0);
    if !peers {
        return None;
    }
    let own = costs.iter().zip(estimates).find_map(|(cost, e)| e.filter(|_| *cost == Some(best)).map(|e| e.own))?;
    #[allow(clippy::cast_precision_loss)]
    if own * 1000.0 < load_signal::CLAIM_PREFILL_US as f64 {
        return None;
    }
    let within = best + tolerance.max(PEERS_SPREAD * own);
    let band: Vec<usize> = (0..costs.len()).filter(|&i| costs[i].is_some_and(|c| c <= within)).collect();
    band.get(fastrand::usize(..band.len().max(1))).copied()
}

/// What the last pick on this thread computed for its request: the policy's `selected` follows
/// it at once (see `select`), and would otherwise hash the prompt and match it a second time.
struct LastPick {
    /// Which policy, prompt and model it was for (addresses and lengths).
    key: [usize; 5],
    hashes: Vec<u64>,
    /// Leading blocks each candidate holds, the time its prefill would take there and when its
    /// first token would come, by generation.
    matched: Vec<(u64, usize, f64, f64)>,
}

thread_local! {
    static LAST_PICK: std::cell::RefCell<Option<LastPick>> = const { std::cell::RefCell::new(None) };
}

fn pick_key(policy: &Scored, ctx: &SelectCtx<'_>) -> [usize; 5] {
    let prompt = ctx.prompt.unwrap_or_default();
    let model = ctx.model.unwrap_or_default();
    [std::ptr::from_ref(policy) as usize, prompt.as_ptr() as usize, prompt.len(), model.as_ptr() as usize, model.len()]
}

impl Scored {
    pub(crate) fn new(weights: ScoreWeights, table: PrefixTableConfig, max_age_ms: u64) -> Self {
        Self {
            weights,
            table: PrefixTable::new(table),
            max_age_ms,
            typical_capacity: AtomicU64::new(0),
            kv_index: ArcSwapOption::empty(),
            followed: AtomicU64::new(1.0f64.to_bits()),
            seen: (weights.future > 0.0).then(SeenPrompts::default),
        }
    }

    /// How many leading table blocks each candidate holds: from the KV index for the nodes it
    /// is live for, from the table for the others (and for prompts it cannot render).
    fn matched(&self, hashes: &[u64], candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<usize> {
        let index = self.kv_index.load();
        let (Some(index), Some(prompt)) = (index.as_ref(), ctx.prompt) else {
            return self.table.matched(hashes, candidates);
        };
        let urls: Vec<&str> = candidates.iter().map(|n| n.url()).collect();
        let found = index.matched_request(prompt, &urls).filter(|found| found.iter().any(Option::is_some));
        let Some(found) = found else {
            index.fell_back.fetch_add(candidates.len() as u64, Ordering::Relaxed);
            return self.table.matched(hashes, candidates);
        };
        // Routes the engines cannot have told of yet count as held: without them, the requests
        // that follow a popular prompt's first, before its prefill is done, would each find it
        // nowhere and prefill it again elsewhere.
        let (mut matched, pending) = self.table.matched_pending(hashes, candidates, Some(now_ms()));
        let mut used = 0;
        for ((held, found), pending) in matched.iter_mut().zip(found).zip(pending) {
            if let Some(found) = found {
                *held = (usize::try_from(found.bytes).unwrap_or(usize::MAX) / self.table.block_bytes()).max(pending);
                used += 1;
            }
        }
        index.used.fetch_add(used, Ordering::Relaxed);
        index.fell_back.fetch_add(candidates.len() as u64 - used, Ordering::Relaxed);
        matched
    }

    /// The median KV capacity the candidates report, kept for the nodes that do not (when
    /// every candidate reports, or none does, there is nothing to do).
    fn note_capacities(&self, candidates: &[Arc<Node>]) {
        let reports = |n: &Arc<Node>| n.engine_load(u64::MAX, now_ms()).and_then(|l| l.kv_capacity_tokens).is_some();
        if candidates.iter().all(reports) || !candidates.iter().any(reports) {
            return;
        }
        let mut reported: Vec<u64> = candidates
            .iter()
            .filter_map(|n| n.engine_load(u64::MAX, now_ms()).and_then(|l| l.kv_capacity_tokens))
            .collect();
        if !reported.is_empty() {
            let mid = reported.len() / 2;
            self.typical_capacity.store(*reported.select_nth_unstable(mid).1, Ordering::Relaxed);
        }
    }

    /// Bytes of the prompt a node holding `matched` leading blocks would still prefill.
    fn uncached(&self, ctx: &SelectCtx<'_>, matched: usize) -> usize {
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        prompt - (matched * self.table.block_bytes()).min(self.table.considered_bytes(ctx))
    }

    /// For each candidate, the KiB a millisecond its engine prefilled lately by its KV events
    /// (empty when they are not followed, or the term is off).
    fn prefilled_by_events(&self, candidates: &[Arc<Node>], now_ms: u64) -> Vec<Option<f64>> {
        let index = self.kv_index.load();
        match index.as_ref().filter(|_| self.weights.future > 0.0) {
            Some(index) => {
                let urls: Vec<&str> = candidates.iter().map(|n| n.url()).collect();
                index.prefilled_kib_per_ms(&urls, now_ms)
            }
            None => Vec::new(),
        }
    }

    /// The wait for the node's prefill that its recent traffic, kept up, makes a request meet:
    /// by the prefill pdproxy sent there, or, where more, by what its engine's KV events show
    /// it computed (`prefilled_kib_per_ms`): with several replicas in front of the same engines,
    /// each sends a share of the traffic, while the events count all of it.
    fn future_wait_ms(node: &Node, ms_per_kib: f64, prefilled_kib_per_ms: Option<f64>, now_ms: u64) -> f64 {
        let (own_busy, mean_ms) = node.counters().recent_work.busy_and_mean(now_ms);
        let busy = prefilled_kib_per_ms.map_or(own_busy, |kib| own_busy.max(kib * ms_per_kib));
        queue_wait_ms(busy, mean_ms)
    }

    /// The share of the prompt that commits the node it goes to: the share no candidate holds
    /// and no prompt sent lately began with, what the request starts that nothing has drawn
    /// anywhere yet (a new session, a new document), whose followers will come where it goes;
    /// 0 where that is less than `FUTURE_MIN_FRESH` of the prompt. A prompt mostly held
    /// somewhere commits nothing new: its followers go where it is held. Nor does one a cache
    /// lost (evicted, flushed, restarted), sent before: its session was priced when it began.
    fn committed_share(&self, ctx: &SelectCtx<'_>, hashes: &[u64], matched: &[usize]) -> f64 {
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        if prompt == 0 {
            return 1.0;
        }
        #[allow(clippy::cast_precision_loss)]
        let fresh = |blocks: usize| self.uncached(ctx, blocks) as f64 / prompt as f64;
        let held = matched.iter().copied().max().unwrap_or(0);
        // Pricing a node's recent traffic for a held prompt's small new tail only pulls requests
        // off their cache. (Checked before the seen prompts are looked through: most requests
        // on a warm fleet stop here.)
        if fresh(held) < FUTURE_MIN_FRESH {
            return 0.0;
        }
        let seen = self.seen.as_ref().map_or(0, |seen| seen.seen_blocks(hashes, held));
        let new = fresh(held.max(seen));
        if new < FUTURE_MIN_FRESH {
            0.0
        } else {
            new
        }
    }

    /// How many followers a fresh prompt commits, as a share: that of the recent requests that
    /// followed a prompt already held (a session's next turns, the users of a known system
    /// prompt). Where prompts share nothing it falls to 0, and a fresh prompt commits nothing:
    /// pricing the nodes' recent traffic then only moves misses off the node that is free now
    /// (on `bench/fleet.py`'s `no_reuse`, TTFT p99 165 ms against 157 without the term).
    fn followed_share(&self) -> f64 {
        f64::from_bits(self.followed.load(Ordering::Relaxed))
    }

    /// Counts one request in `followed_share`: `held`, its prompt was mostly held somewhere.
    /// A load and a store, not a compare-and-swap: a lost update among racing picks only
    /// drops one sample.
    fn note_followed(&self, held: bool) {
        let share = self.followed_share();
        let sample = if held { 1.0 } else { 0.0 };
        self.followed.store((share + FOLLOWED_ALPHA * (sample - share)).to_bits(), Ordering::Relaxed);
    }

    /// The share of the prompt whose followers the node it goes to will hold: the committed
    /// share, times how many followers fresh prompts have had lately. `learn`: count this
    /// request in that (once per request: its pick).
    fn committed(&self, ctx: &SelectCtx<'_>, hashes: &[u64], matched: &[usize], learn: bool) -> f64 {
        if self.weights.future <= 0.0 {
            return 0.0;
        }
        let share = self.committed_share(ctx, hashes, matched);
        if learn && ctx.prompt.is_some_and(|p| !p.is_empty()) {
            self.note_followed(share <= 0.0);
        }
        share * self.followed_share()
    }

    /// The wait for a place in the node's batch (ms): the requests it has beyond those it runs
    /// at once, each place freed as a running request ends its decoding. Where neither the
    /// batch's size nor a queue is known, a whole answer (not a stream) is taken to share the
    /// engine with those in flight: each of them adds what a request took per request in flight.
    fn slot_wait_ms(node: &Node, load: Option<EngineLoad>, speed: &Speed, stream: bool, now_ms: u64) -> f64 {
        let counters = node.counters();
        #[allow(clippy::cast_precision_loss)]
        let in_flight = counters.in_flight() as f64;
        let queue_known = speed.slots.is_some() || load.is_some_and(|l| l.waiting() > 0.0);
        if !stream && !queue_known {
            return speed.ms_per_in_flight.map_or(0.0, |ms| in_flight * ms);
        }
        let decode_ms = speed.decode_ms.unwrap_or(PRIOR_DECODE_MS);
        // The places to be freed before this request has one, and how many free up at once.
        let (frees, slots) = match speed.slots {
            // The engine has at least pdproxy's own requests, whatever a report adjusted by
            // the traffic since says.
            Some(slots) => {
                let requests = load.map_or(in_flight, |l| l.requests().max(in_flight));
                (requests + 1.0 - slots, slots)
            }
            None => match load.filter(|l| l.waiting() > 0.0 && l.running > 0) {
                #[allow(clippy::cast_precision_loss)]
                Some(l) => (l.waiting() + 1.0, l.running as f64),
                None => return 0.0,
            },
        };
        if frees <= 0.0 {
            return 0.0;
        }
        let shared = frees * decode_ms / slots;
        // Requests that began decoding together end together where answers are alike in
        // length: the place comes when the `frees`-th oldest of those decoding ends. Where
        // lengths vary, ends spread out and the share per place holds; weighed between the two
        // by how much decodings vary.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let k = frees.ceil() as usize;
        let (Some(started), Some(spread)) = (
            counters.decode_starts.kth_oldest(usize::try_from(counters.decoding()).unwrap_or(usize::MAX), k),
            speed.decode_spread_ms,
        ) else {
            return shared;
        };
        #[allow(clippy::cast_precision_loss)]
        let ends_in = (started as f64 + decode_ms - now_ms as f64).max(0.0);
        let varied = (spread / decode_ms).min(1.0);
        varied * shared + (1.0 - varied) * ends_in
    }

    /// The requests at the node still waiting for their first token: those pdproxy sent, or
    /// the queue its engine last reported (adjusted by pdproxy's traffic since) where that is
    /// longer and the reading showed requests pdproxy did not send: other replicas' requests,
    /// and traffic that bypasses pdproxy, wait there too. Where pdproxy sent all the engine
    /// had, its own count is the fresher of the two.
    fn behind(&self, node: &Node, load: Option<EngineLoad>) -> f64 {
        let counters = node.counters();
        // This replica's and the others' that say so (`replica_share`): they wait at the same engine.
        #[allow(clippy::cast_precision_loss)]
        let known =
            (counters.unanswered.load(Ordering::Relaxed) + counters.peer_unanswered.load(Ordering::Relaxed)) as f64;
        if self.weights.reported > 0.0 {
            load.filter(EngineLoad::shows_others).map_or(known, |l| known.max(self.weights.reported * l.waiting()))
        } else {
            known
        }
    }

    /// Each available candidate's estimate for the request (`None`: not available).
    #[cfg(test)]
    pub(crate) fn estimates(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<Estimate>> {
        let hashes = self.table.block_hashes(ctx);
        let matched = self.matched(&hashes, candidates, ctx);
        let committed = self.committed(ctx, &hashes, &matched, false);
        self.estimates_for(candidates, ctx, &matched, committed)
    }

    /// The estimates, given how many leading blocks of the prompt each candidate holds and the
    /// share of it whose followers the chosen node will hold (`committed`).
    fn estimates_for(
        &self,
        candidates: &[Arc<Node>],
        ctx: &SelectCtx<'_>,
        matched: &[usize],
        committed: f64,
    ) -> Vec<Option<Estimate>> {
        let speeds = speeds(candidates);
        let now_us = now_us();
        let now = now_us / 1000;
        let prefilled = self.prefilled_by_events(candidates, now);
        let mut out = vec![None; candidates.len()];
        for i in available_indices(candidates) {
            let node = &candidates[i];
            let speed = &speeds[i];
            let ms_per_kib = speed.prefill_ms_per_kib.unwrap_or(PRIOR_MS_PER_KIB);
            #[allow(clippy::cast_precision_loss)]
            let own_kib = self.uncached(ctx, matched[i]) as f64 / 1024.0;
            // Read once: both the batch's wait and the queue ahead come from it.
            let load = node.engine_load(self.max_age_ms, now);
            out[i] = Some(Estimate {
                slot_wait: Self::slot_wait_ms(node, load, speed, ctx.stream, now),
                ahead: node.counters().prefill_left_ms(now_us)
                    + node.counters().peer_prefill_left_ms(now_us)
                    + node.counters().running_late_ms(now),
                first_token: speed.first_token_ms.unwrap_or(0.0),
                own: own_kib * ms_per_kib,
                #[allow(clippy::cast_precision_loss)]
                behind: self.behind(node, load),
                // Read only when it counts (off by default): an `exp` per candidate per request.
                hidden: if self.weights.hidden > 0.0 { node.counters().hidden.ms(now).max(0.0) } else { 0.0 },
                future: if self.weights.future > 0.0 {
                    committed * Self::future_wait_ms(node, ms_per_kib, prefilled.get(i).copied().flatten(), now)
                } else {
                    0.0
                },
            });
        }
        out
    }

    /// Each available candidate's cost for the request, in milliseconds (`None`: not available).
    #[cfg(test)]
    pub(crate) fn costs(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<f64>> {
        self.estimates(candidates, ctx).into_iter().map(|e| e.map(|e| e.cost(self.weights))).collect()
    }
}

impl Policy for Scored {
    fn name(&self) -> &'static str {
        "scored"
    }

    fn use_kv_index(&self, index: Option<Arc<KvIndex>>) {
        self.kv_index.store(index);
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        self.note_capacities(candidates);
        let hashes = self.table.block_hashes(ctx);
        let matched = self.matched(&hashes, candidates, ctx);
        let committed = self.committed(ctx, &hashes, &matched, true);
        let estimates = self.estimates_for(candidates, ctx, &matched, committed);
        let all: Vec<Option<f64>> = estimates.iter().map(|e| e.map(|e| e.cost(self.weights))).collect();
        let matched = candidates
            .iter()
            .zip(matched)
            .zip(&estimates)
            .map(|((n, m), e)| {
                let (prefill_ms, first_token_ms) =
                    e.map_or((0.0, 0.0), |e| (e.first_token + e.own, e.first_token_in_ms()));
                (n.generation(), m, prefill_ms, first_token_ms)
            })
            .collect();
        let key = pick_key(self, ctx);
        LAST_PICK.with(|last| *last.borrow_mut() = Some(LastPick { key, hashes, matched }));
        let best = all.iter().flatten().copied().fold(f64::INFINITY, f64::min);
        let tolerance = (best * TIE_SHARE).max(TIE_MS);
        if let Some(spread) = spread_among_peers(candidates, &all, &estimates, best, tolerance) {
            return Some(spread);
        }
        // Of the nodes within a hair of the best, the one with the fewest requests in flight,
        // then the one sent the fewest: nodes equally ready share the decoding evenly and take
        // turns, so each one's arrivals are spaced as round robin's are.
        let mut chosen = None;
        let mut fewest = (u64::MAX, u64::MAX);
        let mut ties = 0u32;
        for (i, cost) in all.into_iter().enumerate() {
            if cost.is_none_or(|c| c > best + tolerance) {
                continue;
            }
            let counters = candidates[i].counters();
            // Other replicas' requests there too (`replica_share`): each replica's own count
            // alone tells it nothing of how the others spread theirs.
            let key = (counters.fleet_in_flight(), counters.requests.load(Ordering::Relaxed));
            if key < fewest {
                (fewest, chosen, ties) = (key, Some(i), 1);
            } else if key == fewest {
                ties += 1;
                if fastrand::u32(0..ties) == 0 {
                    chosen = Some(i);
                }
            }
        }
        chosen
    }

    fn selected(&self, node: &Arc<Node>, ctx: &SelectCtx<'_>) -> Prediction {
        let key = pick_key(self, ctx);
        let picked = LAST_PICK.with(|last| {
            let mut last = last.borrow_mut();
            let (_, matched, prefill_ms, first_token_ms) =
                *last.as_ref().filter(|l| l.key == key)?.matched.iter().find(|(g, ..)| *g == node.generation())?;
            last.take().map(|l| (l.hashes, matched, prefill_ms, first_token_ms))
        });
        let (hashes, matched, prefill_ms, first_token_ms) = picked.unwrap_or_else(|| {
            let hashes = self.table.block_hashes(ctx);
            let matched = self.matched(&hashes, std::slice::from_ref(node), ctx)[0];
            let committed = self.committed(ctx, &hashes, &[matched], false);
            let estimate = self.estimates_for(std::slice::from_ref(node), ctx, &[matched], committed)[0];
            let (prefill_ms, first_token_ms) =
                estimate.map_or((0.0, 0.0), |e| (e.first_token + e.own, e.first_token_in_ms()));
            (hashes, matched, prefill_ms, first_token_ms)
        });
        let capacity = node
            .engine_load(u64::MAX, now_ms())
            .and_then(|l| l.kv_capacity_tokens)
            .or(Some(self.typical_capacity.load(Ordering::Relaxed)).filter(|&c| c > 0));
        let uncached = self.uncached(ctx, matched);
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        // A route counts as held for the time of its own prefill and the events' lag, not for
        // the prefill owed ahead of it too: on bench/fleet.py's evict_restart (caches evicting
        // all the time), counting that as well left routes held long after the engine had
        // evicted them again (TTFT p99 972 and 810 ms against 284 and 268).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let pending_until =
            if self.kv_index.load().is_some() { now_ms() + prefill_ms as u64 + EVENTS_LAG_MS } else { 0 };
        self.table.learn(node, &hashes, capacity, pending_until);
        if let Some(seen) = &self.seen {
            seen.remember(&hashes, prompt, self.table.block_bytes());
        }
        Prediction {
            prefill: u64::try_from(uncached).unwrap_or(u64::MAX),
            cached: u64::try_from(prompt - uncached).unwrap_or(u64::MAX),
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            prefill_us: (prefill_ms * 1000.0) as u64,
            // Checked against the first byte, always: `/nodes/status` and `/metrics` show how
            // far off the prices are (`first_token_lateness`), which `hidden` may weigh. (At
            // least 1: a prompt all cached, before any speed is learnt, is priced at once.)
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            first_token_us: ((first_token_ms * 1000.0) as u64).max(1),
            // Its fading mean is kept only where it is priced: otherwise an `exp` and two
            // stores per answer for nothing.
            weighs_lateness: self.weights.hidden > 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::testing::*;
    use super::*;

    const WEIGHTS: ScoreWeights = ScoreWeights { prefix: 2.0, queue: 1.0, hidden: 0.0, reported: 0.0, future: 0.0 };

    fn scored(weights: ScoreWeights) -> Scored {
        let table = PrefixTableConfig { block_bytes: 256, max_blocks: 1024, entries: 1 << 16, bytes_per_token: 4.0 };
        Scored::new(weights, table, 10_000)
    }

    fn ctx(prompt: &[u8]) -> SelectCtx<'_> {
        SelectCtx { model: Some("m"), prompt: Some(prompt), ..SelectCtx::default() }
    }

    fn route(policy: &Scored, nodes: &[Arc<Node>], prompt: &[u8]) -> usize {
        let i = policy.pick(nodes, &ctx(prompt)).unwrap();
        policy.selected(&nodes[i], &ctx(prompt));
        i
    }

    /// Teaches `node` an engine that prefills at `ms_per_kib` (plus 10 ms), decodes a request
    /// in `decode_ms` and runs `slots` at once.
    fn learn(node: &Node, ms_per_kib: f64, decode_ms: f64, slots: u64) {
        let speed = &node.counters().speed;
        for i in 0..200 {
            let kib = f64::from(i % 8 + 1);
            speed.first_token(kib, 10.0 + ms_per_kib * kib);
            speed.decoded(decode_ms);
        }
        speed.reported(slots, 1);
    }

    /// Two alike nodes; node 0 kept busy by its recent traffic, a 100 ms prefill every 150 ms.
    fn alike_with_the_first_busy() -> (crate::node::registry::Registry, Vec<Arc<Node>>) {
        let (reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        let start = now_ms().saturating_sub(8_000);
        for i in 0..54 {
            nodes[0].counters().recent_work.add(100.0, start + i * 150);
        }
        (reg, nodes)
    }

    #[test]
    fn a_node_running_late_on_its_first_tokens_is_priced_by_how_late() {
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        let policy = scored(WEIGHTS);
        let prompt = "p".repeat(2048);
        policy.selected(&nodes[0], &ctx(prompt.as_bytes()));
        assert_eq!(policy.pick(&nodes, &ctx(prompt.as_bytes())), Some(0), "the node holding it");
        // A request sent there was due 600 ms ago by the prefill clock, and has no first token
        // yet: the cache it was priced on may be gone, and all queued there waits as long.
        let counters = nodes[0].counters();
        let entry = counters.running_late.enter(now_ms() - 600);
        counters.unanswered.store(1, Ordering::Relaxed);
        let estimate = policy.estimates(&nodes, &ctx(prompt.as_bytes()))[0].unwrap();
        assert!((estimate.ahead - 600.0).abs() < 20.0, "{estimate:?}");
        assert_eq!(policy.pick(&nodes, &ctx(prompt.as_bytes())), Some(1), "a 100 ms prefill elsewhere is sooner");
        // Its first token came: the node is on time again.
        counters.running_late.leave(entry);
        counters.unanswered.store(0, Ordering::Relaxed);
        assert_eq!(policy.pick(&nodes, &ctx(prompt.as_bytes())), Some(0));
    }

    #[test]
    fn lateness_moves_requests_only_where_it_is_weighed() {
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        // Node 0's first tokens came 2 s later than priced: work there others sent.
        for _ in 0..8 {
            nodes[0].counters().hidden.observe(2000.0, now_ms());
        }
        let prompt = b"no prompt held anywhere".as_slice();
        let weighed = scored(ScoreWeights { hidden: 1.0, ..WEIGHTS });
        let [late, other] = [0, 1].map(|i| weighed.estimates(&nodes, &ctx(prompt))[i].unwrap());
        assert!(late.hidden > 1000.0 && other.hidden.abs() < f64::EPSILON, "{late:?} {other:?}");
        assert_eq!(weighed.pick(&nodes, &ctx(prompt)), Some(1));
        // Off (the default): not even read, and both nodes cost the same.
        let off = scored(WEIGHTS);
        let costs = off.costs(&nodes, &ctx(prompt));
        assert_eq!(costs[0], costs[1]);
        assert!(off.estimates(&nodes, &ctx(prompt))[0].unwrap().hidden.abs() < f64::EPSILON);
        // Priced either way: how far off the prices are shows whether it is weighed or not.
        assert!(off.selected(&nodes[0], &ctx(prompt)).first_token_us > 0);
        assert!(weighed.selected(&nodes[0], &ctx(prompt)).first_token_us > 0);
        // Its fading mean is kept only where it is weighed.
        assert!(!off.selected(&nodes[0], &ctx(prompt)).weighs_lateness);
        assert!(weighed.selected(&nodes[0], &ctx(prompt)).weighs_lateness);
    }

    #[test]
    fn an_engines_reported_queue_counts_behind_only_where_it_is_weighed() {
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        // Node 0's engine has twelve requests waiting that another replica sent; pdproxy none.
        report(&nodes[0], 4, 12, 0.9);
        report(&nodes[1], 4, 0, 0.5);
        let prompt = b"no prompt held anywhere".as_slice();
        let weighed = scored(ScoreWeights { reported: 1.0, ..WEIGHTS });
        let [queued, idle] = [0, 1].map(|i| weighed.estimates(&nodes, &ctx(prompt))[i].unwrap());
        assert!((queued.behind - 12.0).abs() < 1e-9 && idle.behind.abs() < 1e-9, "{queued:?} {idle:?}");
        // Off (the default): only what pdproxy sent counts.
        assert!(scored(WEIGHTS).estimates(&nodes, &ctx(prompt))[0].unwrap().behind.abs() < 1e-9);
        // Where pdproxy's own count is the longer, it stands.
        nodes[1].counters().unanswered.store(3, Ordering::Relaxed);
        assert!((weighed.estimates(&nodes, &ctx(prompt))[1].unwrap().behind - 3.0).abs() < 1e-9);
    }

    #[test]
    fn an_engines_reported_queue_is_not_counted_where_pdproxy_sent_all_it_had() {
        let (_reg, nodes) = nodes(1);
        learn(&nodes[0], 50.0, 500.0, 4);
        let weighed = scored(ScoreWeights { reported: 1.0, ..WEIGHTS });
        let behind = || weighed.estimates(&nodes, &ctx(b"a prompt".as_slice()))[0].unwrap().behind;
        // pdproxy had the engine's sixteen requests in flight at the reading, two of them still
        // unanswered now: the reading's twelve waiting have mostly been answered since.
        nodes[0].counters().in_flight.store(16, Ordering::Relaxed);
        report(&nodes[0], 4, 12, 0.9);
        nodes[0].counters().unanswered.store(2, Ordering::Relaxed);
        assert!((behind() - 2.0).abs() < 1e-9, "{}", behind());
        // A reading that shows ten requests pdproxy did not send: the queue counts.
        nodes[0].counters().in_flight.store(6, Ordering::Relaxed);
        report(&nodes[0], 4, 12, 0.9);
        assert!((behind() - 12.0).abs() < 1e-9, "{}", behind());
    }

    #[test]
    fn a_cached_prompt_outweighs_a_short_wait_not_a_long_one() {
        let (_reg, nodes) = nodes(3);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        let policy = scored(WEIGHTS);
        let system = "You are a helpful assistant. ".repeat(280); // about 8 KiB: 400 ms of prefill
        let home = route(&policy, &nodes, format!("{system} first").as_bytes());
        // Four requests there: the fifth waits for one of four places, 125 ms, counted for
        // itself and twice for those that come after it (375 ms) < 3 x 400 ms (its own prefill
        // elsewhere, counted for itself and twice for the next request there).
        set_in_flight(&nodes[home], 4);
        assert_eq!(route(&policy, &nodes, format!("{system} second").as_bytes()), home);
        // Eight: 5 x 125 ms, 3 x 625 ms > 1200 ms (once, 625 ms would not be); another node is
        // cheaper now, and learns the prompt too.
        set_in_flight(&nodes[home], 8);
        let other = route(&policy, &nodes, format!("{system} third").as_bytes());
        assert_ne!(other, home);
        let estimates = policy.estimates(&nodes, &ctx(format!("{system} fourth").as_bytes()));
        let third = (0..3).find(|&i| i != home && i != other).unwrap();
        let own = |i: usize| estimates[i].unwrap().own;
        assert!(own(other) < 10.0 && own(third) > 390.0, "{estimates:?}");
        assert!((estimates[home].unwrap().slot_wait - 5.0 * 125.0).abs() < 1.0, "{estimates:?}");
        // Counted once, the wait (625 ms) would have kept it home: its whole cost, less what the
        // wait adds behind it, is below that of the node it has yet to be prefilled at.
        let (at_home, elsewhere) = (estimates[home].unwrap(), estimates[third].unwrap());
        let once = at_home.cost(WEIGHTS) - WEIGHTS.queue * WEIGHTS.prefix * at_home.slot_wait;
        assert!(once < elsewhere.cost(WEIGHTS), "{at_home:?} {elsewhere:?}");
    }

    #[test]
    fn without_the_queue_weight_a_prompt_stays_home() {
        // Waits not counted: the node holding the prompt wins however long its queue.
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        let blind = scored(ScoreWeights { queue: 0.0, ..WEIGHTS });
        let prompt = "p".repeat(4096);
        let home = route(&blind, &nodes, prompt.as_bytes());
        set_in_flight(&nodes[home], 100);
        assert_eq!(route(&blind, &nodes, prompt.as_bytes()), home);
    }

    #[test]
    fn nodes_equally_ready_take_turns() {
        let (_reg, nodes) = nodes(4);
        nodes[0].counters().requests.fetch_add(5, Ordering::Relaxed);
        let policy = scored(WEIGHTS);
        let mut order = Vec::new();
        for _ in 0..6 {
            let i = policy.pick(&nodes, &ctx(b"x")).unwrap();
            nodes[i].counters().requests.fetch_add(1, Ordering::Relaxed);
            order.push(i);
        }
        // The ones sent the fewest, in turn.
        let count = |n: usize| order.iter().filter(|&&i| i == n).count();
        assert_eq!([count(0), count(1), count(2), count(3)], [0, 2, 2, 2], "{order:?}");
        // Requests in flight come first: node 0, sent the most, but the only one not busy.
        for node in &nodes[1..] {
            set_in_flight(node, 1);
        }
        assert_eq!(policy.pick(&nodes, &ctx(b"x")), Some(0));
    }

    #[test]
    fn without_a_prompt_requests_in_flight_are_balanced() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let mut picks = [0; 3];
        for _ in 0..30 {
            let i = policy.pick(&nodes, &SelectCtx::default()).unwrap();
            picks[i] += 1;
            nodes[i].counters().in_flight.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(picks, [10, 10, 10]);
    }

    #[test]
    fn a_slower_engine_takes_its_share_of_misses_not_an_equal_one() {
        let (reg, nodes) = nodes(2);
        learn(&nodes[0], 25.0, 500.0, 64);
        learn(&nodes[1], 50.0, 1000.0, 64);
        let policy = scored(WEIGHTS);
        let mut picks = [0; 2];
        // Prompts of 4 KiB that share nothing, sent faster than they are answered.
        for i in 0..60 {
            let prompt = format!("{i:04}").repeat(1024);
            let n = crate::engine::select(&reg.load(), &ctx(prompt.as_bytes()), &policy, None).unwrap();
            picks[usize::from(n.node().url() == nodes[1].url())] += 1;
            std::mem::forget(n); // still prefilling
        }
        assert!((38..=42).contains(&picks[0]), "twice the speed, about twice the share: {picks:?}");
    }

    #[test]
    fn a_miss_goes_to_the_engine_with_no_queue() {
        let (_reg, nodes) = nodes(3);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        let policy = scored(WEIGHTS);
        let shared = "s".repeat(8192);
        for node in &nodes[..2] {
            policy.selected(node, &ctx(shared.as_bytes()));
            set_in_flight(node, 6);
        }
        // Node 2 is cold (restarted, say): it holds nothing, but nothing waits there. A prompt
        // nobody holds goes there; so does the shared one, once the waits elsewhere outgrow it.
        assert_eq!(route(&policy, &nodes, "n".repeat(4096).as_bytes()), 2);
        set_in_flight(&nodes[2], 0);
        for node in &nodes[..2] {
            set_in_flight(node, 14);
        }
        assert_eq!(route(&policy, &nodes, shared.as_bytes()), 2);
    }

    /// One node running a full batch of 16 (all answered and decoding), that learnt decodings
    /// of `decodes` ms (in turn) and saw their first tokens come `started_ago` ms ago.
    fn full_batch(decodes: &[f64], started_ago: &[u64]) -> (crate::node::registry::Registry, Vec<Arc<Node>>) {
        let (reg, nodes) = nodes(1);
        learn(&nodes[0], 50.0, decodes[0], 16);
        for i in 0..200 {
            nodes[0].counters().speed.decoded(decodes[i % decodes.len()]);
        }
        let now = now_ms();
        for ago in started_ago {
            nodes[0].counters().decode_starts.record(now - ago);
        }
        set_in_flight(&nodes[0], 16);
        (reg, nodes)
    }

    #[test]
    fn a_full_batch_of_alike_answers_frees_a_place_when_its_oldest_decoding_ends() {
        let wait = |started_ago: u64| {
            let (_reg, nodes) = full_batch(&[500.0], &[started_ago; 16]);
            let policy = scored(WEIGHTS);
            policy.estimates(&nodes, &ctx(b"a prompt".as_slice()))[0].unwrap().slot_wait
        };
        // Sixteen that began together 100 ms ago end in 400 ms, not in a sixteenth of 500.
        assert!((wait(100) - 400.0).abs() < 20.0, "{}", wait(100));
        assert!((wait(450) - 50.0).abs() < 20.0, "{}", wait(450));
        // Overdue: a place any moment.
        assert!(wait(900) < 0.01, "{}", wait(900));
    }

    #[test]
    fn where_answers_vary_in_length_a_place_frees_for_a_share_of_a_decoding() {
        // Decodings of 100 and 900 ms in turn: they spread as far as they last.
        let (_reg, nodes) = full_batch(&[100.0, 900.0], &[100; 16]);
        let policy = scored(WEIGHTS);
        let estimate = policy.estimates(&nodes, &ctx(b"a prompt".as_slice()))[0].unwrap();
        let share = 500.0 / 16.0;
        assert!(estimate.slot_wait > share && estimate.slot_wait < 0.3 * 400.0 + share, "{estimate:?}");
    }

    #[test]
    fn a_place_is_waited_for_while_pdproxy_alone_fills_the_batch_a_report_said_had_room() {
        let (_reg, nodes) = full_batch(&[500.0], &[100; 16]);
        // Read with all sixteen in flight: the engine counted thirteen (three not there yet).
        report(&nodes[0], 13, 0, 0.5);
        let policy = scored(WEIGHTS);
        let wait = policy.estimates(&nodes, &ctx(b"a prompt".as_slice()))[0].unwrap().slot_wait;
        assert!((wait - 400.0).abs() < 20.0, "{wait}");
    }

    #[test]
    fn a_new_session_goes_where_recent_traffic_is_lighter_its_next_turns_where_it_is() {
        // Node 0 holds the short head every session shares and its sessions' turns keep it busy;
        // nothing waits at either node right now.
        let (_reg, nodes) = alike_with_the_first_busy();
        let head = "h".repeat(1024);
        let off = scored(WEIGHTS);
        off.selected(&nodes[0], &ctx(head.as_bytes()));
        let session = format!("{head}{}", "s".repeat(8192));
        assert_eq!(off.pick(&nodes, &ctx(session.as_bytes())), Some(0), "without the term, the head draws it");
        let weighed = scored(ScoreWeights { future: 3.0, ..WEIGHTS });
        weighed.selected(&nodes[0], &ctx(head.as_bytes()));
        let estimates = weighed.estimates(&nodes, &ctx(session.as_bytes()));
        assert!(estimates[0].unwrap().future > 50.0, "{estimates:?}");
        assert!(estimates[1].unwrap().future.abs() < f64::EPSILON, "{estimates:?}");
        assert_eq!(weighed.pick(&nodes, &ctx(session.as_bytes())), Some(1));
        // A session held at node 0 keeps its next turn there: a prompt mostly held is not priced.
        weighed.selected(&nodes[0], &ctx(session.as_bytes()));
        let next_turn = format!("{session}{}", "t".repeat(1024));
        let estimates = weighed.estimates(&nodes, &ctx(next_turn.as_bytes()));
        assert!(estimates[0].unwrap().future.abs() < f64::EPSILON, "a held prompt's tail: {estimates:?}");
        assert_eq!(weighed.pick(&nodes, &ctx(next_turn.as_bytes())), Some(0));
    }

    #[test]
    fn a_session_whose_cache_an_engine_lost_commits_no_new_followers() {
        use crate::node::engine_report::EngineFigures;
        let (_reg, nodes) = alike_with_the_first_busy();
        let policy = scored(ScoreWeights { future: 3.0, ..WEIGHTS });
        let session = "s".repeat(8192);
        policy.selected(&nodes[0], &ctx(session.as_bytes()));
        // Node 0's engine restarts: its cache, and the table's record of it, are gone.
        let reading = |prompt| EngineFigures { prompt_tokens: Some(prompt), ..EngineFigures::default() };
        nodes[0].counters().record_engine_report(&reading(100), 1);
        nodes[0].counters().record_engine_report(&reading(5), 2);
        let next_turn = format!("{session}{}", "t".repeat(1024));
        let estimates = policy.estimates(&nodes, &ctx(next_turn.as_bytes()));
        assert!(estimates.iter().all(|e| e.unwrap().own > 200.0), "held nowhere now: {estimates:?}");
        assert!(estimates[0].unwrap().future.abs() < f64::EPSILON, "sent before: {estimates:?}");
        // A session never sent is priced, on the same node.
        let new_session = format!("{}{}", "n".repeat(8192), "t".repeat(1024));
        assert!(policy.estimates(&nodes, &ctx(new_session.as_bytes()))[0].unwrap().future > 50.0);
    }

    #[test]
    fn a_fresh_prompt_commits_followers_only_while_prompts_have_had_them() {
        let (_reg, nodes) = alike_with_the_first_busy();
        let policy = scored(ScoreWeights { future: 3.0, ..WEIGHTS });
        let fresh = |i: usize| format!("{i:08}{}", "f".repeat(4096));
        let future = |prompt: &str| policy.estimates(&nodes, &ctx(prompt.as_bytes()))[0].unwrap().future;
        let before = future(&fresh(0));
        assert!(before > 50.0, "until requests tell, a fresh prompt commits followers: {before}");
        // Prompts that share nothing: none is followed, so a fresh one commits nothing.
        for i in 1..400 {
            policy.pick(&nodes, &ctx(fresh(i).as_bytes()));
        }
        let alone = future(&fresh(0));
        assert!(alone < 0.01 * before, "{alone} against {before}");
        // Requests that follow a held prompt again: fresh prompts commit their followers again.
        let held = "h".repeat(4096);
        policy.selected(&nodes[1], &ctx(held.as_bytes()));
        for i in 0..400 {
            policy.pick(&nodes, &ctx(format!("{held}{i:04}").as_bytes()));
        }
        let followed = future(&fresh(0));
        assert!(followed > 0.9 * before, "{followed} against {before}");
    }

    #[test]
    fn what_an_engines_kv_events_show_it_prefilled_for_others_counts_in_its_future_wait() {
        use crate::select::kv_index::{ChatTemplate, Detokenizer, Stored};
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        // This replica sent each node the same light traffic...
        let start = now_ms().saturating_sub(4_000);
        for node in &nodes {
            for i in 0..8 {
                node.counters().recent_work.add(100.0, start + i * 500);
            }
        }
        let policy = scored(ScoreWeights { future: 3.0, ..WEIGHTS });
        let miss = "m".repeat(4096);
        let costs = policy.costs(&nodes, &ctx(miss.as_bytes()));
        assert_eq!(costs[0], costs[1]);
        // ...but node 0's engine stored 64 KiB of blocks lately: other replicas' prompts.
        let index = Arc::new(KvIndex::new(Detokenizer::FixedWidth(4), ChatTemplate::mock(), 1 << 16));
        for node in &nodes {
            index.set_live(node.url(), 0, true);
        }
        let ids: Vec<u64> = (0..16_384u64).map(|i| 0x6161_0000 + i % 1000).collect();
        let hashes: Vec<u64> = (0..8_192).collect();
        index.stored(nodes[0].url(), 0, Stored { hashes: &hashes, parent: None, token_ids: &ids, block_size: 2 });
        policy.use_kv_index(Some(index));
        let estimates = policy.estimates(&nodes, &ctx(miss.as_bytes()));
        assert!(estimates[0].unwrap().future > 2.0 * estimates[1].unwrap().future, "{estimates:?}");
        assert_eq!(policy.pick(&nodes, &ctx(miss.as_bytes())), Some(1));
    }

    #[test]
    fn other_replicas_load_counts_as_this_ones() {
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        let policy = scored(WEIGHTS);
        let miss = "p".repeat(4096);
        let alone = policy.estimates(&nodes, &ctx(miss.as_bytes()));
        assert!(alone[0].unwrap().behind.abs() < f64::EPSILON && alone[0].unwrap().ahead.abs() < f64::EPSILON);
        // Another replica has two requests waiting at node 0, with 300 ms of prefill left.
        nodes[0].counters().peer_unanswered.store(2, Ordering::Relaxed);
        nodes[0].counters().peer_prefill_done_at_us.store(now_us() + 300_000, Ordering::Relaxed);
        nodes[0].counters().unanswered.store(1, Ordering::Relaxed);
        let shared = policy.estimates(&nodes, &ctx(miss.as_bytes()));
        let busy = shared[0].unwrap();
        assert!((busy.behind - 3.0).abs() < f64::EPSILON, "its own and the peers': {busy:?}");
        assert!(busy.ahead > 250.0 && busy.ahead <= 300.0, "{busy:?}");
        assert_eq!(route(&policy, &nodes, miss.as_bytes()), 1);
        // A prefill clock of the peers' in the past counts nothing.
        nodes[0].counters().peer_prefill_done_at_us.store(now_us() - 1000, Ordering::Relaxed);
        assert!(policy.estimates(&nodes, &ctx(miss.as_bytes()))[0].unwrap().ahead.abs() < f64::EPSILON);
    }

    #[test]
    fn with_peers_a_long_prefill_goes_to_any_node_priced_near_the_best() {
        let (_reg, nodes) = nodes(3);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        let policy = scored(WEIGHTS);
        // 80 KiB no node holds: 4 s of prefill anywhere. Node 1 owes 500 ms of prefill (within a
        // quarter of it), node 2 3 s. (Clocks that long run down little while the test picks.)
        let miss = "q".repeat(81920);
        nodes[1].counters().prefill_done_at_us.store(now_us() + 500_000, Ordering::Relaxed);
        nodes[2].counters().prefill_done_at_us.store(now_us() + 3_000_000, Ordering::Relaxed);
        let picks = |prompt: &str| {
            let mut counts = [0; 3];
            for _ in 0..300 {
                counts[policy.pick(&nodes, &ctx(prompt.as_bytes())).unwrap()] += 1;
            }
            counts
        };
        assert_eq!(picks(&miss), [300, 0, 0], "alone: the best, always");
        for node in &nodes {
            node.counters().peer_replicas.store(3, Ordering::Relaxed);
        }
        let spread = picks(&miss);
        assert!(spread[0] > 50 && spread[1] > 50 && spread[2] == 0, "with peers, the two near the best: {spread:?}");
        // A short prefill (a few ms: cheap to meet twice) still goes to the best.
        assert_eq!(picks(&"q".repeat(256)), [300, 0, 0]);
    }

    #[test]
    fn a_miss_avoids_the_node_whose_requests_still_wait_for_their_first_token() {
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 16);
        }
        let policy = scored(WEIGHTS);
        // Node 0: three requests prefilling or queued for it; node 1: eight decoding, none waiting.
        nodes[0].counters().unanswered.store(3, Ordering::Relaxed);
        set_in_flight(&nodes[0], 3);
        set_in_flight(&nodes[1], 8);
        let miss = "m".repeat(4096);
        let estimates = policy.estimates(&nodes, &ctx(miss.as_bytes()));
        assert!((estimates[0].unwrap().behind - 3.0).abs() < f64::EPSILON, "{estimates:?}");
        // Its 200 ms of prefill: 200 x (1 + 2 x 4) at node 0, 200 x 3 at node 1.
        assert_eq!(route(&policy, &nodes, miss.as_bytes()), 1, "a prefill there would hold three first tokens");
    }

    #[test]
    fn prefill_sent_and_not_yet_answered_counts_until_the_first_byte() {
        let (reg, nodes) = nodes(2);
        let policy = scored(WEIGHTS);
        let long = "a".repeat(8 * 1024);
        // Two different 8 KiB prompts: the second avoids the node still prefilling the first.
        let first = crate::engine::select(&reg.load(), &ctx(long.as_bytes()), &policy, None).unwrap();
        let unanswered = |n: &Node| n.counters().unanswered.load(Ordering::Relaxed);
        assert_eq!(unanswered(first.node()), 1);
        assert!(first.node().counters().prefill_left_ms(now_us()) > 0.0, "it owes that prefill");
        let other = "b".repeat(8 * 1024);
        let second = crate::engine::select(&reg.load(), &ctx(other.as_bytes()), &policy, None).unwrap();
        assert_ne!(second.node().url(), first.node().url());
        first.first_byte_seen();
        first.first_byte_seen();
        assert_eq!(unanswered(first.node()), 0, "released once");
        assert!(first.node().counters().prefill_left_ms(now_us()) <= 0.0, "and owes nothing more");
        let node = Arc::clone(second.node());
        drop(second);
        assert_eq!(unanswered(&node), 0, "and at the end at the latest");
        assert_eq!(nodes.len(), 2);
    }

    #[test]
    fn a_streamed_first_token_teaches_the_engine_its_speed() {
        let (reg, nodes) = nodes(1);
        let policy = scored(WEIGHTS);
        let prompt = "t".repeat(4096);
        let streamed = SelectCtx { stream: true, ..ctx(prompt.as_bytes()) };
        for _ in 0..5 {
            let permit = crate::engine::select(&reg.load(), &streamed, &policy, None).unwrap();
            permit.first_byte_seen();
        }
        assert!(nodes[0].counters().speed.speed().samples > 4.0);
        let whole = crate::engine::select(&reg.load(), &ctx(prompt.as_bytes()), &policy, None).unwrap();
        whole.first_byte_seen();
        assert!(nodes[0].counters().speed.speed().samples < 5.0, "a whole answer's first byte times no token");
    }

    #[test]
    fn a_first_token_that_waited_for_another_prefill_teaches_nothing() {
        let (reg, nodes) = nodes(1);
        let policy = scored(WEIGHTS);
        let prompt = "q".repeat(4096);
        let streamed = SelectCtx { stream: true, ..ctx(prompt.as_bytes()) };
        let first = crate::engine::select(&reg.load(), &streamed, &policy, None).unwrap();
        let behind = crate::engine::select(&reg.load(), &streamed, &policy, None).unwrap();
        first.first_byte_seen();
        behind.first_byte_seen();
        let samples = nodes[0].counters().speed.speed().samples;
        assert!((samples - 1.0).abs() < 1e-9, "only the first, sent alone, timed the engine: {samples}");
    }
}

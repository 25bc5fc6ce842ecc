//! `scored`: the node where the request's first token comes soonest, counting what the
//! request costs the requests after it there. Every term is a time, from what pdproxy has
//! learnt of each engine's speed (`engine_speed`) and what it knows of each engine's queue:
//!
//! ```text
//! cost = queue  * (the wait for a place in the engine's batch + the prefill still owed to
//!                  the requests sent there before, at that engine's rate)
//!      +          the engine's fixed time to a first token
//!      + prefix * the request's own prefill there (its prompt not in that node's cache)
//! ```
//!
//! `prefix` is 2 by default: a request's own prefill delays its own first token, and once
//! more every request that comes after it to that engine (they wait behind it). So a node that
//! holds the prompt keeps it until the wait there outgrows a prefill elsewhere, and a miss,
//! which costs the same on every node of one speed, goes where the wait is shortest: a cold
//! engine (restarted, flushed, new) takes misses back at once, being the one with no queue.
//! `queue` (1) scales the waits against the prefill.
//!
//! - The prompt a node holds comes from the prefix table (what pdproxy routed there and the
//!   engine has not evicted since, see `prefix_table`).
//! - The prefill owed there is pdproxy's own count of the uncached prompt bytes it sent that
//!   have not had their first byte yet, worked off at the engine's rate since they were sent
//!   (`prefill_remaining_bytes`).
//! - The wait for a place in the batch: the requests the engine has (its last report adjusted
//!   by pdproxy's traffic since; without one, pdproxy's in-flight count) beyond the number it
//!   runs at once, each freeing a place as it finishes decoding.
//! - Rates not learnt yet are the median of the candidates' learnt ones (a fleet is mostly
//!   alike), or, before any, `PRIOR_MS_PER_KIB`.
//!
//! Nodes within `TIE_SHARE` of the lowest cost count as equally ready: the one with the
//! fewest requests in flight, then the one sent the fewest, then one at random, so that they
//! share the decoding evenly and take turns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::prefix_table::{PrefixTable, PrefixTableConfig};
use super::{available_indices, Policy, SelectCtx};
use crate::circuit::now_ms;
use crate::engine_speed::Speed;
use crate::error::{Error, Kind, Result};
use crate::node::Node;
use crate::permit::Prediction;

/// Costs within this share of the lowest (or `TIE_MS`, whichever is more) count as equal.
const TIE_SHARE: f64 = 0.02;
const TIE_MS: f64 = 1.0;
/// Prefill time per KiB of prompt assumed before any engine's is learnt: about 10,000 tokens a
/// second at 4 bytes a token. Only the first requests see it; it sets no ratio that matters,
/// since the prefill owed and the request's own are both priced with it.
const PRIOR_MS_PER_KIB: f64 = 25.0;

/// The weights of the terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreWeights {
    /// Times the request's own prefill counts (its own wait, and that of those after it).
    pub prefix: f64,
    /// Times the waits ahead of it count.
    pub queue: f64,
}

impl ScoreWeights {
    /// `weights` with the overrides of `spec` applied: `prefix=2,queue=0.5` (either, each a
    /// non-negative number).
    pub fn with_overrides(self, spec: &str) -> Result<Self> {
        let mut out = self;
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, raw) = part.split_once('=').ok_or_else(|| invalid(spec))?;
            let value: f64 = raw.trim().parse().map_err(|_| invalid(spec))?;
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(spec));
            }
            match key.trim() {
                "prefix" => out.prefix = value,
                "queue" => out.queue = value,
                _ => return Err(invalid(spec)),
            }
        }
        Ok(out)
    }
}

fn invalid(spec: &str) -> Error {
    Error::new(
        Kind::Config,
        format!("scored weights {spec:?}: use prefix=N and queue=N separated by a comma (non-negative numbers)"),
    )
}

/// The figures a cost is made of for one candidate, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Waiting for a place in the engine's batch.
    pub slot_wait: f64,
    /// Prefill still owed to the requests sent there before.
    pub ahead: f64,
    /// The engine's fixed time to a first token.
    pub first_token: f64,
    /// The request's own prefill there.
    pub own: f64,
}

impl Estimate {
    /// When the request's first token would come (ms after now).
    pub fn first_token_in_ms(&self) -> f64 {
        self.slot_wait + self.ahead + self.first_token + self.own
    }

    fn cost(&self, w: ScoreWeights) -> f64 {
        w.queue * (self.slot_wait + self.ahead) + self.first_token + w.prefix * self.own
    }
}

#[derive(Debug)]
pub struct Scored {
    weights: ScoreWeights,
    table: PrefixTable,
    /// Older engine reports are ignored.
    max_age_ms: u64,
    /// The median KV capacity (tokens) the candidates' engines report, for the nodes whose
    /// engines do not (a fleet is mostly alike); 0 when none does.
    typical_capacity: AtomicU64,
}

/// The median of the values given (`None`: none).
fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mid = values.len() / 2;
    Some(*values.select_nth_unstable_by(mid, f64::total_cmp).1)
}

/// Each candidate's learnt speed, its gaps filled with the candidates' medians (computed only
/// for a figure some candidate lacks: after the first answers, none).
fn speeds(candidates: &[Arc<Node>]) -> Vec<Speed> {
    let mut learnt: Vec<Speed> = candidates.iter().map(|n| n.counters().speed.speed()).collect();
    // Before any stream taught a prefill rate, whole answers bound it: no slower than they took.
    for speed in &mut learnt {
        if speed.prefill_ms_per_kib.is_none() {
            speed.prefill_ms_per_kib = speed.prefill_bound_ms_per_kib.map(|bound| bound.min(PRIOR_MS_PER_KIB));
        }
    }
    let fields: [fn(&mut Speed) -> &mut Option<f64>; 5] = [
        |s| &mut s.prefill_ms_per_kib,
        |s| &mut s.first_token_ms,
        |s| &mut s.decode_ms,
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

/// What the last pick on this thread computed for its request: the policy's `selected` follows
/// it at once (see `select`), and would otherwise hash the prompt and match it a second time.
struct LastPick {
    /// Which policy, prompt and model it was for (addresses and lengths).
    key: [usize; 5],
    hashes: Vec<u64>,
    /// Leading blocks each candidate holds, by generation.
    matched: Vec<(u64, usize)>,
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
    pub fn new(weights: ScoreWeights, table: PrefixTableConfig, max_age_ms: u64) -> Self {
        Self { weights, table: PrefixTable::new(table), max_age_ms, typical_capacity: AtomicU64::new(0) }
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

    pub fn weights(&self) -> ScoreWeights {
        self.weights
    }

    /// Bytes of the prompt a node holding `matched` leading blocks would still prefill.
    fn uncached(&self, ctx: &SelectCtx<'_>, matched: usize) -> usize {
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        prompt - (matched * self.table.block_bytes()).min(self.table.considered_bytes(ctx))
    }

    /// The wait for a place in the node's batch (ms): the requests it has beyond those it runs
    /// at once, each place freed as a running request ends its decoding. Where neither the
    /// batch's size nor a queue is known, a whole answer (not a stream) is taken to share the
    /// engine with those in flight: each of them adds what a request took per request in flight.
    fn slot_wait_ms(&self, node: &Node, speed: &Speed, now: u64, stream: bool) -> f64 {
        let load = node.engine_load(self.max_age_ms, now);
        #[allow(clippy::cast_precision_loss)]
        let in_flight = node.counters().in_flight() as f64;
        let queue_known = speed.slots.is_some() || load.is_some_and(|l| l.waiting() > 0.0);
        if !stream && !queue_known {
            return speed.ms_per_in_flight.map_or(0.0, |ms| in_flight * ms);
        }
        let Some(decode_ms) = speed.decode_ms else { return 0.0 };
        match speed.slots {
            Some(slots) => {
                let there = load.map_or(in_flight, |l| l.requests());
                let beyond = there + 1.0 - slots;
                if beyond > 0.0 {
                    beyond * decode_ms / slots
                } else {
                    0.0
                }
            }
            None => load.filter(|l| l.waiting() > 0.0 && l.running > 0).map_or(0.0, |l| {
                #[allow(clippy::cast_precision_loss)]
                let running = l.running as f64;
                (l.waiting() + 1.0) * decode_ms / running
            }),
        }
    }

    /// Each available candidate's estimate for the request (`None`: not available).
    pub fn estimates(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<Estimate>> {
        let hashes = self.table.block_hashes(ctx);
        let matched = self.table.matched(&hashes, candidates);
        self.estimates_for(candidates, ctx, &matched)
    }

    /// The estimates, given how many leading blocks of the prompt each candidate holds.
    fn estimates_for(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>, matched: &[usize]) -> Vec<Option<Estimate>> {
        let speeds = speeds(candidates);
        let now = now_ms();
        let mut out = vec![None; candidates.len()];
        for i in available_indices(candidates) {
            let node = &candidates[i];
            let speed = &speeds[i];
            let ms_per_kib = speed.prefill_ms_per_kib.unwrap_or(PRIOR_MS_PER_KIB);
            #[allow(clippy::cast_precision_loss)]
            let own_kib = self.uncached(ctx, matched[i]) as f64 / 1024.0;
            let ahead_kib = node.counters().prefill_remaining_bytes(now) / 1024.0;
            out[i] = Some(Estimate {
                slot_wait: self.slot_wait_ms(node, speed, now, ctx.stream),
                ahead: ahead_kib * ms_per_kib,
                first_token: speed.first_token_ms.unwrap_or(0.0),
                own: own_kib * ms_per_kib,
            });
        }
        out
    }

    /// Each available candidate's cost for the request, in milliseconds (`None`: not available).
    pub fn costs(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Vec<Option<f64>> {
        self.estimates(candidates, ctx).into_iter().map(|e| e.map(|e| e.cost(self.weights))).collect()
    }
}

impl Policy for Scored {
    fn name(&self) -> &'static str {
        "scored"
    }

    fn pick(&self, candidates: &[Arc<Node>], ctx: &SelectCtx<'_>) -> Option<usize> {
        self.note_capacities(candidates);
        let hashes = self.table.block_hashes(ctx);
        let matched = self.table.matched(&hashes, candidates);
        let all: Vec<Option<f64>> = self
            .estimates_for(candidates, ctx, &matched)
            .into_iter()
            .map(|e| e.map(|e| e.cost(self.weights)))
            .collect();
        let matched = candidates.iter().map(|n| n.generation()).zip(matched).collect();
        let key = pick_key(self, ctx);
        LAST_PICK.with(|last| *last.borrow_mut() = Some(LastPick { key, hashes, matched }));
        let best = all.iter().flatten().copied().fold(f64::INFINITY, f64::min);
        let tolerance = (best * TIE_SHARE).max(TIE_MS);
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
            let key = (counters.in_flight(), counters.requests.load(Ordering::Relaxed));
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
            let matched =
                last.as_ref().filter(|l| l.key == key)?.matched.iter().find(|(g, _)| *g == node.generation())?.1;
            last.take().map(|l| (l.hashes, matched))
        });
        let (hashes, matched) = picked.unwrap_or_else(|| {
            let hashes = self.table.block_hashes(ctx);
            let matched = self.table.matched(&hashes, std::slice::from_ref(node))[0];
            (hashes, matched)
        });
        let capacity = node
            .engine_load(u64::MAX, now_ms())
            .and_then(|l| l.kv_capacity_tokens)
            .or(Some(self.typical_capacity.load(Ordering::Relaxed)).filter(|&c| c > 0));
        let uncached = self.uncached(ctx, matched);
        let prompt = ctx.prompt.map_or(0, <[u8]>::len);
        self.table.learn(node, &hashes, capacity);
        Prediction {
            prefill: u64::try_from(uncached).unwrap_or(u64::MAX),
            cached: u64::try_from(prompt - uncached).unwrap_or(u64::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::testing::*;
    use super::*;

    const WEIGHTS: ScoreWeights = ScoreWeights { prefix: 2.0, queue: 1.0 };

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
        for i in 0..20 {
            let kib = f64::from(i % 8 + 1);
            speed.first_token(kib, 10.0 + ms_per_kib * kib);
            speed.decoded(decode_ms);
        }
        speed.batch_full(slots);
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
        // Four requests there: the fifth waits for one of four places, 125 ms < 2 x 400 ms.
        set_in_flight(&nodes[home], 4);
        assert_eq!(route(&policy, &nodes, format!("{system} second").as_bytes()), home);
        // Twelve: 9 x 125 ms > 800 ms; another node is cheaper now, and learns the prompt too.
        set_in_flight(&nodes[home], 12);
        let other = route(&policy, &nodes, format!("{system} third").as_bytes());
        assert_ne!(other, home);
        let estimates = policy.estimates(&nodes, &ctx(format!("{system} fourth").as_bytes()));
        let third = (0..3).find(|&i| i != home && i != other).unwrap();
        let own = |i: usize| estimates[i].unwrap().own;
        assert!(own(other) < 10.0 && own(third) > 390.0, "{estimates:?}");
        assert!((estimates[home].unwrap().slot_wait - 9.0 * 125.0).abs() < 1.0, "{estimates:?}");
    }

    #[test]
    fn weights_are_configurable_and_only_the_two() {
        let w = WEIGHTS.with_overrides("prefix=1, queue=0.5").unwrap();
        assert_eq!(w, ScoreWeights { prefix: 1.0, queue: 0.5 });
        for bad in ["prefix", "prefix=-1", "speed=2", "kv=1", "load=1", "queue=inf", "queue=x"] {
            assert!(WEIGHTS.with_overrides(bad).is_err(), "{bad}");
        }
        // Waits not counted: the node holding the prompt wins however long its queue.
        let (_reg, nodes) = nodes(2);
        for node in &nodes {
            learn(node, 50.0, 500.0, 4);
        }
        let blind = scored(WEIGHTS.with_overrides("queue=0").unwrap());
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
            let n = crate::select::select(&reg.load(), &ctx(prompt.as_bytes()), &policy, None).unwrap();
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
            set_in_flight(node, 12);
        }
        assert_eq!(route(&policy, &nodes, shared.as_bytes()), 2);
    }

    #[test]
    fn whole_answers_spread_a_held_prompt_once_its_wait_outgrows_a_prefill() {
        let (_reg, nodes) = nodes(2);
        let policy = scored(WEIGHTS);
        let prompt = "w".repeat(8192);
        let home = route(&policy, &nodes, prompt.as_bytes());
        // Whole answers of 10 ms for 8 KiB prefilled, one in flight: prefill is no slower than
        // 1.25 ms a KiB (20 ms for this prompt, twice over), each request in flight adds 10 ms.
        for node in &nodes {
            node.counters().speed.served(10.0, 1, Some(8.0));
        }
        set_in_flight(&nodes[home], 1);
        assert_eq!(route(&policy, &nodes, prompt.as_bytes()), home, "10 ms of wait < 20 ms of prefill");
        set_in_flight(&nodes[home], 5);
        assert_ne!(route(&policy, &nodes, prompt.as_bytes()), home, "50 ms of wait > 20 ms of prefill");
    }

    #[test]
    fn when_every_node_is_prefilling_the_one_sent_its_prompt_longest_ago_is_chosen() {
        let (_reg, nodes) = nodes(3);
        let policy = scored(WEIGHTS);
        let now = now_ms();
        for (node, age_ms) in nodes.iter().zip([50, 400, 100]) {
            let counters = node.counters();
            for _ in 0..8 {
                counters.speed.first_token(1.0, 102.4); // about 10 bytes per ms
            }
            counters.prefill_pending_bytes.fetch_add(8 * 1024, Ordering::Relaxed);
            counters.prefill_pending_byte_ms.fetch_add((8 * 1024u64).wrapping_mul(now - age_ms), Ordering::Relaxed);
        }
        let prompt = "c".repeat(1024);
        assert_eq!(policy.pick(&nodes, &ctx(prompt.as_bytes())), Some(1));
    }

    #[test]
    fn prefill_sent_and_not_yet_answered_counts_until_the_first_byte() {
        let (reg, nodes) = nodes(2);
        let policy = scored(WEIGHTS);
        let long = "a".repeat(8 * 1024);
        // Two different 8 KiB prompts: the second avoids the node still prefilling the first.
        let first = crate::select::select(&reg.load(), &ctx(long.as_bytes()), &policy, None).unwrap();
        let pending = first.node().counters().prefill_pending_bytes.load(Ordering::Relaxed);
        assert_eq!(pending, 8 * 1024);
        let other = "b".repeat(8 * 1024);
        let second = crate::select::select(&reg.load(), &ctx(other.as_bytes()), &policy, None).unwrap();
        assert_ne!(second.node().url(), first.node().url());
        first.first_byte_seen();
        first.first_byte_seen();
        assert_eq!(first.node().counters().prefill_pending_bytes.load(Ordering::Relaxed), 0, "released once");
        let node = Arc::clone(second.node());
        drop(second);
        assert_eq!(node.counters().prefill_pending_bytes.load(Ordering::Relaxed), 0, "and at the end at the latest");
        for node in [first.node(), &node] {
            assert_eq!(node.counters().prefill_pending_byte_ms.load(Ordering::Relaxed), 0, "their send times too");
        }
        assert_eq!(nodes.len(), 2);
    }

    #[test]
    fn a_streamed_first_token_teaches_the_engine_its_speed() {
        let (reg, nodes) = nodes(1);
        let policy = scored(WEIGHTS);
        let prompt = "t".repeat(4096);
        let streamed = SelectCtx { stream: true, ..ctx(prompt.as_bytes()) };
        for _ in 0..5 {
            let permit = crate::select::select(&reg.load(), &streamed, &policy, None).unwrap();
            permit.first_byte_seen();
        }
        assert!(nodes[0].counters().speed.speed().samples > 4.0);
        let whole = crate::select::select(&reg.load(), &ctx(prompt.as_bytes()), &policy, None).unwrap();
        whole.first_byte_seen();
        assert!(nodes[0].counters().speed.speed().samples < 5.0, "a whole answer's first byte times no token");
    }
}

//! Admission: when every candidate node is at its cap, requests wait here, bounded in number
//! and in time. A released permit wakes the waiter its node serves that comes first:
//!
//! - by class: a smaller `priority` first (vLLM's convention);
//! - within a class, tenant after tenant in turn, each tenant's requests in arrival order, so a
//!   tenant that sends ten times more waits longer, not the others;
//! - every `AGING_EVERY`-th slot goes to the request that has waited longest in a less urgent
//!   class than the most urgent one waiting: the lowest class still gets at least that share of
//!   the slots freed while it waits.
//!
//! Nothing already running is preempted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::node::{Node, NodeState, Role};
use crate::observe::histogram::{Histogram, Latency};
use crate::tenants::Class;

/// One slot in this many goes to the longest-waiting request, whatever its class.
pub(crate) const AGING_EVERY: u64 = 8;

#[derive(Debug)]
struct Waiting {
    id: u64,
    /// Arrival order (kept when a woken request has to wait again).
    seq: u64,
    role: Role,
    model: Option<String>,
    class: Class,
    wake: oneshot::Sender<()>,
}

/// A place in the queue.
#[derive(Debug)]
pub(crate) struct Ticket {
    pub(crate) id: u64,
    pub(crate) woken: oneshot::Receiver<()>,
    seq: u64,
    class: Class,
}

#[derive(Debug, Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// Slots handed out so far (every `AGING_EVERY`-th goes to the oldest waiter).
    wakes: u64,
    /// Per priority: the tenant that was served last (the next in turn comes after it).
    last_tenant: HashMap<i32, u32>,
}

#[derive(Debug)]
pub struct Admission {
    queue: Mutex<Queue>,
    queued: AtomicUsize,
    capacity: usize,
    next_id: AtomicU64,
    completions: RateMeter,
    /// How long queued requests waited, until served or turned away.
    pub(crate) waited: Histogram<Latency>,
}

impl Admission {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: Mutex::default(),
            queued: AtomicUsize::new(0),
            capacity,
            next_id: AtomicU64::new(0),
            completions: RateMeter::new(),
            waited: Histogram::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Joins the queue, or `None` when it is full.
    pub(crate) fn enqueue(&self, role: Role, model: Option<&str>, class: Class) -> Option<Ticket> {
        let mut queue = self.lock();
        if queue.waiting.len() >= self.capacity {
            return None;
        }
        let seq = self.next_id.fetch_add(1, Ordering::Relaxed);
        Some(self.push(&mut queue, role, model, class, seq))
    }

    /// Back into the queue, in its old place, for a request that was woken but lost its slot
    /// (whatever the queue's length: it was counted in it already).
    pub(crate) fn requeue(&self, role: Role, model: Option<&str>, ticket: &Ticket) -> Ticket {
        let mut queue = self.lock();
        self.push(&mut queue, role, model, ticket.class, ticket.seq)
    }

    fn push(&self, queue: &mut Queue, role: Role, model: Option<&str>, class: Class, seq: u64) -> Ticket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (wake, woken) = oneshot::channel();
        queue.waiting.push(Waiting { id, seq, role, model: model.map(str::to_owned), class, wake });
        self.queued.store(queue.waiting.len(), Ordering::Release);
        Ticket { id, woken, seq, class }
    }

    /// Leaves the queue (served, timed out or cancelled). Returns false when the ticket was
    /// no longer queued because a release had woken it: if that wake goes unused, pass it on
    /// with `pass_on`, or a slot would stay idle while others wait.
    pub(crate) fn leave(&self, id: u64) -> bool {
        let mut queue = self.lock();
        let before = queue.waiting.len();
        queue.waiting.retain(|w| w.id != id);
        let was_queued = queue.waiting.len() < before;
        self.queued.store(queue.waiting.len(), Ordering::Release);
        was_queued
    }

    /// Wakes the next request of `role` (a wake its receiver did not use).
    pub(crate) fn pass_on(&self, role: Role) {
        let mut queue = self.lock();
        queue.wake_next(|w| w.role == role);
        self.queued.store(queue.waiting.len(), Ordering::Release);
    }

    /// True when a queued request of `role` for `model`, of a class at least as urgent as
    /// `class`, could take a slot on these nodes: newcomers then queue behind it instead of
    /// taking the slot first.
    pub(crate) fn has_waiter_for(&self, role: Role, model: Option<&str>, class: Class) -> bool {
        self.queued() > 0
            && self.lock().waiting.iter().any(|w| {
                w.role == role
                    && w.class.priority <= class.priority
                    && (w.model.is_none() || w.model.as_deref() == model)
            })
    }

    /// A permit on `node` was released: wake the next request it can serve.
    pub(crate) fn released(&self, node: &Node) {
        self.completions.tick();
        if self.queued() == 0 || node.counters().state() != NodeState::Healthy {
            return;
        }
        let mut queue = self.lock();
        queue.wake_next(|w| serves(node, w));
        self.queued.store(queue.waiting.len(), Ordering::Release);
    }

    /// Seconds a rejected client should wait: the time the queue takes to drain at the
    /// observed completion rate, between 1 and 60.
    pub(crate) fn retry_after(&self) -> u32 {
        let rate = self.completions.per_second().max(0.1);
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let seconds = ((self.queued() + 1) as f64 / rate).ceil() as u32;
        seconds.clamp(1, 60)
    }
}

impl Queue {
    /// Removes and wakes the waiter that comes next among those `eligible` (see the module's
    /// order); waiters that gave up are skipped.
    fn wake_next(&mut self, eligible: impl Fn(&Waiting) -> bool) {
        while let Some(pos) = self.next(&eligible) {
            let waiting = self.waiting.swap_remove(pos);
            self.last_tenant.insert(waiting.class.priority, waiting.class.tenant);
            if waiting.wake.send(()).is_ok() {
                return;
            }
        }
    }

    fn next(&mut self, eligible: &impl Fn(&Waiting) -> bool) -> Option<usize> {
        self.wakes += 1;
        let oldest = |candidates: &mut dyn Iterator<Item = (usize, &Waiting)>| {
            candidates.min_by_key(|(_, w)| w.seq).map(|(i, _)| i)
        };
        let priority = self.waiting.iter().filter(|w| eligible(w)).map(|w| w.class.priority).min()?;
        if self.wakes % AGING_EVERY == 0 {
            // The longest waiter of a less urgent class, if any waits (within one class, the
            // tenants' turns already keep everyone moving).
            let lower = oldest(
                &mut self.waiting.iter().enumerate().filter(|(_, w)| eligible(w) && w.class.priority > priority),
            );
            if lower.is_some() {
                return lower;
            }
        }
        let in_class = |w: &Waiting| eligible(w) && w.class.priority == priority;
        // The next tenant in turn after the one served last in this class (cyclically).
        let last = self.last_tenant.get(&priority).copied();
        let tenants = self.waiting.iter().filter(|w| in_class(w)).map(|w| w.class.tenant);
        let after = last.and_then(|last| tenants.clone().filter(|&t| t > last).min());
        let tenant = after.or_else(|| tenants.min())?;
        oldest(&mut self.waiting.iter().enumerate().filter(|(_, w)| in_class(w) && w.class.tenant == tenant))
    }
}

fn serves(node: &Node, waiting: &Waiting) -> bool {
    node.role() == waiting.role
        && match &waiting.model {
            None => !node.models().is_empty(),
            Some(m) => node.models().iter().any(|n| n == m),
        }
}

/// Events per second over a sliding pair of 5-second windows. Lock-free; a lost update
/// under a race only skews the estimate.
#[derive(Debug)]
struct RateMeter {
    epoch: Instant,
    window_start_ms: AtomicU64,
    count: AtomicU64,
    previous_per_second_milli: AtomicU64,
}

const RATE_WINDOW_MS: u64 = 5_000;

impl RateMeter {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            window_start_ms: AtomicU64::new(0),
            count: AtomicU64::new(0),
            previous_per_second_milli: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn tick(&self) {
        self.roll();
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn roll(&self) {
        let now = self.now_ms();
        let start = self.window_start_ms.load(Ordering::Relaxed);
        let elapsed = now.saturating_sub(start);
        if elapsed >= RATE_WINDOW_MS
            && self.window_start_ms.compare_exchange(start, now, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            let count = self.count.swap(0, Ordering::AcqRel);
            self.previous_per_second_milli.store(count * 1_000_000 / elapsed.max(1), Ordering::Relaxed);
        }
    }

    fn per_second(&self) -> f64 {
        self.roll();
        let elapsed = self.now_ms().saturating_sub(self.window_start_ms.load(Ordering::Relaxed)).max(1);
        #[allow(clippy::cast_precision_loss)]
        let current = self.count.load(Ordering::Relaxed) as f64 * 1000.0 / elapsed as f64;
        #[allow(clippy::cast_precision_loss)]
        let previous = self.previous_per_second_milli.load(Ordering::Relaxed) as f64 / 1000.0;
        current.max(previous)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engine::permit::InFlightPermit;
    use crate::node::registry::Registry;
    use crate::node::NodeSpec;

    fn capped(reg: &Registry, url: &str, model: &str) -> Arc<Node> {
        reg.add(url, NodeSpec { models: vec![model.into()], max_concurrency: Some(1), ..NodeSpec::default() }).unwrap()
    }

    fn class(priority: i32, tenant: u32) -> Class {
        Class { priority, tenant }
    }

    #[test]
    fn bounded() {
        let admission = Admission::new(2);
        let first = admission.enqueue(Role::Hybrid, Some("m"), Class::default()).unwrap();
        let _second = admission.enqueue(Role::Hybrid, Some("m"), Class::default()).unwrap();
        assert!(admission.enqueue(Role::Hybrid, Some("m"), Class::default()).is_none(), "the queue is bounded");
        admission.leave(first.id);
        assert_eq!(admission.queued(), 1);
        assert!(admission.has_waiter_for(Role::Hybrid, Some("m"), Class::default()));
        assert!(!admission.has_waiter_for(Role::Hybrid, Some("m"), class(-1, 0)), "a more urgent class goes first");
        assert!(!admission.has_waiter_for(Role::Decode, Some("m"), Class::default()));
    }

    #[test]
    fn release_wakes_a_waiter_the_node_serves() {
        let reg = Registry::new();
        let admission = Arc::new(Admission::new(8));
        let a = capped(&reg, "h:1", "a");
        let held = InFlightPermit::try_acquire(&a, Some(&admission)).unwrap();
        let mut for_b = admission.enqueue(Role::Hybrid, Some("b"), Class::default()).unwrap();
        let mut for_a = admission.enqueue(Role::Hybrid, Some("a"), Class::default()).unwrap();
        drop(held);
        assert!(for_a.woken.try_recv().is_ok(), "the waiter for `a` is woken");
        assert!(for_b.woken.try_recv().is_err(), "`a`'s node cannot serve `b`");
        assert_eq!(admission.queued(), 1);
    }

    #[test]
    fn a_gone_waiter_passes_the_slot_on() {
        let reg = Registry::new();
        let admission = Arc::new(Admission::new(8));
        let a = capped(&reg, "h:1", "a");
        let held = InFlightPermit::try_acquire(&a, Some(&admission)).unwrap();
        drop(admission.enqueue(Role::Hybrid, None, Class::default()).unwrap());
        let mut alive = admission.enqueue(Role::Hybrid, None, Class::default()).unwrap();
        drop(held);
        assert!(alive.woken.try_recv().is_ok());
    }

    #[test]
    fn retry_after_is_bounded() {
        let admission = Admission::new(1000);
        assert_eq!(admission.retry_after(), 10, "no completions seen: one request at the floor rate of 0.1/s");
        for _ in 0..500 {
            admission.completions.tick();
        }
        assert_eq!(admission.retry_after(), 1);
    }

    /// Which of `tickets` the next `slots` releases of one node wake, in order.
    fn served(node: &Arc<Node>, admission: &Arc<Admission>, tickets: &mut [(char, Ticket)], slots: usize) -> String {
        let mut order = String::new();
        for _ in 0..slots {
            drop(InFlightPermit::try_acquire(node, Some(admission)).unwrap());
            for (name, ticket) in tickets.iter_mut() {
                if ticket.woken.try_recv().is_ok() {
                    order.push(*name);
                }
            }
        }
        order
    }

    #[test]
    fn urgent_classes_first_tenants_in_turn_and_the_oldest_every_eighth_slot() {
        let reg = Registry::new();
        let admission = Arc::new(Admission::new(64));
        let node = reg.add("h:1", NodeSpec { models: vec!["m".into()], ..NodeSpec::default() }).unwrap();
        let mut tickets = Vec::new();
        // Low priority first in time (l), then tenant 1 sends nine (a) and tenant 2 three (b).
        tickets.push(('l', admission.enqueue(Role::Hybrid, Some("m"), class(5, 1)).unwrap()));
        for _ in 0..9 {
            tickets.push(('a', admission.enqueue(Role::Hybrid, Some("m"), class(0, 1)).unwrap()));
        }
        for _ in 0..3 {
            tickets.push(('b', admission.enqueue(Role::Hybrid, Some("m"), class(0, 2)).unwrap()));
        }
        let order = served(&node, &admission, &mut tickets, 13);
        // Turns between the tenants while both wait; the 8th slot to the oldest: the low one.
        assert_eq!(order, "abababalaaaaa");
        assert_eq!(admission.queued(), 0);
    }
}

//! Admission: when every candidate node is at its cap, requests wait here in FIFO order,
//! bounded in number and in time. A released permit wakes the first waiter its node can
//! serve, so a freed slot goes to the request that has waited longest.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::histogram::{Histogram, Latency};
use crate::node::{Node, NodeState, Role};

#[derive(Debug)]
struct Waiting {
    id: u64,
    role: Role,
    model: Option<String>,
    wake: oneshot::Sender<()>,
}

/// A place in the queue.
#[derive(Debug)]
pub struct Ticket {
    pub id: u64,
    pub woken: oneshot::Receiver<()>,
}

#[derive(Debug)]
pub struct Admission {
    queue: Mutex<VecDeque<Waiting>>,
    queued: AtomicUsize,
    capacity: usize,
    next_id: AtomicU64,
    completions: RateMeter,
    /// How long queued requests waited, until served or turned away.
    pub waited: Histogram<Latency>,
}

impl Admission {
    pub fn new(capacity: usize) -> Self {
        Self {
            queue: Mutex::default(),
            queued: AtomicUsize::new(0),
            capacity,
            next_id: AtomicU64::new(0),
            completions: RateMeter::new(),
            waited: Histogram::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Waiting>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Joins the queue (at its head for a request that was woken but lost its slot), or
    /// `None` when the queue is full.
    pub fn enqueue(&self, role: Role, model: Option<&str>, at_front: bool) -> Option<Ticket> {
        let mut queue = self.lock();
        if !at_front && queue.len() >= self.capacity {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (wake, woken) = oneshot::channel();
        let waiting = Waiting { id, role, model: model.map(str::to_owned), wake };
        if at_front {
            queue.push_front(waiting);
        } else {
            queue.push_back(waiting);
        }
        self.queued.store(queue.len(), Ordering::Release);
        Some(Ticket { id, woken })
    }

    /// Leaves the queue (served, timed out or cancelled). Returns false when the ticket was
    /// no longer queued because a release had woken it: if that wake goes unused, pass it on
    /// with `pass_on`, or a slot would stay idle while others wait.
    pub fn leave(&self, id: u64) -> bool {
        let mut queue = self.lock();
        let before = queue.len();
        queue.retain(|w| w.id != id);
        let was_queued = queue.len() < before;
        self.queued.store(queue.len(), Ordering::Release);
        was_queued
    }

    /// Wakes the longest-waiting request of `role` (a wake its receiver did not use).
    pub fn pass_on(&self, role: Role) {
        let mut queue = self.lock();
        wake_first(&mut queue, |w| w.role == role);
        self.queued.store(queue.len(), Ordering::Release);
    }

    /// True when a queued request could take a slot on nodes of `role` serving `model`:
    /// newcomers then queue behind it instead of taking the slot first.
    pub fn has_waiter_for(&self, role: Role, model: Option<&str>) -> bool {
        self.queued() > 0
            && self.lock().iter().any(|w| w.role == role && (w.model.is_none() || w.model.as_deref() == model))
    }

    /// A permit on `node` was released: wake the longest-waiting request it can serve.
    pub(crate) fn released(&self, node: &Node) {
        self.completions.tick();
        if self.queued() == 0 || node.counters().state() != NodeState::Healthy {
            return;
        }
        let mut queue = self.lock();
        wake_first(&mut queue, |w| serves(node, w));
        self.queued.store(queue.len(), Ordering::Release);
    }

    /// Seconds a rejected client should wait: the time the queue takes to drain at the
    /// observed completion rate, between 1 and 60.
    pub fn retry_after(&self) -> u32 {
        let rate = self.completions.per_second().max(0.1);
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let seconds = ((self.queued() + 1) as f64 / rate).ceil() as u32;
        seconds.clamp(1, 60)
    }
}

/// Removes and wakes the first waiter that `accepts`; waiters that gave up are skipped.
fn wake_first(queue: &mut VecDeque<Waiting>, accepts: impl Fn(&Waiting) -> bool) {
    while let Some(waiting) = queue.iter().position(&accepts).and_then(|pos| queue.remove(pos)) {
        if waiting.wake.send(()).is_ok() {
            return;
        }
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
    use crate::node::NodeSpec;
    use crate::permit::InFlightPermit;
    use crate::registry::Registry;

    fn capped(reg: &Registry, url: &str, model: &str) -> Arc<Node> {
        reg.add(url, NodeSpec { models: vec![model.into()], max_concurrency: Some(1), ..NodeSpec::default() }).unwrap()
    }

    #[test]
    fn bounded_fifo() {
        let admission = Admission::new(2);
        let first = admission.enqueue(Role::Hybrid, Some("m"), false).unwrap();
        let _second = admission.enqueue(Role::Hybrid, Some("m"), false).unwrap();
        assert!(admission.enqueue(Role::Hybrid, Some("m"), false).is_none(), "the queue is bounded");
        admission.leave(first.id);
        assert_eq!(admission.queued(), 1);
        assert!(admission.has_waiter_for(Role::Hybrid, Some("m")));
        assert!(!admission.has_waiter_for(Role::Decode, Some("m")));
    }

    #[test]
    fn release_wakes_the_oldest_waiter_the_node_serves() {
        let reg = Registry::new();
        let admission = Arc::new(Admission::new(8));
        let a = capped(&reg, "h:1", "a");
        let held = InFlightPermit::try_acquire(&a, Some(&admission)).unwrap();
        let mut for_b = admission.enqueue(Role::Hybrid, Some("b"), false).unwrap();
        let mut for_a = admission.enqueue(Role::Hybrid, Some("a"), false).unwrap();
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
        drop(admission.enqueue(Role::Hybrid, None, false).unwrap());
        let mut alive = admission.enqueue(Role::Hybrid, None, false).unwrap();
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
}

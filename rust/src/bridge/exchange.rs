//! One request/response exchange between the pump task (tokio) and its reader (Python).
//!
//! The pump reads the node's body as fast as it arrives and keeps it here; the reader takes
//! everything complete in one step. When the reader finds nothing ready it leaves a waiter,
//! which the pump completes with the next batch. So a reader that keeps up never waits on a
//! thread hand-off, and one that falls behind gets a whole burst at once. No event is ever
//! split across batches, and the bytes are exactly the node's.

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::engine::permit::{InFlightPermit, Report};
use crate::error::{Error, Kind};
use crate::node::Outcome;
use crate::sse;
use crate::upstream::forward::StreamBody;

/// What the reader gets.
#[derive(Debug)]
pub enum Delivery {
    Batch(Bytes),
    End,
    Failed(Error),
}

/// Completes a reader that found nothing ready. Runs on a runtime thread.
pub(crate) type Waiter = Box<dyn FnOnce(Delivery) + Send>;

#[derive(Default)]
struct Inner {
    pending: BytesMut,
    /// Bytes of `pending` already scanned for an event boundary.
    scanned: usize,
    event_stream: bool,
    /// How the body ended, once it has; reported after `pending` is drained.
    end: Option<Result<(), Error>>,
    waiter: Option<Waiter>,
    closed: bool,
    /// The node's permit, held here so that closing releases it at once, on any thread.
    permit: Option<InFlightPermit>,
}

/// Shared by the pump task and the Python `Response`.
pub struct Exchange {
    inner: Mutex<Inner>,
    /// Signalled when the reader takes data, so a pump held back by a full buffer resumes.
    space: Notify,
    task: OnceLock<AbortHandle>,
    /// The pump holds back once this many bytes wait for the reader (slow clients).
    buffer_limit: usize,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange").field("closed", &self.is_closed()).finish_non_exhaustive()
    }
}

impl Exchange {
    pub fn new(buffer_limit: usize) -> Self {
        Self { inner: Mutex::default(), space: Notify::new(), task: OnceLock::new(), buffer_limit }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds the request's permit until the exchange ends.
    pub(crate) fn attach(&self, permit: InFlightPermit) {
        let mut inner = self.lock();
        if inner.closed {
            drop(inner);
            drop(permit); // closed before it started: counts as cancelled
            return;
        }
        inner.permit = Some(permit);
    }

    /// Releases the permit with the request's outcome (once; later calls do nothing).
    pub(crate) fn release(&self, outcome: Outcome, report: Report) {
        let permit = self.lock().permit.take();
        if let Some(mut permit) = permit {
            permit.set_outcome(outcome);
            permit.set_report(report);
        }
    }

    /// Ties the exchange to the task that forwards the request and pumps the body.
    pub(crate) fn set_task(&self, task: AbortHandle) {
        let _ = self.task.set(task);
    }

    /// Takes everything ready, if anything is.
    pub fn take_ready(&self) -> Option<Delivery> {
        let delivery = self.lock().ready(self.buffer_limit);
        if delivery.is_some() {
            self.space.notify_one();
        }
        delivery
    }

    /// Keeps `waiter` for the next batch, unless one is ready by now: then it is handed
    /// back with the batch.
    pub fn wait(&self, waiter: Waiter) -> Result<(), (Delivery, Waiter)> {
        let mut inner = self.lock();
        if let Some(delivery) = inner.ready(self.buffer_limit) {
            drop(inner);
            self.space.notify_one();
            return Err((delivery, waiter));
        }
        inner.waiter = Some(waiter);
        Ok(())
    }

    /// Stops the exchange now: the node's connection is dropped and its permit released.
    /// Returns a waiting reader's waiter, to be completed with `Delivery::End`.
    pub(crate) fn close(&self) -> Option<Waiter> {
        if let Some(task) = self.task.get() {
            task.abort();
        }
        let mut inner = self.lock();
        inner.closed = true;
        inner.pending.clear();
        inner.end.get_or_insert(Ok(()));
        let permit = inner.permit.take();
        let waiter = inner.waiter.take();
        drop(inner);
        drop(permit); // outcome unset: counted as cancelled
        waiter
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The pump's side: appends body bytes; completes a waiting reader when a batch is ready.
    fn push(&self, burst: &[Bytes], gap: Option<Duration>, events: u64) {
        if burst.is_empty() {
            return;
        }
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        if let Some(permit) = &inner.permit {
            permit.first_byte_seen();
            for data in burst {
                permit.saw(data);
            }
            // Each event's gap to the one before: events that came together had none.
            let itl = &permit.node().counters().itl;
            if let Some(gap) = gap {
                itl.observe(gap);
            }
            itl.observe_zeros(events.saturating_sub(1));
        }
        for data in burst {
            inner.pending.extend_from_slice(data);
        }
        self.wake(inner);
    }

    /// Ends the exchange with `error` (the router shuts down, the request ran out of time):
    /// the permit is released with `outcome` and the reader gets the error after any whole
    /// events still buffered.
    pub(crate) fn fail(&self, error: Error, outcome: Outcome) {
        self.release(outcome, Report::default());
        self.finish(Err(error));
    }

    fn finish(&self, end: Result<(), Error>) {
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        if end.is_err() && inner.event_stream {
            // Whole events still go out; a torn trailing event could never parse.
            let whole = sse::last_event_end(&inner.pending, 0).unwrap_or(0);
            inner.pending.truncate(whole);
            inner.scanned = whole;
        }
        inner.end = Some(end);
        self.wake(inner);
    }

    fn wake(&self, mut inner: MutexGuard<'_, Inner>) {
        if inner.waiter.is_some() {
            if let Some(delivery) = inner.ready(self.buffer_limit) {
                let waiter = inner.waiter.take();
                drop(inner);
                if let Some(waiter) = waiter {
                    waiter(delivery);
                }
            }
        }
    }

    fn over_limit(&self) -> bool {
        self.lock().pending.len() >= self.buffer_limit
    }
}

impl Inner {
    /// Whole events (everything, for other bodies), else how the body ended, else nothing.
    fn ready(&mut self, buffer_limit: usize) -> Option<Delivery> {
        // An event larger than the buffer goes out as it is (held back, it would stall the stream).
        let whole_only = self.event_stream && self.end.is_none() && self.pending.len() < buffer_limit;
        let batch = if whole_only {
            let end = sse::last_event_end(&self.pending, self.scanned);
            let batch = end.map(|end| self.pending.split_to(end));
            // What is left followed the last boundary, so it holds none.
            self.scanned = self.pending.len();
            batch
        } else {
            (!self.pending.is_empty()).then(|| self.pending.split())
        };
        if let Some(batch) = batch {
            self.scanned = self.pending.len();
            return Some(Delivery::Batch(batch.freeze()));
        }
        match self.end.take()? {
            Ok(()) => {
                self.end = Some(Ok(()));
                Some(Delivery::End)
            }
            // Report a failure once; afterwards the body has simply ended.
            Err(e) => {
                self.end = Some(Ok(()));
                Some(Delivery::Failed(e))
            }
        }
    }
}

/// How long a stream may wait on either side.
#[derive(Debug, Clone, Copy)]
pub struct StreamTimeouts {
    /// Silence of the node between two pieces of its body.
    pub idle: Duration,
    /// A reader that does not take what is buffered (a stalled client).
    pub stall: Duration,
}

/// Reads the node's body into `exchange` until it ends, fails, goes idle for longer than
/// `idle_timeout`, or the exchange is closed (which aborts this task). The exchange's permit
/// is released when the body ends: `outcome_at_end` if it ended cleanly, else a failure.
/// `observe` sees every piece and the events it ended (a tenant's token count).
pub async fn pump(
    exchange: &Exchange,
    body: StreamBody,
    started: Instant,
    timeouts: StreamTimeouts,
    outcome_at_end: Outcome,
    observe: &mut (dyn FnMut(&[u8], u64) + Send),
) {
    let StreamTimeouts { idle: idle_timeout, stall: stall_timeout } = timeouts;
    let StreamBody { mut body, event_stream } = body;
    exchange.lock().event_stream = event_stream;
    let mut report = Report::default();
    let mut last_was_newline = false;
    let mut burst: Vec<Bytes> = Vec::new();
    let mut burst_events = 0u64;
    let mut last_chunk: Option<Instant> = None;
    let end = loop {
        if exchange.over_limit() {
            // The client reads slower than the node writes: wait for it, but not forever.
            if tokio::time::timeout(stall_timeout, exchange.space.notified()).await.is_err() {
                break Err(Error::new(Kind::Timeout, "the client stopped reading the stream"));
            }
            continue;
        }
        let Ok(mut next) = tokio::time::timeout(idle_timeout, body.frame()).await else {
            break Err(Error::new(Kind::Timeout, "the node sent nothing for too long"));
        };
        // Take whatever else is ready without waiting, so one hand-over carries a burst.
        let ended = loop {
            match next {
                None => break Some(Ok(())),
                Some(Err(e)) => {
                    break Some(Err(Error::with_source(Kind::Upstream, "the node broke off the response", e)))
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        report.first_byte.get_or_insert_with(|| started.elapsed());
                        let events = sse::count_events(&data, &mut last_was_newline);
                        report.events += events;
                        burst_events += events;
                        observe(&data, events);
                        burst.push(data);
                    }
                }
            }
            match body.frame().now_or_never() {
                Some(frame) => next = frame,
                None => break None,
            }
        };
        let now = Instant::now();
        let gap = if burst.is_empty() { None } else { last_chunk.replace(now).map(|last| now - last) };
        exchange.push(&burst, gap, burst_events);
        burst_events = 0;
        burst.clear();
        if let Some(end) = ended {
            break end;
        }
    };
    exchange.release(if end.is_ok() { outcome_at_end } else { Outcome::Failed }, report);
    exchange.finish(end);
}

/// Relays a body the pipeline already accounts for (its permit, events and timers:
/// `edge::body::Relay`) into `exchange`, holding back while the reader is behind, but not longer
/// than `stall`. The exchange being closed aborts this task, and dropping the body ends it.
pub(crate) async fn relay<B>(exchange: &Exchange, mut body: B, stall: Duration)
where
    B: http_body::Body<Data = Bytes, Error = crate::error::BoxError> + Unpin,
{
    let end = loop {
        if exchange.over_limit() {
            if tokio::time::timeout(stall, exchange.space.notified()).await.is_err() {
                break Err(Error::new(Kind::Timeout, "the client stopped reading the stream"));
            }
            continue;
        }
        match body.frame().await {
            None => break Ok(()),
            Some(Err(e)) => {
                break Err(match e.downcast::<Error>() {
                    Ok(own) => *own,
                    Err(other) => Error::with_source(Kind::Upstream, "the node broke off the response", other),
                })
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    exchange.push(&[data], None, 0);
                }
            }
        }
    };
    exchange.finish(end);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::channel::{Channel, Sender};

    use super::*;
    use crate::engine::permit::InFlightPermit;
    use crate::error::BoxError;
    use crate::node::registry::Registry;
    use crate::node::{Counters, NodeSpec};

    const TIMEOUTS: StreamTimeouts = StreamTimeouts { idle: Duration::from_secs(5), stall: Duration::from_secs(5) };

    /// A body fed by the test, pumped into an exchange.
    fn pumped(event_stream: bool, buffer_limit: usize) -> (Sender<Bytes, BoxError>, Arc<Exchange>, Counters) {
        let (tx, body) = Channel::<Bytes, BoxError>::new(64);
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let counters = node.counters().clone();
        let exchange = Arc::new(Exchange::new(buffer_limit));
        exchange.attach(InFlightPermit::acquire(&node));
        let stream = StreamBody { body: body.boxed(), event_stream };
        let pumping = Arc::clone(&exchange);
        let task = tokio::spawn(async move {
            pump(&pumping, stream, Instant::now(), TIMEOUTS, Outcome::Succeeded, &mut |_, _| {}).await;
        });
        exchange.set_task(task.abort_handle());
        (tx, exchange, counters)
    }

    /// Waits for the next delivery the way the Python side does.
    async fn next(exchange: &Exchange) -> Delivery {
        if let Some(d) = exchange.take_ready() {
            return d;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        match exchange.wait(Box::new(move |d| drop(tx.send(d)))) {
            Ok(()) => rx.await.unwrap(),
            Err((d, _)) => d,
        }
    }

    fn batch(d: Delivery) -> Bytes {
        match d {
            Delivery::Batch(b) => b,
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_burst_is_one_batch_of_whole_events() {
        let (mut tx, exchange, counters) = pumped(true, 1 << 20);
        for piece in ["data: 1\n\nda", "ta: 2\n", "\ndata: 3\n\ndata: 4"] {
            tx.send_data(Bytes::from(piece)).await.unwrap();
        }
        settle().await;
        assert_eq!(batch(next(&exchange).await), "data: 1\n\ndata: 2\n\ndata: 3\n\n");
        tx.send_data(Bytes::from("\n\n")).await.unwrap();
        drop(tx);
        assert_eq!(batch(next(&exchange).await), "data: 4\n\n");
        assert!(matches!(next(&exchange).await, Delivery::End));
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.succeeded), (0, 1));
    }

    #[tokio::test]
    async fn a_partial_event_waits_for_its_end() {
        let (mut tx, exchange, _counters) = pumped(true, 1 << 20);
        tx.send_data(Bytes::from("data: {\"a\":")).await.unwrap();
        settle().await;
        assert!(exchange.take_ready().is_none(), "no event is complete yet");
        tx.send_data(Bytes::from("1}\r\n\r\n")).await.unwrap();
        assert_eq!(batch(next(&exchange).await), "data: {\"a\":1}\r\n\r\n");
    }

    #[tokio::test]
    async fn other_bodies_pass_as_they_come() {
        let (mut tx, exchange, _counters) = pumped(false, 1 << 20);
        tx.send_data(Bytes::from("{\"partial\":")).await.unwrap();
        assert_eq!(batch(next(&exchange).await), "{\"partial\":");
    }

    #[tokio::test]
    async fn a_torn_stream_keeps_whole_events_then_fails() {
        let (mut tx, exchange, counters) = pumped(true, 1 << 20);
        tx.send_data(Bytes::from("data: 1\n\ndata: 2")).await.unwrap();
        settle().await;
        tx.abort("connection reset".into());
        settle().await;
        assert_eq!(batch(next(&exchange).await), "data: 1\n\n");
        assert!(matches!(next(&exchange).await, Delivery::Failed(e) if e.kind() == Kind::Upstream));
        assert!(matches!(next(&exchange).await, Delivery::End));
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.failed), (0, 1));
    }

    #[tokio::test]
    async fn close_releases_at_once_and_ends_a_waiting_reader() {
        let (_tx, exchange, counters) = pumped(true, 1 << 20);
        let (tx, rx) = tokio::sync::oneshot::channel();
        assert!(exchange.wait(Box::new(move |d| drop(tx.send(d)))).is_ok());
        let waiter = exchange.close().expect("the waiting reader is handed back");
        // Released by close() itself, before the pump task has even noticed.
        assert_eq!(counters.snapshot().in_flight, 0);
        waiter(Delivery::End);
        assert!(matches!(rx.await.unwrap(), Delivery::End));
        settle().await;
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.cancelled), (0, 1));
        assert!(matches!(next(&exchange).await, Delivery::End));
    }

    #[tokio::test]
    async fn a_slow_reader_holds_the_node_back() {
        let (mut tx, exchange, _counters) = pumped(true, 64);
        let event = Bytes::from(format!("data: {}\n\n", "x".repeat(60)));
        // The pump stops reading once 64 bytes wait; the channel (64 deep) then fills up.
        let mut sent = 0;
        while tokio::time::timeout(Duration::from_millis(50), tx.send_data(event.clone())).await.is_ok() {
            sent += 1;
            assert!(sent < 1000, "the pump kept reading past its buffer limit");
        }
        let mut read = 0;
        while let Some(Delivery::Batch(b)) = exchange.take_ready() {
            read += b.len() / event.len();
            settle().await;
        }
        assert!(read >= 1);
    }

    #[tokio::test]
    async fn idle_node_times_out() {
        let (tx, body) = Channel::<Bytes, BoxError>::new(1);
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let counters = node.counters().clone();
        let exchange = Exchange::new(1 << 20);
        exchange.attach(InFlightPermit::acquire(&node));
        let stream = StreamBody { body: body.boxed(), event_stream: true };
        let timeouts = StreamTimeouts { idle: Duration::from_millis(20), stall: Duration::from_secs(5) };
        pump(&exchange, stream, Instant::now(), timeouts, Outcome::Succeeded, &mut |_, _| {}).await;
        assert!(matches!(exchange.take_ready(), Some(Delivery::Failed(e)) if e.is_timeout()));
        assert_eq!(counters.snapshot().failed, 1);
        drop(tx);
    }

    #[tokio::test]
    async fn a_stalled_reader_is_cut_off() {
        let (tx, body) = Channel::<Bytes, BoxError>::new(64);
        let node = Registry::new().add("h:1", NodeSpec::default()).unwrap();
        let exchange = Exchange::new(16);
        exchange.attach(InFlightPermit::acquire(&node));
        let stream = StreamBody { body: body.boxed(), event_stream: true };
        let mut tx = tx;
        tx.send_data(Bytes::from("data: 0123456789abcdef\n\n")).await.unwrap();
        let timeouts = StreamTimeouts { idle: Duration::from_secs(5), stall: Duration::from_millis(30) };
        // Nobody reads: past the stall limit the node is let go.
        pump(&exchange, stream, Instant::now(), timeouts, Outcome::Succeeded, &mut |_, _| {}).await;
        assert_eq!(node.counters().snapshot().in_flight, 0);
        assert!(matches!(exchange.take_ready(), Some(Delivery::Batch(_))));
        assert!(matches!(exchange.take_ready(), Some(Delivery::Failed(e)) if e.is_timeout()));
    }
}

//! The streamed response body, handed out in batches: each call returns everything the
//! node has sent so far, cut after the last complete SSE event, so a burst costs one
//! crossing into Python and no event is ever split across batches.

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::error::{BoxError, Error, Kind, Result};
use crate::permit::{InFlightPermit, Outcome};
use crate::sse;

#[derive(Debug)]
pub struct BodyStream {
    state: Mutex<State>,
    cancel: CancellationToken,
}

#[derive(Debug)]
struct State {
    /// `None` once the body ended, failed or was cancelled: the connection is released.
    body: Option<UpstreamBody>,
    pending: BytesMut,
    /// Bytes of `pending` already scanned for an event boundary.
    scanned: usize,
    event_stream: bool,
    /// An error met after some bytes were read: reported once those bytes are handed out.
    deferred: Option<Error>,
    permit: Option<InFlightPermit>,
    /// Outcome recorded when the body ends normally (a 5xx body still counts as a failure).
    outcome_at_end: Outcome,
}

enum Step {
    Data,
    End,
    Failed(Error),
}

/// The node's response body (boxed so tests can feed one from a channel).
pub type UpstreamBody = BoxBody<Bytes, BoxError>;

impl BodyStream {
    pub fn new(body: UpstreamBody, event_stream: bool, permit: InFlightPermit, outcome_at_end: Outcome) -> Self {
        Self {
            state: Mutex::new(State {
                body: Some(body),
                pending: BytesMut::new(),
                scanned: 0,
                event_stream,
                deferred: None,
                permit: Some(permit),
                outcome_at_end,
            }),
            cancel: CancellationToken::new(),
        }
    }

    /// The next batch of bytes, or `None` at the end (also after `cancel`).
    pub async fn next_batch(&self) -> Result<Option<Bytes>> {
        let mut state = self.state.lock().await;
        loop {
            if let Some(err) = state.deferred.take() {
                return Err(err);
            }
            let Some(body) = state.body.as_mut() else {
                return Ok(None);
            };
            let first = tokio::select! {
                biased;
                () = self.cancel.cancelled() => {
                    state.release(Outcome::Cancelled);
                    return Ok(None);
                }
                frame = body.frame() => read_frame(frame, &mut state.pending),
            };
            let mut step = first;
            // Take whatever else is ready without waiting, so one batch carries a burst.
            while matches!(step, Step::Data) {
                let Some(body) = state.body.as_mut() else { break };
                match body.frame().now_or_never() {
                    Some(frame) => step = read_frame(frame, &mut state.pending),
                    None => break,
                }
            }
            match step {
                Step::Data => {
                    if let Some(batch) = state.take_complete_events() {
                        return Ok(Some(batch));
                    }
                }
                Step::End => {
                    let outcome = state.outcome_at_end;
                    state.release(outcome);
                    return Ok(state.take_all());
                }
                Step::Failed(err) => {
                    state.release(Outcome::Failed);
                    // Whole events still go out; a torn trailing event could never parse.
                    let delivered = if state.event_stream { state.take_complete_events() } else { state.take_all() };
                    state.pending.clear();
                    match delivered {
                        Some(batch) => {
                            state.deferred = Some(err);
                            return Ok(Some(batch));
                        }
                        None => return Err(err),
                    }
                }
            }
        }
    }

    /// Stops the stream: the connection to the node is closed and the permit released now,
    /// or, if a `next_batch` is waiting, as soon as it wakes (at once).
    pub fn cancel(&self) {
        self.cancel.cancel();
        if let Ok(mut state) = self.state.try_lock() {
            state.release(Outcome::Cancelled);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

impl State {
    fn release(&mut self, outcome: Outcome) {
        self.body = None;
        if let Some(mut permit) = self.permit.take() {
            permit.set_outcome(outcome);
        }
    }

    /// Hands out whole events; for bodies that are not event streams, everything.
    fn take_complete_events(&mut self) -> Option<Bytes> {
        if !self.event_stream {
            return self.take_all();
        }
        if let Some(end) = sse::last_event_end(&self.pending, self.scanned) {
            let batch = self.pending.split_to(end).freeze();
            // What is left followed the last boundary, so it holds none.
            self.scanned = self.pending.len();
            Some(batch)
        } else {
            self.scanned = self.pending.len();
            None
        }
    }

    fn take_all(&mut self) -> Option<Bytes> {
        self.scanned = 0;
        (!self.pending.is_empty()).then(|| self.pending.split().freeze())
    }
}

fn read_frame(frame: Option<std::result::Result<hyper::body::Frame<Bytes>, BoxError>>, pending: &mut BytesMut) -> Step {
    match frame {
        None => Step::End,
        Some(Ok(frame)) => {
            // Trailers carry nothing the client of an OpenAI API needs; data is all we forward.
            if let Ok(data) = frame.into_data() {
                pending.extend_from_slice(&data);
            }
            Step::Data
        }
        Some(Err(e)) => Step::Failed(Error::with_source(Kind::Upstream, "the node broke off the response", e)),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::channel::{Channel, Sender};

    use super::*;
    use crate::node::NodeCounters;

    fn stream(event_stream: bool) -> (Sender<Bytes, BoxError>, BodyStream, Arc<NodeCounters>) {
        let (tx, body) = Channel::<Bytes, BoxError>::new(64);
        let counters = Arc::new(NodeCounters::default());
        let permit = InFlightPermit::acquire(&counters);
        (tx, BodyStream::new(body.boxed(), event_stream, permit, Outcome::Succeeded), counters)
    }

    fn in_flight(counters: &NodeCounters) -> u64 {
        counters.snapshot().in_flight
    }

    #[tokio::test]
    async fn a_burst_is_one_batch_of_whole_events() {
        let (mut tx, body, counters) = stream(true);
        for piece in ["data: 1\n\nda", "ta: 2\n", "\ndata: 3\n\ndata: 4"] {
            tx.send_data(Bytes::from(piece)).await.unwrap();
        }
        // Everything ready is handed over at once, up to the last complete event.
        assert_eq!(body.next_batch().await.unwrap().unwrap(), "data: 1\n\ndata: 2\n\ndata: 3\n\n");
        tx.send_data(Bytes::from("\n\n")).await.unwrap();
        drop(tx);
        assert_eq!(body.next_batch().await.unwrap().unwrap(), "data: 4\n\n");
        assert!(body.next_batch().await.unwrap().is_none());
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.succeeded), (0, 1));
    }

    #[tokio::test]
    async fn a_partial_event_waits_for_its_end() {
        let (mut tx, body, _counters) = stream(true);
        tx.send_data(Bytes::from("data: {\"a\":")).await.unwrap();
        let next = body.next_batch();
        tokio::pin!(next);
        assert!(next.as_mut().now_or_never().is_none(), "no event is complete yet");
        tx.send_data(Bytes::from("1}\r\n\r\n")).await.unwrap();
        assert_eq!(next.await.unwrap().unwrap(), "data: {\"a\":1}\r\n\r\n");
    }

    #[tokio::test]
    async fn other_bodies_pass_as_they_come() {
        let (mut tx, body, _counters) = stream(false);
        tx.send_data(Bytes::from("{\"partial\":")).await.unwrap();
        assert_eq!(body.next_batch().await.unwrap().unwrap(), "{\"partial\":");
    }

    #[tokio::test]
    async fn a_torn_stream_keeps_whole_events_then_fails() {
        let (mut tx, body, counters) = stream(true);
        tx.send_data(Bytes::from("data: 1\n\ndata: 2")).await.unwrap();
        tx.abort("connection reset".into());
        assert_eq!(body.next_batch().await.unwrap().unwrap(), "data: 1\n\n");
        assert_eq!(body.next_batch().await.unwrap_err().kind(), Kind::Upstream);
        assert!(body.next_batch().await.unwrap().is_none());
        let snap = counters.snapshot();
        assert_eq!((snap.in_flight, snap.failed), (0, 1));
    }

    #[tokio::test]
    async fn cancel_releases_at_once_even_while_waiting() {
        let (_tx, body, counters) = stream(true);
        let body = Arc::new(body);
        let waiting = tokio::spawn({
            let body = Arc::clone(&body);
            async move { body.next_batch().await }
        });
        tokio::task::yield_now().await;
        body.cancel();
        assert!(waiting.await.unwrap().unwrap().is_none());
        assert_eq!(in_flight(&counters), 0);
        assert_eq!(counters.snapshot().cancelled, 1);
        assert!(body.next_batch().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn dropping_the_body_releases_the_permit() {
        let (_tx, body, counters) = stream(true);
        assert_eq!(in_flight(&counters), 1);
        drop(body);
        assert_eq!(in_flight(&counters), 0);
    }
}

//! Response bodies of the edge. A node's streamed answer is read by the very task that writes
//! the client's connection (hyper polls this body), so no channel or wake-up sits between the
//! two sockets; whatever frames are ready are written together, whole events only.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

use super::answer::{self, Fault};
use super::control_body::ControlBody;
use super::notes::Notes;
use super::Stop;
use crate::coalesce::Coalescer;
use crate::distserve::Preserved;
use crate::engine::permit::{InFlightPermit, Report};
use crate::engine::GatePass;
use crate::error::{BoxError, Error, Kind};
use crate::node::Outcome;
use crate::sse;
use crate::upstream::forward::UpstreamBody;

/// What hyper writes back to the client.
pub(crate) enum EdgeBody {
    Full(Option<Bytes>),
    Relay(Box<Relay>),
    Control(Box<ControlBody>),
}

impl EdgeBody {
    pub(crate) fn full(bytes: Bytes) -> Self {
        EdgeBody::Full(Some(bytes))
    }

    pub(crate) fn empty() -> Self {
        EdgeBody::Full(None)
    }
}

impl Body for EdgeBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            EdgeBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            EdgeBody::Relay(relay) => relay.poll_next(cx),
            EdgeBody::Control(control) => Pin::new(control.as_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            EdgeBody::Full(bytes) => bytes.is_none(),
            EdgeBody::Relay(relay) => relay.finished,
            EdgeBody::Control(control) => control.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            EdgeBody::Full(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            EdgeBody::Full(None) => SizeHint::with_exact(0),
            EdgeBody::Relay(relay) => relay.size_hint(),
            EdgeBody::Control(control) => control.size_hint(),
        }
    }
}

/// A node's body on its way to the client, with the request's permit: released when the body
/// ends (its outcome), fails (a failure) or is dropped because the client left (cancelled).
pub(crate) struct Relay {
    upstream: UpstreamBody,
    permit: Option<InFlightPermit>,
    outcome_at_end: Outcome,
    event_stream: bool,
    /// The start of an event whose end has not arrived yet (event streams).
    held: BytesMut,
    /// An unfinished event larger than this goes out as it is (whole events are a courtesy,
    /// not a reason to hold a giant event in memory).
    held_limit: usize,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    deadline: Option<Pin<Box<Sleep>>>,
    /// When the last data came (the idle timer's deadline follows it).
    last_data: tokio::time::Instant,
    /// Set when the proxy shuts down with this stream still running.
    cut: Arc<Stop>,
    started: Instant,
    report: Report,
    last_chunk: Option<Instant>,
    last_was_newline: bool,
    /// How the node's body ended, once it has, for the poll after the last data.
    ended: Option<Result<(), Error>>,
    finished: bool,
    notes: Notes,
    _pass: Option<GatePass>,
    /// A DistServe session, consumed by the first data (freed if the relay ends before).
    session: Option<Preserved>,
}

/// What a relay needs beyond the node's body.
pub(crate) struct RelayParts {
    pub(crate) permit: InFlightPermit,
    pub(crate) outcome_at_end: Outcome,
    pub(crate) event_stream: bool,
    pub(crate) idle_timeout: Duration,
    pub(crate) held_limit: usize,
    pub(crate) deadline: Option<tokio::time::Instant>,
    pub(crate) cut: Arc<Stop>,
    pub(crate) started: Instant,
    pub(crate) notes: Notes,
    pub(crate) pass: Option<GatePass>,
    pub(crate) session: Option<Preserved>,
}

impl Relay {
    pub(crate) fn new(upstream: UpstreamBody, parts: RelayParts) -> Self {
        Self {
            upstream,
            permit: Some(parts.permit),
            outcome_at_end: parts.outcome_at_end,
            event_stream: parts.event_stream,
            held: BytesMut::new(),
            held_limit: parts.held_limit,
            idle_timeout: parts.idle_timeout,
            idle: Box::pin(tokio::time::sleep(parts.idle_timeout)),
            deadline: parts.deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            last_data: tokio::time::Instant::now(),
            cut: parts.cut,
            started: parts.started,
            report: Report::default(),
            last_chunk: None,
            last_was_newline: false,
            ended: None,
            finished: false,
            notes: parts.notes,
            _pass: parts.pass,
            session: parts.session,
        }
    }

    fn size_hint(&self) -> SizeHint {
        if self.event_stream {
            SizeHint::default()
        } else {
            self.upstream.size_hint()
        }
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if let Some(end) = self.ended.take() {
            return self.finish(end);
        }
        // The connection polls its body as soon as the shutdown wakes it (see `server`).
        if self.cut.is_set() {
            return self.finish(Err(Error::new(Kind::Cancelled, "the proxy is shutting down")));
        }
        if self.deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready()) {
            return self.finish(Err(Error::new(Kind::Timeout, "the request took longer than its time limit")));
        }
        // Take every frame that is ready: one write carries them all.
        let mut joined = Coalescer::default();
        loop {
            match Pin::new(&mut self.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else { continue };
                    if data.is_empty() {
                        continue;
                    }
                    joined.push(data);
                }
                Poll::Ready(Some(Err(e))) => {
                    self.ended = Some(Err(Error::with_source(Kind::Upstream, "the node broke off the response", e)));
                    break;
                }
                Poll::Ready(None) => {
                    self.ended = Some(Ok(()));
                    break;
                }
                Poll::Pending => break,
            }
        }
        if let Some(data) = joined.take() {
            let out = self.arrived(data);
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
        if let Some(end) = self.ended.take() {
            return self.finish(end);
        }
        // The idle timer is armed lazily: data pushes its deadline forward without touching
        // the timer; when it fires early, it is re-armed for the real deadline.
        loop {
            if self.idle.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let deadline = self.last_data + self.idle_timeout;
            if deadline <= tokio::time::Instant::now() {
                return self.finish(Err(Error::new(Kind::Timeout, "the node sent nothing for too long")));
            }
            self.idle.as_mut().reset(deadline);
        }
    }

    /// Records a burst from the node; returns what may go to the client now.
    fn arrived(&mut self, data: Bytes) -> Bytes {
        let now = Instant::now();
        let first = self.report.first_byte.is_none();
        self.report.first_byte.get_or_insert_with(|| now - self.started);
        if let Some(session) = self.session.take() {
            session.consume();
        }
        let events = sse::count_events(&data, &mut self.last_was_newline);
        self.report.events += events;
        if let Some(permit) = &self.permit {
            // A stream's first event is its first token: its decoding begins (a whole answer's
            // first byte comes at its end).
            if first && self.event_stream {
                permit.decoding_began();
            }
            permit.first_byte_seen();
            permit.saw(&data);
            // Each event's gap to the one before: events that came together had none.
            let itl = &permit.node().counters().itl;
            if let Some(last) = self.last_chunk.replace(now) {
                itl.observe(now - last);
            }
            itl.observe_zeros(events.saturating_sub(1));
        }
        self.last_data = tokio::time::Instant::from_std(now);
        let out = if self.event_stream { self.whole_events(data) } else { data };
        self.notes.sent(&out, events);
        out
    }

    /// The whole events of what was held plus `data`; the start of an unfinished event is held
    /// (up to `held_limit`: past it, everything goes).
    fn whole_events(&mut self, data: Bytes) -> Bytes {
        if self.held.len() + data.len() > self.held_limit {
            if self.held.is_empty() {
                return data;
            }
            self.held.extend_from_slice(&data);
            return self.held.split().freeze();
        }
        if self.held.is_empty() {
            match sse::last_event_end(&data, 0) {
                Some(end) if end == data.len() => data,
                Some(end) => {
                    self.held.extend_from_slice(&data[end..]);
                    data.slice(..end)
                }
                None => {
                    self.held.extend_from_slice(&data);
                    Bytes::new()
                }
            }
        } else {
            let scanned = self.held.len();
            self.held.extend_from_slice(&data);
            match sse::last_event_end(&self.held, scanned) {
                Some(end) => self.held.split_to(end).freeze(),
                None => Bytes::new(),
            }
        }
    }

    /// Ends the relay: releases the permit with the outcome; a failure of an event stream
    /// becomes a terminal error event, any other failure breaks the client's connection.
    fn finish(&mut self, end: Result<(), Error>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.finished = true;
        let outcome = if end.is_ok() { self.outcome_at_end } else { Outcome::Failed };
        if let Some(mut permit) = self.permit.take() {
            // Shut down by the proxy: the node did nothing wrong.
            let cut = matches!(&end, Err(e) if e.kind() == Kind::Cancelled);
            permit.set_outcome(if cut { Outcome::Cancelled } else { outcome });
            permit.set_report(self.report);
        }
        match end {
            Ok(()) => {
                self.notes.completed();
                // A node that ended mid-event: what it sent still goes out.
                let rest = self.held.split().freeze();
                if rest.is_empty() {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Ok(Frame::data(rest))))
                }
            }
            Err(error) if self.event_stream => {
                // A torn trailing event could never parse: it is dropped, never joined to the error.
                self.held.clear();
                let fault: Fault =
                    if error.kind() == Kind::Cancelled { answer::DRAINING } else { answer::fault_of(&error) };
                let event = answer::stream_error_event(error.message(), fault);
                self.notes.stream_failed(&event, error.message());
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            Err(error) => Poll::Ready(Some(Err(Box::new(error)))),
        }
    }
}

//! The spans of a request: one trace per request, its root span (the request as this proxy
//! served it) and the spans recorded under it, sent to the exporter when the request ends.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use http::header::HeaderValue;

use super::context::{hex, push_hex, random_bytes, SpanId};
use super::Tracer;

/// One finished span.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(super) trace: [u8; 16],
    pub(super) id: SpanId,
    pub(super) parent: Option<SpanId>,
    pub(super) name: &'static str,
    pub(super) kind: SpanKind,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) attributes: Vec<(&'static str, String)>,
    pub(super) error: Option<String>,
}

/// OTLP's span kinds (the values are the protocol's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanKind {
    Internal = 1,
    /// The request as this proxy served it.
    Server = 2,
    /// A call to a node.
    Client = 3,
}

/// A span begun and not yet ended: plain data, so it can wait in a queue ticket.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenSpan {
    pub(crate) id: SpanId,
    parent: SpanId,
    name: &'static str,
    kind: SpanKind,
    start: u64,
}

/// Where the spans of one part of a request go: its trace, under which span.
#[derive(Debug, Clone, Copy)]
pub struct Traced<'a> {
    pub(crate) trace: &'a Trace,
    pub(crate) parent: SpanId,
}

impl<'a> Traced<'a> {
    /// Begins a span under this one.
    pub(crate) fn open(self, name: &'static str, kind: SpanKind) -> OpenSpan {
        OpenSpan { id: random_bytes::<8>(), parent: self.parent, name, kind, start: now_ns() }
    }

    /// The same trace, under `span`.
    #[must_use]
    pub(crate) fn under(self, span: &OpenSpan) -> Traced<'a> {
        Traced { trace: self.trace, parent: span.id }
    }
}

/// The trace of one request: its root span (the request as this proxy served it) and the spans
/// recorded under it, exported together when the request ends (the last reference is dropped).
#[derive(Debug)]
pub(crate) struct Trace {
    pub(super) tracer: Arc<Tracer>,
    pub(super) id: [u8; 16],
    pub(super) root: SpanId,
    /// The caller's span, when the request came with a trace context.
    pub(super) parent: Option<SpanId>,
    pub(super) sampled: bool,
    pub(super) name: &'static str,
    pub(super) start: u64,
    pub(super) spans: Mutex<Vec<Span>>,
    pub(super) attributes: Mutex<Vec<(&'static str, String)>>,
    pub(super) error: Mutex<Option<String>>,
}

impl Trace {
    /// Spans under the request's root span.
    pub(crate) fn traced(&self) -> Traced<'_> {
        Traced { trace: self, parent: self.root }
    }

    /// The trace id, as logs show it (32 hex digits).
    pub(crate) fn id_hex(&self) -> String {
        hex(&self.id)
    }

    pub(crate) fn sampled(&self) -> bool {
        self.sampled
    }

    /// The request's own attributes (on the root span); built only when the trace is recorded.
    pub(crate) fn annotate(&self, attributes: impl FnOnce() -> Vec<(&'static str, String)>) {
        if self.sampled {
            self.attributes.lock().unwrap_or_else(PoisonError::into_inner).extend(attributes());
        }
    }

    /// Marks the request as failed, with why.
    pub(crate) fn fail(&self, message: &str) {
        if self.sampled {
            *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(message.to_owned());
        }
    }

    /// Ends `span` now; its attributes are built only when the trace is recorded.
    pub(crate) fn end(
        &self,
        span: OpenSpan,
        attributes: impl FnOnce() -> Vec<(&'static str, String)>,
        error: Option<&str>,
    ) {
        if !self.sampled {
            return;
        }
        let span = Span {
            trace: self.id,
            id: span.id,
            parent: Some(span.parent),
            name: span.name,
            kind: span.kind,
            start: span.start,
            end: now_ns(),
            attributes: attributes(),
            error: error.map(str::to_owned),
        };
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).push(span);
    }

    /// The context a node gets for the call made as `span`.
    pub(crate) fn traceparent(&self, span: &OpenSpan) -> HeaderValue {
        let flags = if self.sampled { "01" } else { "00" };
        let mut value = String::with_capacity(55);
        value.push_str("00-");
        push_hex(&mut value, &self.id);
        value.push('-');
        push_hex(&mut value, &span.id);
        value.push('-');
        value.push_str(flags);
        HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        if !self.sampled {
            return;
        }
        let mut spans = std::mem::take(&mut *self.spans.lock().unwrap_or_else(PoisonError::into_inner));
        spans.push(Span {
            trace: self.id,
            id: self.root,
            parent: self.parent,
            name: self.name,
            kind: SpanKind::Server,
            start: self.start,
            end: now_ns(),
            attributes: std::mem::take(&mut *self.attributes.lock().unwrap_or_else(PoisonError::into_inner)),
            error: self.error.lock().unwrap_or_else(PoisonError::into_inner).take(),
        });
        self.tracer.send(spans);
    }
}

/// Nanoseconds since the Unix epoch (spans carry wall-clock times).
pub(crate) fn now_ns() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()).unwrap_or(u64::MAX)
}

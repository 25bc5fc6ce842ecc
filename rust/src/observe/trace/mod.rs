//! Tracing: W3C trace context taken from the client (or started here) and passed on to the
//! nodes, and the spans of each request (the request, its admission and queue wait, the node's
//! selection, every attempt, each prefill/decode leg) exported over OTLP/HTTP (JSON) by a
//! writer thread. Off unless configured: then a request carries no trace and pays nothing, and
//! the client's `traceparent` reaches the node unchanged.

mod context;
mod export;
pub(crate) mod spans;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub(crate) use context::{parse_traceparent, trace_id_of, Sampler, TRACEPARENT};
pub(crate) use spans::{now_ns, OpenSpan, Span, SpanKind, Trace, Traced};

use context::random_bytes;
use export::{Collector, Exporter, Message};

/// Spans waiting for the exporter beyond this are dropped (and counted), never queued forever.
const BACKLOG: u64 = 65_536;

/// Where and how spans are exported.
#[derive(Debug, Clone)]
pub struct TracingConfig {
    /// The OTLP/HTTP traces URL (`http://host:port/v1/traces`).
    pub(crate) endpoint: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) service_name: String,
    pub(crate) sampler: Sampler,
}

/// The process's tracer: a sampler, and the queue to the exporter thread.
#[derive(Debug)]
pub(crate) struct Tracer {
    sampler: Sampler,
    spans: Mutex<Sender<Message>>,
    backlog: Arc<AtomicU64>,
    /// Spans lost (backlog full, or the collector failed).
    pub(crate) dropped: Arc<AtomicU64>,
}

impl Tracer {
    /// Starts the exporter thread.
    pub(crate) fn start(config: TracingConfig) -> Arc<Self> {
        let (sender, receiver) = channel();
        let backlog = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let writer = Exporter {
            collector: Collector::new(&config),
            config: config.clone(),
            backlog: Arc::clone(&backlog),
            dropped: Arc::clone(&dropped),
        };
        let _ = std::thread::Builder::new().name("pdproxy-traces".into()).spawn(move || writer.run(&receiver));
        Arc::new(Self { sampler: config.sampler, spans: Mutex::new(sender), backlog, dropped })
    }

    /// The trace of a request that came with `traceparent` (the caller's context; else a new
    /// trace). The caller's `tracestate` travels on with the client's headers unchanged.
    pub(crate) fn begin(self: &Arc<Self>, traceparent: Option<&[u8]>, name: &'static str) -> Arc<Trace> {
        let caller = traceparent.and_then(parse_traceparent);
        let (trace_id, parent, caller_sampled) = match caller {
            Some((trace, span, sampled)) => (trace, Some(span), Some(sampled)),
            None => (random_bytes::<16>(), None, None),
        };
        let sampled = self.sampler.sampled(&trace_id, caller_sampled);
        Arc::new(Trace {
            tracer: Arc::clone(self),
            id: trace_id,
            root: random_bytes::<8>(),
            parent,
            sampled,
            name,
            start: now_ns(),
            spans: Mutex::default(),
            attributes: Mutex::default(),
            error: Mutex::default(),
        })
    }

    /// Exports the spans recorded so far (requests that ended), waiting at most `wait`: for a
    /// proxy that stops, so that its last traces are not lost.
    pub(crate) fn flush(&self, wait: Duration) {
        let (done, exported) = std::sync::mpsc::sync_channel(1);
        let sent = self.spans.lock().unwrap_or_else(PoisonError::into_inner).send(Message::Flush(done));
        if sent.is_ok() {
            let _ = exported.recv_timeout(wait);
        }
    }

    pub(super) fn send(&self, spans: Vec<Span>) {
        let count = spans.len() as u64;
        if self.backlog.fetch_add(count, Ordering::Relaxed) + count > BACKLOG {
            self.backlog.fetch_sub(count, Ordering::Relaxed);
            self.dropped.fetch_add(count, Ordering::Relaxed);
            return;
        }
        let sender = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        for span in spans {
            let _ = sender.send(Message::Span(span));
        }
    }
}

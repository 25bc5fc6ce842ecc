//! Tracing: W3C trace context taken from the client (or started here) and passed on to the
//! nodes, and the spans of each request (the request, its admission and queue wait, the node's
//! selection, every attempt, each prefill/decode leg) exported over OTLP/HTTP (JSON) by a
//! writer thread. Off unless configured: then a request carries no trace and pays nothing, and
//! the client's `traceparent` reaches the node unchanged.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::header::{HeaderName, HeaderValue};

pub(crate) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Spans are sent in batches of at most this many, at most this long after the first one
/// (OpenTelemetry's batch processor sends 512 at most, after 5 s by default).
const BATCH: usize = 512;
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Spans waiting for the exporter beyond this are dropped (and counted), never queued forever.
const BACKLOG: u64 = 65_536;

/// Which traces are recorded (OpenTelemetry's samplers, by their `OTEL_TRACES_SAMPLER` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// This share of traces, decided from the trace id (so every hop decides alike).
    Ratio(f64),
    /// As the caller decided when there is one; else the inner sampler.
    ParentBased(Base),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Base {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

impl Sampler {
    /// From `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub(crate) fn parse(name: &str, arg: Option<f64>) -> Option<Self> {
        let ratio = arg.unwrap_or(1.0).clamp(0.0, 1.0);
        Some(match name {
            "always_on" => Sampler::AlwaysOn,
            "always_off" => Sampler::AlwaysOff,
            "traceidratio" => Sampler::Ratio(ratio),
            "parentbased_always_on" => Sampler::ParentBased(Base::AlwaysOn),
            "parentbased_always_off" => Sampler::ParentBased(Base::AlwaysOff),
            "parentbased_traceidratio" => Sampler::ParentBased(Base::Ratio(ratio)),
            _ => return None,
        })
    }

    fn sampled(self, trace: &[u8; 16], parent: Option<bool>) -> bool {
        let ratio = |r: f64| {
            // The trace id's last 8 bytes as a fraction of 2^64, as OpenTelemetry does.
            let tail = u64::from_be_bytes(trace[8..].try_into().unwrap_or_default());
            #[allow(clippy::cast_precision_loss)]
            let share = tail as f64 / u64::MAX as f64;
            share < r
        };
        match self {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::Ratio(r) => ratio(r),
            Sampler::ParentBased(base) => parent.unwrap_or(match base {
                Base::AlwaysOn => true,
                Base::AlwaysOff => false,
                Base::Ratio(r) => ratio(r),
            }),
        }
    }
}

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

    fn send(&self, spans: Vec<Span>) {
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

/// What the exporter thread is sent.
enum Message {
    Span(Span),
    /// Export what is waiting now, then say so.
    Flush(std::sync::mpsc::SyncSender<()>),
}

/// One finished span.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    trace: [u8; 16],
    id: SpanId,
    parent: Option<SpanId>,
    name: &'static str,
    kind: SpanKind,
    start: u64,
    end: u64,
    attributes: Vec<(&'static str, String)>,
    error: Option<String>,
}

pub(crate) type SpanId = [u8; 8];

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
    tracer: Arc<Tracer>,
    id: [u8; 16],
    root: SpanId,
    /// The caller's span, when the request came with a trace context.
    parent: Option<SpanId>,
    sampled: bool,
    name: &'static str,
    start: u64,
    spans: Mutex<Vec<Span>>,
    attributes: Mutex<Vec<(&'static str, String)>>,
    error: Mutex<Option<String>>,
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

/// `00-<trace id>-<span id>-<flags>`: the trace, the caller's span and whether it sampled.
pub(crate) fn parse_traceparent(raw: &[u8]) -> Option<([u8; 16], SpanId, bool)> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    let mut parts = text.split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    let trace: [u8; 16] = unhex(trace)?;
    let span: [u8; 8] = unhex(span)?;
    let flags: [u8; 1] = unhex(flags)?;
    if trace == [0; 16] || span == [0; 8] {
        return None;
    }
    Some((trace, span, flags[0] & 1 == 1))
}

/// The trace id of a `traceparent`, as logs show it.
pub(crate) fn trace_id_of(raw: &[u8]) -> Option<String> {
    parse_traceparent(raw).map(|(trace, _, _)| hex(&trace))
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    for &b in bytes {
        let [high, low] = hex_pair(b);
        out.push(char::from(high));
        out.push(char::from(low));
    }
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    loop {
        for b in &mut out {
            *b = fastrand::u8(..);
        }
        if out.iter().any(|&b| b != 0) {
            return out;
        }
    }
}

/// Nanoseconds since the Unix epoch (spans carry wall-clock times).
pub(crate) fn now_ns() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()).unwrap_or(u64::MAX)
}

/// The exporter thread: batches spans and posts them to the collector.
struct Exporter {
    config: TracingConfig,
    collector: Collector,
    backlog: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
}

impl Exporter {
    /// Sends a batch once it is full, or `FLUSH_EVERY` after its first span came.
    fn run(mut self, messages: &Receiver<Message>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut due: Option<Instant> = None;
        loop {
            let wait = due.map_or(Duration::from_secs(3600), |due| due.saturating_duration_since(Instant::now()));
            match messages.recv_timeout(wait) {
                Ok(Message::Span(span)) => {
                    due.get_or_insert_with(|| Instant::now() + FLUSH_EVERY);
                    batch.push(span);
                    while batch.len() < BATCH {
                        match messages.try_recv() {
                            Ok(Message::Span(span)) => batch.push(span),
                            Ok(Message::Flush(done)) => {
                                self.flush(&mut batch);
                                let _ = done.send(());
                            }
                            Err(_) => break,
                        }
                    }
                }
                Ok(Message::Flush(done)) => {
                    self.flush(&mut batch);
                    due = None;
                    let _ = done.send(());
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush(&mut batch);
                    return;
                }
            }
            if batch.len() >= BATCH || due.is_some_and(|due| Instant::now() >= due) {
                self.flush(&mut batch);
                due = None;
            }
        }
    }

    fn flush(&mut self, batch: &mut Vec<Span>) {
        if batch.is_empty() {
            return;
        }
        let count = batch.len() as u64;
        self.backlog.fetch_sub(count, Ordering::Relaxed);
        let body = otlp_json(&self.config.service_name, batch);
        batch.clear();
        if self.collector.post(&body).is_err() {
            self.dropped.fetch_add(count, Ordering::Relaxed);
        }
    }
}

/// One OTLP/HTTP request with the JSON encoding (an `ExportTraceServiceRequest`).
fn otlp_json(service: &str, spans: &[Span]) -> Vec<u8> {
    let mut out = Json(Vec::with_capacity(256 + spans.len() * 768));
    out.raw(r#"{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"#);
    out.string(service);
    out.raw(r#"}}]},"scopeSpans":[{"scope":{"name":"pdproxy","version":""#);
    out.raw(env!("CARGO_PKG_VERSION"));
    out.raw(r#""},"spans":["#);
    for (i, span) in spans.iter().enumerate() {
        if i > 0 {
            out.raw(",");
        }
        out.raw(r#"{"traceId":""#);
        out.hex(&span.trace);
        out.raw(r#"","spanId":""#);
        out.hex(&span.id);
        out.raw(r#"","#);
        if let Some(parent) = span.parent {
            out.raw(r#""parentSpanId":""#);
            out.hex(&parent);
            out.raw(r#"","#);
        }
        out.raw(r#""name":"#);
        out.string(span.name);
        out.raw(r#","kind":"#);
        out.number(span.kind as u64);
        out.raw(r#","startTimeUnixNano":""#);
        out.number(span.start);
        out.raw(r#"","endTimeUnixNano":""#);
        out.number(span.end);
        out.raw(r#"","attributes":["#);
        for (j, (key, value)) in span.attributes.iter().enumerate() {
            if j > 0 {
                out.raw(",");
            }
            out.raw(r#"{"key":"#);
            out.string(key);
            out.raw(r#","value":{"stringValue":"#);
            out.string(value);
            out.raw("}}");
        }
        out.raw("]");
        if let Some(error) = &span.error {
            out.raw(r#","status":{"code":2,"message":"#);
            out.string(error);
            out.raw("}");
        }
        out.raw("}");
    }
    out.raw("]}]}]}");
    out.0
}

/// JSON written straight into bytes.
struct Json(Vec<u8>);

impl Json {
    fn raw(&mut self, text: &str) {
        self.0.extend_from_slice(text.as_bytes());
    }

    fn hex(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0.extend_from_slice(&hex_pair(b));
        }
    }

    fn number(&mut self, n: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = n;
        loop {
            at -= 1;
            #[allow(clippy::cast_possible_truncation)]
            let digit = (n % 10) as u8;
            digits[at] = b'0' + digit;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.0.extend_from_slice(&digits[at..]);
    }

    fn string(&mut self, text: &str) {
        if text.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
            self.0.push(b'"');
            self.0.extend_from_slice(text.as_bytes());
            self.0.push(b'"');
        } else {
            let _ = serde_json::to_writer(&mut self.0, text);
        }
    }
}

fn hex_pair(b: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0xf)]]
}

/// The collector's endpoint, with a kept-alive connection to it.
struct Collector {
    authority: String,
    path: String,
    headers: String,
    stream: Option<TcpStream>,
}

impl Collector {
    fn new(config: &TracingConfig) -> Self {
        let rest = config.endpoint.strip_prefix("http://").unwrap_or(&config.endpoint);
        let (authority, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
        let mut headers = String::new();
        for (name, value) in &config.headers {
            let _ = write!(headers, "{name}: {value}\r\n");
        }
        Self { authority: authority.to_owned(), path, headers, stream: None }
    }

    /// Posts `body`; a kept connection the collector closed meanwhile is replaced once.
    fn post(&mut self, body: &[u8]) -> std::io::Result<()> {
        if self.stream.is_some() && self.send(body).is_ok() {
            return Ok(());
        }
        self.send(body)
    }

    fn send(&mut self, body: &[u8]) -> std::io::Result<()> {
        let mut stream = if let Some(stream) = self.stream.take() {
            stream
        } else {
            let stream = TcpStream::connect(&self.authority)?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.set_write_timeout(Some(Duration::from_secs(10)))?;
            let _ = stream.set_nodelay(true);
            stream
        };
        let head = format!(
            "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}\r\n",
            self.path,
            self.authority,
            body.len(),
            self.headers
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let (status_ok, keep) = read_answer(&mut stream)?;
        if keep {
            self.stream = Some(stream);
        }
        if status_ok {
            Ok(())
        } else {
            Err(std::io::Error::other("the collector refused the spans"))
        }
    }
}

/// Reads the collector's answer: whether it is a 2xx, and whether the connection may be kept.
fn read_answer(stream: &mut TcpStream) -> std::io::Result<(bool, bool)> {
    let mut head = Vec::with_capacity(512);
    let mut byte = [0u8; 256];
    let end = loop {
        let n = stream.read(&mut byte)?;
        if n == 0 {
            return Err(std::io::Error::other("the collector closed the connection"));
        }
        head.extend_from_slice(&byte[..n]);
        if let Some(end) = memchr::memmem::find(&head, b"\r\n\r\n") {
            break end + 4;
        }
        if head.len() > 64 << 10 {
            return Err(std::io::Error::other("the collector's answer head is too long"));
        }
    };
    let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
    let status_ok = text.starts_with("http/1.1 2") || text.starts_with("http/1.0 2");
    let length = text
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse::<usize>().ok());
    let keep = text.starts_with("http/1.1") && !text.contains("connection: close") && length.is_some();
    // The answer's body (an ExportTraceServiceResponse) is read and dropped.
    let mut remaining = length.unwrap_or(0).saturating_sub(head.len() - end);
    while remaining > 0 {
        let n = stream.read(&mut byte[..remaining.min(256)])?;
        if n == 0 {
            break;
        }
        remaining -= n;
    }
    Ok((status_ok, keep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_parsed_strictly() {
        let (trace, span, sampled) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(hex(&trace), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&span), "00f067aa0ba902b7");
        assert!(sampled);
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"garbage",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn samplers() {
        let id = [0xffu8; 16];
        assert!(!Sampler::Ratio(0.5).sampled(&id, None), "the highest ids fall outside a half");
        assert!(Sampler::Ratio(1.0).sampled(&[0; 16], None));
        assert!(!Sampler::ParentBased(Base::AlwaysOn).sampled(&id, Some(false)), "the caller said no");
        assert!(Sampler::ParentBased(Base::AlwaysOff).sampled(&id, Some(true)));
        assert_eq!(Sampler::parse("parentbased_traceidratio", Some(0.1)), Some(Sampler::ParentBased(Base::Ratio(0.1))));
        assert_eq!(Sampler::parse("nope", None), None);
    }

    #[test]
    fn spans_encode_as_otlp_json() {
        let span = Span {
            trace: [1; 16],
            id: [2; 8],
            parent: Some([3; 8]),
            name: "pdproxy.attempt",
            kind: SpanKind::Client,
            start: 1,
            end: 2,
            attributes: vec![("pdproxy.node", "http://n:1".into())],
            error: Some("boom".into()),
        };
        let json: serde_json::Value = serde_json::from_slice(&otlp_json("svc", &[span])).unwrap();
        let got = &json["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(got["traceId"], "01010101010101010101010101010101");
        assert_eq!(got["parentSpanId"], "0303030303030303");
        assert_eq!(got["attributes"][0]["value"]["stringValue"], "http://n:1");
        assert_eq!(got["status"]["code"], 2);
        assert_eq!(json["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"], "svc");
    }
}

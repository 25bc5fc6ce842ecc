//! The exporter thread: spans batched and posted to the collector over OTLP/HTTP with the JSON
//! encoding, on a kept-alive connection of its own.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use super::context::hex_pair;
use super::spans::Span;
use super::TracingConfig;

/// Spans are sent in batches of at most this many, at most this long after the first one
/// (OpenTelemetry's batch processor sends 512 at most, after 5 s by default).
const BATCH: usize = 512;
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// What the exporter thread is sent.
pub(super) enum Message {
    Span(Span),
    /// Export what is waiting now, then say so.
    Flush(std::sync::mpsc::SyncSender<()>),
}

/// The exporter thread: batches spans and posts them to the collector.
pub(super) struct Exporter {
    pub(super) config: TracingConfig,
    pub(super) collector: Collector,
    pub(super) backlog: Arc<AtomicU64>,
    pub(super) dropped: Arc<AtomicU64>,
}

impl Exporter {
    /// Sends a batch once it is full, or `FLUSH_EVERY` after its first span came.
    pub(super) fn run(mut self, messages: &Receiver<Message>) {
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
    let request = Request {
        resource_spans: [ResourceSpans {
            resource: Resource {
                attributes: [KeyValue { key: "service.name", value: StringValue { string_value: service } }],
            },
            scope_spans: [ScopeSpans {
                scope: Scope { name: "pdproxy", version: env!("CARGO_PKG_VERSION") },
                spans: spans.iter().map(OtlpSpan::of).collect(),
            }],
        }],
    };
    let mut out = Vec::with_capacity(256 + spans.len() * 768);
    // Writing into a Vec cannot fail, and every value here serialises.
    let _ = serde_json::to_writer(&mut out, &request);
    out
}

// The OTLP JSON shapes, field order as the protocol's examples write them.

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    resource_spans: [ResourceSpans<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResourceSpans<'a> {
    resource: Resource<'a>,
    scope_spans: [ScopeSpans<'a>; 1],
}

#[derive(Serialize)]
struct Resource<'a> {
    attributes: [KeyValue<'a>; 1],
}

#[derive(Serialize)]
struct ScopeSpans<'a> {
    scope: Scope,
    spans: Vec<OtlpSpan<'a>>,
}

#[derive(Serialize)]
struct Scope {
    name: &'static str,
    version: &'static str,
}

#[derive(Serialize)]
struct KeyValue<'a> {
    key: &'a str,
    value: StringValue<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StringValue<'a> {
    string_value: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct OtlpSpan<'a> {
    trace_id: Hex<'a>,
    span_id: Hex<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_span_id: Option<Hex<'a>>,
    name: &'a str,
    kind: u8,
    /// Nanoseconds as a decimal string (OTLP JSON writes 64-bit integers as strings).
    #[serde(serialize_with = "as_decimal")]
    start_time_unix_nano: u64,
    #[serde(serialize_with = "as_decimal")]
    end_time_unix_nano: u64,
    attributes: Vec<KeyValue<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status<'a>>,
}

impl<'a> OtlpSpan<'a> {
    fn of(span: &'a Span) -> Self {
        Self {
            trace_id: Hex(&span.trace),
            span_id: Hex(&span.id),
            parent_span_id: span.parent.as_ref().map(|p| Hex(p)),
            name: span.name,
            kind: span.kind as u8,
            start_time_unix_nano: span.start,
            end_time_unix_nano: span.end,
            attributes: span
                .attributes
                .iter()
                .map(|(key, value)| KeyValue { key, value: StringValue { string_value: value } })
                .collect(),
            status: span.error.as_deref().map(|message| Status { code: STATUS_ERROR, message }),
        }
    }
}

/// OTLP's `STATUS_CODE_ERROR`.
const STATUS_ERROR: u8 = 2;

#[derive(Serialize)]
struct Status<'a> {
    code: u8,
    message: &'a str,
}

/// An id as lower-case hex digits (OTLP JSON writes ids so, not base64).
struct Hex<'a>(&'a [u8]);

impl Serialize for Hex<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut out = [0u8; 32];
        let digits = 2 * self.0.len().min(16);
        for (pair, &b) in out.chunks_exact_mut(2).zip(self.0) {
            pair.copy_from_slice(&hex_pair(b));
        }
        serializer.serialize_str(std::str::from_utf8(&out[..digits]).unwrap_or_default())
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` hands the field by reference
fn as_decimal<S: Serializer>(n: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(itoa::Buffer::new().format(*n))
}

/// The collector's endpoint, with a kept-alive connection to it.
pub(super) struct Collector {
    authority: String,
    path: String,
    headers: String,
    stream: Option<TcpStream>,
}

impl Collector {
    pub(super) fn new(config: &TracingConfig) -> Self {
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
    use crate::observe::trace::spans::SpanKind;

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

    #[test]
    fn the_json_is_byte_for_byte_what_the_hand_written_writer_made() {
        let spans = [
            Span {
                trace: [0xab; 16],
                id: [0x0f; 8],
                parent: None,
                name: "pdproxy.request",
                kind: SpanKind::Server,
                start: 1_733_000_000_123_456_789,
                end: u64::MAX,
                attributes: vec![],
                error: None,
            },
            Span {
                trace: [1; 16],
                id: [2; 8],
                parent: Some([3; 8]),
                name: "pdproxy.attempt",
                kind: SpanKind::Client,
                start: 0,
                end: 10,
                attributes: vec![
                    ("pdproxy.node", "http://n:1".into()),
                    ("q", "a \"quoted\" \\ \n tab\t \u{e9} \u{7f}".into()),
                ],
                error: Some("boom \"x\"".into()),
            },
        ];
        let got = String::from_utf8(otlp_json("svc \"s\"", &spans)).unwrap();
        // Written by the hand-written writer this replaced, with the version of then.
        let want = "{\"resourceSpans\":[{\"resource\":{\"attributes\":[{\"key\":\"service.name\",\"value\":{\"stringValue\":\"svc \\\"s\\\"\"}}]},\"scopeSpans\":[{\"scope\":{\"name\":\"pdproxy\",\"version\":\"0.1.0\"},\"spans\":[{\"traceId\":\"abababababababababababababababab\",\"spanId\":\"0f0f0f0f0f0f0f0f\",\"name\":\"pdproxy.request\",\"kind\":2,\"startTimeUnixNano\":\"1733000000123456789\",\"endTimeUnixNano\":\"18446744073709551615\",\"attributes\":[]},{\"traceId\":\"01010101010101010101010101010101\",\"spanId\":\"0202020202020202\",\"parentSpanId\":\"0303030303030303\",\"name\":\"pdproxy.attempt\",\"kind\":3,\"startTimeUnixNano\":\"0\",\"endTimeUnixNano\":\"10\",\"attributes\":[{\"key\":\"pdproxy.node\",\"value\":{\"stringValue\":\"http://n:1\"}},{\"key\":\"q\",\"value\":{\"stringValue\":\"a \\\"quoted\\\" \\\\ \\n tab\\t é \u{7f}\"}}],\"status\":{\"code\":2,\"message\":\"boom \\\"x\\\"\"}}]}]}]}";
        assert_eq!(got.replace(env!("CARGO_PKG_VERSION"), "0.1.0"), want);
    }
}

//! The access log of the inference requests the pipeline serves (whichever server took them):
//! one record per request, finished when the request's last piece is dropped (so every ending, a
//! client gone included, writes one line), handed to a writer thread. A line, in text
//! (`name=value`, `-` for nothing) or JSON, tells when the request arrived (UTC) and from which
//! address, then what became of it; seconds with microseconds.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// An event's end, its searcher built once rather than per chunk.
static EVENT_END: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\n\n"));

/// The access log's output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Text,
    Json,
}

#[derive(Debug)]
pub(crate) struct AccessLog {
    lines: Sender<String>,
    format: Format,
}

impl AccessLog {
    /// Starts the writer thread (standard output).
    pub(crate) fn start(format: Format) -> Arc<Self> {
        let (lines, incoming) = channel::<String>();
        let _ = std::thread::Builder::new().name("pdproxy-access".into()).spawn(move || {
            let stdout = std::io::stdout();
            while let Ok(line) = incoming.recv() {
                let mut out = stdout.lock();
                let _ = out.write_all(line.as_bytes());
                // Whatever else is queued goes out in the same write.
                while let Ok(line) = incoming.try_recv() {
                    let _ = out.write_all(line.as_bytes());
                }
                let _ = out.flush();
            }
        });
        Arc::new(Self { lines, format })
    }
}

/// What is known of one request, filled in as it goes; written when dropped.
#[derive(Debug)]
pub(crate) struct Record {
    log: Arc<AccessLog>,
    started: Instant,
    /// When the request arrived, for the line's `time`.
    arrived: SystemTime,
    client: IpAddr,
    pub(crate) request_id: String,
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) model: Option<String>,
    pub(crate) node: Option<String>,
    pub(crate) status: Option<u16>,
    /// `x-pdproxy-error` of a proxy-made answer.
    pub(crate) proxy_error: Option<&'static str>,
    /// The stream ended with a terminal error event.
    pub(crate) stream_error: bool,
    /// The whole answer was sent.
    pub(crate) complete: bool,
    pub(crate) bytes: u64,
    pub(crate) events: u64,
    pub(crate) first_byte: Option<Duration>,
    /// The request's trace (its own, or the caller's when requests are not traced).
    pub(crate) trace_id: Option<String>,
}

impl Record {
    pub(crate) fn new(log: &Arc<AccessLog>, client: IpAddr, request_id: &str, method: &str, path: &str) -> Box<Self> {
        Box::new(Self {
            log: Arc::clone(log),
            started: Instant::now(),
            arrived: SystemTime::now(),
            client,
            request_id: request_id.to_owned(),
            method: method.to_owned(),
            path: path.to_owned(),
            model: None,
            node: None,
            status: None,
            proxy_error: None,
            stream_error: false,
            complete: false,
            bytes: 0,
            events: 0,
            first_byte: None,
            trace_id: None,
        })
    }

    /// Body bytes sent to the client.
    pub(crate) fn sent(&mut self, chunk: &[u8]) {
        if self.first_byte.is_none() {
            self.first_byte = Some(self.started.elapsed());
        }
        self.bytes += chunk.len() as u64;
        self.events += EVENT_END.find_iter(chunk).count() as u64;
    }

    /// How the request ended and in which phase: `completed`, `client_cancel@ttfb`, ...
    fn cause(&self) -> String {
        if !self.complete {
            return format!("client_cancel@{}", if self.status.is_none() { "ttfb" } else { "stream" });
        }
        if let Some(code) = self.proxy_error {
            return format!("{code}@{}", if code == "upstream_error" { "ttfb" } else { "admission" });
        }
        if self.stream_error {
            return "upstream_error@stream".to_owned();
        }
        if self.status.is_some_and(|s| s >= 400) {
            return "upstream_status@ttfb".to_owned();
        }
        "completed".to_owned()
    }

    fn line(&self) -> String {
        let cause = self.cause();
        let duration = self.started.elapsed();
        let mut out = String::with_capacity(256);
        let json = self.log.format == Format::Json;
        let mut first = true;
        let mut field = |name: &str, value: Value<'_>| {
            if json {
                out.push(if first { '{' } else { ',' });
                let _ = write!(out, "\"{name}\":");
                match value {
                    Value::Str(Some(s)) => out.push_str(&serde_json::Value::from(s).to_string()),
                    Value::Int(Some(n)) => {
                        let _ = write!(out, "{n}");
                    }
                    Value::Seconds(Some(d)) => {
                        let _ = write!(out, "{:.6}", d.as_secs_f64());
                    }
                    Value::Str(None) | Value::Int(None) | Value::Seconds(None) => out.push_str("null"),
                }
            } else {
                if !first {
                    out.push(' ');
                }
                let _ = write!(out, "{name}=");
                match value {
                    Value::Str(Some(s)) => escape_text(&mut out, s),
                    Value::Int(Some(n)) => {
                        let _ = write!(out, "{n}");
                    }
                    Value::Seconds(Some(d)) => {
                        let _ = write!(out, "{:.6}", d.as_secs_f64());
                    }
                    Value::Str(None) | Value::Int(None) | Value::Seconds(None) => out.push('-'),
                }
            }
            first = false;
        };
        field("time", Value::Str(Some(&utc_timestamp(self.arrived))));
        field("client", Value::Str(Some(&self.client.to_string())));
        field("request_id", Value::Str(Some(&self.request_id)));
        field("method", Value::Str(Some(&self.method)));
        field("path", Value::Str(Some(&self.path)));
        field("model", Value::Str(self.model.as_deref()));
        field("node", Value::Str(self.node.as_deref()));
        field("status", Value::Int(self.status.map(u64::from)));
        field("cause", Value::Str(Some(&cause)));
        field("bytes", Value::Int(Some(self.bytes)));
        field("events", Value::Int(Some(self.events)));
        field("ttfb", Value::Seconds(self.first_byte));
        field("duration", Value::Seconds(Some(duration)));
        field("trace_id", Value::Str(self.trace_id.as_deref()));
        if json {
            out.push('}');
        }
        out.push('\n');
        out
    }
}

enum Value<'a> {
    Str(Option<&'a str>),
    Int(Option<u64>),
    Seconds(Option<Duration>),
}

impl Drop for Record {
    fn drop(&mut self) {
        let line = self.line();
        let _ = self.log.lines.send(line);
    }
}

/// `time` as UTC in ISO 8601 with milliseconds (`2026-12-01T09:30:00.123Z`).
fn utc_timestamp(at: SystemTime) -> String {
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since_epoch.as_secs();
    let (year, month, day) = civil_date(seconds / 86_400);
    let of_day = seconds % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60,
        since_epoch.subsec_millis()
    )
}

/// The Gregorian (year, month, day) of a count of days since 1970-01-01 (H. Hinnant's
/// `civil_from_days`, for days on or after the epoch).
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// A text-line field that cannot break its line or forge another field: backslashes, spaces
/// and control characters as escapes.
fn escape_text(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' ' => out.push_str("\\x20"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_iso_8601() {
        let at = |secs: u64, millis: u64| UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(millis);
        assert_eq!(utc_timestamp(at(0, 0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_timestamp(at(951_782_400, 7)), "2000-02-29T00:00:00.007Z"); // a leap day
        assert_eq!(utc_timestamp(at(1_796_092_309, 123)), "2026-12-01T02:31:49.123Z");
        assert_eq!(utc_timestamp(at(4_102_444_799, 999)), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn text_fields_cannot_break_their_line() {
        let mut out = String::new();
        escape_text(&mut out, "m\nrequest_id=forged x\\y\u{1}z\t");
        assert_eq!(out, "m\\nrequest_id=forged\\x20x\\\\y\\x01z\\t");
    }

    #[test]
    fn text_lines_mark_what_is_unknown_and_give_microseconds() {
        let log = AccessLog::start(Format::Text);
        let mut r = Record::new(&log, "127.0.0.1".parse().unwrap(), "id", "POST", "/v1/completions");
        r.first_byte = Some(Duration::from_micros(1_234_567));
        let line = r.line();
        assert!(line.contains(" model=- node=- status=- cause=client_cancel@ttfb "), "{line}");
        assert!(line.contains(" ttfb=1.234567 duration="), "{line}");
        assert!(line.ends_with(" trace_id=-\n"), "{line}");
    }

    #[test]
    fn causes() {
        let log = AccessLog::start(Format::Json);
        let mut r = Record::new(&log, "127.0.0.1".parse().unwrap(), "id", "POST", "/v1/chat/completions");
        assert_eq!(r.cause(), "client_cancel@ttfb");
        r.status = Some(200);
        assert_eq!(r.cause(), "client_cancel@stream");
        r.complete = true;
        assert_eq!(r.cause(), "completed");
        r.proxy_error = Some("overloaded");
        assert_eq!(r.cause(), "overloaded@admission");
        r.proxy_error = Some("upstream_error");
        assert_eq!(r.cause(), "upstream_error@ttfb");
        let line = r.line();
        assert!(line.starts_with(r#"{"time":""#));
        assert!(line.contains(
            r#"Z","client":"127.0.0.1","request_id":"id","method":"POST","path":"/v1/chat/completions","model":null,"#
        ));
    }
}

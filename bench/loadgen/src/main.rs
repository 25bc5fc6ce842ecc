//! Closed-loop load generator for pdproxy's benchmarks.
//!
//! Each of `--connections` tasks keeps one keep-alive HTTP/1.1 connection and sends the same
//! request back to back for `--duration` seconds (after `--warmup`). Responses are read as
//! they arrive; server-sent events are counted and timestamped on arrival, which wrk cannot
//! do. Prints one JSON object of results.
//!
//! With `--rate R`, requests arrive at R per second in all, whatever the answers take (open
//! loop): each connection sends on a schedule of its own (every `connections / R` seconds,
//! staggered), so latencies compare at one offered load rather than at whatever throughput each
//! target reaches. A send the schedule could not keep (its connection still busy) is counted late.
//!
//! With `--interleave MS`, one client sends requests one at a time, back to back, to each `--url`
//! in turn for MS milliseconds (each URL on its own keep-alive connection), and prints the results
//! per URL: targets measured over the same stretch of time, so that a shared machine's drift falls
//! on all of them alike.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

struct Args {
    /// Connections are spread over these round-robin.
    urls: Vec<hyper::Uri>,
    body: Bytes,
    headers: Vec<(String, String)>,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    threads: usize,
    /// `--interleave`: how long each URL has the client before the next one's turn.
    interleave: Option<Duration>,
    /// `--rate`: requests per second in all, open loop.
    rate: Option<f64>,
}

const USAGE: &str = "usage: pdproxy-loadgen --url URL [--url URL]... [--body JSON] [--header NAME:VALUE]... \
[--connections N] [--duration SECONDS] [--warmup SECONDS] [--threads N] [--interleave MS] [--rate PER_SECOND]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        urls: Vec::new(),
        body: Bytes::new(),
        headers: Vec::new(),
        connections: 64,
        duration: Duration::from_secs(10),
        warmup: Duration::from_secs(1),
        threads: 1,
        interleave: None,
        rate: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"));
        let secs = |v: String| v.parse::<f64>().map(Duration::from_secs_f64).map_err(|e| format!("{e}"));
        match flag.as_str() {
            "--url" => args.urls.push(value()?.parse::<hyper::Uri>().map_err(|e| e.to_string())?),
            "--body" => args.body = Bytes::from(value()?),
            "--header" => {
                let v = value()?;
                let (name, val) = v.split_once(':').ok_or("--header takes NAME:VALUE")?;
                args.headers.push((name.trim().to_owned(), val.trim().to_owned()));
            }
            "--connections" => args.connections = value()?.parse().map_err(|e| format!("{e}"))?,
            "--duration" => args.duration = secs(value()?)?,
            "--warmup" => args.warmup = secs(value()?)?,
            "--threads" => args.threads = value()?.parse().map_err(|e| format!("{e}"))?,
            "--interleave" => {
                let ms = value()?.parse::<f64>().map_err(|e| format!("{e}"))?;
                args.interleave = Some(Duration::from_secs_f64(ms / 1000.0));
            }
            "--rate" => {
                let rate = value()?.parse::<f64>().map_err(|e| format!("{e}"))?;
                if !(rate.is_finite() && rate > 0.0) {
                    return Err("--rate takes a positive number of requests per second".to_owned());
                }
                args.rate = Some(rate);
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if args.urls.is_empty() {
        return Err(USAGE.to_owned());
    }
    Ok(args)
}

/// What one connection measured inside the measurement window.
#[derive(Default, Debug)]
struct Samples {
    latency_us: Vec<u32>,
    ttft_us: Vec<u32>,
    gap_us: Vec<u32>,
    events: u64,
    errors: u64,
    bytes: u64,
    /// `--rate`: measured sends that left more than `LATE` after their scheduled time.
    late: u64,
}

/// A scheduled send later than this is late: beyond the timer's and a busy machine's wake-up
/// delays, its connection was still busy with the answer before.
const LATE: Duration = Duration::from_millis(10);

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

async fn connect(url: &hyper::Uri) -> Option<http1::SendRequest<Full<Bytes>>> {
    let host = url.host()?;
    let port = url.port_u16().unwrap_or(80);
    let stream = TcpStream::connect((host, port)).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    Some(sender)
}

/// Counts server-sent events across the chunks of one body. An event ends at a blank line that follows
/// data: as in the SSE rules, a blank line with nothing before it is no event (LMDeploy's proxy ends
/// each event with `\n\n\n`, which would otherwise count twice).
#[derive(Default)]
struct EventCounter {
    last_was_newline: bool,
    data: bool,
}

impl EventCounter {
    fn feed(&mut self, chunk: &[u8]) -> u64 {
        let mut events = 0;
        let mut line_start = 0;
        for pos in memchr::memchr_iter(b'\n', chunk) {
            if pos > line_start {
                self.data = true;
                self.last_was_newline = false;
            }
            if self.last_was_newline && self.data {
                events += 1;
                self.data = false;
            }
            self.last_was_newline = true;
            line_start = pos + 1;
        }
        if line_start < chunk.len() {
            self.data = true;
            self.last_was_newline = false;
        }
        events
    }
}

/// One keep-alive connection to one URL, opened again when it breaks.
struct Client {
    url: hyper::Uri,
    sender: Option<http1::SendRequest<Full<Bytes>>>,
}

impl Client {
    fn new(url: &hyper::Uri) -> Self {
        Self { url: url.clone(), sender: None }
    }

    /// Sends one request and reads the whole response, adding what it measured to `samples` when
    /// it started at or after `measure_from` (and, for its latency, ended by `end`).
    async fn exchange(&mut self, args: &Args, measure_from: Instant, end: Instant, samples: &mut Samples) {
        if self.sender.is_none() {
            self.sender = connect(&self.url).await;
            if self.sender.is_none() {
                samples.errors += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                return;
            }
        }
        let Some(s) = self.sender.as_mut() else { return };
        if s.ready().await.is_err() {
            self.sender = None;
            return;
        }
        let url = &self.url;
        // Origin-form request target, as clients send to servers (not proxies).
        let mut request = Request::post(url.path_and_query().map_or("/", |p| p.as_str()))
            .header("host", url.authority().map_or("localhost", |a| a.as_str()))
            .header("content-type", "application/json");
        for (name, value) in &args.headers {
            request = request.header(name, value);
        }
        let request = request.body(Full::new(args.body.clone())).expect("valid request");
        let t0 = Instant::now();
        let measured = t0 >= measure_from;
        let Ok(response) = s.send_request(request).await else {
            samples.errors += u64::from(measured);
            self.sender = None;
            return;
        };
        let ok = response.status().is_success();
        let mut body = response.into_body();
        let (mut first_event, mut last_event) = (None::<Instant>, None::<Instant>);
        let mut counter = EventCounter::default();
        let mut broken = false;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                broken = true;
                break;
            };
            let Ok(data) = frame.into_data() else { continue };
            let now = Instant::now();
            let events = counter.feed(&data);
            if measured {
                samples.bytes += data.len() as u64;
                samples.events += events;
                if events > 0 {
                    if first_event.is_none() {
                        first_event = Some(now);
                        samples.ttft_us.push(micros(now - t0));
                    }
                    if let Some(prev) = last_event {
                        samples.gap_us.push(micros(now - prev));
                    }
                    // Events of one chunk arrived together: gaps of zero.
                    samples.gap_us.extend(std::iter::repeat_n(0, usize::try_from(events - 1).unwrap_or(0)));
                    last_event = Some(now);
                }
            }
        }
        if broken {
            self.sender = None;
        }
        if measured && Instant::now() <= end {
            if ok && !broken {
                samples.latency_us.push(micros(t0.elapsed()));
            } else {
                samples.errors += 1;
            }
        }
    }
}

async fn run_connection(args: Arc<Args>, index: usize, start: Instant, measure_from: Instant, end: Instant) -> Samples {
    let mut client = Client::new(&args.urls[index % args.urls.len()]);
    let mut samples = Samples::default();
    // `--rate`: this connection's share of the arrivals, staggered among the connections.
    #[allow(clippy::cast_precision_loss)]
    let mut schedule =
        args.rate.map(|rate| (start + Duration::from_secs_f64(index as f64 / rate), args.connections as f64 / rate));
    while Instant::now() < end {
        if let Some((due, period)) = schedule.as_mut() {
            tokio::time::sleep_until((*due).into()).await;
            let now = Instant::now();
            if now >= end {
                break;
            }
            if now >= measure_from && now > *due + LATE {
                samples.late += 1;
            }
            *due += Duration::from_secs_f64(*period);
        }
        client.exchange(&args, measure_from, end, &mut samples).await;
    }
    samples
}

/// `--interleave`: requests one at a time, to each URL in turn for its turn; samples per URL.
async fn run_interleaved(args: Arc<Args>, measure_from: Instant, end: Instant) -> Vec<Samples> {
    let turn = args.interleave.unwrap_or_default();
    let mut clients: Vec<Client> = args.urls.iter().map(Client::new).collect();
    let mut samples: Vec<Samples> = clients.iter().map(|_| Samples::default()).collect();
    while Instant::now() < end {
        for (client, samples) in clients.iter_mut().zip(&mut samples) {
            let turn_ends = Instant::now() + turn;
            loop {
                client.exchange(&args, measure_from, end, samples).await;
                let now = Instant::now();
                if now >= turn_ends || now >= end {
                    break;
                }
            }
        }
    }
    samples
}

fn percentiles(mut v: Vec<u32>) -> serde_json::Value {
    if v.is_empty() {
        return serde_json::Value::Null;
    }
    v.sort_unstable();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        f64::from(v[i]) / 1000.0
    };
    #[allow(clippy::cast_precision_loss)]
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64 / 1000.0;
    serde_json::json!({"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": at(1.0), "mean": mean})
}

impl Samples {
    fn add(&mut self, other: Samples) {
        self.latency_us.extend(other.latency_us);
        self.ttft_us.extend(other.ttft_us);
        self.gap_us.extend(other.gap_us);
        self.events += other.events;
        self.errors += other.errors;
        self.bytes += other.bytes;
        self.late += other.late;
    }

    #[allow(clippy::cast_precision_loss)]
    fn report(self, connections: usize, duration: Duration) -> serde_json::Value {
        let secs = duration.as_secs_f64();
        serde_json::json!({
            "connections": connections,
            "duration_s": secs,
            "requests": self.latency_us.len(),
            "errors": self.errors,
            "rps": self.latency_us.len() as f64 / secs,
            "events": self.events,
            "events_per_s": self.events as f64 / secs,
            "bytes": self.bytes,
            "latency_ms": percentiles(self.latency_us),
            "ttft_ms": percentiles(self.ttft_us),
            "gap_ms": percentiles(self.gap_us),
            "late": self.late,
        })
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => Arc::new(a),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async {
        let start = Instant::now();
        let measure_from = start + args.warmup;
        let end = measure_from + args.duration;
        if args.interleave.is_some() {
            let per_url = tokio::spawn(run_interleaved(Arc::clone(&args), measure_from, end));
            let per_url = per_url.await.expect("interleaved client");
            let reports: Vec<_> = per_url.into_iter().map(|s| s.report(1, args.duration)).collect();
            return serde_json::json!({ "interleaved": reports });
        }
        let tasks: Vec<_> = (0..args.connections)
            .map(|i| tokio::spawn(run_connection(Arc::clone(&args), i, start, measure_from, end)))
            .collect();
        let mut all = Samples::default();
        for task in tasks {
            all.add(task.await.expect("connection task"));
        }
        all.report(args.connections, args.duration)
    });
    println!("{result}");
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use http_body_util::Full;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::{run_interleaved, Args, EventCounter};

    /// A server answering every request with `{}`, logging its `name` for each one it serves.
    async fn server(name: usize, log: Arc<Mutex<Vec<usize>>>) -> hyper::Uri {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                let service = service_fn(move |_request| {
                    log.lock().expect("log").push(name);
                    async { Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from("{}")))) }
                });
                tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
            }
        });
        format!("http://{address}/v1/chat/completions").parse().expect("uri")
    }

    #[tokio::test]
    async fn interleaved_targets_take_turns() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let urls = vec![server(0, Arc::clone(&log)).await, server(1, Arc::clone(&log)).await];
        let args = Arc::new(Args {
            urls,
            body: Bytes::from("{}"),
            headers: Vec::new(),
            connections: 1,
            duration: Duration::from_millis(300),
            warmup: Duration::ZERO,
            threads: 1,
            interleave: Some(Duration::from_millis(30)),
            rate: None,
        });
        let start = Instant::now();
        let samples = run_interleaved(Arc::clone(&args), start, start + args.duration).await;
        let served = log.lock().expect("log").clone();
        // Each target answered, and each measured request is one a target served.
        for (target, s) in samples.iter().enumerate() {
            let count = served.iter().filter(|&&t| t == target).count();
            assert!(!s.latency_us.is_empty(), "target {target} measured nothing");
            assert!(s.latency_us.len() <= count && count <= s.latency_us.len() + 1, "{count} served, {s:?}");
            assert_eq!(s.errors, 0);
        }
        // Turns, not alternation: runs of requests to one target, then to the other.
        let switches = served.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(switches >= 4, "{switches} switches in {} requests", served.len());
        assert!(served.len() > 4 * (switches + 1), "{} requests in {} turns", served.len(), switches + 1);
    }

    #[tokio::test]
    async fn a_rate_paces_the_arrivals_whatever_the_connections() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let args = Arc::new(Args {
            urls: vec![server(0, Arc::clone(&log)).await],
            body: Bytes::from("{}"),
            headers: Vec::new(),
            connections: 8,
            duration: Duration::from_millis(500),
            warmup: Duration::ZERO,
            threads: 1,
            interleave: None,
            rate: Some(40.0),
        });
        let start = Instant::now();
        let end = start + args.duration;
        let tasks: Vec<_> = (0..args.connections)
            .map(|i| tokio::spawn(super::run_connection(Arc::clone(&args), i, start, start, end)))
            .collect();
        let mut sent = 0;
        for task in tasks {
            let samples = task.await.expect("connection");
            assert_eq!(samples.errors, 0);
            sent += samples.latency_us.len();
        }
        // 40 a second for half a second: 20, not the hundreds eight connections would send.
        assert!((18..=21).contains(&sent), "{sent} sent");
        assert_eq!(log.lock().expect("log").len(), sent);
    }

    fn count(chunks: &[&[u8]]) -> u64 {
        let mut counter = EventCounter::default();
        chunks.iter().map(|c| counter.feed(c)).sum()
    }

    #[test]
    fn counts_events_across_chunks() {
        assert_eq!(count(&[b"data: a\n\ndata: b\n\n"]), 2);
        assert_eq!(count(&[b"data: a\n", b"\n", b"data: [DONE]\n\n"]), 2);
        assert_eq!(count(&[b"data: a\n\n", b"data: b", b"\n\n"]), 2);
    }

    #[test]
    fn extra_blank_lines_are_no_events() {
        assert_eq!(count(&[b"data: a\n\n\ndata: b\n\n\n"]), 2);
        assert_eq!(count(&[b"data: a\n\n", b"\n", b"\n"]), 1);
        assert_eq!(count(&[b"\n\n"]), 0);
    }
}

//! The floor of a Rust proxy, for calibration: hyper 1 on tokio, each client connection paired
//! with one keep-alive connection to the next upstream (round robin), every request passed
//! through as it is. No parsing, no selection, no accounting, no timeouts: what any proxy built
//! on the same stack pays at least.
//!
//! With `--per-request`, each request goes to the next upstream instead (round robin per
//! request, as the routers in the benchmarks route), on an idle keep-alive connection from a pool
//! of each upstream's, or a new one.
//!
//! usage: pdproxy-floor --port PORT --upstream HOST:PORT [--upstream HOST:PORT]... [--threads N] [--per-request]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

type Sender = client::SendRequest<Incoming>;
type Upstream = Arc<Mutex<Sender>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn open(address: &str) -> std::io::Result<Sender> {
    let stream = TcpStream::connect(address).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = client::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn connect(address: &str) -> std::io::Result<Upstream> {
    Ok(Arc::new(Mutex::new(open(address).await?)))
}

/// The upstreams, the next one's turn, and (`--per-request`) each one's idle connections.
struct Pools {
    upstreams: Vec<String>,
    idle: Vec<std::sync::Mutex<Vec<Sender>>>,
    next: AtomicUsize,
}

impl Pools {
    /// An idle connection to upstream `i` (the most recently used first), if any is ready.
    fn take(&self, i: usize) -> Option<Sender> {
        let mut idle = self.idle[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = idle.iter().rposition(Sender::is_ready)?;
        Some(idle.swap_remove(at))
    }
}

async fn pass_per_request(pools: Arc<Pools>, request: Request<Incoming>) -> Result<Response<Incoming>, BoxError> {
    let i = pools.next.fetch_add(1, Ordering::Relaxed) % pools.upstreams.len();
    let mut sender = match pools.take(i) {
        Some(sender) => sender,
        None => open(&pools.upstreams[i]).await?,
    };
    sender.ready().await?;
    let response = sender.send_request(request).await;
    // Back once the head is in: it is ready again when the body has been read.
    pools.idle[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(sender);
    Ok(response?)
}

async fn pass(upstream: Upstream, request: Request<Incoming>) -> Result<Response<Incoming>, hyper::Error> {
    // One request at a time per client connection, as HTTP/1.1 keep-alive sends them.
    let mut sender = upstream.lock().await;
    sender.ready().await?;
    sender.send_request(request).await
}

fn main() -> std::io::Result<()> {
    let mut port = 0u16;
    let mut upstreams = Vec::new();
    let mut threads = std::thread::available_parallelism().map_or(1, usize::from);
    let mut per_request = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--per-request" {
            per_request = true;
            continue;
        }
        let value = args.next().unwrap_or_default();
        match flag.as_str() {
            "--port" => port = value.parse().map_err(std::io::Error::other)?,
            "--upstream" => upstreams.push(value),
            "--threads" => threads = value.parse().map_err(std::io::Error::other)?,
            other => return Err(std::io::Error::other(format!("unknown argument {other}"))),
        }
    }
    if upstreams.is_empty() {
        return Err(std::io::Error::other("at least one --upstream HOST:PORT"));
    }
    let pools = Arc::new(Pools {
        idle: upstreams.iter().map(|_| std::sync::Mutex::default()).collect(),
        upstreams,
        next: AtomicUsize::new(0),
    });
    tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()?.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            if per_request {
                let pools = Arc::clone(&pools);
                tokio::spawn(async move {
                    let service = service_fn(move |request| pass_per_request(Arc::clone(&pools), request));
                    let _ = server::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
                continue;
            }
            let address = pools.upstreams[pools.next.fetch_add(1, Ordering::Relaxed) % pools.upstreams.len()].clone();
            tokio::spawn(async move {
                let Ok(upstream) = connect(&address).await else { return };
                let service = service_fn(move |request| pass(upstream.clone(), request));
                let _ = server::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    })
}

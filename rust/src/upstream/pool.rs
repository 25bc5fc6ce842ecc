//! Idle keep-alive connections, per node address: the most recently used first, none kept
//! longer than the idle timeout (which should stay below the nodes' own keep-alive).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rustc_hash::FxHashMap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// One connection to a node, with what has been read from it and not consumed yet.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) stream: Stream,
    pub(crate) buffer: BytesMut,
    /// Bytes the next read asks for (see `codec::poll_fill`).
    pub(crate) read_size: usize,
}

/// A connection's socket: plain TCP (`http://` nodes) or TLS over it (`https://` nodes).
#[derive(Debug)]
pub(crate) enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Self::Plain(tcp) => tcp,
            Self::Tls(tls) => tls.get_ref().0,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

#[derive(Debug)]
struct Idle {
    connection: Connection,
    since: Instant,
}

/// One origin's idle connections, and its name shared with the returners of its connections,
/// so that taking a connection and giving it back allocate nothing.
#[derive(Debug)]
struct Idles {
    origin: Arc<str>,
    list: Vec<Idle>,
}

#[derive(Debug)]
struct Shared {
    idle: Mutex<FxHashMap<Arc<str>, Idles>>,
    max_per_host: usize,
    idle_timeout: Duration,
}

#[derive(Debug, Clone)]
pub(crate) struct Pool(Arc<Shared>);

impl Pool {
    pub(crate) fn new(max_per_host: usize, idle_timeout: Duration) -> Self {
        Self(Arc::new(Shared { idle: Mutex::default(), max_per_host, idle_timeout }))
    }

    /// An idle connection to `host` that is still open, if any, and where the connection the
    /// request ends up on goes back once its answer has been read.
    pub(crate) fn checkout(&self, host: &str) -> (Option<Connection>, Returner) {
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let idles = if let Some(idles) = idle.get_mut(host) {
            idles
        } else {
            let origin: Arc<str> = Arc::from(host);
            idle.entry(Arc::clone(&origin)).or_insert(Idles { origin, list: Vec::new() })
        };
        let returner = Returner { pool: self.clone(), host: Arc::clone(&idles.origin) };
        while let Some(Idle { connection, since }) = idles.list.pop() {
            if since.elapsed() < self.0.idle_timeout && still_open(&connection.stream) {
                return (Some(connection), returner);
            }
        }
        (None, returner)
    }

    /// Closes the idle connections past the idle timeout or no longer open, and every one to
    /// an origin `keep` refuses (a removed node), whose entry goes too.
    pub(crate) fn sweep(&self, keep: &dyn Fn(&str) -> bool) {
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|origin, idles| {
            if !keep(origin) {
                return false;
            }
            idles.list.retain(|i| i.since.elapsed() < self.0.idle_timeout && still_open(&i.connection.stream));
            true
        });
    }

    fn put(&self, host: &Arc<str>, connection: Connection) {
        if !connection.buffer.is_empty() {
            return; // the node sent more than its answer: not safe to reuse
        }
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        // Its entry was made at checkout.
        let Some(idles) = idle.get_mut(&**host) else { return };
        if idles.list.len() < self.0.max_per_host {
            idles.list.push(Idle { connection, since: Instant::now() });
        }
    }
}

/// Gives a connection back to the pool it came from.
#[derive(Debug)]
pub(crate) struct Returner {
    pool: Pool,
    host: Arc<str>,
}

impl Returner {
    pub(crate) fn give_back(self, connection: Connection) {
        self.pool.put(&self.host, connection);
    }
}

/// An idle connection is usable when nothing is waiting on it: no data (the node has nothing
/// to say between answers) and no end (it has not closed). Reads only what the event loop
/// already knows, so a healthy connection costs no system call. Under TLS the probe reads the
/// socket beneath it: whatever it finds (a close notification, or the end) means the
/// connection is dropped anyway.
fn still_open(stream: &Stream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.tcp().try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

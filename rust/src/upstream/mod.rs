//! The upstream client: HTTP/1.1 to the nodes over pooled keep-alive connections, made for a
//! proxy. A response body is read from the node's socket by whoever consumes it (the edge's
//! relay writes each read to the client in the same task), so there is no connection task and
//! no channel between the two sockets, and everything one read brings goes on as one piece.

mod body;
mod codec;
pub(crate) mod forward;
mod pool;
pub(crate) mod request;
pub(crate) mod retry;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use http::{HeaderMap, StatusCode};
use tokio::io::AsyncWrite;
use tokio::net::TcpSocket;
use tokio_rustls::TlsConnector;

pub(crate) use body::Body;
pub(crate) use codec::Hop;
use codec::{body_after_head, encode_request, poll_fill, read_head, Head, HeadError};
use pool::{Connection, Pool, Stream};
pub(crate) use request::ForwardRequest;

use crate::error::{Error, Kind, Result};
use crate::node::Target;
use retry::RetryBudget;

/// How long a node that stopped reading a request gets to show the answer it sent before.
const EARLY_ANSWER_WAIT: Duration = Duration::from_secs(1);

/// Client settings; values come from the control plane's settings.
#[derive(Debug, Clone)]
pub(crate) struct ClientConfig {
    pub(crate) connect_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_idle_per_host: usize,
    /// `SO_RCVBUF` of each connection (a node's answer waits here when the client is slow).
    pub(crate) receive_buffer: usize,
    /// CA certificates that `https://` nodes are verified against; `None`: the system's roots.
    pub(crate) ca_file: Option<PathBuf>,
    /// Silence on a connection before TCP keep-alive probes start.
    pub(crate) tcp_keepalive: Duration,
}

/// A node's answer: its head (without the headers of the node's hop), and its body still to be read.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    /// The body's announced length, when it has one.
    pub(crate) content_length: Option<u64>,
    pub(crate) body: Body,
}

#[derive(Debug)]
pub(crate) struct Client {
    config: ClientConfig,
    pool: Pool,
    /// Built at the first `https://` node (loading the roots takes a while, and most fleets
    /// are plain http).
    tls: OnceLock<std::result::Result<Arc<rustls::ClientConfig>, String>>,
}

impl Client {
    pub(crate) fn new(config: ClientConfig) -> Self {
        let pool = Pool::new(config.max_idle_per_host, config.idle_timeout);
        Self { config, pool, tls: OnceLock::new() }
    }

    /// Sends one request to `target` and reads the answer's head. A request goes on another
    /// connection only when it provably never reached the node: a pooled connection the node
    /// had already closed or reset fails the write itself. Then it is sent once more, on a new
    /// connection, if the retry `budget` allows it. A pooled connection that closes
    /// once the request was written may have run it: that is an error, never a resend.
    pub(crate) async fn send(
        &self,
        target: Target<'_>,
        path: &str,
        request: &ForwardRequest,
        hop: &Hop<'_>,
        budget: &RetryBudget,
    ) -> Result<Answer> {
        let method = &request.method;
        let head = encode_request(path, target.authority, request, hop);
        let parts = [head.as_slice(), body_after_head(request)];
        let mut fresh_only = false;
        loop {
            let (idle, returner) = self.pool.checkout(target.origin);
            let (mut connection, reused) = match idle.filter(|_| !fresh_only) {
                Some(connection) => (connection, true),
                // Boxed: connecting (DNS, TCP, TLS) is rare with pooled connections, and inline
                // its state would make every request's future 1.5 KiB larger.
                None => (Box::pin(self.connect(target)).await?, false),
            };
            let early = match write_request(&mut connection, &parts).await {
                Written::Whole => false,
                Written::Answering => true,
                Written::Failed(e) => {
                    // The node may have answered before it stopped reading (a 413 for a body too
                    // large for it): that answer is the client's.
                    if let Ok(Ok(head)) =
                        tokio::time::timeout(EARLY_ANSWER_WAIT, read_head(&mut connection, method)).await
                    {
                        return Ok(answer(connection, head, false, returner));
                    }
                    if reused && !fresh_only && budget.spend() {
                        fresh_only = true;
                        continue;
                    }
                    return Err(Error::with_source(Kind::Connect, "could not send the request to the node", e));
                }
            };
            return match read_head(&mut connection, method).await {
                // A node that answered before taking the whole request leaves the connection
                // in no state for another one.
                Ok(head) => Ok(answer(connection, head, !early, returner)),
                Err(HeadError::Closed) => Err(Error::new(
                    Kind::Upstream,
                    if reused {
                        "the node closed a pooled connection without answering (the request may have run)"
                    } else {
                        "the node closed the connection before answering"
                    },
                )),
                Err(HeadError::Io(e)) => {
                    Err(Error::with_source(Kind::Upstream, "the node broke off the connection before answering", e))
                }
                Err(HeadError::Invalid(why)) => {
                    Err(Error::new(Kind::InvalidAnswer, format!("the node's answer is not valid HTTP: {why}")))
                }
            };
        }
    }

    /// A new connection to the target's pinned address, else to its host (resolved now); over
    /// TLS for `https://` nodes.
    async fn connect(&self, target: Target<'_>) -> Result<Connection> {
        let deadline = tokio::time::Instant::now() + self.config.connect_timeout;
        let connecting = async {
            let addresses: Vec<SocketAddr> = match target.pinned {
                Some(address) => vec![address],
                None => tokio::net::lookup_host(target.dial).await?.collect(),
            };
            let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the node's host resolves to nothing");
            for address in addresses {
                let socket = if address.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }?;
                // Before connecting, so that the window is sized from the start.
                let _ = socket.set_recv_buffer_size(u32::try_from(self.config.receive_buffer).unwrap_or(u32::MAX));
                match socket.connect(address).await {
                    Ok(stream) => return Ok(stream),
                    Err(e) => last = e,
                }
            }
            Err(last)
        };
        let connected = tokio::time::timeout_at(deadline, connecting).await;
        let tcp = match connected {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) if is_local_shortage(&e) => {
                return Err(Error::with_source(Kind::Resources, "the proxy has no socket to spare for the node", e))
            }
            Ok(Err(e)) => return Err(Error::with_source(Kind::Connect, "could not connect to the node", e)),
            Err(_) => return Err(Error::new(Kind::Connect, "could not connect to the node in time")),
        };
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(self.config.tcp_keepalive);
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        let stream = match target.tls_name {
            None => Stream::Plain(tcp),
            Some(name) => {
                // Within the same deadline: a handshake that fails never ran the request either.
                let handshake = self.tls_connector()?.connect(crate::tls::server_name(name)?, tcp);
                match tokio::time::timeout_at(deadline, handshake).await {
                    Ok(Ok(tls)) => Stream::Tls(Box::new(tls)),
                    Ok(Err(e)) => {
                        return Err(Error::with_source(Kind::Connect, "the TLS handshake with the node failed", e))
                    }
                    Err(_) => return Err(Error::new(Kind::Connect, "the TLS handshake with the node took too long")),
                }
            }
        };
        Ok(Connection { stream, buffer: BytesMut::with_capacity(codec::READ_SIZE), read_size: codec::READ_SIZE })
    }

    /// Closes idle connections past their timeout, or to origins `keep` refuses (removed nodes).
    pub(crate) fn sweep(&self, keep: &dyn Fn(&str) -> bool) {
        self.pool.sweep(keep);
    }

    fn tls_connector(&self) -> Result<TlsConnector> {
        let built = self
            .tls
            .get_or_init(|| crate::tls::client_config(self.config.ca_file.as_deref()).map_err(|e| e.to_string()));
        match built {
            Ok(config) => Ok(TlsConnector::from(Arc::clone(config))),
            Err(why) => Err(Error::new(Kind::Connect, format!("cannot verify https nodes: {why}"))),
        }
    }
}

/// The answer of `head`, its body still on `connection`.
fn answer(connection: Connection, head: Head, reusable: bool, returner: pool::Returner) -> Answer {
    let content_length = match head.framing {
        codec::Framing::Length(length) => Some(length),
        _ => None,
    };
    let body = Body::new(connection, head.framing, head.reusable && reusable, returner);
    Answer { status: head.status, headers: head.headers, content_length, body }
}

/// How writing a request went.
enum Written {
    Whole,
    /// The node began to answer before it took the whole request.
    Answering,
    Failed(std::io::Error),
}

/// Writes the request; while the node is not taking more of it, watches for its answer.
async fn write_request(connection: &mut Connection, parts: &[&[u8]]) -> Written {
    let (mut part, mut sent) = (0, 0);
    std::future::poll_fn(|cx| loop {
        if part == parts.len() {
            return match std::pin::Pin::new(&mut connection.stream).poll_flush(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(Written::Whole),
                Poll::Ready(Err(e)) => Poll::Ready(Written::Failed(e)),
                Poll::Pending => Poll::Pending,
            };
        }
        if sent == parts[part].len() {
            (part, sent) = (part + 1, 0);
            continue;
        }
        match std::pin::Pin::new(&mut connection.stream).poll_write(cx, &parts[part][sent..]) {
            Poll::Ready(Ok(0)) => return Poll::Ready(Written::Failed(std::io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => sent += n,
            Poll::Ready(Err(e)) => return Poll::Ready(Written::Failed(e)),
            // Only when the node stops reading (a large body): the usual request goes in one write.
            Poll::Pending => {
                return match poll_fill(connection, cx) {
                    Poll::Ready(Ok(0)) => Poll::Ready(Written::Failed(std::io::ErrorKind::UnexpectedEof.into())),
                    Poll::Ready(Ok(_)) => Poll::Ready(Written::Answering),
                    Poll::Ready(Err(e)) => Poll::Ready(Written::Failed(e)),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    })
    .await
}

/// Whether a failed connect was the proxy's own shortage (descriptors, buffers, local ports),
/// which says nothing of the node.
fn is_local_shortage(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EADDRNOTAVAIL))
}

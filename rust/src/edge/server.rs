//! The listener and the connections: HTTP/1.1 with keep-alive on the data plane's runtime;
//! each request routed to the fast path or to the control plane.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use http::header::ORIGIN;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::answer;
use super::body::EdgeBody;
use super::cors::Cors;
use super::error_answer;
use super::request::{request_id, Peer};
use super::worker::Worker;
use super::{pipeline, EdgeState, Route, Stop};

/// How long open connections get to finish once the edge shuts down.
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// How far ahead the pacemaker keeps a timer (below the header timeout's smallest sane value).
const PACE: Duration = Duration::from_millis(500);

/// A connection handed to an edge thread.
type Accepted = (std::net::TcpStream, SocketAddr);

/// The threads' inboxes, and how many connections each serves (the acceptor hands each new
/// connection to the least busy thread).
pub(crate) struct Inboxes {
    senders: Vec<UnboundedSender<Accepted>>,
    open: Vec<Arc<AtomicUsize>>,
}

/// What each edge thread starts with.
pub(crate) struct ThreadStart {
    inbox: UnboundedReceiver<Accepted>,
    open: Arc<AtomicUsize>,
}

/// `threads` inboxes: one for the acceptor, one start for each thread.
pub(crate) fn inboxes(threads: usize) -> (Inboxes, Vec<ThreadStart>) {
    let mut inboxes = Inboxes { senders: Vec::new(), open: Vec::new() };
    let mut starts = Vec::new();
    for _ in 0..threads {
        let (sender, inbox) = unbounded_channel();
        let open = Arc::new(AtomicUsize::new(0));
        inboxes.senders.push(sender);
        inboxes.open.push(Arc::clone(&open));
        starts.push(ThreadStart { inbox, open });
    }
    (inboxes, starts)
}

/// Runs one edge thread until the edge shuts down and its connections have closed; the first
/// thread (`acceptor`) also accepts connections for all of them.
pub(crate) fn run_thread(
    state: &Arc<EdgeState>,
    start: ThreadStart,
    acceptor: Option<(std::net::TcpListener, Inboxes)>,
) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
    runtime.block_on(async {
        let worker =
            Arc::new(Worker { state: Arc::clone(state), forwarder: state.engine.new_forwarder(), open: start.open });
        let accepting = async {
            if let Some((listener, inboxes)) = acceptor {
                if let Ok(listener) = TcpListener::from_std(listener) {
                    accept(state, listener, inboxes).await;
                }
            }
        };
        tokio::select! {
            ((), ()) = async { tokio::join!(accepting, serve_inbox(&worker, start.inbox)) } => {}
            never = pacemaker() => match never {},
            never = worker.forwarder.keep_swept(&state.engine.registry) => match never {},
        }
        // Each connection closes within CLOSE_GRACE of the shutdown; wait a little longer.
        let deadline = tokio::time::Instant::now() + CLOSE_GRACE * 2;
        while worker.open.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
}

/// Keeps a timer at most `PACE` away on this thread's clock, forever. tokio wakes its own event
/// loop (an eventfd write, then one more epoll round) whenever a timer is armed earlier than the
/// one the loop last parked for; hyper arms a header timer after every response while the loop's
/// next timer is often a far one (a first-byte timeout), so without this every request paid that
/// wake-up. One timer a second costs nothing in comparison.
async fn pacemaker() -> std::convert::Infallible {
    loop {
        tokio::time::sleep(PACE).await;
    }
}

/// Accepts connections until the edge shuts down, each for the thread serving the fewest.
async fn accept(state: &EdgeState, listener: TcpListener, inboxes: Inboxes) {
    loop {
        let accepted = tokio::select! {
            () = state.shutdown.token().cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted.and_then(|(stream, peer)| Ok((stream.into_std()?, peer))) {
            // Refused here, at once: a flood must not take the descriptors that requests
            // already admitted need for their nodes.
            Ok((stream, _))
                if inboxes.open.iter().map(|o| o.load(Ordering::Relaxed)).sum::<usize>()
                    >= state.config.max_connections =>
            {
                refuse_connection(stream, state.config.max_connections);
            }
            Ok(connection) => {
                let least_busy = (0..inboxes.open.len())
                    .min_by_key(|&i| inboxes.open[i].load(Ordering::Relaxed))
                    .unwrap_or_default();
                // Counted now, so that the next connection of a burst goes elsewhere.
                inboxes.open[least_busy].fetch_add(1, Ordering::Relaxed);
                if inboxes.senders[least_busy].send(connection).is_err() {
                    inboxes.open[least_busy].fetch_sub(1, Ordering::Relaxed);
                }
            }
            // Out of descriptors or a connection reset before it was accepted: go on, gently.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    // Dropping the senders ends every thread's inbox.
}

/// Answers a connection past the cap with a 503 and closes it. The client's first bytes, if
/// already there, are read first, so that the close does not reset the answer away.
fn refuse_connection(mut stream: std::net::TcpStream, cap: usize) {
    use std::io::{Read as _, Write as _};
    let mut scratch = [0u8; 4096];
    let _ = stream.read(&mut scratch);
    let message = format!("the proxy has its limit of {cap} client connections open");
    let body = answer::error_body(&message, answer::TOO_MANY_CONNECTIONS, None);
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nx-pdproxy-error: {}\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        answer::TOO_MANY_CONNECTIONS.code,
        body.len()
    );
    let _ = stream.write_all(format!("{head}{body}").as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Serves the connections handed to this thread until the acceptor stops.
async fn serve_inbox(worker: &Arc<Worker>, mut inbox: UnboundedReceiver<Accepted>) {
    while let Some((stream, peer)) = inbox.recv().await {
        match TcpStream::from_std(stream) {
            Ok(stream) => {
                tokio::spawn(serve_connection(Arc::clone(worker), stream, peer));
            }
            Err(_) => {
                worker.open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

async fn serve_connection(worker: Arc<Worker>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    // Every buffer of a stream counts: the kernel's too (see `forward::socket_buffer`).
    let limit = worker.state.engine.config.forward.stream_buffer_limit;
    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(crate::upstream::forward::socket_buffer(limit));
    let peer = Arc::new(Peer::new(peer));
    let state = Arc::clone(&worker.state);
    state.connections.fetch_add(1, Ordering::Relaxed);
    match &state.config.tls {
        None => serve_http(&worker, stream, peer).await,
        Some(tls) => {
            // The handshake gets the time a client has to send its headers.
            let handshake = TlsAcceptor::from(Arc::clone(tls)).accept(stream);
            if let Ok(Ok(stream)) = tokio::time::timeout(state.config.header_read_timeout, handshake).await {
                serve_http(&worker, stream, peer).await;
            }
        }
    }
    state.connections.fetch_sub(1, Ordering::Relaxed);
    worker.open.fetch_sub(1, Ordering::Relaxed);
}

/// Serves HTTP/1.1 on a client's connection (plain, or TLS once its handshake is done).
async fn serve_http<S>(worker: &Arc<Worker>, stream: S, peer: Arc<Peer>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let state = &worker.state;
    let io = TokioIo::new(StallGuard::new(stream, state.engine.config.forward.stream_stall_timeout));
    let service_worker = Arc::clone(worker);
    let service = service_fn(move |request| {
        let worker = Arc::clone(&service_worker);
        let peer = Arc::clone(&peer);
        async move { Ok::<_, Infallible>(guarded(worker, &peer, request).await) }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(state.config.header_read_timeout)
        .keep_alive(true)
        .max_buf_size(state.engine.config.forward.stream_buffer_limit.max(8192));
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        biased;
        _ = connection.as_mut() => {}
        () = Shutdown::new(&state.shutdown) => {
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(CLOSE_GRACE, connection).await;
        }
    }
}

/// Routes the request; a panic while serving it becomes a 500 answer, never a dead connection.
async fn guarded(worker: Arc<Worker>, peer: &Peer, request: Request<Incoming>) -> Response<EdgeBody> {
    let (id, had_id) = request_id(request.headers());
    let echo = id.clone();
    match AssertUnwindSafe(route(&worker, peer, request, id, had_id)).catch_unwind().await {
        Ok(response) => response,
        Err(_) => error_answer::error(answer::INTERNAL, "the proxy failed while serving this request", None, &echo),
    }
}

async fn route(
    worker: &Worker,
    peer: &Peer,
    request: Request<Incoming>,
    id: http::HeaderValue,
    had_id: bool,
) -> Response<EdgeBody> {
    let state = &worker.state;
    // Browsers' CORS, on the routes they may call; what the control plane serves it decorates itself.
    let cors = state.config.cors.as_ref().filter(|_| Cors::applies_to(request.uri().path()));
    if let Some(cors) = cors.filter(|_| Cors::is_preflight(request.method(), request.headers())) {
        return cors.preflight(request.headers(), &id);
    }
    if request.method() == Method::POST {
        let origin = cors.and(request.headers().get(ORIGIN).cloned());
        // Boxed: hyper keeps room for this future beside every open connection, streaming or
        // idle; the state of serving a request (3 KiB of it) need only live while it is served.
        let mut response = match state.route(request.uri().path()) {
            Route::Inference(strategy) => {
                let (parts, body) = request.into_parts();
                let body = pipeline::ClientBody::Incoming(body);
                Box::pin(pipeline::serve(worker, peer, parts, body, id, had_id, strategy)).await
            }
            Route::ControlPlane => return Box::pin(state.control.forward(peer.address, request, &id)).await,
        };
        if let (Some(cors), Some(origin)) = (cors, origin) {
            cors.decorate(response.headers_mut(), &origin);
        }
        return response;
    }
    Box::pin(state.control.forward(peer.address, request, &id)).await
}

/// The edge's shutdown, as a connection waits for it: its waker is registered once, then each
/// wake-up only reads a flag (polling the token's own future takes a lock every time, and a
/// streaming connection is woken for every event it relays).
struct Shutdown {
    stop: Arc<Stop>,
    waiting: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
}

impl Shutdown {
    fn new(stop: &Arc<Stop>) -> Self {
        Self { stop: Arc::clone(stop), waiting: None }
    }
}

impl Future for Shutdown {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.stop.is_set() {
            return Poll::Ready(());
        }
        if self.waiting.is_none() {
            let mut waiting = Box::pin(self.stop.token().clone().cancelled_owned());
            if waiting.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            self.waiting = Some(waiting);
        }
        Poll::Pending
    }
}

/// The client's socket, cut off when the client stops reading for longer than `limit` (its
/// stream would otherwise hold its node for as long as the client likes).
struct StallGuard<S> {
    stream: S,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl<S> StallGuard<S> {
    fn new(stream: S, limit: Duration) -> Self {
        Self { stream, limit, stalled: None, armed: false }
    }

    fn written<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        let limit = self.limit;
        let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if !self.armed {
            sleep.as_mut().reset(tokio::time::Instant::now() + limit);
            self.armed = true;
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the client stopped reading"))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallGuard<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallGuard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.written(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.written(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_flush(cx);
        self.written(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

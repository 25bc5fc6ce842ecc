//! The listener and the connections: HTTP/1.1 with keep-alive on the data plane's runtime;
//! each request routed to the fast path or to the control plane.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

use super::answer;
use super::body::EdgeBody;
use super::request::request_id;
use super::{hybrid, pd, EdgeState, Route};

/// How long open connections get to finish once the edge shuts down.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Accepts connections until the edge shuts down.
pub async fn accept(state: Arc<EdgeState>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            () = state.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                tokio::spawn(serve_connection(Arc::clone(&state), stream, peer));
            }
            // Out of descriptors or a connection reset before it was accepted: go on, gently.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn serve_connection(state: Arc<EdgeState>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    state.connections.fetch_add(1, Ordering::Relaxed);
    let io = TokioIo::new(StallGuard::new(stream, state.engine.config.forward.stream_stall_timeout));
    let service_state = Arc::clone(&state);
    let service = service_fn(move |request| {
        let state = Arc::clone(&service_state);
        async move { Ok::<_, Infallible>(guarded(state, peer, request).await) }
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
        _ = connection.as_mut() => {}
        () = state.shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(CLOSE_GRACE, connection).await;
        }
    }
    state.connections.fetch_sub(1, Ordering::Relaxed);
}

/// Routes the request; a panic while serving it becomes a 500 answer, never a dead connection.
async fn guarded(state: Arc<EdgeState>, peer: SocketAddr, request: Request<Incoming>) -> Response<EdgeBody> {
    let (id, had_id) = request_id(request.headers());
    let echo = id.clone();
    match AssertUnwindSafe(route(state, peer, request, id, had_id)).catch_unwind().await {
        Ok(response) => response,
        Err(_) => answer::error(answer::INTERNAL, "the proxy failed while serving this request", None, &echo),
    }
}

async fn route(
    state: Arc<EdgeState>,
    peer: SocketAddr,
    request: Request<Incoming>,
    id: http::HeaderValue,
    had_id: bool,
) -> Response<EdgeBody> {
    if request.method() == Method::POST {
        match state.route(request.uri().path()) {
            Route::Hybrid { require_model } => {
                return hybrid::serve(&state, peer, request, id, had_id, require_model).await;
            }
            Route::Disaggregated(protocol) => return pd::serve(&state, peer, request, id, had_id, protocol).await,
            Route::ControlPlane => {}
        }
    }
    state.control.forward(peer, request, &id).await
}

/// The client's socket, cut off when the client stops reading for longer than `limit` (its
/// stream would otherwise hold its node for as long as the client likes).
struct StallGuard {
    stream: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl StallGuard {
    fn new(stream: TcpStream, limit: Duration) -> Self {
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
            Poll::Ready(()) => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the client stopped reading")))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for StallGuard {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallGuard {
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

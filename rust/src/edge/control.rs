//! The way to the control plane: every request the edge does not serve itself goes, unchanged,
//! to the Python ASGI app that granian serves on a private Unix socket, over a small pool of
//! keep-alive connections; its answer comes back unchanged. A control plane that cannot be
//! reached, has stopped beating or does not answer in time gets a clear 503, never a hang.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderValue, HOST};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use super::answer::{self, CONTROL_PLANE_UNAVAILABLE};
use super::body::EdgeBody;
use super::request::X_REQUEST_ID;
use crate::error::BoxError;
use crate::headers::strip_hop_headers;

/// The header that tells the control plane the client's address (its own peer is the edge).
pub const PEER_HEADER: &str = "x-pdproxy-peer";

/// Idle connections kept to the control plane: as many as the requests it may serve at once
/// (LMDeploy's DistServe streams all go through it), so that none has to connect anew.
const POOL_SIZE: usize = 1024;

#[derive(Debug)]
pub struct ControlPlane {
    socket: PathBuf,
    idle: Arc<Mutex<Vec<SendRequest<Incoming>>>>,
    /// Longest wait for the control plane's response head.
    head_timeout: Duration,
    /// Milliseconds since `epoch` of the control plane's last heartbeat (0: none yet).
    beat_ms: AtomicU64,
    epoch: Instant,
    /// Silence after which the control plane counts as stuck.
    stale_after: Duration,
}

impl ControlPlane {
    pub fn new(socket: PathBuf, head_timeout: Duration, stale_after: Duration) -> Self {
        Self {
            socket,
            idle: Arc::default(),
            head_timeout,
            beat_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            stale_after,
        }
    }

    /// The control plane's loop is alive (called by it, periodically).
    pub fn beat(&self) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX).max(1);
        self.beat_ms.store(now, Ordering::Relaxed);
    }

    fn stuck(&self) -> bool {
        let beat = self.beat_ms.load(Ordering::Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        beat > 0 && now.saturating_sub(beat) > u64::try_from(self.stale_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// Forwards `request` and returns the control plane's answer.
    pub async fn forward(
        &self,
        peer: SocketAddr,
        request: Request<Incoming>,
        request_id: &HeaderValue,
    ) -> Response<EdgeBody> {
        let unavailable = |message: &str| answer::error(CONTROL_PLANE_UNAVAILABLE, message, None, request_id);
        if self.stuck() {
            return unavailable("the control plane is not responding");
        }
        let Ok(mut sender) = self.connection().await else {
            return unavailable("the control plane is not available");
        };
        let (mut parts, body) = request.into_parts();
        strip_hop_headers(&mut parts.headers);
        parts.headers.insert(
            PEER_HEADER,
            HeaderValue::from_str(&peer.to_string()).unwrap_or_else(|_| HeaderValue::from_static("")),
        );
        // The control plane's answers carry the id the edge's own do.
        parts.headers.insert(X_REQUEST_ID.clone(), request_id.clone());
        if !parts.headers.contains_key(HOST) {
            parts.headers.insert(HOST, HeaderValue::from_static("localhost"));
        }
        let sent = tokio::time::timeout(self.head_timeout, sender.send_request(Request::from_parts(parts, body))).await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(_)) => return unavailable("the control plane broke off the request"),
            Err(_) => return unavailable("the control plane did not answer in time"),
        };
        let (mut parts, body) = response.into_parts();
        // `connection: close` of a draining answer is the client's business too.
        let close =
            parts.headers.get(http::header::CONNECTION).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        strip_hop_headers(&mut parts.headers);
        if close {
            parts.headers.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        // The private hop's server is an implementation detail: the client sees the edge's answers.
        if parts.headers.get(http::header::SERVER).is_some_and(|v| v == "granian") {
            parts.headers.remove(http::header::SERVER);
        }
        let body = ControlBody { body, sender: Some(sender), idle: Arc::clone(&self.idle) };
        Response::from_parts(parts, EdgeBody::Control(Box::new(body)))
    }

    /// An idle pooled connection, or a new one.
    async fn connection(&self) -> std::io::Result<SendRequest<Incoming>> {
        loop {
            let pooled = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
            match pooled {
                Some(sender) if sender.is_ready() => return Ok(sender),
                Some(_) => {}
                None => break,
            }
        }
        let stream = UnixStream::connect(&self.socket).await?;
        let (sender, connection) =
            http1::handshake(TokioIo::new(stream)).await.map_err(|e| std::io::Error::other(e.to_string()))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// The control plane's answer body; its connection goes back to the pool once the body ended.
pub struct ControlBody {
    body: Incoming,
    sender: Option<SendRequest<Incoming>>,
    idle: Arc<Mutex<Vec<SendRequest<Incoming>>>>,
}

impl ControlBody {
    pub fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    pub fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }

    /// Back to the pool once the connection can take the next request.
    fn recycle(&mut self) {
        if let Some(mut sender) = self.sender.take() {
            let idle = Arc::clone(&self.idle);
            tokio::spawn(async move {
                if sender.ready().await.is_ok() {
                    let mut idle = idle.lock().unwrap_or_else(PoisonError::into_inner);
                    if idle.len() < POOL_SIZE {
                        idle.push(sender);
                    }
                }
            });
        }
    }
}

impl Body for ControlBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match polled {
            Poll::Ready(None) => {
                self.recycle();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(Some(Ok(frame))) => {
                if self.body.is_end_stream() {
                    self.recycle();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

//! The way to the control plane: every request the edge does not serve itself goes, unchanged,
//! to the Python ASGI app that granian serves on a private Unix socket, over a small pool of
//! keep-alive connections; its answer comes back unchanged. A control plane that cannot be
//! reached, has stopped beating or does not answer in time gets a clear 503, never a hang.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use http::header::{HeaderValue, HOST};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use super::answer::CONTROL_PLANE_UNAVAILABLE;
use super::body::EdgeBody;
use super::control_body::{ControlBody, Idle};
use super::error_answer;
use super::request::X_REQUEST_ID;
use crate::headers::strip_hop_headers;

/// The header that tells the control plane the client's address (its own peer is the edge).
pub(crate) const PEER_HEADER: &str = "x-pdproxy-peer";

#[derive(Debug)]
pub(crate) struct ControlPlane {
    socket: PathBuf,
    idle: Idle,
    /// Longest wait for the control plane's response head.
    head_timeout: Duration,
    /// Milliseconds since `epoch` of the control plane's last heartbeat (0: none yet).
    beat_ms: AtomicU64,
    epoch: Instant,
    /// Silence after which the control plane counts as stuck.
    stale_after: Duration,
}

impl ControlPlane {
    pub(crate) fn new(socket: PathBuf, head_timeout: Duration, stale_after: Duration) -> Self {
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
    pub(crate) fn beat(&self) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX).max(1);
        self.beat_ms.store(now, Ordering::Relaxed);
    }

    fn stuck(&self) -> bool {
        let beat = self.beat_ms.load(Ordering::Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        beat > 0 && now.saturating_sub(beat) > u64::try_from(self.stale_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// Forwards `request` and returns the control plane's answer.
    pub(crate) async fn forward(
        &self,
        peer: SocketAddr,
        request: Request<Incoming>,
        request_id: &HeaderValue,
    ) -> Response<EdgeBody> {
        let unavailable = |message: &str| error_answer::error(CONTROL_PLANE_UNAVAILABLE, message, None, request_id);
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

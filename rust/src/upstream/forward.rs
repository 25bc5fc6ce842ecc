//! Forwarding a request to a node: its key, the time to its answer's head, and the answer's
//! body read whole (small answers) or left to stream.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use http::StatusCode;
use http_body::{Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;

use super::retry::RetryBudget;
use super::{Client, ClientConfig, ForwardRequest, Hop};
use crate::coalesce::Coalescer;
use crate::error::{BoxError, Error, Kind, Result};
use crate::memory;
use crate::node::registry::Registry;
use crate::node::Node;
use crate::node::Outcome;
use crate::sse;

/// Client settings. Values come from the control plane's settings; no defaults live here.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    pub connect_timeout: Duration,
    /// Time allowed from sending the request to receiving the response head.
    pub first_byte_timeout: Duration,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle_per_node: usize,
    /// Bodies that are not event streams and announce at most this many bytes are read
    /// whole before the head is handed over, so a small JSON answer crosses into Python once.
    pub prefetch_limit: usize,
    /// Longest silence allowed between two pieces of a streamed body.
    pub stream_idle_timeout: Duration,
    /// Bytes kept for a reader that falls behind before the node's stream is held back.
    pub stream_buffer_limit: usize,
    /// How long a reader may leave a full buffer untouched before the stream is cut off.
    pub stream_stall_timeout: Duration,
    /// CA certificates that `https://` nodes are verified against; `None`: the system's roots.
    pub node_ca_file: Option<std::path::PathBuf>,
    /// Silence on a node connection before TCP keep-alive probes start.
    pub tcp_keepalive: Duration,
    /// Most bytes of an answer the proxy reads whole (a prefill's answer, an error body).
    pub answer_buffer_limit: usize,
    /// Longest time from an answer's head to the end of its body, for answers that are not
    /// event streams (a node that drips one is cut off), and for every answer read whole.
    pub answer_timeout: Duration,
}

/// The node's answer: head now, body either already read or still streaming.
#[derive(Debug)]
pub struct UpstreamResponse {
    pub status: StatusCode,
    /// Without the headers of the node's hop.
    pub headers: HeaderMap,
    pub body: ResponseBody,
}

impl UpstreamResponse {
    /// How the request counts for the node once its body has ended: a gateway error (502,
    /// 503, 504) is the node's failure; another 5xx, or a 429 (the engine is full), counts as
    /// failed without touching its circuit (a client can provoke a 500 with a bad request); any
    /// other 4xx is the client's error, apart from both.
    pub fn outcome(&self) -> Outcome {
        match self.status.as_u16() {
            502..=504 => Outcome::Failed,
            429 | 500..=599 => Outcome::Errored,
            400..=499 => Outcome::Rejected,
            _ => Outcome::Succeeded,
        }
    }
}

#[derive(Debug)]
pub enum ResponseBody {
    /// Read whole; the permit is already released.
    Complete(Bytes),
    /// Still arriving: to be pumped (see `exchange::pump`).
    Streaming(StreamBody),
}

/// The node's response body, boxed so tests can feed one from a channel.
pub(crate) type UpstreamBody = BoxBody<Bytes, BoxError>;

/// A body still arriving.
#[derive(Debug)]
pub struct StreamBody {
    pub body: UpstreamBody,
    pub event_stream: bool,
}

/// Sends requests to nodes. Cheap to clone: clones share one pool of connections.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: Arc<Client>,
    config: ForwardConfig,
    /// The proxy's id, added to every request's `x-pdproxy-via` (see `loops`).
    via: HeaderValue,
    /// What a request sent again on a new connection spends (see `Client::send`).
    budget: Arc<RetryBudget>,
}

impl Forwarder {
    /// Builds the client for the proxy `instance`. Needs no runtime; connections belong to the
    /// runtime that opens them.
    pub fn new(config: ForwardConfig, instance: &str, budget: Arc<RetryBudget>) -> Self {
        let client = Client::new(ClientConfig {
            connect_timeout: config.connect_timeout,
            idle_timeout: config.pool_idle_timeout,
            max_idle_per_host: config.pool_max_idle_per_node,
            // Every buffer of a stream counts (see `ForwardConfig::stream_buffer_limit`).
            receive_buffer: socket_buffer(config.stream_buffer_limit),
            ca_file: config.node_ca_file.clone(),
            tcp_keepalive: config.tcp_keepalive,
        });
        let via = HeaderValue::from_str(instance).unwrap_or_else(|_| HeaderValue::from_static("pdproxy"));
        Self { client: Arc::new(client), config, via, budget }
    }

    /// Closes idle connections past their timeout, and those to nodes `registry` no longer has.
    pub(crate) fn sweep(&self, registry: &Registry) {
        let nodes = registry.load();
        let origins: rustc_hash::FxHashSet<&str> = nodes.nodes().iter().map(|n| n.target().origin).collect();
        self.client.sweep(&|origin| origins.contains(origin));
    }

    /// How often the pool is swept: every second, or more often with a shorter idle timeout.
    pub(crate) fn sweep_interval(&self) -> Duration {
        SWEEP_INTERVAL.min(self.config.pool_idle_timeout)
    }

    /// Sweeps the pool forever. Runs on the event loop that uses the pool (an edge thread's).
    /// Every few sweeps, it also hands this thread's freed memory back to the system.
    pub(crate) async fn keep_swept(&self, registry: &Registry) -> std::convert::Infallible {
        let mut sweeps = 0u32;
        loop {
            tokio::time::sleep(self.sweep_interval()).await;
            self.sweep(registry);
            sweeps = sweeps.wrapping_add(1);
            if sweeps % memory::COLLECT_EVERY_SWEEPS == 0 {
                memory::return_free_pages();
            }
        }
    }

    /// Sends `request` to `node` (with the attempt's `traceparent`, when traced) and returns
    /// the response head; with `prefetch`, the body is read whole first when it is small and
    /// not an event stream. Accounting is the caller's.
    pub async fn forward(
        &self,
        node: &Node,
        request: &ForwardRequest,
        prefetch: bool,
        traceparent: Option<&HeaderValue>,
    ) -> Result<UpstreamResponse> {
        self.forward_to(node, request, prefetch, traceparent).await.map_err(|e| e.at_node(node.url()))
    }

    async fn forward_to(
        &self,
        node: &Node,
        request: &ForwardRequest,
        prefetch: bool,
        traceparent: Option<&HeaderValue>,
    ) -> Result<UpstreamResponse> {
        let path = node.path_for(&request.path_and_query);
        let key = match &node.spec().api_key {
            Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(|e| {
                Error::with_source(Kind::InvalidNode, "the node's API key is not a valid header value", e)
            })?),
            None => None,
        };
        let hop = Hop { authorization: key.as_ref(), via: &self.via, traceparent };
        let sent = self.client.send(node.target(), &path, request, &hop, &self.budget);
        let answer = match tokio::time::timeout(self.config.first_byte_timeout, sent).await {
            Ok(answer) => answer?,
            Err(_) => return Err(Error::new(Kind::Timeout, "the node did not answer in time")),
        };
        let headers = answer.headers;
        let event_stream = headers.get(CONTENT_TYPE).is_some_and(|ct| sse::is_event_stream(ct.as_bytes()));
        if event_stream {
            let body = ResponseBody::Streaming(StreamBody { body: answer.body.boxed(), event_stream });
            return Ok(UpstreamResponse { status: answer.status, headers, body });
        }
        // Not an event stream: its whole body is due soon after its head.
        let mut body = Timed::new(answer.body, self.config.answer_timeout);
        let small = answer.content_length.is_some_and(|len| len <= self.config.prefetch_limit as u64);
        let idle = self.config.stream_idle_timeout;
        let body = if prefetch && small {
            // A small body is due whole within one idle span of its head.
            let whole = tokio::time::timeout(idle, read_all(body, self.config.prefetch_limit));
            ResponseBody::Complete(whole.await.map_err(|_| went_quiet(idle))??)
        } else {
            // Its first piece now: a body that fails at once is a 502, not a head with nothing after.
            let first = tokio::time::timeout(idle, read_frame(&mut body)).await.map_err(|_| went_quiet(idle))?;
            match first? {
                None => ResponseBody::Complete(Bytes::new()),
                Some(first) => ResponseBody::Streaming(StreamBody {
                    body: Prepended { first: Some(first), rest: body }.boxed(),
                    event_stream,
                }),
            }
        };
        Ok(UpstreamResponse { status: answer.status, headers, body })
    }
}

fn went_quiet(idle: Duration) -> Error {
    Error::new(Kind::Timeout, format!("the node sent nothing for {}s", idle.as_secs_f64()))
}

/// How often idle connections to nodes are looked over.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// The next data of `body`; its errors as the node's failure.
async fn read_frame(
    body: &mut (impl http_body::Body<Data = Bytes, Error = BoxError> + Unpin),
) -> Result<Option<Bytes>> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(node_failure(e)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
            }
        }
    }
}

/// A body's error as the request's: the proxy's own verdict on the answer (too large, too slow)
/// as it is, anything else as the node breaking off.
fn node_failure(e: BoxError) -> Error {
    match e.downcast::<Error>() {
        Ok(own) if own.kind() == Kind::InvalidAnswer => *own,
        Ok(own) => Error::with_source(Kind::Upstream, "the node broke off the response", own),
        Err(other) => Error::with_source(Kind::Upstream, "the node broke off the response", other),
    }
}

/// A body read whole, refused past `limit` bytes.
pub(crate) async fn read_all(
    mut body: impl http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
    limit: usize,
) -> Result<Bytes> {
    let mut joined = Coalescer::default();
    let mut size = 0usize;
    while let Some(data) = read_frame(&mut body).await? {
        size += data.len();
        if size > limit {
            return Err(too_large(limit));
        }
        joined.push(data);
    }
    Ok(joined.take().unwrap_or_default())
}

impl Forwarder {
    /// A node's answer body read whole, within the answer limits: `answer_buffer_limit` bytes
    /// and `answer_timeout` from now. Past either, the body (and its connection) is dropped.
    pub(crate) async fn read_answer(&self, body: UpstreamBody) -> Result<Bytes> {
        read_all(Timed::new(body, self.config.answer_timeout), self.config.answer_buffer_limit).await
    }
}

fn too_large(limit: usize) -> Error {
    Error::new(Kind::InvalidAnswer, format!("the node's answer is larger than the {limit} bytes the proxy reads whole"))
}

/// A body that fails once its time is up: `answer_timeout` from the first time it has to wait
/// (a body that came whole with its head costs no timer).
struct Timed<B> {
    body: B,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    limit: Duration,
}

impl<B> Timed<B> {
    fn new(body: B, limit: Duration) -> Self {
        Self { body, deadline: None, limit }
    }
}

impl<B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin> http_body::Body for Timed<B> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        let limit = self.limit;
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let message = format!("the node's answer did not end within {}s", limit.as_secs_f64());
                Poll::Ready(Some(Err(Box::new(Error::new(Kind::InvalidAnswer, message)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A body whose first piece was read already.
struct Prepended<B> {
    first: Option<Bytes>,
    rest: B,
}

impl<B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin> http_body::Body for Prepended<B> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.first.take() {
            Some(first) => Poll::Ready(Some(Ok(Frame::data(first)))),
            None => Pin::new(&mut self.rest).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(first) = &self.first {
            let extra = first.len() as u64;
            hint.set_lower(hint.lower() + extra);
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper + extra);
            }
        }
        hint
    }
}

/// The kernel buffer of one socket of a stream: a quarter of the stream's buffer limit (the
/// kernel doubles what it is asked for), so that the proxy's buffer and both sockets together
/// stay near the limit however slowly a client reads.
pub(crate) fn socket_buffer(stream_buffer_limit: usize) -> usize {
    (stream_buffer_limit / 4).max(16 << 10)
}

//! Forwarding a request to a node: its key, the time to its answer's head, and the answer's
//! body read whole (small answers) or left to stream.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;

use crate::error::{BoxError, Error, Kind, Result};
use crate::node::Node;
use crate::permit::Outcome;
use crate::sse;
use crate::upstream::{Client, ClientConfig, Hop};

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
}

/// A request to forward, as the client sent it plus the proxy's own headers.
#[derive(Debug, Clone)]
pub struct ForwardRequest {
    pub method: Method,
    pub path_and_query: String,
    /// The client's headers; those of the client's hop are left out when the request is
    /// written (`headers::stays_on_client_hop`), and so are those `extra` replaces.
    pub headers: HeaderMap,
    /// The proxy's own headers (request id, `X-Forwarded-*`).
    pub extra: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
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
    /// 503, 504) is the node's failure; another 5xx counts as failed without touching its
    /// circuit (a client can provoke a 500 with a bad request).
    pub fn outcome(&self) -> Outcome {
        match self.status.as_u16() {
            502..=504 => Outcome::Failed,
            500..=599 => Outcome::Errored,
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
pub type UpstreamBody = BoxBody<Bytes, BoxError>;

/// A body still arriving.
#[derive(Debug)]
pub struct StreamBody {
    pub body: UpstreamBody,
    pub event_stream: bool,
}

/// Sends requests to nodes. Cheap to clone: clones share one pool of connections.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: std::sync::Arc<Client>,
    config: ForwardConfig,
    /// The proxy's id, added to every request's `x-pdproxy-via` (see `loops`).
    via: HeaderValue,
}

impl Forwarder {
    /// Builds the client for the proxy `instance`. Needs no runtime; connections belong to the
    /// runtime that opens them.
    pub fn new(config: ForwardConfig, instance: &str) -> Self {
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
        Self { client: std::sync::Arc::new(client), config, via }
    }

    pub fn config(&self) -> &ForwardConfig {
        &self.config
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
        let sent = self.client.send(node.target(), &path, request, &hop);
        let answer = match tokio::time::timeout(self.config.first_byte_timeout, sent).await {
            Ok(answer) => answer?,
            Err(_) => return Err(Error::new(Kind::Timeout, "the node did not answer in time")),
        };
        let headers = answer.headers;
        let event_stream = headers.get(CONTENT_TYPE).is_some_and(|ct| sse::is_event_stream(ct.as_bytes()));
        let small = answer.content_length.is_some_and(|len| len <= self.config.prefetch_limit as u64);
        let body = if prefetch && !event_stream && small {
            ResponseBody::Complete(read_whole(answer.body, self.config.stream_idle_timeout).await?)
        } else {
            ResponseBody::Streaming(StreamBody { body: answer.body.boxed(), event_stream })
        };
        Ok(UpstreamResponse { status: answer.status, headers, body })
    }
}

/// A small body read whole; every read is bounded by `idle` (a node that announces a length,
/// sends part of it and stalls must not hold the request forever).
async fn read_whole(
    mut body: impl http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
    idle: Duration,
) -> Result<Bytes> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err(Error::new(Kind::Timeout, "the node sent nothing for too long")),
            Ok(None) => return Ok(joined.map(bytes::BytesMut::freeze).or(first).unwrap_or_default()),
            Ok(Some(Err(e))) => return Err(Error::with_source(Kind::Upstream, "the node broke off the response", e)),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else { continue };
                match (&first, &mut joined) {
                    (None, _) => first = Some(data),
                    (Some(head), None) => {
                        let mut all = bytes::BytesMut::with_capacity(head.len() + data.len());
                        all.extend_from_slice(head);
                        all.extend_from_slice(&data);
                        joined = Some(all);
                    }
                    (Some(_), Some(all)) => all.extend_from_slice(&data),
                }
            }
        }
    }
}

/// The kernel buffer of one socket of a stream: a quarter of the stream's buffer limit (the
/// kernel doubles what it is asked for), so that the proxy's buffer and both sockets together
/// stay near the limit however slowly a client reads.
pub fn socket_buffer(stream_buffer_limit: usize) -> usize {
    (stream_buffer_limit / 4).max(16 << 10)
}

pub fn content_length(headers: &HeaderMap) -> Option<usize> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

//! Forwarding a request to a node: its key, the time to its answer's head, and the answer's
//! body read whole (small answers) or left to stream.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;

use crate::error::{BoxError, Error, Kind, Result};
use crate::headers::strip_hop_headers;
use crate::node::Node;
use crate::permit::Outcome;
use crate::sse;
use crate::upstream::{Client, ClientConfig};

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
}

/// A request to forward: the client's, with its headers already fit for the node's hop
/// (see `headers::upstream_request_headers`).
#[derive(Debug, Clone)]
pub struct ForwardRequest {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
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
    /// How the request counts for the node once its body has ended: a 5xx is the node's failure.
    pub fn outcome(&self) -> Outcome {
        if self.status.is_server_error() {
            Outcome::Failed
        } else {
            Outcome::Succeeded
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
}

impl Forwarder {
    /// Builds the client. Needs no runtime; connections belong to the runtime that opens them.
    pub fn new(config: ForwardConfig) -> Self {
        let client = Client::new(ClientConfig {
            connect_timeout: config.connect_timeout,
            idle_timeout: config.pool_idle_timeout,
            max_idle_per_host: config.pool_max_idle_per_node,
            ca_file: config.node_ca_file.clone(),
        });
        Self { client: std::sync::Arc::new(client), config }
    }

    pub fn config(&self) -> &ForwardConfig {
        &self.config
    }

    /// Sends `request` to `node` and returns the response head; with `prefetch`, the body
    /// is read whole first when it is small and not an event stream. Accounting is the caller's.
    pub async fn forward(&self, node: &Node, request: &ForwardRequest, prefetch: bool) -> Result<UpstreamResponse> {
        self.forward_to(node, request, prefetch).await.map_err(|e| e.at_node(node.url()))
    }

    async fn forward_to(&self, node: &Node, request: &ForwardRequest, prefetch: bool) -> Result<UpstreamResponse> {
        let path = node.path_for(&request.path_and_query);
        let key = match &node.spec().api_key {
            Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(|e| {
                Error::with_source(Kind::InvalidNode, "the node's API key is not a valid header value", e)
            })?),
            None => None,
        };
        let sent =
            self.client.send(node.target(), &request.method, &path, &request.headers, key.as_ref(), &request.body);
        let answer = match tokio::time::timeout(self.config.first_byte_timeout, sent).await {
            Ok(answer) => answer?,
            Err(_) => return Err(Error::new(Kind::Timeout, "the node did not answer in time")),
        };
        let mut headers = answer.headers;
        strip_hop_headers(&mut headers);
        let event_stream = headers.get(CONTENT_TYPE).is_some_and(|ct| sse::is_event_stream(ct.as_bytes()));
        let small = content_length(&headers).is_some_and(|len| len <= self.config.prefetch_limit);
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

pub fn content_length(headers: &HeaderMap) -> Option<usize> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

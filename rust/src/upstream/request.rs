//! A request to send to a node.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Method;

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

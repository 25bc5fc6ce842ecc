//! The client's request on the fast path: its id, its media type, its body (bounded in size
//! and time), and the headers the node gets.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::coalesce::Coalescer;

pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// The client's `x-request-id`, or a new one (a random UUID, as hex).
pub(crate) fn request_id(headers: &HeaderMap) -> (HeaderValue, bool) {
    if let Some(id) = headers.get(&X_REQUEST_ID) {
        return (id.clone(), true);
    }
    let random = fastrand::u128(..);
    // Version 4, variant 1, as Python's uuid4().hex.
    let uuid = (random & !(0xF << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62);
    let mut hex = [0u8; 32];
    for (i, digit) in hex.iter_mut().enumerate() {
        *digit = b"0123456789abcdef"[((uuid >> (124 - 4 * i)) & 0xF) as usize];
    }
    let id = HeaderValue::from_bytes(&hex).unwrap_or_else(|_| HeaderValue::from_static("0"));
    (id, false)
}

/// Whether a declared media type is acceptable (none, JSON or a `+json` type); the type
/// named in the refusal otherwise.
pub(crate) fn check_media_type(headers: &HeaderMap) -> Result<(), String> {
    let Some(value) = headers.get(CONTENT_TYPE) else { return Ok(()) };
    let raw = value.as_bytes();
    let media = raw.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    // Compared without a lowered copy: this runs for every request.
    let json_suffix = media.len() >= 5 && media[media.len() - 5..].eq_ignore_ascii_case(b"+json");
    if media.eq_ignore_ascii_case(b"application/json") || json_suffix {
        Ok(())
    } else {
        Err(media.iter().map(|&b| char::from(b.to_ascii_lowercase())).collect())
    }
}

/// A content coding of the body other than `identity`: the proxy routes on the body's bytes,
/// so it does not take compressed ones.
pub(crate) fn content_coding(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(http::header::CONTENT_ENCODING)?.as_bytes();
    let coding = value.trim_ascii();
    (!coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"))
        .then(|| String::from_utf8_lossy(coding).into_owned())
}

/// Whether a pass-through path stays under `/v1/`: no dot-segments and no encoded dots or
/// separators that a node might decode into one (`/v1/%2e%2e/%2e%2e/start_profile`).
pub(crate) fn plain_path(path: &str) -> bool {
    let lowered = path.to_ascii_lowercase();
    !lowered.contains("%2e")
        && !lowered.contains("%2f")
        && !lowered.contains("%5c")
        && !path.contains('\\')
        && !path.split('/').any(|segment| segment == "." || segment == "..")
}

/// Why a body was not read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// Over the limit; the rest of the body is still to be drained.
    TooLarge(Option<Incoming>),
    /// Not complete within the deadline.
    Timeout,
    /// The client went away or broke the framing.
    Broken,
}

/// The declared `content-length`, when valid.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// Reads the whole body, refusing it past `limit` bytes or `deadline`.
pub(crate) async fn read_body(
    headers: &HeaderMap,
    mut body: Incoming,
    limit: usize,
    deadline: Duration,
) -> Result<Bytes, BodyError> {
    let declared = declared_length(headers);
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge(Some(body)));
    }
    let declared = declared.and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
    let read = async move {
        let mut joined = Coalescer::expecting(declared);
        let mut size = 0usize;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return Err(BodyError::Broken) };
            let Ok(data) = frame.into_data() else { continue };
            size += data.len();
            if size > limit {
                return Err(BodyError::TooLarge(Some(body)));
            }
            joined.push(data);
        }
        Ok(joined.take().unwrap_or_default())
    };
    tokio::time::timeout(deadline, read).await.unwrap_or(Err(BodyError::Timeout))
}

/// Reads and discards the rest of a refused body, for a while, so that a client that writes its
/// whole body before reading sees the answer instead of a reset connection.
pub(crate) async fn linger(mut body: Incoming) {
    const LINGER: Duration = Duration::from_secs(5);
    let _ = tokio::time::timeout(LINGER, async { while let Some(Ok(_)) = body.frame().await {} }).await;
}

/// The client's address, as the headers that carry it need it (formatted once per connection).
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub(crate) address: SocketAddr,
    /// The address without its port, for `X-Forwarded-For`.
    pub(crate) ip: HeaderValue,
}

impl Peer {
    pub(crate) fn new(address: SocketAddr) -> Self {
        let ip = HeaderValue::from_str(&address.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static(""));
        Self { address, ip }
    }
}

/// The proxy's own headers for the node: the request id (when the client sent none) and
/// `X-Forwarded-For/Host/Proto`, which replace whatever the client claimed in them (`https`
/// when the client came over TLS).
pub(crate) fn proxy_headers(
    client: &HeaderMap,
    peer: &Peer,
    request_id: &HeaderValue,
    had_id: bool,
    https: bool,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::with_capacity(4);
    if !had_id {
        out.push((X_REQUEST_ID.clone(), request_id.clone()));
    }
    let chain = match client.get_all(&X_FORWARDED_FOR).iter().next_back() {
        Some(earlier) => {
            let mut chain = Vec::with_capacity(earlier.len() + 2 + peer.ip.len());
            chain.extend_from_slice(earlier.as_bytes());
            chain.extend_from_slice(b", ");
            chain.extend_from_slice(peer.ip.as_bytes());
            HeaderValue::from_bytes(&chain).unwrap_or_else(|_| peer.ip.clone())
        }
        None => peer.ip.clone(),
    };
    out.push((X_FORWARDED_FOR.clone(), chain));
    if let Some(host) = client.get(HOST) {
        out.push((X_FORWARDED_HOST.clone(), host.clone()));
    }
    out.push((X_FORWARDED_PROTO.clone(), HeaderValue::from_static(if https { "https" } else { "http" })));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_or_made() {
        let mut h = HeaderMap::new();
        let (made, had) = request_id(&h);
        assert!(!had && made.len() == 32 && made.to_str().unwrap().as_bytes()[12] == b'4');
        h.insert("x-request-id", HeaderValue::from_static("mine"));
        assert_eq!(request_id(&h), (HeaderValue::from_static("mine"), true));
    }

    #[test]
    fn pass_through_paths() {
        assert!(plain_path("/v1/rerank"));
        assert!(plain_path("/v1/models/a.b"));
        for bad in ["/v1/%2e%2e/x", "/v1/../x", "/v1/a%2Fb", "/v1/./x", "/v1/a%5Cb", "/v1/a\\b", "/v1/x/.."] {
            assert!(!plain_path(bad), "{bad}");
        }
    }

    #[test]
    fn media_types() {
        let mut h = HeaderMap::new();
        assert!(check_media_type(&h).is_ok());
        h.insert(CONTENT_TYPE, HeaderValue::from_static("Application/JSON; charset=utf-8"));
        assert!(check_media_type(&h).is_ok());
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/vnd.x+json"));
        assert!(check_media_type(&h).is_ok());
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/VND.X+JSON"));
        assert!(check_media_type(&h).is_ok());
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert_eq!(check_media_type(&h), Err("text/plain".to_owned()));
        h.insert(CONTENT_TYPE, HeaderValue::from_static("Text/Plain; charset=utf-8"));
        assert_eq!(check_media_type(&h), Err("text/plain".to_owned()));
        h.insert(CONTENT_TYPE, HeaderValue::from_static("json"));
        assert_eq!(check_media_type(&h), Err("json".to_owned()));
    }

    #[test]
    fn forwarded_headers_extend_the_clients_chain() {
        let mut h = HeaderMap::new();
        h.insert(HOST, HeaderValue::from_static("proxy:8000"));
        h.insert("x-forwarded-for", HeaderValue::from_static("1.2.3.4"));
        h.insert("x-forwarded-host", HeaderValue::from_static("evil"));
        let peer = Peer::new("10.0.0.9:5000".parse().unwrap());
        let out: HeaderMap =
            proxy_headers(&h, &peer, &HeaderValue::from_static("id"), false, false).into_iter().collect();
        assert_eq!(out["x-forwarded-for"], "1.2.3.4, 10.0.0.9");
        assert_eq!(out["x-forwarded-host"], "proxy:8000");
        assert_eq!(out["x-forwarded-proto"], "http");
        assert_eq!(out["x-request-id"], "id");
        let out = proxy_headers(&HeaderMap::new(), &peer, &HeaderValue::from_static("id"), true, true);
        assert_eq!(out.len(), 2, "the client's own id is kept as it is, with no host to forward");
        assert!(out.iter().any(|(name, value)| name == "x-forwarded-proto" && value == "https"), "over TLS");
    }
}

//! Header hygiene between client and node: hop-by-hop headers stay on their own hop.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn is_hop_by_hop(name: &[u8]) -> bool {
    HOP_BY_HOP.iter().any(|h| h.as_bytes().eq_ignore_ascii_case(name))
}

/// Header names listed in `Connection` values: hop-by-hop for this message only.
fn connection_listed<'a>(values: impl Iterator<Item = &'a [u8]>) -> Vec<Vec<u8>> {
    values
        .flat_map(|v| v.split(|&b| b == b','))
        .map(|token| token.trim_ascii().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect()
}

/// Whether a client's request header stays on the client's hop: hop-by-hop headers (and
/// those its `Connection` header lists), `host` and `content-length` (the client sets them
/// for the node's hop) and the client's `authorization` (the proxy's key is not the node's key).
pub fn stays_on_client_hop(name: &[u8], listed: &[Vec<u8>]) -> bool {
    is_hop_by_hop(name)
        || name.eq_ignore_ascii_case(b"host")
        || name.eq_ignore_ascii_case(b"content-length")
        || name.eq_ignore_ascii_case(b"authorization")
        || listed.iter().any(|l| l.eq_ignore_ascii_case(name))
}

/// The header names a request's `Connection` header lists.
pub fn listed_in_connection(headers: &HeaderMap) -> Vec<Vec<u8>> {
    connection_listed(headers.get_all(header::CONNECTION).iter().map(HeaderValue::as_bytes))
}

/// The headers to send upstream, from the client's raw header list (see `stays_on_client_hop`).
pub fn upstream_request_headers(client: &[(Vec<u8>, Vec<u8>)]) -> HeaderMap {
    let listed = connection_listed(
        client.iter().filter(|(n, _)| n.eq_ignore_ascii_case(b"connection")).map(|(_, v)| v.as_slice()),
    );
    let mut out = HeaderMap::with_capacity(client.len());
    for (name, value) in client {
        if stays_on_client_hop(name, &listed) {
            continue;
        }
        // Names or values that are not valid HTTP are dropped rather than failing the request.
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            out.append(n, v);
        }
    }
    out
}

/// Whether a response header stays on its hop.
pub fn is_hop_header(name: &HeaderName, listed: &[Vec<u8>]) -> bool {
    let n = name.as_str().as_bytes();
    is_hop_by_hop(n) || listed.iter().any(|l| l.as_slice() == n)
}

/// The node's response headers that may reach the client.
pub fn client_response_headers(upstream: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    let listed = connection_listed(upstream.get_all(header::CONNECTION).iter().map(HeaderValue::as_bytes));
    upstream
        .iter()
        .filter(|(name, _)| {
            let n = name.as_str().as_bytes();
            !is_hop_by_hop(n) && !listed.iter().any(|l| l.as_slice() == n)
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(pairs: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
        pairs.iter().map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn request_hygiene() {
        let headers = upstream_request_headers(&raw(&[
            ("Host", "proxy"),
            ("Content-Type", "application/json"),
            ("Connection", "keep-alive, X-Secret-Hop"),
            ("x-secret-hop", "1"),
            ("Authorization", "Bearer client-key"),
            ("Content-Length", "10"),
            ("Transfer-Encoding", "chunked"),
            ("x-request-id", "abc"),
            ("bad header", "x"),
        ]));
        let names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type", "x-request-id"]);
    }

    #[test]
    fn response_hygiene() {
        let mut upstream = HeaderMap::new();
        upstream.insert("content-type", HeaderValue::from_static("text/event-stream"));
        upstream.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        upstream.insert("connection", HeaderValue::from_static("x-hop"));
        upstream.insert("x-hop", HeaderValue::from_static("1"));
        upstream.insert("x-request-id", HeaderValue::from_static("abc"));
        let kept: Vec<String> = client_response_headers(&upstream).into_iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(kept, ["content-type", "x-request-id"]);
    }
}

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
/// for the node's hop) and the client's key, `authorization` or Anthropic's `x-api-key` (the
/// proxy's key is not the node's key).
pub fn stays_on_client_hop(name: &[u8], listed: &[Vec<u8>]) -> bool {
    is_hop_by_hop(name)
        || name.eq_ignore_ascii_case(b"host")
        || name.eq_ignore_ascii_case(b"content-length")
        || name.eq_ignore_ascii_case(b"authorization")
        || name.eq_ignore_ascii_case(b"x-api-key")
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

/// Removes every header named in `names` (one pass over the headers when none is there, which
/// is the common case: no hashing).
pub fn remove_any(headers: &mut HeaderMap, names: &[HeaderName]) {
    if !headers.keys().any(|n| names.contains(n)) {
        return;
    }
    for name in names {
        headers.remove(name);
    }
}

/// Removes from `headers` those of its own hop: hop-by-hop headers and those its `Connection`
/// header lists (a response passed on, or a request before the proxy's own are added).
pub fn strip_hop_headers(headers: &mut HeaderMap) {
    static HOP: [HeaderName; 8] = [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ];
    let listed = if headers.contains_key(header::CONNECTION) { listed_in_connection(headers) } else { Vec::new() };
    remove_any(headers, &HOP);
    for name in listed {
        if let Ok(name) = HeaderName::from_bytes(&name) {
            headers.remove(name);
        }
    }
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
            ("X-Api-Key", "client-key"),
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
        strip_hop_headers(&mut upstream);
        let kept: Vec<&str> = upstream.keys().map(HeaderName::as_str).collect();
        assert_eq!(kept, ["content-type", "x-request-id"]);
    }
}

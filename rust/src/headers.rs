//! Header hygiene between client and node: hop-by-hop headers stay on their own hop.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Header names listed in `Connection` values: hop-by-hop for this message only.
fn connection_listed<'a>(values: impl Iterator<Item = &'a [u8]>) -> Vec<Vec<u8>> {
    values
        .flat_map(|v| v.split(|&b| b == b','))
        .map(|token| token.trim_ascii().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect()
}

/// Whether a header describes one hop only (RFC 9110 §7.6.1): never passed on, in either
/// direction. One comparison of lengths and bytes per header, no hashing.
pub(crate) fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Whether a client's request header stays on the client's hop: hop-by-hop headers, `host` and
/// `content-length` (the proxy sets them for the node's hop), the client's key, `authorization`
/// or Anthropic's `x-api-key` (the proxy's key is not the node's key), and the client's own
/// claims of where it came from, `forwarded` and `x-real-ip` (the proxy says it in
/// `x-forwarded-for`, which it extends with the address it saw).
pub(crate) fn stays_on_client_hop(name: &HeaderName) -> bool {
    is_hop_by_hop_name(name)
        || matches!(
            name.as_str(),
            "host" | "content-length" | "authorization" | "x-api-key" | "forwarded" | "x-real-ip"
        )
}

/// The header names a request's `Connection` header lists (only computed when it has one).
pub(crate) fn listed_in_connection(headers: &HeaderMap) -> Vec<Vec<u8>> {
    if !headers.contains_key(header::CONNECTION) {
        return Vec::new();
    }
    connection_listed(headers.get_all(header::CONNECTION).iter().map(HeaderValue::as_bytes))
}

/// A client's headers as a map, from a raw list (the embedded router's callers); names or values
/// that are not valid HTTP are dropped rather than failing the request. What stays on the
/// client's hop is left out when the request is written (see `upstream::codec`).
pub fn header_map(raw: &[(Vec<u8>, Vec<u8>)]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(raw.len());
    for (name, value) in raw {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            out.append(n, v);
        }
    }
    out
}

/// Headers as Python takes them: `(name, value)` byte pairs.
pub(crate) fn header_pairs<N: AsRef<str>, V: AsRef<[u8]>>(
    headers: impl IntoIterator<Item = (N, V)>,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    headers.into_iter().map(|(n, v)| (n.as_ref().as_bytes().to_vec(), v.as_ref().to_vec())).collect()
}

/// Removes from `headers` those of its own hop: hop-by-hop headers and those its `Connection`
/// header lists.
pub(crate) fn strip_hop_headers(headers: &mut HeaderMap) {
    let listed = listed_in_connection(headers);
    if headers.keys().any(is_hop_by_hop_name) {
        let hop: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop_name(n)).cloned().collect();
        for name in hop {
            headers.remove(name);
        }
    }
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
    fn which_headers_stay_on_the_clients_hop() {
        let stays = |n: &str| stays_on_client_hop(&HeaderName::from_bytes(n.as_bytes()).unwrap());
        for name in [
            "Host",
            "content-length",
            "Connection",
            "TE",
            "transfer-encoding",
            "authorization",
            "x-api-key",
            "upgrade",
            "Forwarded",
            "x-real-ip",
        ] {
            assert!(stays(name), "{name}");
        }
        for name in ["content-type", "x-request-id", "accept", "x-teapot", "x-forwarded-for"] {
            assert!(!stays(name), "{name}");
        }
        let map = header_map(&raw(&[("bad header", "x"), ("x-a", "1")]));
        assert_eq!(map.len(), 1);
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

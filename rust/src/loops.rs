//! Loop detection. Every request a proxy sends to a node carries the proxy's id in
//! `x-pdproxy-via` (after the ids already there); a request that arrives with this proxy's own
//! id in it has gone round a loop (a node that is this proxy, or that routes back to it) and is
//! refused instead of going round again.

use http::header::{HeaderMap, HeaderName};

pub(crate) static VIA: HeaderName = HeaderName::from_static("x-pdproxy-via");

/// A new proxy id: random, so that two proxies (or two workers) never share one.
pub(crate) fn new_instance_id() -> String {
    format!("pdproxy-{:016x}", fastrand::u64(..))
}

/// Whether the request already went through the proxy `instance`.
pub(crate) fn came_back(headers: &HeaderMap, instance: &str) -> bool {
    headers
        .get_all(&VIA)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b',').any(|id| id.trim_ascii() == instance.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_its_own_id_among_others() {
        let mut headers = HeaderMap::new();
        assert!(!came_back(&headers, "me"));
        headers.insert(&VIA, "other, me ,third".parse().unwrap());
        assert!(came_back(&headers, "me"));
        assert!(!came_back(&headers, "m"));
        assert_ne!(new_instance_id(), new_instance_id());
    }
}

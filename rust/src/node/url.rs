//! A node's URL, normalised so that the same server is always the same node, and the
//! address the upstream client reaches it at.

use std::net::SocketAddr;

use http::uri::{Authority, Scheme};
use http::Uri;

use crate::error::{Error, Kind, Result};

/// Where a request goes: the node's origin (the pool's key), the `Host` it is sent with, the
/// `host:port` to resolve unless the address is pinned, and for `https://` nodes the name its
/// certificate must carry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'a> {
    pub(crate) origin: &'a str,
    pub(crate) authority: &'a str,
    pub(crate) dial: &'a str,
    pub(crate) pinned: Option<SocketAddr>,
    pub(crate) tls_name: Option<&'a str>,
}

/// A node URL after normalisation: scheme and host lower-cased, default scheme `http`,
/// no trailing slash, so that the same server is always the same node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeUrl {
    pub(crate) normalized: String,
    pub(super) scheme: Scheme,
    pub(super) authority: Authority,
    pub(super) base_path: String,
}

impl NodeUrl {
    pub(crate) fn parse(raw: &str) -> Result<Self> {
        let raw = raw.trim();
        let with_scheme = if raw.contains("://") { raw.to_owned() } else { format!("http://{raw}") };
        let uri: Uri = with_scheme
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid node URL {raw:?}"), e))?;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(Error::new(
                Kind::InvalidNode,
                format!("unsupported scheme in node URL {raw:?}: use http or https"),
            ));
        }
        let authority =
            uri.authority().ok_or_else(|| Error::new(Kind::InvalidNode, format!("node URL {raw:?} has no host")))?;
        if uri.query().is_some() {
            return Err(Error::new(Kind::InvalidNode, format!("node URL {raw:?} must not have a query")));
        }
        if authority.as_str().contains('@') {
            // A key goes to a node as `api_key` (a header), never in its URL (logs, status).
            return Err(Error::new(
                Kind::InvalidNode,
                "credentials in a node URL are refused; register the node with an api_key",
            ));
        }
        let authority: Authority = authority
            .as_str()
            .to_ascii_lowercase()
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid host in node URL {raw:?}"), e))?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let normalized = format!("{scheme}://{authority}{base_path}");
        Ok(Self { normalized, scheme, authority, base_path })
    }

    /// The port a URL without one means: 443 for `https`, else 80.
    pub(crate) fn default_port(&self) -> u16 {
        if self.scheme == Scheme::HTTPS {
            443
        } else {
            80
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_urls() {
        for (raw, want) in [
            ("127.0.0.1:8001", "http://127.0.0.1:8001"),
            ("http://127.0.0.1:8001/", "http://127.0.0.1:8001"),
            ("HTTP://LocalHost:8001", "http://localhost:8001"),
            (" http://h:1/base/ ", "http://h:1/base"),
            ("HTTPS://Node.Example/", "https://node.example"),
        ] {
            assert_eq!(NodeUrl::parse(raw).unwrap().normalized, want, "{raw}");
        }
        assert!(NodeUrl::parse("http://user:pw@h:1").is_err(), "credentials are refused");
    }

    #[test]
    fn rejects_unusable_urls() {
        for raw in ["ftp://h:1", "http://", "http://h:1/?a=1", "http://h h"] {
            assert_eq!(NodeUrl::parse(raw).unwrap_err().kind(), Kind::InvalidNode, "{raw}");
        }
    }
}

//! A node: one upstream inference server, with counters that outlive any snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::Uri;

use crate::error::{Error, Kind, Result};

/// Per-node counters. Plain atomics with no pointers inside, so the same layout could later
/// live in a shared-memory table used by several worker processes.
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub in_flight: AtomicU64,
    pub requests: AtomicU64,
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub latency_us_sum: AtomicU64,
}

/// One point-in-time copy of a node's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CountersSnapshot {
    pub in_flight: u64,
    pub requests: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub latency_us_sum: u64,
}

impl NodeCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            latency_us_sum: self.latency_us_sum.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn record_latency(&self, elapsed: Duration) {
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.latency_us_sum.fetch_add(micros, Ordering::Relaxed);
    }
}

/// An immutable description of a node plus its shared counters. Changing a node's models
/// builds a new `Node` that shares the same counters and generation.
#[derive(Debug)]
pub struct Node {
    url: String,
    scheme: Scheme,
    authority: Authority,
    base_path: String,
    generation: u64,
    models: Vec<String>,
    counters: Arc<NodeCounters>,
}

impl Node {
    pub(crate) fn new(url: &NodeUrl, generation: u64, models: Vec<String>, counters: Arc<NodeCounters>) -> Self {
        Self {
            url: url.normalized.clone(),
            scheme: url.scheme.clone(),
            authority: url.authority.clone(),
            base_path: url.base_path.clone(),
            generation,
            models,
            counters,
        }
    }

    /// The normalised base URL, e.g. `http://127.0.0.1:8001`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Distinguishes successive registrations of the same URL.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Models the node serves; empty when unknown (the node is then eligible for any model).
    pub fn models(&self) -> &[String] {
        &self.models
    }

    pub fn counters(&self) -> &Arc<NodeCounters> {
        &self.counters
    }

    /// The absolute URI of `path_and_query` on this node.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri> {
        let mut joined = String::with_capacity(self.base_path.len() + path_and_query.len());
        joined.push_str(&self.base_path);
        joined.push_str(path_and_query);
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(joined)
            .build()
            .map_err(|e| Error::with_source(Kind::InvalidRequest, "invalid request path", e))
    }
}

/// A node URL after normalisation: scheme and host lower-cased, default scheme `http`,
/// no trailing slash, so that the same server is always the same node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUrl {
    pub normalized: String,
    scheme: Scheme,
    authority: Authority,
    base_path: String,
}

impl NodeUrl {
    pub fn parse(raw: &str) -> Result<Self> {
        let raw = raw.trim();
        let with_scheme = if raw.contains("://") { raw.to_owned() } else { format!("http://{raw}") };
        let uri: Uri = with_scheme
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid node URL {raw:?}"), e))?;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        if scheme != Scheme::HTTP {
            return Err(Error::new(
                Kind::InvalidNode,
                format!("unsupported scheme in node URL {raw:?}: only http is supported"),
            ));
        }
        let authority =
            uri.authority().ok_or_else(|| Error::new(Kind::InvalidNode, format!("node URL {raw:?} has no host")))?;
        if uri.query().is_some() {
            return Err(Error::new(Kind::InvalidNode, format!("node URL {raw:?} must not have a query")));
        }
        let authority: Authority = authority
            .as_str()
            .to_ascii_lowercase()
            .parse()
            .map_err(|e| Error::with_source(Kind::InvalidNode, format!("invalid host in node URL {raw:?}"), e))?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let normalized = format!("http://{authority}{base_path}");
        Ok(Self { normalized, scheme, authority, base_path })
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
        ] {
            assert_eq!(NodeUrl::parse(raw).unwrap().normalized, want, "{raw}");
        }
    }

    #[test]
    fn rejects_unusable_urls() {
        for raw in ["https://h:1", "http://", "http://h:1/?a=1", "http://h h"] {
            assert_eq!(NodeUrl::parse(raw).unwrap_err().kind(), Kind::InvalidNode, "{raw}");
        }
    }

    #[test]
    fn joins_base_path() {
        let url = NodeUrl::parse("http://h:1/base/").unwrap();
        let node = Node::new(&url, 1, vec![], Arc::default());
        assert_eq!(node.uri_for("/v1/models?x=1").unwrap().to_string(), "http://h:1/base/v1/models?x=1");
    }
}

//! A node: one upstream inference server, its URL, its counters (which outlive any snapshot
//! of it), what is known of its engine, and the table of registered nodes.

pub(crate) mod address;
pub(crate) mod circuit;
pub(crate) mod counters;
pub(crate) mod decode_starts;
pub(crate) mod engine_report;
pub(crate) mod engine_speed;
pub(crate) mod hidden_load;
pub(crate) mod load_signal;
pub(crate) mod place;
pub(crate) mod recent_work;
pub(crate) mod registry;
pub(crate) mod running_late;
pub(crate) mod shared;
pub(crate) mod state;
mod url;

use std::sync::atomic::Ordering;

use http::uri::{Authority, Scheme};

pub(crate) use counters::{NodeCounters, Outcome};
pub(crate) use place::Counters;
pub(crate) use state::NodeState;
pub(crate) use url::{NodeUrl, Target};

use crate::error::{Error, Kind, Result};
use engine_report::EngineLoad;

/// What a node does in a disaggregated deployment (LMDeploy's `EngineRole`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    #[default]
    Hybrid,
    Prefill,
    Decode,
}

impl Role {
    pub(crate) const ALL: [Role; 3] = [Role::Hybrid, Role::Prefill, Role::Decode];

    /// The role's place in tables indexed by role.
    pub(crate) fn index(self) -> usize {
        match self {
            Role::Hybrid => 0,
            Role::Prefill => 1,
            Role::Decode => 2,
        }
    }

    /// Accepts LMDeploy's integers (Hybrid=1, Prefill=2, Decode=3) and names, any case.
    pub(crate) fn parse(raw: &str) -> Result<Self> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "hybrid" | "1" => Ok(Role::Hybrid),
            "prefill" | "2" => Ok(Role::Prefill),
            "decode" | "3" => Ok(Role::Decode),
            _ => Err(Error::new(Kind::InvalidNode, format!("unknown role {raw:?}: use hybrid, prefill or decode"))),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Hybrid => "hybrid",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// What a node is registered with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSpec {
    /// Models the node serves; empty when unknown (the node is then eligible for any model).
    pub models: Vec<String>,
    pub role: Role,
    /// Relative throughput (LMDeploy's `speed`); `None` when not declared.
    pub speed: Option<f64>,
    pub max_concurrency: Option<u32>,
    /// The node's own API key, sent to it as `Authorization: Bearer` (never the client's).
    pub api_key: Option<String>,
    /// SGLang prefill nodes: the port of their bootstrap server, when declared.
    pub bootstrap_port: Option<u16>,
    /// The models it was registered with (`None`: none declared, discovery asks it); `models`
    /// is what it serves, as discovery learnt it.
    pub declared_models: Option<Vec<String>>,
    /// Seconds its registration lasts unless renewed (`None`: no lease). The control plane
    /// keeps the timer; the node keeps what it was registered with.
    pub lease_ttl: Option<f64>,
    /// The operator's labels (`zone=a`): shown in status, never used for routing.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Where the node is reached: the address its name resolved to when it was checked, so
    /// that a name whose answer changes later cannot send requests elsewhere. `None`: resolve.
    pub address: Option<std::net::SocketAddr>,
}

impl NodeSpec {
    /// Every rule a node's attributes must pass (the URL's are `NodeUrl::parse`'s, its
    /// addresses' `address::AddressRules`'): the one place the node table checks them. The
    /// error names the attribute in its message (its `param` stays the default, `url`, as the
    /// management API has always answered).
    pub(crate) fn check(&self) -> Result<()> {
        let refused =
            |param: &'static str, message: String| Err(Error::new(Kind::InvalidNode, message).with_param(param));
        if let Some(speed) = self.speed.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return refused("speed", format!("speed must be a positive number, got {speed}"));
        }
        // The key goes into a header: it must be a valid header value (no CR, LF or other
        // control characters), or requests and health checks would fail (or carry injected headers).
        if let Some(key) = &self.api_key {
            if http::HeaderValue::from_str(&format!("Bearer {key}")).is_err() {
                return refused("api_key", "the node's api_key must be printable text without line breaks".to_owned());
            }
        }
        if self.bootstrap_port == Some(0) {
            return refused("bootstrap_port", "bootstrap_port must be a port number".to_owned());
        }
        if self.lease_ttl.is_some_and(|ttl| ttl.is_nan() || ttl <= 0.0) {
            return refused("lease_ttl", "lease_ttl must be a positive number of seconds".to_owned());
        }
        Ok(())
    }
}

/// An immutable description of a node plus its shared counters. Changing a node's spec
/// builds a new `Node` that shares the same counters and generation.
#[derive(Debug)]
pub struct Node {
    url: String,
    scheme: Scheme,
    authority: Authority,
    /// `scheme://host:port`, the port always written (the pool's key).
    origin: String,
    /// `host:port` to resolve and connect to (the scheme's port when the URL names none).
    dial: String,
    base_path: String,
    generation: u64,
    spec: NodeSpec,
    counters: Counters,
}

impl Node {
    pub(crate) fn new(url: &NodeUrl, generation: u64, spec: NodeSpec, counters: Counters) -> Self {
        counters.set_max_concurrency(spec.max_concurrency);
        let port = url.authority.port_u16().unwrap_or(if url.scheme == Scheme::HTTPS { 443 } else { 80 });
        let dial = format!("{}:{port}", url.authority.host());
        Self {
            url: url.normalized.clone(),
            scheme: url.scheme.clone(),
            authority: url.authority.clone(),
            origin: format!("{}://{dial}", url.scheme),
            dial,
            base_path: url.base_path.clone(),
            generation,
            spec,
            counters,
        }
    }

    /// A node outside the table, to reach once more (a removed node that still holds something
    /// of the proxy's, such as a preserved session).
    pub(crate) fn detached(url: &str, api_key: Option<String>) -> Result<Self> {
        let spec = NodeSpec { api_key, ..NodeSpec::default() };
        Ok(Self::new(&NodeUrl::parse(url)?, 0, spec, Counters::default()))
    }

    /// The normalised base URL, e.g. `http://127.0.0.1:8001`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Distinguishes successive registrations of the same URL.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    pub(crate) fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    pub(crate) fn models(&self) -> &[String] {
        &self.spec.models
    }

    pub(crate) fn role(&self) -> Role {
        self.spec.role
    }

    pub(crate) fn speed(&self) -> Option<f64> {
        self.spec.speed
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The engine's report if it is younger than `max_age_ms`, with pdproxy's traffic since.
    pub(crate) fn engine_load(&self, max_age_ms: u64, now_ms: u64) -> Option<EngineLoad> {
        let c = &self.counters;
        c.engine.fresh(max_age_ms, now_ms, c.in_flight(), c.requests.load(Ordering::Relaxed))
    }

    /// Where the upstream client sends this node's requests (TLS for `https://` nodes).
    pub(crate) fn target(&self) -> Target<'_> {
        Target {
            origin: &self.origin,
            authority: self.authority.as_str(),
            dial: &self.dial,
            pinned: self.spec.address,
            tls_name: (self.scheme == Scheme::HTTPS).then(|| self.host()),
        }
    }

    /// The path on the node for a request's `path_and_query` (below the node's base path).
    pub(crate) fn path_for(&self, path_and_query: &str) -> String {
        let mut joined = String::with_capacity(self.base_path.len() + path_and_query.len());
        joined.push_str(&self.base_path);
        joined.push_str(path_and_query);
        joined
    }

    /// The node's host, without brackets around an IPv6 address.
    pub(crate) fn host(&self) -> &str {
        self.authority.host().trim_start_matches('[').trim_end_matches(']')
    }

    /// The absolute URI of `path_and_query` on this node.
    #[cfg(test)]
    pub(crate) fn uri_for(&self, path_and_query: &str) -> Result<http::Uri> {
        let mut joined = String::with_capacity(self.base_path.len() + path_and_query.len());
        joined.push_str(&self.base_path);
        joined.push_str(path_and_query);
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(joined)
            .build()
            .map_err(|e| Error::with_source(Kind::InvalidRequest, "invalid request path", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_nodes_are_reached_with_tls_on_the_schemes_port() {
        let node = |raw: &str| Node::new(&NodeUrl::parse(raw).unwrap(), 1, NodeSpec::default(), Counters::default());
        let secure = node("https://node.example");
        let target = secure.target();
        assert_eq!(
            (target.origin, target.dial, target.authority),
            ("https://node.example:443", "node.example:443", "node.example")
        );
        assert_eq!(target.tls_name, Some("node.example"));
        let plain = node("http://[::1]:8001");
        assert_eq!((plain.target().dial, plain.target().tls_name), ("[::1]:8001", None));
        assert_eq!(node("http://h").target().origin, "http://h:80");
    }

    #[test]
    fn joins_base_path() {
        let url = NodeUrl::parse("http://h:1/base/").unwrap();
        let node = Node::new(&url, 1, NodeSpec::default(), Counters::default());
        assert_eq!(node.uri_for("/v1/models?x=1").unwrap().to_string(), "http://h:1/base/v1/models?x=1");
    }

    #[test]
    fn roles_and_states_parse_like_lmdeploy() {
        assert_eq!(Role::parse("2").unwrap(), Role::Prefill);
        assert_eq!(Role::parse("Decode").unwrap(), Role::Decode);
        assert!(Role::parse("4").is_err());
        assert_eq!(NodeState::parse("Sleeping").unwrap(), NodeState::Sleeping);
    }
}

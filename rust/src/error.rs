//! One opaque error type for the data plane; the kind decides how the control plane answers.

use std::error::Error as StdError;
use std::fmt;

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The request body is not a JSON object, or a field has the wrong type.
    InvalidRequest,
    /// No registered node serves the requested model.
    ModelNotFound,
    /// No node is registered at all (for the role).
    NoNodes,
    /// Nodes exist for the request but none is healthy.
    NoHealthyNode,
    /// Every candidate is at its cap and the wait queue is full or timed out.
    Overloaded,
    /// No node with that URL is registered.
    NodeNotFound,
    /// The node URL given to the registry cannot be used.
    InvalidNode,
    /// The node's host name does not resolve (yet: a service still coming up).
    NodeUnresolvable,
    /// The connection to the node could not be made: the request never ran.
    Connect,
    /// The node did not answer in time.
    Timeout,
    /// The node accepted the request, then failed (reset, broke off its answer).
    Upstream,
    /// The node's answer cannot be used: its framing is malformed or ambiguous, or it is larger
    /// or slower than the proxy reads whole.
    InvalidAnswer,
    /// The proxy itself ran out of something (file descriptors, memory): nobody's fault but
    /// its own, never counted against a node.
    Resources,
    /// The response body was cancelled by the caller.
    Cancelled,
    /// The proxy's own setup failed (the shared table of a worker group).
    Config,
    /// LMDeploy DistServe: the prefill and decode nodes could not be linked.
    LinkFailed,
}

pub struct Error {
    kind: Kind,
    message: String,
    source: Option<BoxError>,
    retry_after: Option<u32>,
    /// The request's field at fault, when one is (the error body's `param`).
    param: Option<&'static str>,
    /// The node the error happened at, for whoever debugs it (never shown to a client).
    node: Option<String>,
}

impl Error {
    #[cold]
    pub(crate) fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), source: None, retry_after: None, param: None, node: None }
    }

    #[cold]
    pub(crate) fn with_source(kind: Kind, message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self { kind, message: message.into(), source: Some(source.into()), retry_after: None, param: None, node: None }
    }

    /// Seconds after which a retry may succeed, for errors that say so (`Retry-After`).
    #[must_use]
    pub(crate) fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub(crate) fn retry_after(&self) -> Option<u32> {
        self.retry_after
    }

    /// The error is about the request's field `name`.
    #[must_use]
    pub(crate) fn with_param(mut self, name: &'static str) -> Self {
        self.param = Some(name);
        self
    }

    pub(crate) fn param(&self) -> Option<&'static str> {
        self.param
    }

    /// The error happened at the node `url`.
    #[must_use]
    pub(crate) fn at_node(mut self, url: &str) -> Self {
        self.node = Some(url.to_owned());
        self
    }

    pub(crate) fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// The node broke off or failed the exchange (hyper's style: the kind stays private).
    pub fn is_upstream(&self) -> bool {
        self.kind == Kind::Upstream
    }

    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    pub fn is_connect(&self) -> bool {
        self.kind == Kind::Connect
    }

    pub fn is_timeout(&self) -> bool {
        self.kind == Kind::Timeout
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("message", &self.message).field("retry_after", &self.retry_after);
        if let Some(param) = self.param {
            d.field("param", &param);
        }
        if let Some(node) = &self.node {
            d.field("node", node);
        }
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn StdError + 'static))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

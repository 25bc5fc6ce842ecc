//! pdproxy data plane: the node table, selection, in-flight accounting and the upstream
//! forwarder. Plain Rust except `py/`, the only module that touches pyo3.
//!
//! The folders, bottom up: `node` (a node, its counters and the node table), `upstream` (the
//! client that sends requests to nodes), `select` (the routing policies), `engine` (admission,
//! permits, selection and forwarding with retries), `edge` (the HTTP server), `bridge` (what
//! the Python side drives the engine with), `observe` (traces, histograms, the access log),
//! `replica_share` (replicas telling each other their load on the nodes), and `py` (the Python
//! module).

// Without the Python module much of the data plane is reached from `py/` alone; its dead code
// is checked with the feature on (`make lint-rust` builds with every feature).
#![cfg_attr(not(feature = "python"), allow(dead_code))]

mod bridge;
mod clock;
mod coalesce;
mod distserve;
mod edge;
mod engine;
mod error;
mod headers;
mod inspect;
mod loops;
mod memory;
mod node;
mod observe;
mod replica_share;
mod select;
mod sse;
mod tenants;
mod tls;
mod upstream;

#[cfg(feature = "python")]
mod py;

// The public surface: what the integration tests (rust/tests) drive the data plane with.
pub use bridge::exchange::{pump, Delivery, Exchange, StreamTimeouts};
pub use engine::permit::InFlightPermit;
pub use engine::policies::RolePolicies;
pub use engine::selection::select;
pub use engine::{Engine, EngineConfig};
pub use error::{Error, Result};
pub use headers::header_map;
pub use node::counters::Outcome;
pub use node::registry::Registry;
pub use node::state::NodeState;
pub use node::{Node, NodeSpec};
pub use select::{policy_from_spec, PolicySpec, SelectCtx, POLICY_NAMES};
pub use upstream::forward::{ForwardConfig, Forwarder, ResponseBody, StreamBody, UpstreamResponse};
pub use upstream::request::ForwardRequest;
pub use upstream::retry::RetryBudget;

/// Rust's allocations in this library (Python's own are untouched): the edge allocates and
/// frees small buffers for every request on several threads, where mimalloc is much cheaper.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

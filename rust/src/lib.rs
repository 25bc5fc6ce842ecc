//! pdproxy data plane: the node table, selection, in-flight accounting and the upstream
//! forwarder. Plain Rust except `py/`, the only module that touches pyo3.
//!
//! The folders, bottom up: `node` (a node, its counters and the node table), `upstream` (the
//! client that sends requests to nodes), `select` (the routing policies), `engine` (admission,
//! permits, selection and forwarding with retries), `edge` (the HTTP server), `bridge` (what
//! the Python side drives the engine with), `observe` (traces, histograms, the access log), and
//! `py` (the Python module).

pub mod bridge;
pub mod clock;
pub mod distserve;
pub mod edge;
pub mod engine;
pub mod error;
pub mod headers;
pub mod inspect;
pub mod loops;
pub mod memory;
pub mod node;
pub mod observe;
pub mod select;
pub mod sse;
pub mod tenants;
pub mod tls;
pub mod upstream;

#[cfg(feature = "python")]
mod py;

/// Rust's allocations in this library (Python's own are untouched): the edge allocates and
/// frees small buffers for every request on several threads, where mimalloc is much cheaper.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

//! pdproxy data plane: the node table, selection, in-flight accounting and the upstream
//! forwarder. Plain Rust except `py/`, the only module that touches pyo3.

pub mod admission;
pub mod circuit;
pub mod distserve;
pub mod doorbell;
pub mod edge;
pub mod engine;
pub mod engine_report;
pub mod engine_speed;
pub mod error;
pub mod exchange;
pub mod forward;
pub mod headers;
pub mod hidden_load;
pub mod histogram;
pub mod inspect;
pub mod loops;
pub mod memory;
pub mod node;
pub mod permit;
pub mod registry;
pub mod retry;
pub mod runtime;
pub mod select;
pub mod shared;
pub mod sse;
pub mod tenants;
pub mod tls;
pub mod trace;
pub mod upstream;

#[cfg(feature = "python")]
mod py;

/// Rust's allocations in this library (Python's own are untouched): the edge allocates and
/// frees small buffers for every request on several threads, where mimalloc is much cheaper.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

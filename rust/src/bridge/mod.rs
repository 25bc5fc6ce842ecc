//! What the Python side drives the engine with, kept free of pyo3 so that `cargo test` reaches
//! it: an exchange's relay of a node's answer, the doorbell that wakes the event loop, and the
//! runtime the requests run on.

pub(crate) mod doorbell;
pub(crate) mod exchange;
pub(crate) mod runtime;

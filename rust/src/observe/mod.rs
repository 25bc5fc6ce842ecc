//! What the proxy tells about its requests: traces (spans exported to a collector), latency
//! histograms, and the access log.

pub mod access;
pub mod histogram;
pub mod trace;

//! What the proxy tells about its requests: traces (spans exported to a collector), latency
//! histograms, and the access log.

pub(crate) mod access;
pub(crate) mod histogram;
pub(crate) mod trace;

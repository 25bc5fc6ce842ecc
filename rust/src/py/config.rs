//! The router's settings, read from the Python `Settings` object by attribute. Every
//! default lives in `pdproxy/config.py`; nothing here declares one.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::forward::ForwardConfig;

#[derive(FromPyObject)]
pub struct RouterConfig {
    pub policy: String,
    pub runtime_threads: usize,
    pub connect_timeout: f64,
    pub first_byte_timeout: f64,
    pub pool_idle_timeout: f64,
    pub pool_max_idle_per_node: usize,
    pub prefetch_limit: usize,
    pub stream_idle_timeout: f64,
    pub stream_buffer_limit: usize,
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("{name} must be a positive number of seconds, got {value}")))
}

impl RouterConfig {
    pub fn forward_config(&self) -> PyResult<ForwardConfig> {
        Ok(ForwardConfig {
            connect_timeout: seconds("connect_timeout", self.connect_timeout)?,
            first_byte_timeout: seconds("first_byte_timeout", self.first_byte_timeout)?,
            pool_idle_timeout: seconds("pool_idle_timeout", self.pool_idle_timeout)?,
            pool_max_idle_per_node: self.pool_max_idle_per_node,
            prefetch_limit: self.prefetch_limit,
            stream_idle_timeout: seconds("stream_idle_timeout", self.stream_idle_timeout)?,
            stream_buffer_limit: self.stream_buffer_limit.max(1),
        })
    }
}

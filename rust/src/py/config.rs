//! The router's settings, read from the Python `Settings` object by attribute. Every
//! default lives in `pdproxy/config.py`; nothing here declares one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::forward::ForwardConfig;
use crate::node::Role;
use crate::select::{policy_from_name, Policy, PolicyConfig, PrefixConfig};

#[derive(FromPyObject)]
pub struct RouterConfig {
    pub policy: String,
    pub prefill_policy: String,
    pub decode_policy: String,
    pub model_policies: Vec<String>,
    pub hash_load_factor: f64,
    pub prefix_block_bytes: usize,
    pub prefix_max_blocks: usize,
    pub prefix_cache_entries: usize,
    pub prefix_balance_threshold: u64,
    pub queue_size: usize,
    pub queue_timeout: f64,
    pub request_timeout: f64,
    pub retries: u32,
    pub retry_budget_ratio: f64,
    pub retry_budget_floor: u64,
    pub circuit_failures: u32,
    pub circuit_cooldown: f64,
    pub runtime_threads: usize,
    pub connect_timeout: f64,
    pub first_byte_timeout: f64,
    pub pool_idle_timeout: f64,
    pub pool_max_idle_per_node: usize,
    pub prefetch_limit: usize,
    pub stream_idle_timeout: f64,
    pub stream_buffer_limit: usize,
    pub stream_stall_timeout: f64,
}

pub fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("{name} must be a positive number of seconds, got {value}")))
}

/// The policy of each role, and the per-model overrides.
#[derive(Debug)]
pub struct PolicySet {
    by_role: HashMap<Role, Arc<dyn Policy>>,
    by_model: HashMap<String, Arc<dyn Policy>>,
}

impl PolicySet {
    pub fn for_request(&self, role: Role, model: Option<&str>) -> &Arc<dyn Policy> {
        model.and_then(|m| self.by_model.get(m)).unwrap_or(&self.by_role[&role])
    }

    pub fn names(&self) -> Vec<(String, &'static str)> {
        let mut out: Vec<(String, &'static str)> =
            Role::ALL.iter().map(|r| (r.name().to_owned(), self.by_role[r].name())).collect();
        out.extend(self.by_model.iter().map(|(m, p)| (format!("model:{m}"), p.name())));
        out
    }
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
            stream_stall_timeout: seconds("stream_stall_timeout", self.stream_stall_timeout)?,
        })
    }

    pub fn policies(&self) -> PyResult<PolicySet> {
        let config = PolicyConfig {
            hash_load_factor: self.hash_load_factor,
            prefix: PrefixConfig {
                block_bytes: self.prefix_block_bytes,
                max_blocks: self.prefix_max_blocks,
                cache_entries: self.prefix_cache_entries,
                balance_threshold: self.prefix_balance_threshold,
            },
        };
        let build =
            |name: &str| policy_from_name(name, &config).map_err(|e| PyValueError::new_err(e.message().to_owned()));
        let by_role = HashMap::from([
            (Role::Hybrid, build(&self.policy)?),
            (Role::Prefill, build(&self.prefill_policy)?),
            (Role::Decode, build(&self.decode_policy)?),
        ]);
        let mut by_model = HashMap::new();
        for entry in &self.model_policies {
            let Some((model, name)) = entry.split_once('=') else {
                return Err(PyValueError::new_err(format!("model policy {entry:?} must read MODEL=POLICY")));
            };
            by_model.insert(model.trim().to_owned(), build(name.trim())?);
        }
        Ok(PolicySet { by_role, by_model })
    }
}

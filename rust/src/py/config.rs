//! The router's settings, read from the Python `Settings` object by attribute. Every
//! default lives in `pdproxy/config/settings.py`; nothing here declares one.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::engine::{EngineConfig, PolicyNames};
use crate::observe::trace::{Sampler, TracingConfig};
use crate::select::{PolicyConfig, PrefixConfig, ScoreWeights};
use crate::upstream::forward::ForwardConfig;

#[derive(FromPyObject)]
pub(crate) struct RouterConfig {
    pub(crate) policy: String,
    pub(crate) prefill_policy: String,
    pub(crate) decode_policy: String,
    pub(crate) model_policies: Vec<String>,
    pub(crate) hash_load_factor: f64,
    pub(crate) prefix_block_bytes: usize,
    pub(crate) prefix_max_blocks: usize,
    pub(crate) prefix_cache_entries: usize,
    pub(crate) prefix_balance_threshold: u64,
    pub(crate) prefix_bytes_per_token: f64,
    pub(crate) score_prefix_weight: f64,
    pub(crate) score_queue_weight: f64,
    pub(crate) score_hidden_weight: f64,
    pub(crate) engine_metrics_max_age: f64,
    pub(crate) queue_size: usize,
    pub(crate) queue_timeout: f64,
    pub(crate) request_timeout: f64,
    pub(crate) retries: u32,
    pub(crate) retry_budget_ratio: f64,
    pub(crate) retry_budget_floor: u64,
    pub(crate) circuit_failures: u32,
    pub(crate) circuit_cooldown: f64,
    pub(crate) runtime_threads: usize,
    pub(crate) connect_timeout: f64,
    pub(crate) first_byte_timeout: f64,
    pub(crate) pool_idle_timeout: f64,
    pub(crate) pool_max_idle_per_node: usize,
    pub(crate) prefetch_limit: usize,
    pub(crate) stream_idle_timeout: f64,
    pub(crate) stream_buffer_limit: usize,
    pub(crate) stream_stall_timeout: f64,
    pub(crate) node_tcp_keepalive: f64,
    pub(crate) answer_buffer_limit: usize,
    pub(crate) answer_timeout: f64,
    pub(crate) max_requests: usize,
    pub(crate) max_n: u64,
    pub(crate) node_ca_file: String,
    pub(crate) otlp_endpoint: String,
    /// `NAME=VALUE` pairs.
    pub(crate) otlp_headers: Vec<String>,
    pub(crate) service_name: String,
    pub(crate) trace_sampler: String,
    pub(crate) trace_sampler_arg: f64,
}

pub(crate) fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("{name} must be a positive number of seconds, got {value}")))
}

fn or_general(role_policy: &str, general: &str) -> String {
    if role_policy.is_empty() { general } else { role_policy }.to_owned()
}

impl RouterConfig {
    pub(crate) fn forward_config(&self) -> PyResult<ForwardConfig> {
        Ok(ForwardConfig {
            connect_timeout: seconds("connect_timeout", self.connect_timeout)?,
            first_byte_timeout: seconds("first_byte_timeout", self.first_byte_timeout)?,
            pool_idle_timeout: seconds("pool_idle_timeout", self.pool_idle_timeout)?,
            pool_max_idle_per_node: self.pool_max_idle_per_node,
            prefetch_limit: self.prefetch_limit,
            stream_idle_timeout: seconds("stream_idle_timeout", self.stream_idle_timeout)?,
            stream_buffer_limit: self.stream_buffer_limit.max(1),
            stream_stall_timeout: seconds("stream_stall_timeout", self.stream_stall_timeout)?,
            node_ca_file: (!self.node_ca_file.is_empty()).then(|| self.node_ca_file.clone().into()),
            tcp_keepalive: seconds("node_tcp_keepalive", self.node_tcp_keepalive)?,
            answer_buffer_limit: self.answer_buffer_limit.max(1),
            answer_timeout: seconds("answer_timeout", self.answer_timeout)?,
        })
    }

    pub(crate) fn engine_config(&self) -> PyResult<EngineConfig> {
        Ok(EngineConfig {
            policies: PolicyNames {
                hybrid: self.policy.clone(),
                // A role without a policy of its own takes the general one (`--routing-strategy`).
                prefill: or_general(&self.prefill_policy, &self.policy),
                decode: or_general(&self.decode_policy, &self.policy),
                by_model: self.model_policies.clone(),
            },
            policy: PolicyConfig {
                hash_load_factor: self.hash_load_factor,
                prefix: PrefixConfig {
                    block_bytes: self.prefix_block_bytes,
                    max_blocks: self.prefix_max_blocks,
                    cache_entries: self.prefix_cache_entries,
                    balance_threshold: self.prefix_balance_threshold,
                },
                engine_max_age_ms: u64::try_from(
                    seconds("engine_metrics_max_age", self.engine_metrics_max_age)?.as_millis(),
                )
                .unwrap_or(u64::MAX),
                score: ScoreWeights {
                    prefix: self.score_prefix_weight,
                    queue: self.score_queue_weight,
                    hidden: self.score_hidden_weight,
                    reported: 0.0,
                },
                prefix_bytes_per_token: self.prefix_bytes_per_token,
            },
            queue_size: self.queue_size,
            queue_timeout: seconds("queue_timeout", self.queue_timeout)?,
            request_timeout: (self.request_timeout > 0.0)
                .then(|| seconds("request_timeout", self.request_timeout))
                .transpose()?,
            retries: self.retries,
            retry_budget_ratio: self.retry_budget_ratio,
            retry_budget_floor: self.retry_budget_floor,
            circuit_failures: self.circuit_failures,
            circuit_cooldown: seconds("circuit_cooldown", self.circuit_cooldown)?,
            forward: self.forward_config()?,
            max_requests: self.max_requests,
            max_n: self.max_n,
            tracing: self.tracing_config()?,
        })
    }

    /// Tracing, when an OTLP endpoint is set.
    fn tracing_config(&self) -> PyResult<Option<TracingConfig>> {
        if self.otlp_endpoint.is_empty() {
            return Ok(None);
        }
        let sampler = Sampler::parse(&self.trace_sampler, Some(self.trace_sampler_arg))
            .ok_or_else(|| PyValueError::new_err(format!("unknown trace sampler {:?}", self.trace_sampler)))?;
        Ok(Some(TracingConfig {
            endpoint: self.otlp_endpoint.clone(),
            headers: self
                .otlp_headers
                .iter()
                .filter_map(|h| h.split_once('=').map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned())))
                .collect(),
            service_name: self.service_name.clone(),
            sampler,
        }))
    }
}

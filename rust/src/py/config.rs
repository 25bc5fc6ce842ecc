//! The router's settings, read from the Python `Settings` object group by group
//! (`settings.routing`, `settings.timeouts`...), each group by attribute. Every default lives
//! in `pdproxy/config/settings.py`; nothing here declares one.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::engine::{EngineConfig, PolicyNames};
use crate::observe::trace::{Sampler, TracingConfig};
use crate::select::{PolicyConfig, PrefixConfig, ScoreWeights};
use crate::upstream::forward::ForwardConfig;

/// What the data plane's router reads of `Settings`: the groups it needs, each by its
/// attribute (`settings.routing`, `settings.timeouts`...).
#[derive(FromPyObject)]
pub(crate) struct RouterConfig {
    pub(crate) routing: RoutingGroup,
    pub(crate) limits: LimitsGroup,
    pub(crate) timeouts: TimeoutsGroup,
    pub(crate) engine_metrics: EngineMetricsGroup,
    pub(crate) security: NodeTlsGroup,
    pub(crate) observability: TracingGroup,
}

/// `settings.routing`: policies, retries, circuits.
#[derive(FromPyObject)]
pub(crate) struct RoutingGroup {
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
    pub(crate) score_reported_weight: f64,
    pub(crate) retries: u32,
    pub(crate) retry_budget_ratio: f64,
    pub(crate) retry_budget_floor: u64,
    pub(crate) circuit_failures: u32,
    pub(crate) circuit_cooldown: f64,
}

/// `settings.limits`: queue, caps, buffers, pools, threads.
#[derive(FromPyObject)]
pub(crate) struct LimitsGroup {
    pub(crate) queue_size: usize,
    pub(crate) max_requests: usize,
    pub(crate) max_n: u64,
    pub(crate) answer_buffer: usize,
    pub(crate) prefetch: usize,
    pub(crate) stream_buffer: usize,
    pub(crate) pool_max_idle_per_node: usize,
    pub(crate) runtime_threads: usize,
}

/// `settings.timeouts`: the data plane's steps.
#[derive(FromPyObject)]
pub(crate) struct TimeoutsGroup {
    pub(crate) queue: f64,
    pub(crate) request: f64,
    pub(crate) connect: f64,
    pub(crate) first_byte: f64,
    pub(crate) pool_idle: f64,
    pub(crate) stream_idle: f64,
    pub(crate) stream_stall: f64,
    pub(crate) node_tcp_keepalive: f64,
    pub(crate) answer: f64,
}

/// `settings.engine_metrics`: how old an engine's figures may be to route by.
#[derive(FromPyObject)]
pub(crate) struct EngineMetricsGroup {
    pub(crate) max_age: f64,
}

/// `settings.security`: the CA that https:// nodes are verified against.
#[derive(FromPyObject)]
pub(crate) struct NodeTlsGroup {
    pub(crate) node_ca_file: String,
}

/// `settings.observability`: tracing.
#[derive(FromPyObject)]
pub(crate) struct TracingGroup {
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
        let (limits, timeouts) = (&self.limits, &self.timeouts);
        Ok(ForwardConfig {
            connect_timeout: seconds("connect_timeout", timeouts.connect)?,
            first_byte_timeout: seconds("first_byte_timeout", timeouts.first_byte)?,
            pool_idle_timeout: seconds("pool_idle_timeout", timeouts.pool_idle)?,
            pool_max_idle_per_node: limits.pool_max_idle_per_node,
            prefetch_limit: limits.prefetch,
            stream_idle_timeout: seconds("stream_idle_timeout", timeouts.stream_idle)?,
            stream_buffer_limit: limits.stream_buffer.max(1),
            stream_stall_timeout: seconds("stream_stall_timeout", timeouts.stream_stall)?,
            node_ca_file: (!self.security.node_ca_file.is_empty()).then(|| self.security.node_ca_file.clone().into()),
            tcp_keepalive: seconds("node_tcp_keepalive", timeouts.node_tcp_keepalive)?,
            answer_buffer_limit: limits.answer_buffer.max(1),
            answer_timeout: seconds("answer_timeout", timeouts.answer)?,
        })
    }

    pub(crate) fn engine_config(&self) -> PyResult<EngineConfig> {
        let (routing, limits, timeouts) = (&self.routing, &self.limits, &self.timeouts);
        Ok(EngineConfig {
            policies: PolicyNames {
                hybrid: routing.policy.clone(),
                // A role without a policy of its own takes the general one (`--routing-strategy`).
                prefill: or_general(&routing.prefill_policy, &routing.policy),
                decode: or_general(&routing.decode_policy, &routing.policy),
                by_model: routing.model_policies.clone(),
            },
            policy: PolicyConfig {
                hash_load_factor: routing.hash_load_factor,
                prefix: PrefixConfig {
                    block_bytes: routing.prefix_block_bytes,
                    max_blocks: routing.prefix_max_blocks,
                    cache_entries: routing.prefix_cache_entries,
                    balance_threshold: routing.prefix_balance_threshold,
                },
                engine_max_age_ms: u64::try_from(
                    seconds("engine_metrics_max_age", self.engine_metrics.max_age)?.as_millis(),
                )
                .unwrap_or(u64::MAX),
                score: ScoreWeights {
                    prefix: routing.score_prefix_weight,
                    queue: routing.score_queue_weight,
                    hidden: routing.score_hidden_weight,
                    reported: routing.score_reported_weight,
                    future: 0.0,
                },
                prefix_bytes_per_token: routing.prefix_bytes_per_token,
            },
            queue_size: limits.queue_size,
            queue_timeout: seconds("queue_timeout", timeouts.queue)?,
            request_timeout: (timeouts.request > 0.0)
                .then(|| seconds("request_timeout", timeouts.request))
                .transpose()?,
            retries: routing.retries,
            retry_budget_ratio: routing.retry_budget_ratio,
            retry_budget_floor: routing.retry_budget_floor,
            circuit_failures: routing.circuit_failures,
            circuit_cooldown: seconds("circuit_cooldown", routing.circuit_cooldown)?,
            forward: self.forward_config()?,
            max_requests: limits.max_requests,
            max_n: limits.max_n,
            tracing: self.observability.tracing_config()?,
        })
    }
}

impl TracingGroup {
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

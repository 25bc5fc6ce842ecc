//! The router's settings, read from the Python `Settings` object group by group
//! (`settings.routing`, `settings.timeouts`...), each group by attribute. Every default lives
//! in `pdproxy/config/settings.py`; nothing here declares one.

use std::collections::HashMap;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;

use crate::engine::{EngineConfig, RolePolicies};
use crate::observe::trace::{Sampler, TracingConfig};
use crate::select::{PolicySpec, PrefixConfig, PrefixTableConfig, ScoreWeights};
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
    /// The policy of each role and model, each with its own knobs, as the settings parsed them.
    #[pyo3(from_py_with = role_policies)]
    pub(crate) policies: RolePolicies,
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

/// `settings.routing.policies` (`RolePolicies`, `pdproxy/config/policies.py`).
fn role_policies(policies: &Bound<'_, PyAny>) -> PyResult<RolePolicies> {
    let py = policies.py();
    let by_model: HashMap<String, Bound<'_, PyAny>> = policies.getattr(intern!(py, "by_model"))?.extract()?;
    Ok(RolePolicies {
        hybrid: policy_spec(&policies.getattr(intern!(py, "hybrid"))?)?,
        prefill: policy_spec(&policies.getattr(intern!(py, "prefill"))?)?,
        decode: policy_spec(&policies.getattr(intern!(py, "decode"))?)?,
        by_model: by_model.into_iter().map(|(model, p)| Ok((model, policy_spec(&p)?))).collect::<PyResult<_>>()?,
    })
}

/// One policy of the settings: its `kind`, and that kind's own knobs.
fn policy_spec(policy: &Bound<'_, PyAny>) -> PyResult<PolicySpec> {
    let kind: String = policy.getattr(intern!(policy.py(), "kind"))?.extract()?;
    Ok(match kind.as_str() {
        "consistent_hash" => PolicySpec::ConsistentHash { load_factor: policy.getattr("load_factor")?.extract()? },
        "prefix" => {
            let p: PrefixPolicy = policy.extract()?;
            PolicySpec::Prefix(PrefixConfig {
                block_bytes: p.block_bytes,
                max_blocks: p.max_blocks,
                cache_entries: p.cache_entries,
                balance_threshold: p.balance_threshold,
            })
        }
        "scored" => {
            let p: ScoredPolicy = policy.extract()?;
            PolicySpec::Scored {
                weights: ScoreWeights {
                    prefix: p.prefix,
                    queue: p.queue,
                    hidden: p.hidden,
                    reported: p.reported,
                    future: p.future,
                },
                table: PrefixTableConfig {
                    block_bytes: p.block_bytes,
                    max_blocks: p.max_blocks,
                    entries: p.cache_entries,
                    bytes_per_token: p.bytes_per_token,
                },
            }
        }
        other => PolicySpec::basic(other)
            .ok_or_else(|| PyValueError::new_err(format!("unknown routing policy {other:?}")))?,
    })
}

/// `PrefixPolicy`'s knobs.
#[derive(FromPyObject)]
struct PrefixPolicy {
    block_bytes: usize,
    max_blocks: usize,
    cache_entries: usize,
    balance_threshold: u64,
}

/// `ScoredPolicy`'s knobs: the weights of its terms, then its prefix table's.
#[derive(FromPyObject)]
struct ScoredPolicy {
    prefix: f64,
    queue: f64,
    hidden: f64,
    reported: f64,
    future: f64,
    block_bytes: usize,
    max_blocks: usize,
    cache_entries: usize,
    bytes_per_token: f64,
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
            policies: routing.policies.clone(),
            engine_max_age_ms: u64::try_from(
                seconds("engine_metrics_max_age", self.engine_metrics.max_age)?.as_millis(),
            )
            .unwrap_or(u64::MAX),
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

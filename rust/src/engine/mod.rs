//! The request engine, shared by the edge and the embedded `Router`: admission (the global
//! gate, selection with its permit, the FIFO wait queue), then forwarding with retries.
//! Plain Rust: no Python, no HTTP server; `cargo test` reaches all of it.

pub(crate) mod admission;
mod gate;
pub(crate) mod permit;
pub(crate) mod policies;
pub(crate) mod selection;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use gate::{Gate, GatePass, Refusal};
pub(crate) use policies::{PolicySet, RolePolicies};
pub(crate) use selection::{select, select_excluding};

use arc_swap::ArcSwapOption;
use http::HeaderMap;

use crate::engine::admission::{Admission, Ticket};

use crate::distserve::DistServe;
use crate::engine::permit::InFlightPermit;
use crate::error::{Error, Kind, Result};
use crate::inspect::RequestInfo;
use crate::node::registry::Registry;
use crate::node::Outcome;
use crate::node::{Node, NodeSpec, NodeState, NodeUrl, Role};
use crate::observe::trace::{OpenSpan, SpanKind, Trace, Tracer, TracingConfig};
use crate::select::kv_index::KvIndex;
use crate::select::SelectCtx;
use crate::tenants::Class;
use crate::tenants::Tenants;
use crate::upstream::forward::{ForwardConfig, Forwarder, UpstreamResponse};
use crate::upstream::retry::RetryBudget;
use crate::upstream::ForwardRequest;

/// How often a request queued in a worker group looks for room freed by another worker.
const GROUP_POLL: Duration = Duration::from_millis(5);

/// The engine's settings. Values come from the control plane's settings; no defaults here.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub policies: RolePolicies,
    /// Engine reports older than this (milliseconds) are not used.
    pub engine_max_age_ms: u64,
    pub queue_size: usize,
    pub queue_timeout: Duration,
    /// Limit on a whole exchange, queueing included; `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// Further nodes a request may try when the first provably did not run it.
    pub retries: u32,
    pub retry_budget_ratio: f64,
    pub retry_budget_floor: u64,
    pub circuit_failures: u32,
    pub circuit_cooldown: Duration,
    pub forward: ForwardConfig,
    /// Inference requests served at once by the proxy (0: no cap).
    pub max_requests: usize,
    /// The largest `n` (and `best_of`) a request may ask for.
    pub max_n: u64,
    /// Where spans go; `None`: requests are not traced.
    pub tracing: Option<TracingConfig>,
}

impl EngineConfig {
    /// When a request that started at `started` runs out of time, if requests have a limit.
    pub(crate) fn deadline(&self, started: std::time::Instant) -> Option<tokio::time::Instant> {
        self.request_timeout.map(|limit| tokio::time::Instant::from_std(started) + limit)
    }
}

#[derive(Debug)]
pub struct Engine {
    pub registry: Registry,
    policies: PolicySet,
    pub admission: Arc<Admission>,
    pub(crate) retry_budget: Arc<RetryBudget>,
    pub(crate) forwarder: Forwarder,
    pub(crate) gate: Arc<Gate>,
    pub(crate) config: EngineConfig,
    /// In a worker group: how often a queued request looks for room freed by other workers.
    group_poll: Option<Duration>,
    /// This proxy's id in `x-pdproxy-via` (see `loops`).
    instance: String,
    /// Present when requests are traced.
    pub(crate) tracer: Option<Arc<Tracer>>,
    /// Who requests count for, and their limits (empty: nobody's).
    pub(crate) tenants: Tenants,
    /// LMDeploy DistServe's links and sessions, once the control plane has started its flow.
    pub(crate) distserve: ArcSwapOption<DistServe>,
    /// The engines' KV events, once the control plane follows them (see `select::kv_index`).
    kv_index: ArcSwapOption<KvIndex>,
}

/// A permit taken at once, or a place in the queue.
#[derive(Debug)]
pub(crate) enum Admitted {
    Now(InFlightPermit),
    Queued(Queued),
}

/// A request waiting in the queue: its ticket, and when traced its admission and queue spans.
#[derive(Debug)]
pub(crate) struct Queued {
    ticket: Ticket,
    spans: Option<(OpenSpan, OpenSpan)>,
}

impl Engine {
    pub fn new(config: EngineConfig, registry: Registry) -> Self {
        let policies = PolicySet::build(&config.policies, config.engine_max_age_ms);
        let group_poll = registry.in_a_group().then_some(GROUP_POLL);
        let instance = crate::loops::new_instance_id();
        let retry_budget = Arc::new(RetryBudget::new(config.retry_budget_ratio, config.retry_budget_floor));
        Self {
            registry,
            policies,
            admission: Arc::new(Admission::new(config.queue_size)),
            forwarder: Forwarder::new(config.forward.clone(), &instance, Arc::clone(&retry_budget)),
            retry_budget,
            gate: Arc::new(Gate::new(config.max_requests)),
            tracer: config.tracing.clone().map(Tracer::start),
            tenants: Tenants::default(),
            distserve: ArcSwapOption::empty(),
            kv_index: ArcSwapOption::empty(),
            config,
            group_poll,
            instance,
        }
    }

    /// This proxy's id, as its requests carry it in `x-pdproxy-via`.
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }

    /// A forwarder with a pool of its own (an edge thread's), sharing the engine's retry budget.
    pub(crate) fn new_forwarder(&self) -> Forwarder {
        Forwarder::new(self.config.forward.clone(), &self.instance, Arc::clone(&self.retry_budget))
    }

    pub(crate) fn policies(&self) -> &PolicySet {
        &self.policies
    }

    /// Prices cache hits from `index` where it is live (`None`: from the prefix table alone).
    pub(crate) fn set_kv_index(&self, index: Option<Arc<KvIndex>>) {
        self.policies.use_kv_index(index.as_ref());
        self.kv_index.store(index);
    }

    pub(crate) fn kv_index(&self) -> Option<Arc<KvIndex>> {
        self.kv_index.load_full()
    }

    /// Refuses a request whose numbers would size the proxy's own work past its settings:
    /// `n` and `best_of` past `max_n` (SGLang's disaggregation sends one bootstrap entry per
    /// choice). Other numbers (`max_tokens`, `logprobs`) size nothing in the proxy.
    pub(crate) fn check_asks(&self, info: &RequestInfo<'_>) -> Result<()> {
        let max = self.config.max_n;
        for (field, asked) in [("n", info.n), ("best_of", info.best_of)] {
            if let Some(asked) = asked.filter(|&asked| asked > max) {
                return Err(Error::new(
                    Kind::InvalidRequest,
                    format!("{field} must be at most {max} (max_n), got {asked}"),
                )
                .with_param(field));
            }
        }
        Ok(())
    }

    /// Adds a node, or updates a registered one.
    pub fn add_node(&self, url: &str, spec: NodeSpec) -> Result<Arc<Node>> {
        Ok(self.add_parsed(&NodeUrl::parse(url)?, spec)?.0)
    }

    /// `add_node` for a URL parsed already; also says whether the node is new.
    pub(crate) fn add_parsed(&self, url: &NodeUrl, spec: NodeSpec) -> Result<(Arc<Node>, bool)> {
        let (node, created) = self.registry.add_parsed(url, spec)?;
        node.counters().circuit.configure(self.config.circuit_failures, self.config.circuit_cooldown);
        Ok((node, created))
    }

    /// The registered node at `url`.
    pub(crate) fn node(&self, url: &str) -> Result<Arc<Node>> {
        self.registry
            .load()
            .get(url)
            .cloned()
            .ok_or_else(|| Error::new(Kind::NodeNotFound, format!("no node {url} is registered")))
    }

    /// Selects a node and takes its permit now, or queues the request when every candidate
    /// is full. Counts the request for its model.
    pub(crate) fn admit(&self, ctx: &SelectCtx<'_>) -> Result<Admitted> {
        let set = self.registry.load();
        set.count_request(ctx.model);
        let policy = self.policies.for_request(ctx.role, ctx.model);
        let span = ctx.trace.map(|t| t.open("pdproxy.admission", SpanKind::Internal));
        let inner = SelectCtx { trace: ctx.trace.zip(span.as_ref()).map(|(t, s)| t.under(s)), ..*ctx };
        // First come, first served: newcomers wait behind requests already queued for the same nodes.
        let selected = if self.admission.has_waiter_for(ctx.role, ctx.model, ctx.class) {
            Err(Error::new(Kind::Overloaded, "requests are queued for these nodes"))
        } else {
            select(&set, &inner, policy.as_ref(), Some(&self.admission))
        };
        let admitted = match selected {
            Ok(permit) => Ok(Admitted::Now(permit)),
            Err(e) if e.kind() == Kind::Overloaded && self.config.queue_size > 0 => {
                match self.admission.enqueue(ctx.role, ctx.model, ctx.class) {
                    Some(ticket) => {
                        let spans =
                            inner.trace.zip(span).map(|(t, s)| (s, t.open("pdproxy.queue", SpanKind::Internal)));
                        return Ok(Admitted::Queued(Queued { ticket, spans }));
                    }
                    None => Err(self.overloaded()),
                }
            }
            Err(e) if e.kind() == Kind::Overloaded => Err(self.overloaded()),
            Err(e) => Err(e),
        };
        end_admission(ctx, span, false, admitted.as_ref().err());
        admitted
    }

    /// `admit`, then the wait in the queue if there was one.
    pub async fn permit(&self, ctx: &SelectCtx<'_>) -> Result<InFlightPermit> {
        match self.admit(ctx)? {
            Admitted::Now(permit) => Ok(permit),
            Admitted::Queued(queued) => self.wait_for_permit(queued, ctx).await,
        }
    }

    /// Takes a permit on one given node (a request whose node was chosen beforehand). It
    /// does not queue.
    pub(crate) fn admit_on(&self, url: &str) -> Result<InFlightPermit> {
        let node = self.node(url)?;
        if node.counters().state() != NodeState::Healthy {
            return Err(Error::new(Kind::NoHealthyNode, format!("node {} is not healthy", node.url())));
        }
        InFlightPermit::try_acquire(&node, Some(&self.admission)).ok_or_else(|| self.overloaded())
    }

    /// The node the policy would choose now, without taking its permit.
    pub(crate) fn choose(&self, ctx: &SelectCtx<'_>) -> Result<Arc<Node>> {
        let policy = self.policies.for_request(ctx.role, ctx.model);
        let permit = select(&self.registry.load(), ctx, policy.as_ref(), None)?;
        let node = Arc::clone(permit.node());
        permit.unused();
        Ok(node)
    }

    fn overloaded(&self) -> Error {
        Error::new(Kind::Overloaded, "every node that serves this request is busy and the wait queue is full")
            .with_retry_after(self.admission.retry_after())
    }

    /// Waits in the queue until a node with room takes the request, or the wait times out.
    /// The request is queued on entry; every round first tries to select (a slot freed just
    /// before the request queued would otherwise wake nobody), then waits for a wake.
    pub(crate) async fn wait_for_permit(&self, queued: Queued, ctx: &SelectCtx<'_>) -> Result<InFlightPermit> {
        let Queued { mut ticket, spans } = queued;
        let (admission_span, queue_span) = spans.unzip();
        let inner = SelectCtx { trace: ctx.trace.zip(admission_span.as_ref()).map(|(t, s)| t.under(s)), ..*ctx };
        let waited = self.wait_in_queue(&mut ticket, &inner).await;
        if let (Some(traced), Some(span)) = (inner.trace, queue_span) {
            traced.trace.end(span, Vec::new, waited.as_ref().err().map(Error::message));
        }
        end_admission(ctx, admission_span, true, waited.as_ref().err());
        waited
    }

    async fn wait_in_queue(&self, ticket: &mut Ticket, ctx: &SelectCtx<'_>) -> Result<InFlightPermit> {
        // Records the wait on every way out: served, timed out, failed or cancelled.
        let timer = WaitTimer { admission: &self.admission, since: Instant::now() };
        let deadline = tokio::time::Instant::from_std(timer.since) + self.config.queue_timeout;
        let policy = self.policies.for_request(ctx.role, ctx.model);
        let role = ctx.role;
        loop {
            match select(&self.registry.load(), ctx, policy.as_ref(), Some(&self.admission)) {
                Ok(permit) => {
                    self.leave_queue(ticket.id, role);
                    return Ok(permit);
                }
                Err(e) if e.kind() == Kind::Overloaded => {}
                Err(e) => {
                    self.leave_queue(ticket.id, role);
                    return Err(e);
                }
            }
            // In a worker group, a slot freed by another worker wakes nobody here: look again
            // every `group_poll` while waiting.
            let wake_by = self.group_poll.map_or(deadline, |poll| deadline.min(tokio::time::Instant::now() + poll));
            if tokio::time::timeout_at(wake_by, &mut ticket.woken).await.is_err() {
                if tokio::time::Instant::now() < deadline {
                    continue; // still queued, in the same place
                }
                self.leave_queue(ticket.id, role);
                return Err(Error::new(Kind::Overloaded, "no node had room for the request in time")
                    .with_retry_after(self.admission.retry_after()));
            }
            // Woken and out of the queue: back in, in its old place, before trying again.
            *ticket = self.admission.requeue(role, ctx.model, ticket);
        }
    }

    fn leave_queue(&self, id: u64, role: Role) {
        if !self.admission.leave(id) {
            self.admission.pass_on(role);
        }
    }

    /// Sends `request` with `permit`'s node through `forwarder` (the engine's own, or an edge
    /// thread's), retrying on another node (when `retry`) what provably did not run: a connect
    /// failure, or a 429/503 answer before any byte. The answer comes back with the permit of
    /// the node that gave it; every other permit is released with its outcome. Dropped midway,
    /// the permit in use goes with it (counted as cancelled). `prefetch`: small bodies that are
    /// not event streams are read whole with the head. A node that has not answered by
    /// `deadline` (the request's time limit) failed it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn send(
        &self,
        forwarder: &Forwarder,
        mut permit: InFlightPermit,
        request: &ForwardRequest,
        ctx: &SelectCtx<'_>,
        retry: bool,
        prefetch: bool,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Sent> {
        self.retry_budget.request();
        let mut tried: Vec<u64> = Vec::new();
        loop {
            let node = Arc::clone(permit.node());
            let span = ctx.trace.map(|t| t.open("pdproxy.attempt", SpanKind::Client));
            let traceparent = ctx.trace.zip(span.as_ref()).map(|(t, s)| t.trace.traceparent(s));
            let on_its_way = forwarder.forward(&node, request, prefetch, traceparent.as_ref());
            let answer = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, on_its_way)
                    .await
                    .unwrap_or_else(|_| Err(Error::new(Kind::Timeout, "the request took longer than its time limit"))),
                None => on_its_way.await,
            };
            if let (Some(traced), Some(span)) = (ctx.trace, span) {
                end_attempt(traced.trace, span, &node, tried.len(), &answer);
            }
            let attempt = match answer {
                // Refused before any work (overloaded or unavailable): another node may take it.
                Ok(response) if matches!(response.status.as_u16(), 429 | 503) => Attempt::Refused(response),
                Ok(response) => return Ok(Sent { permit, response }),
                Err(e) => {
                    if e.is_connect() {
                        node.counters().connect_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    Attempt::Failed(e)
                }
            };
            tried.push(node.generation());
            let retriable = match &attempt {
                Attempt::Failed(e) => e.is_connect(),
                Attempt::Refused(_) => true,
            };
            let next = if retry && retriable && tried.len() <= self.config.retries as usize && self.retry_budget.spend()
            {
                let policy = self.policies.for_request(ctx.role, ctx.model);
                select_excluding(&self.registry.load(), ctx, policy.as_ref(), Some(&self.admission), &tried).ok()
            } else {
                None
            };
            match (attempt, next) {
                (Attempt::Refused(response), None) => return Ok(Sent { permit, response }),
                (Attempt::Refused(response), Some(next)) => {
                    permit.set_outcome(response.outcome());
                    permit = next;
                }
                (Attempt::Failed(e), next) => {
                    // The proxy's own shortage says nothing of the node: recorded nowhere.
                    permit.set_outcome(if e.kind() == Kind::Resources { Outcome::Unused } else { Outcome::Failed });
                    match next {
                        Some(next) => permit = next,
                        None => return Err(e),
                    }
                }
            }
        }
    }
}

/// A node's answer, with the permit taken on it: released (with the answer's outcome) when the
/// answer has been passed on.
#[derive(Debug)]
pub(crate) struct Sent {
    pub(crate) permit: InFlightPermit,
    pub(crate) response: UpstreamResponse,
}

impl Sent {
    /// The node that answered.
    pub(crate) fn node(&self) -> &Arc<Node> {
        self.permit.node()
    }
}

/// How one attempt at a node went, when it did not simply answer.
enum Attempt {
    /// The node refused before any work (429, 503): its answer, for the client if no other node takes it.
    Refused(UpstreamResponse),
    Failed(Error),
}

/// The affinity key of a request: the `x-smg-routing-key` (the SGLang gateway's), `x-session-id`
/// or `x-user-id` header, else the body's `session_id` or `user`.
pub(crate) fn affinity<'a>(headers: &'a HeaderMap, info: &'a RequestInfo<'_>) -> Option<&'a str> {
    static ROUTING_KEY: http::HeaderName = http::HeaderName::from_static("x-smg-routing-key");
    static SESSION: http::HeaderName = http::HeaderName::from_static("x-session-id");
    static USER: http::HeaderName = http::HeaderName::from_static("x-user-id");
    let header = |name: &http::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    header(&ROUTING_KEY).or_else(|| header(&SESSION)).or_else(|| header(&USER)).or(info.body_affinity())
}

/// Ends the admission span (when traced).
fn end_admission(ctx: &SelectCtx<'_>, span: Option<OpenSpan>, queued: bool, error: Option<&Error>) {
    if let (Some(traced), Some(span)) = (ctx.trace, span) {
        let attributes =
            || vec![("pdproxy.queued", queued.to_string()), ("pdproxy.priority", ctx.class.priority.to_string())];
        traced.trace.end(span, attributes, error.map(Error::message));
    }
}

/// Ends an attempt's span: the node, the attempt's number, and its answer's status or error.
fn end_attempt(trace: &Trace, span: OpenSpan, node: &Node, earlier: usize, answer: &Result<UpstreamResponse>) {
    let attributes = || {
        let mut out = vec![("pdproxy.node", node.url().to_owned()), ("pdproxy.attempt", (earlier + 1).to_string())];
        if let Ok(response) = answer {
            out.push(("http.response.status_code", response.status.as_str().to_owned()));
        }
        out
    };
    let error = match answer {
        Ok(response) if response.status.as_u16() >= 500 => Some(response.status.as_str()),
        Ok(_) => None,
        Err(e) => Some(e.message()),
    };
    trace.end(span, attributes, error);
}

/// What selection needs of a request, from its parsed body and headers.
pub(crate) fn select_ctx<'a>(role: Role, headers: &'a HeaderMap, info: &'a RequestInfo<'_>) -> SelectCtx<'a> {
    SelectCtx {
        role,
        model: info.model.as_deref(),
        affinity: affinity(headers, info),
        prompt: info.prompt,
        stream: info.stream,
        class: Class::default(),
        trace: None,
    }
}

/// Observes the time a request spent queued when dropped.
struct WaitTimer<'a> {
    admission: &'a Admission,
    since: Instant,
}

impl Drop for WaitTimer<'_> {
    fn drop(&mut self) {
        self.admission.waited.observe(self.since.elapsed());
    }
}

#[cfg(test)]
impl Engine {
    /// An engine with round robin for every role and the limits the tests run with, nodes
    /// none yet; `stream_idle`: how long a stream may be silent.
    pub(crate) fn for_tests(stream_idle: Duration) -> Arc<Self> {
        let forward = ForwardConfig {
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(5),
            pool_idle_timeout: Duration::from_secs(30),
            pool_max_idle_per_node: 8,
            prefetch_limit: 64 * 1024,
            stream_idle_timeout: stream_idle,
            stream_buffer_limit: 1 << 20,
            stream_stall_timeout: Duration::from_secs(5),
            node_ca_file: None,
            tcp_keepalive: Duration::from_secs(30),
            answer_buffer_limit: 1 << 20,
            answer_timeout: Duration::from_secs(5),
        };
        let config = EngineConfig {
            policies: RolePolicies::every_role(crate::select::PolicySpec::RoundRobin),
            engine_max_age_ms: 10_000,
            queue_size: 16,
            queue_timeout: Duration::from_secs(1),
            request_timeout: None,
            retries: 1,
            retry_budget_ratio: 0.2,
            retry_budget_floor: 10,
            circuit_failures: 5,
            circuit_cooldown: Duration::from_secs(10),
            forward,
            max_requests: 0,
            max_n: 16,
            tracing: None,
        };
        Arc::new(Self::new(config, Registry::new()))
    }
}

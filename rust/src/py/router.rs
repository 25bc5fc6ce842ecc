//! `Router`: the node table, selection, admission and forwarding, as one Python object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tokio_util::sync::CancellationToken;

use super::bridge::{resolve, LoopBridge};
use super::config::{seconds, PolicySet, RouterConfig};
use super::errors::to_pyerr;
use super::response::{Head, Response};
use super::shared::SharedTable;
use crate::admission::{Admission, Ticket};
use crate::error::{Error, Kind, Result};
use crate::exchange::{pump, Exchange, StreamTimeouts};
use crate::forward::{ForwardConfig, ForwardRequest, Forwarder, ResponseBody, UpstreamResponse};
use crate::histogram::HistogramSnapshot;
use crate::inspect::{inspect, patch};
use crate::node::{Node, NodeSpec, NodeState, NodeUrl, Role};
use crate::permit::{InFlightPermit, Outcome, Report};
use crate::registry::{check_speed, Registry};
use crate::retry::RetryBudget;
use crate::runtime;
use crate::select::{select, select_excluding, SelectCtx};

/// How often a request queued in a worker group looks for room freed by another worker.
const GROUP_POLL: Duration = Duration::from_millis(5);

#[pyclass(frozen, name = "Router", module = "pdproxy._pdproxy")]
pub struct Router {
    shared: Arc<Shared>,
    queue_size: usize,
    config: ForwardConfig,
    runtime: &'static tokio::runtime::Runtime,
    /// Ends every task of this router when it closes.
    shutdown: CancellationToken,
    /// The event loop this router serves, bound on first use.
    bridge: OnceLock<Py<LoopBridge>>,
    /// Requests admitted per model (models no node declares count as `other`, so a client
    /// cannot grow the label set).
    model_requests: Mutex<HashMap<String, u64>>,
}

fn role_of(raw: &str) -> PyResult<Role> {
    Role::parse(raw).map_err(|e| to_pyerr(&e))
}

/// The affinity key: the `x-session-id` or `x-user-id` header, else the body's
/// `session_id` or `user`.
fn affinity<'a>(headers: &'a [(Vec<u8>, Vec<u8>)], body_key: Option<&'a str>) -> Option<&'a str> {
    let header = |name: &[u8]| {
        headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    header(b"x-session-id").or_else(|| header(b"x-user-id")).or(body_key)
}

#[pymethods]
impl Router {
    /// `group`: the worker group's shared table and this worker's index in it.
    #[new]
    #[pyo3(signature = (config, group=None))]
    fn new(config: RouterConfig, group: Option<(PyRef<'_, SharedTable>, usize)>) -> PyResult<Self> {
        let policies = config.policies()?;
        let forward_config = config.forward_config()?;
        let forwarder = Forwarder::new(forward_config.clone());
        // Built on first use; the first router's thread count wins.
        let runtime =
            runtime::get(config.runtime_threads).map_err(|e| PyRuntimeError::new_err(e.message().to_owned()))?;
        let group_poll = group.is_some().then_some(GROUP_POLL);
        let registry = match group {
            Some((table, worker)) => Registry::in_group(Arc::clone(&table.inner), worker),
            None => Registry::new(),
        };
        let shared = Shared {
            registry,
            policies,
            admission: Arc::new(Admission::new(config.queue_size)),
            queue_timeout: seconds("queue_timeout", config.queue_timeout)?,
            request_timeout: (config.request_timeout > 0.0)
                .then(|| seconds("request_timeout", config.request_timeout))
                .transpose()?,
            retry_budget: RetryBudget::new(config.retry_budget_ratio, config.retry_budget_floor),
            max_retries: config.retries,
            circuit_failures: config.circuit_failures,
            circuit_cooldown: seconds("circuit_cooldown", config.circuit_cooldown)?,
            forwarder,
            group_poll,
        };
        Ok(Self {
            shared: Arc::new(shared),
            queue_size: config.queue_size,
            config: forward_config,
            runtime,
            shutdown: CancellationToken::new(),
            bridge: OnceLock::new(),
            model_requests: Mutex::default(),
        })
    }

    /// The routing policy of each role (and per-model overrides, as `model:NAME`).
    #[getter]
    fn policies(&self) -> Vec<(String, &'static str)> {
        self.shared.policies.names()
    }

    #[pyo3(signature = (url, models=None, role="hybrid", speed=None, max_concurrency=None, api_key=None))]
    fn add_node(
        &self,
        url: &str,
        models: Option<Vec<String>>,
        role: &str,
        speed: Option<f64>,
        max_concurrency: Option<u32>,
        api_key: Option<String>,
    ) -> PyResult<String> {
        let spec = NodeSpec {
            models: models.unwrap_or_default(),
            role: role_of(role)?,
            speed,
            max_concurrency: max_concurrency.filter(|&m| m > 0),
            api_key: api_key.filter(|k| !k.is_empty()),
        };
        let node = self.shared.registry.add(url, spec).map_err(|e| to_pyerr(&e))?;
        node.counters().circuit.configure(self.shared.circuit_failures, self.shared.circuit_cooldown);
        Ok(node.url().to_owned())
    }

    /// Replaces the models of a registered node, keeping everything else.
    fn set_models(&self, url: &str, models: Vec<String>) -> PyResult<()> {
        self.shared.registry.update(url, |spec| spec.models = models).map_err(|e| to_pyerr(&e))?;
        Ok(())
    }

    /// In a worker group: rebinds nodes whose shared slot another worker retired (it removed
    /// and re-added the URL). Returns how many were rebound.
    fn refresh_bindings(&self) -> PyResult<usize> {
        self.shared.registry.refresh_bindings().map_err(|e| to_pyerr(&e))
    }

    fn remove_node(&self, url: &str) -> PyResult<String> {
        let node = self.shared.registry.remove(url).map_err(|e| to_pyerr(&e))?;
        Ok(node.url().to_owned())
    }

    /// Sets whether a node takes new requests: `healthy`, `unhealthy`, `draining` or
    /// `sleeping`. Only healthy nodes are selected.
    fn set_node_state(&self, url: &str, state: &str) -> PyResult<()> {
        let state = NodeState::parse(state).map_err(|e| to_pyerr(&e))?;
        self.node(url)?.counters().set_state(state);
        Ok(())
    }

    /// Sets (or with `None` lifts) a node's hard cap on requests in flight.
    fn set_max_concurrency(&self, url: &str, max_concurrency: Option<u32>) -> PyResult<()> {
        // Through the spec, so that later updates of the node (discovery) keep the cap.
        self.shared
            .registry
            .update(url, |spec| spec.max_concurrency = max_concurrency.filter(|&m| m > 0))
            .map_err(|e| to_pyerr(&e))?;
        Ok(())
    }

    /// Models served by the registered nodes, deduplicated.
    fn models(&self) -> Vec<String> {
        self.shared.registry.load().models().into_iter().map(str::to_owned).collect()
    }

    /// One snapshot of every node and its counters.
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let set = self.shared.registry.load();
        let list = PyList::empty(py);
        for node in set.nodes() {
            list.append(node_stats(py, node)?)?;
        }
        Ok(list)
    }

    /// Requests waiting for a node with room.
    #[getter]
    fn queued(&self) -> usize {
        self.shared.admission.queued()
    }

    /// How long requests waited in the queue for a node with room (those that queued).
    fn queue_wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        histogram_dict(py, self.shared.admission.waited.snapshot())
    }

    /// Retries taken since the start.
    #[getter]
    fn retries(&self) -> u64 {
        self.shared.retry_budget.total()
    }

    /// Requests received per model (`other`: a model no node declares; `none`: no model).
    fn model_requests(&self) -> HashMap<String, u64> {
        self.model_requests.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The node the policy would choose now, without sending anything or taking a permit.
    #[pyo3(signature = (model=None, role="hybrid", affinity=None))]
    fn select(&self, model: Option<&str>, role: &str, affinity: Option<&str>) -> PyResult<String> {
        let ctx = SelectCtx { role: role_of(role)?, model, affinity, prompt: None };
        let set = self.shared.registry.load();
        let policy = self.shared.policies.for_request(ctx.role, model);
        let permit = select(&set, &ctx, policy.as_ref(), None).map_err(|e| to_pyerr(&e))?;
        let url = permit.node().url().to_owned();
        // Not a request: release without recording an outcome.
        permit.unused();
        Ok(url)
    }

    /// The canonical form of a node URL (scheme and host lower-cased, no trailing slash).
    /// Raises `InvalidNode` for a node the table would refuse (URL, role, speed), without adding it.
    #[staticmethod]
    #[pyo3(signature = (url, role="hybrid", speed=None))]
    fn check_node(url: &str, role: &str, speed: Option<f64>) -> PyResult<()> {
        NodeUrl::parse(url).map_err(|e| to_pyerr(&e))?;
        role_of(role)?;
        check_speed(speed).map_err(|e| to_pyerr(&e))
    }

    #[staticmethod]
    fn normalize_url(url: &str) -> PyResult<String> {
        Ok(crate::node::NodeUrl::parse(url).map_err(|e| to_pyerr(&e))?.normalized)
    }

    /// The routing fields of a request body: `model`, `stream`, `n`, `user`, `session_id`,
    /// `max_tokens`.
    #[staticmethod]
    fn inspect<'py>(py: Python<'py>, body: &[u8]) -> PyResult<Bound<'py, PyDict>> {
        let info = inspect(body).map_err(|e| to_pyerr(&e))?;
        let out = PyDict::new(py);
        out.set_item("model", info.model.as_deref())?;
        out.set_item("stream", info.stream)?;
        out.set_item("n", info.n)?;
        out.set_item("user", info.user.as_deref())?;
        out.set_item("session_id", info.session_id.as_deref())?;
        out.set_item("max_tokens", info.max_tokens)?;
        Ok(out)
    }

    /// The raw JSON text of a top-level member of `body` (`None` when absent), so that it can
    /// be passed on byte for byte.
    #[staticmethod]
    fn member(body: &[u8], key: &str) -> PyResult<Option<String>> {
        Ok(crate::inspect::member(body, key).map_err(|e| to_pyerr(&e))?.map(str::to_owned))
    }

    /// A copy of `body` with top-level members set (values given as JSON text) or removed;
    /// everything else keeps its order and bytes.
    #[staticmethod]
    #[pyo3(signature = (body, set=Vec::new(), remove=Vec::new()))]
    fn patch<'py>(
        py: Python<'py>,
        body: &[u8],
        set: Vec<(String, String)>,
        remove: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let set: Vec<(&str, &str)> = set.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let remove: Vec<&str> = remove.iter().map(String::as_str).collect();
        let out = patch(body, &set, &remove).map_err(|e| to_pyerr(&e))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Selects a node for the request in `body` and forwards it. Returns a future of the
    /// running loop that resolves to a `Response` once the node's response head has arrived;
    /// cancelling it cancels the upstream request. When every candidate is at its cap the
    /// request waits in the queue first.
    #[pyo3(signature = (path, body, headers=Vec::new(), method="POST", role="hybrid", node=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        path: String,
        body: &[u8],
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        method: &str,
        role: &str,
        node: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid HTTP method {method:?}")))?;
        let role = role_of(role)?;
        if self.shutdown.is_cancelled() {
            return Err(PyRuntimeError::new_err("this Router is closed"));
        }
        let bridge = self.bridge(py)?;
        let body = Bytes::copy_from_slice(body);
        let admitted = match node {
            Some(url) => {
                self.count_model(inspect(&body).map_err(|e| to_pyerr(&e))?.model.as_deref());
                Admitted::Now(self.admit_on(url)?)
            }
            None => self.admit_now(&body, &headers, role)?,
        };

        let future = bridge.get().create_future(py)?;
        let exchange = Arc::new(Exchange::new(self.config.stream_buffer_limit));
        let reply = Reply {
            future: Some(future.clone().unbind()),
            bridge: bridge.clone_ref(py),
            bridge_for_response: Some(bridge),
        };
        let job = Job {
            router: Arc::clone(&self.shared),
            retry: node.is_none(),
            admitted,
            request: ForwardRequest { method, path_and_query: path, headers, body },
            role,
            exchange: Arc::clone(&exchange),
            timeouts: StreamTimeouts { idle: self.config.stream_idle_timeout, stall: self.config.stream_stall_timeout },
        };
        let shutdown = self.shutdown.clone();
        let task = self.runtime.spawn(async move { job.run(reply, shutdown).await });
        exchange.set_task(task.abort_handle());
        future.call_method1(pyo3::intern!(py, "add_done_callback"), (AbortOnCancel(exchange),))?;
        Ok(future)
    }

    /// Stops serving: requests in flight end now (their readers get an error) and new ones
    /// are refused. The router leaves its event loop when it is dropped, so that the endings
    /// of those requests still reach their readers.
    fn close(&self) {
        self.shutdown.cancel();
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        if let Some(bridge) = self.bridge.get() {
            // Dropped by Python's deallocator, so the interpreter is attached.
            Python::attach(|py| bridge.get().stop(py));
        }
    }
}

/// What the router shares with its requests' tasks.
struct Shared {
    registry: Registry,
    policies: PolicySet,
    admission: Arc<Admission>,
    queue_timeout: Duration,
    /// Limit on a whole exchange, queueing included; `None`: no limit.
    request_timeout: Option<Duration>,
    retry_budget: RetryBudget,
    /// Further nodes a request may try when the first did not run it.
    max_retries: u32,
    circuit_failures: u32,
    circuit_cooldown: Duration,
    forwarder: Forwarder,
    /// In a worker group: how often a queued request looks for room freed by other workers.
    group_poll: Option<Duration>,
}

/// A permit taken at once, or a place in the queue.
enum Admitted {
    Now(InFlightPermit),
    Queued(Ticket),
}

impl Router {
    fn count_model(&self, model: Option<&str>) {
        let label = match model {
            None => "none",
            Some(m) if self.shared.registry.load().models().contains(&m) => m,
            Some(_) => "other",
        };
        let mut counts = self.model_requests.lock().unwrap_or_else(PoisonError::into_inner);
        match counts.get_mut(label) {
            Some(n) => *n += 1,
            None => {
                counts.insert(label.to_owned(), 1);
            }
        }
    }

    fn node(&self, url: &str) -> PyResult<Arc<Node>> {
        self.shared
            .registry
            .load()
            .get(url)
            .cloned()
            .ok_or_else(|| to_pyerr(&Error::new(Kind::NodeNotFound, format!("no node {url} is registered"))))
    }

    /// Takes a permit on one given node (a request whose node was chosen beforehand, such as a
    /// decode bound to its prefill's link). It does not queue.
    fn admit_on(&self, url: &str) -> PyResult<InFlightPermit> {
        let node = self.node(url)?;
        if node.counters().state() != NodeState::Healthy {
            return Err(to_pyerr(&Error::new(Kind::NoHealthyNode, format!("node {} is not healthy", node.url()))));
        }
        InFlightPermit::try_acquire(&node, Some(&self.shared.admission))
            .ok_or_else(|| to_pyerr(&overloaded(&self.shared.admission)))
    }

    /// Selects and takes a permit now, or queues the request when every candidate is full.
    fn admit_now(&self, body: &[u8], headers: &[(Vec<u8>, Vec<u8>)], role: Role) -> PyResult<Admitted> {
        let info = inspect(body).map_err(|e| to_pyerr(&e))?;
        let model = info.model.as_deref();
        self.count_model(model);
        let ctx = SelectCtx { role, model, affinity: affinity(headers, info.body_affinity()), prompt: info.prompt };
        let policy = self.shared.policies.for_request(role, model);
        // First come, first served: newcomers wait behind requests already queued for the same nodes.
        let selected = if self.shared.admission.has_waiter_for(role, model) {
            Err(Error::new(Kind::Overloaded, "requests are queued for these nodes"))
        } else {
            select(&self.shared.registry.load(), &ctx, policy.as_ref(), Some(&self.shared.admission))
        };
        match selected {
            Ok(permit) => Ok(Admitted::Now(permit)),
            Err(e) if e.kind() == Kind::Overloaded && self.queue_size > 0 => {
                match self.shared.admission.enqueue(role, model, false) {
                    Some(ticket) => Ok(Admitted::Queued(ticket)),
                    None => Err(to_pyerr(&overloaded(&self.shared.admission))),
                }
            }
            Err(e) if e.kind() == Kind::Overloaded => Err(to_pyerr(&overloaded(&self.shared.admission))),
            Err(e) => Err(to_pyerr(&e)),
        }
    }

    /// The bridge to the running loop; the first call binds the router to it.
    fn bridge(&self, py: Python<'_>) -> PyResult<Py<LoopBridge>> {
        if let Some(bridge) = self.bridge.get() {
            if !bridge.get().serves_running_loop(py)? {
                return Err(PyRuntimeError::new_err("this Router serves another event loop"));
            }
            return Ok(bridge.clone_ref(py));
        }
        let bridge = LoopBridge::start(py)?;
        if let Err(bridge) = self.bridge.set(bridge) {
            bridge.get().stop(py);
        }
        self.bridge.get().map(|b| b.clone_ref(py)).ok_or_else(|| PyRuntimeError::new_err("router has no event loop"))
    }
}

fn overloaded(admission: &Admission) -> Error {
    Error::new(Kind::Overloaded, "every node that serves this request is busy and the wait queue is full")
        .with_retry_after(admission.retry_after())
}

impl Shared {
    /// A permit on another node than those `tried`, for a retry; never queued.
    fn reselect(&self, request: &ForwardRequest, role: Role, tried: &[u64]) -> Result<InFlightPermit> {
        let info = inspect(&request.body)?;
        let model = info.model.as_deref();
        let ctx =
            SelectCtx { role, model, affinity: affinity(&request.headers, info.body_affinity()), prompt: info.prompt };
        let policy = self.policies.for_request(role, model);
        select_excluding(&self.registry.load(), &ctx, policy.as_ref(), Some(&self.admission), tried)
    }

    /// Waits in the queue until a node with room takes the request, or the wait times out.
    /// The request is queued on entry; every round first tries to select (a slot freed just
    /// before the request queued would otherwise wake nobody), then waits for a wake.
    async fn wait_for_permit(
        &self,
        mut ticket: Ticket,
        body: &[u8],
        headers: &[(Vec<u8>, Vec<u8>)],
        role: Role,
    ) -> Result<InFlightPermit> {
        // Records the wait on every way out: served, timed out, failed or cancelled.
        let timer = WaitTimer { admission: &self.admission, since: Instant::now() };
        let deadline = tokio::time::Instant::from_std(timer.since) + self.queue_timeout;
        let info = inspect(body)?;
        let model = info.model.as_deref();
        let ctx = SelectCtx { role, model, affinity: affinity(headers, info.body_affinity()), prompt: info.prompt };
        let policy = self.policies.for_request(role, model);
        loop {
            match select(&self.registry.load(), &ctx, policy.as_ref(), Some(&self.admission)) {
                Ok(permit) => {
                    if !self.admission.leave(ticket.id) {
                        self.admission.pass_on(role);
                    }
                    return Ok(permit);
                }
                Err(e) if e.kind() == Kind::Overloaded => {}
                Err(e) => {
                    if !self.admission.leave(ticket.id) {
                        self.admission.pass_on(role);
                    }
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
                if !self.admission.leave(ticket.id) {
                    self.admission.pass_on(role);
                }
                return Err(Error::new(Kind::Overloaded, "no node had room for the request in time")
                    .with_retry_after(self.admission.retry_after()));
            }
            // Woken and out of the queue: back in at its head before trying again.
            ticket = self.admission.enqueue(role, model, true).expect("the head of the queue is always open");
        }
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

/// Where the task reports: the future to complete (until it is) and the bridge to its loop
/// (twice: one to submit with, one for the `Response`, since `Py` handles are cloned only
/// under the GIL).
struct Reply {
    future: Option<Py<PyAny>>,
    bridge: Py<LoopBridge>,
    bridge_for_response: Option<Py<LoopBridge>>,
}

impl Reply {
    fn fail(&mut self, error: Error) {
        if let Some(future) = self.future.take() {
            self.bridge.get().submit(Box::new(move |py| resolve(py, &future, Err(to_pyerr(&error)))));
        }
    }
}

/// One request's work on the runtime.
struct Job {
    router: Arc<Shared>,
    /// May try another node when the first provably did not run the request.
    retry: bool,
    admitted: Admitted,
    request: ForwardRequest,
    role: Role,
    exchange: Arc<Exchange>,
    timeouts: StreamTimeouts,
}

impl Job {
    async fn run(self, mut reply: Reply, shutdown: CancellationToken) {
        let exchange = Arc::clone(&self.exchange);
        let deadline = self.router.request_timeout.map(|t| tokio::time::Instant::now() + t);
        let out_of_time = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let (kind, message, outcome) = tokio::select! {
            () = self.forward_and_pump(&mut reply) => return,
            () = shutdown.cancelled() => (Kind::Cancelled, "the router is shutting down", Outcome::Cancelled),
            () = out_of_time => (Kind::Timeout, "the request took longer than its time limit", Outcome::Failed),
        };
        exchange.fail(Error::new(kind, message), outcome);
        reply.fail(Error::new(kind, message));
    }

    /// Forwards the request, hands the head to Python, then pumps the body.
    async fn forward_and_pump(self, reply: &mut Reply) {
        let Job { router, retry, admitted, request, role, exchange, timeouts } = self;
        let started = Instant::now();
        let mut permit = match admitted {
            Admitted::Now(permit) => permit,
            Admitted::Queued(ticket) => {
                match router.wait_for_permit(ticket, &request.body, &request.headers, role).await {
                    Ok(permit) => permit,
                    Err(e) => return reply.fail(e),
                }
            }
        };
        router.retry_budget.request();
        let mut tried: Vec<u64> = Vec::new();
        let (node, response) = loop {
            let node = Arc::clone(permit.node());
            exchange.attach(permit);
            let error = match router.forwarder.forward(&node, request.clone()).await {
                // Refused before any work (overloaded or unavailable): another node may take it.
                Ok(response) if matches!(response.status.as_u16(), 429 | 503) => Err(response),
                Ok(response) => break (node, response),
                Err(e) => {
                    if e.is_connect() {
                        node.counters().connect_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    exchange.release(Outcome::Failed, Report::default());
                    Ok(e)
                }
            };
            // Only what provably did not run is retried: a connect failure, or a 429/503 answer.
            let retriable = match &error {
                Ok(e) => e.is_connect(),
                Err(_) => true,
            };
            tried.push(node.generation());
            let next =
                if retry && retriable && tried.len() <= router.max_retries as usize && router.retry_budget.spend() {
                    router.reselect(&request, role, &tried).ok()
                } else {
                    None
                };
            match (next, error) {
                (Some(next), Err(refused)) => {
                    exchange.release(refused.outcome(), Report::default());
                    permit = next;
                }
                (Some(next), Ok(_)) => permit = next,
                (None, Ok(e)) => return reply.fail(e),
                (None, Err(response)) => break (node, response),
            }
        };
        let outcome = response.outcome();
        let UpstreamResponse { status, headers, body } = response;
        let (complete, stream) = match body {
            ResponseBody::Complete(bytes) => {
                exchange.release(outcome, Report::default());
                (Some(bytes), None)
            }
            ResponseBody::Streaming(stream) => (None, Some(stream)),
        };
        let for_python = stream.is_some().then(|| Arc::clone(&exchange));
        let bridge_for_response = reply.bridge_for_response.take();
        if let Some(future) = reply.future.take() {
            reply.bridge.get().submit(Box::new(move |py| {
                let head = Head { status, headers: &headers, node: node.url(), complete: complete.as_deref() };
                let built = bridge_for_response
                    .ok_or_else(|| PyRuntimeError::new_err("response built twice"))
                    .and_then(|bridge| Response::build(py, &head, for_python, bridge))
                    .and_then(|r| Ok(Py::new(py, r)?.into_any()));
                resolve(py, &future, built);
            }));
        }
        if let Some(stream) = stream {
            pump(&exchange, stream, started, timeouts, outcome).await;
        }
    }
}

/// Cancels the upstream request when the forward future is cancelled.
#[pyclass(frozen)]
struct AbortOnCancel(Arc<Exchange>);

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0(pyo3::intern!(future.py(), "cancelled"))?.is_truthy()? {
            drop(self.0.close());
        }
        Ok(())
    }
}

fn node_stats<'py>(py: Python<'py>, node: &Arc<Node>) -> PyResult<Bound<'py, PyDict>> {
    let c = node.counters().snapshot();
    let stats = PyDict::new(py);
    stats.set_item("url", node.url())?;
    stats.set_item("generation", node.generation())?;
    stats.set_item("role", node.role().name())?;
    stats.set_item("models", node.models())?;
    stats.set_item("speed", node.speed())?;
    stats.set_item("has_api_key", node.spec().api_key.is_some())?;
    stats.set_item("state", c.state)?;
    stats.set_item("circuit", c.circuit)?;
    stats.set_item("max_concurrency", c.max_concurrency)?;
    stats.set_item("in_flight", c.in_flight)?;
    stats.set_item("requests", c.requests)?;
    stats.set_item("succeeded", c.succeeded)?;
    stats.set_item("failed", c.failed)?;
    stats.set_item("connect_failures", c.connect_failures)?;
    stats.set_item("cancelled", c.cancelled)?;
    stats.set_item("events", c.events)?;
    #[allow(clippy::cast_precision_loss)] // microsecond sums stay far below 2^52
    let mean = (c.succeeded > 0).then(|| c.latency_us_sum as f64 / c.succeeded as f64 / 1e6);
    stats.set_item("mean_latency", mean)?;
    stats.set_item("recent_latency", c.recent_latency_us.map(|us| us / 1e6))?;
    stats.set_item(
        "recent_latencies",
        node.counters().recent_latencies().iter().map(|us| us / 1e6).collect::<Vec<_>>(),
    )?;
    stats.set_item("recent_latency_per_token", c.recent_latency_per_event_us.map(|us| us / 1e6))?;
    stats.set_item("mean_ttft", c.mean_ttft_us.map(|us| us / 1e6))?;
    stats.set_item("ttft_ewma", c.ttft_us_ewma.map(|us| us / 1e6))?;
    let histograms = PyDict::new(py);
    let counters = node.counters();
    for (name, snapshot) in [
        ("duration", counters.duration.snapshot()),
        ("ttft", counters.ttft.snapshot()),
        ("itl", counters.itl.snapshot()),
    ] {
        histograms.set_item(name, histogram_dict(py, snapshot)?)?;
    }
    stats.set_item("histograms", histograms)?;
    Ok(stats)
}

/// A histogram as Python sees it: `bounds`, per-bucket `counts` (+Inf last), `sum`, `count`.
fn histogram_dict(py: Python<'_>, snapshot: HistogramSnapshot) -> PyResult<Bound<'_, PyDict>> {
    let h = PyDict::new(py);
    h.set_item("bounds", snapshot.bounds)?;
    h.set_item("counts", snapshot.counts)?;
    h.set_item("sum", snapshot.sum)?;
    h.set_item("count", snapshot.count)?;
    Ok(h)
}

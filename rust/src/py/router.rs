//! `Router`: the engine (node table, selection, admission, forwarding) as one Python object.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use http::Method;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tokio_util::sync::CancellationToken;

use super::bridge::{resolve, LoopBridge};
use super::config::RouterConfig;
use super::distserve::{DistServeCore, DistServeSettings};
use super::node::{record_dict, HistogramView, NodeAddressRules, NodeRecord, NodeView};
use super::response::{Head, Response};
use super::shared::SharedTable;
use super::tenants::{limited_to_pyerr, tenant_dict, TenantEntry, TenantTicket};
use super::trace::{traced, Trace};
use crate::bridge::exchange::{pump, Exchange, StreamTimeouts};
use crate::bridge::runtime;
use crate::clock::now_ms;
use crate::engine::{select_ctx, Admitted, Engine};
use crate::error::{Error, Kind};
use crate::headers::header_map;
use crate::inspect::{inspect, patch};
use crate::memory;
use crate::node::engine_report::EngineFigures;
use crate::node::registry::Registry;
use crate::node::Outcome;
use crate::node::{Node, NodeState, NodeUrl, Role};
use crate::observe::trace::{OpenSpan, Trace as RequestTrace};
use crate::select::kv_index::{ChatTemplate, Detokenizer, KvIndex, Stored};
use crate::select::SelectCtx;
use crate::tenants::Class;
use crate::tenants::{estimate_tokens, TenantPass, TenantSpec};
use crate::upstream::forward::{ResponseBody, UpstreamResponse};
use crate::upstream::ForwardRequest;

#[pyclass(frozen, name = "Router", module = "pdproxy._pdproxy")]
pub(crate) struct Router {
    pub(crate) engine: Arc<Engine>,
    pub(crate) runtime: &'static tokio::runtime::Runtime,
    /// Ends every task of this router when it closes.
    pub(crate) shutdown: CancellationToken,
    /// The event loop this router serves, bound on first use.
    bridge: OnceLock<Py<LoopBridge>>,
}

fn role_of(raw: &str) -> PyResult<Role> {
    Ok(Role::parse(raw)?)
}

/// A chat template's five parts, as `kv_events.chat_template` gives them: what starts a
/// prompt, what comes before and after each message's role, what ends a message, and what asks
/// for the answer.
type TemplateParts = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);

#[pymethods]
impl Router {
    /// `group`: the worker group's shared table and this worker's index in it.
    #[new]
    #[pyo3(signature = (config, group=None))]
    fn new(config: RouterConfig, group: Option<(PyRef<'_, SharedTable>, usize)>) -> PyResult<Self> {
        let engine_config = config.engine_config()?;
        // Built on first use; the first router's thread count wins.
        let runtime =
            runtime::get(config.limits.runtime_threads).map_err(|e| PyRuntimeError::new_err(e.message().to_owned()))?;
        let registry = match group {
            Some((table, worker)) => Registry::in_group(Arc::clone(&table.inner), worker),
            None => Registry::new(),
        };
        let engine = Arc::new(Engine::new(engine_config, registry));
        let shutdown = CancellationToken::new();
        runtime.spawn(keep_swept(Arc::downgrade(&engine), shutdown.clone()));
        Ok(Self { engine, runtime, shutdown, bridge: OnceLock::new() })
    }

    /// This proxy's id, as the requests it sends carry it in `x-pdproxy-via`.
    #[getter]
    fn instance_id(&self) -> &str {
        self.engine.instance()
    }

    /// The routing policy of each role (and per-model overrides, as `model:NAME`).
    #[getter]
    fn policies(&self) -> Vec<(String, &'static str)> {
        self.engine.policies().names()
    }

    /// Adds a node (or updates a registered one) from its record, in one call: the URL parsed
    /// once, every rule checked once, the host resolved and its addresses checked by `rules`
    /// (with the GIL released: call it off the event loop), the node registered. Returns the
    /// node's view and whether it is new. `address` (`HOST:PORT`): where to connect, instead
    /// of resolving the URL's host (then `rules` are not applied). `end_drain`: a draining node
    /// takes requests again (its lease was renewed).
    #[pyo3(signature = (record, address=None, rules=None, end_drain=false))]
    fn add_node(
        &self,
        py: Python<'_>,
        record: NodeRecord,
        address: Option<&str>,
        rules: Option<Bound<'_, NodeAddressRules>>,
        end_drain: bool,
    ) -> PyResult<(NodeView, bool)> {
        let (url, mut spec) = record.checked(address)?;
        if let (None, Some(rules)) = (address, &rules) {
            let rules = &rules.get().rules;
            spec.address = Some(py.detach(|| rules.resolve(&url))?);
        }
        let (node, created) = self.engine.add_parsed(&url, spec)?;
        if end_drain && !created && node.counters().state() == NodeState::Draining {
            node.counters().set_state(NodeState::Healthy);
        }
        Ok((NodeView::of(&node, self.engine.config.engine_max_age_ms), created))
    }

    /// One node's view (`NodeView`). Raises `NodeNotFound`.
    fn view(&self, url: &str) -> PyResult<NodeView> {
        Ok(NodeView::of(&self.lookup(url)?, self.engine.config.engine_max_age_ms))
    }

    /// Every node's view, in the table's order.
    fn views(&self) -> Vec<NodeView> {
        let max_age_ms = self.engine.config.engine_max_age_ms;
        self.engine.registry.load().nodes().iter().map(|node| NodeView::of(node, max_age_ms)).collect()
    }

    /// One node: its record (API key included), state, circuit and requests in flight.
    fn node<'py>(&self, py: Python<'py>, url: &str) -> PyResult<Bound<'py, PyDict>> {
        let node = self.lookup(url)?;
        let out = record_dict(py, &node)?;
        let counters = node.counters().snapshot();
        out.set_item("state", counters.state)?;
        out.set_item("circuit", counters.circuit)?;
        out.set_item("in_flight", counters.in_flight)?;
        Ok(out)
    }

    /// Replaces the models of a registered node, keeping everything else; returns its view.
    fn set_models(&self, url: &str, models: Vec<String>) -> PyResult<NodeView> {
        let node = self.engine.registry.update(url, |spec| spec.models = models)?;
        Ok(NodeView::of(&node, self.engine.config.engine_max_age_ms))
    }

    /// In a worker group: rebinds nodes whose shared slot another worker retired (it removed
    /// and re-added the URL). Returns how many were rebound.
    fn refresh_bindings(&self) -> PyResult<usize> {
        Ok(self.engine.registry.refresh_bindings()?)
    }

    fn remove_node(&self, url: &str) -> PyResult<String> {
        let node = self.engine.registry.remove(url)?;
        Ok(node.url().to_owned())
    }

    /// Sets whether a node takes new requests: `healthy`, `unhealthy`, `draining` or
    /// `sleeping`. Only healthy nodes are selected.
    fn set_node_state(&self, url: &str, state: &str) -> PyResult<()> {
        let state = NodeState::parse(state)?;
        self.lookup(url)?.counters().set_state(state);
        Ok(())
    }

    /// Records what a node's engine reported about itself (read from its `/metrics`); policies
    /// use it until it is older than `engine_metrics_max_age`.
    #[pyo3(signature = (url, running, waiting, kv_usage=None, prompt_tokens=None, cached_tokens=None, kv_capacity_tokens=None, transferred_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn record_engine_report(
        &self,
        url: &str,
        running: u64,
        waiting: u64,
        kv_usage: Option<f64>,
        prompt_tokens: Option<u64>,
        cached_tokens: Option<u64>,
        kv_capacity_tokens: Option<u64>,
        transferred_tokens: Option<u64>,
    ) -> PyResult<()> {
        if kv_usage.is_some_and(|u| !u.is_finite()) {
            return Err(PyValueError::new_err(format!("kv_usage must be a finite number, got {kv_usage:?}")));
        }
        let node = self.lookup(url)?;
        let c = node.counters();
        let figures = EngineFigures {
            running,
            waiting,
            kv_usage,
            prompt_tokens,
            cached_tokens,
            kv_capacity_tokens,
            transferred_tokens,
        };
        c.record_engine_report(&figures, now_ms());
        Ok(())
    }

    /// Marks that a reading of a node's engine metrics is being asked for: the next
    /// `record_engine_report` then tells the requests the engine had that pdproxy cannot have
    /// sent (another replica's, or traffic that bypasses pdproxy).
    fn engine_reading_asked(&self, url: &str) -> PyResult<()> {
        self.lookup(url)?.counters().engine_reading_asked();
        Ok(())
    }

    /// The node's engine flushed its prefix cache (`POST /flush_cache`, or a flush sent to it
    /// directly): what the policies learnt it holds is void.
    fn cache_flushed(&self, url: &str) -> PyResult<()> {
        self.lookup(url)?.counters().engine.flushed();
        Ok(())
    }

    /// Counts a failed reading of a node's engine metrics.
    fn record_engine_failure(&self, url: &str) -> PyResult<()> {
        self.lookup(url)?.counters().engine.record_failure();
        Ok(())
    }

    /// Starts pricing cache hits from the engines' KV events: block token ids decode through
    /// `vocabulary` (each id's bytes) or, without one, as `token_width` little-endian bytes each
    /// (the mock engine's tokenizer); chat prompts render through `template` (see
    /// `TemplateParts`); at most `max_blocks` blocks are kept.
    #[pyo3(signature = (template, max_blocks, vocabulary=None, token_width=None))]
    fn start_kv_index(
        &self,
        template: TemplateParts,
        max_blocks: usize,
        vocabulary: Option<Vec<Vec<u8>>>,
        token_width: Option<usize>,
    ) -> PyResult<()> {
        let detokenizer = match (vocabulary, token_width) {
            (Some(vocabulary), None) => Detokenizer::Table(vocabulary.into_iter().map(Vec::into_boxed_slice).collect()),
            (None, Some(width)) if (1..=8).contains(&width) => Detokenizer::FixedWidth(width),
            _ => return Err(PyValueError::new_err("give a vocabulary, or a token width of 1 to 8 bytes")),
        };
        let (start, before_role, after_role, end, generation) = template;
        let template = ChatTemplate { start, before_role, after_role, end, generation };
        self.engine.set_kv_index(Some(Arc::new(KvIndex::new(detokenizer, template, max_blocks))));
        Ok(())
    }

    fn stop_kv_index(&self) {
        self.engine.set_kv_index(None);
    }

    /// A `BlockStored` event of `node`'s rank `rank` (see `kv_index::Stored`).
    fn kv_stored(
        &self,
        node: &str,
        rank: u32,
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u64>,
        block_size: usize,
    ) -> PyResult<()> {
        let index = self.kv_index()?;
        index.stored(
            node,
            rank,
            Stored { hashes: &hashes, parent, token_ids: &token_ids, block_size: block_size.max(1) },
        );
        Ok(())
    }

    fn kv_removed(&self, node: &str, rank: u32, hashes: Vec<u64>) -> PyResult<()> {
        self.kv_index()?.removed(node, rank, &hashes);
        Ok(())
    }

    /// Everything `node`'s rank held is gone or no longer known.
    fn kv_cleared(&self, node: &str, rank: u32) -> PyResult<()> {
        self.kv_index()?.cleared(node, rank);
        Ok(())
    }

    fn kv_live(&self, node: &str, rank: u32, live: bool) -> PyResult<()> {
        self.kv_index()?.set_live(node, rank, live);
        Ok(())
    }

    fn kv_forget_node(&self, node: &str) -> PyResult<()> {
        self.kv_index()?.forget_node(node);
        Ok(())
    }

    /// What each of `nodes` holds of a request's prompt (its raw `messages` or `prompt` JSON),
    /// in tokens: `None` for a node the index is not live for, or for every node when the
    /// prompt cannot be rendered.
    fn kv_matched(&self, prompt: &[u8], nodes: Vec<String>) -> PyResult<Vec<Option<u64>>> {
        let urls: Vec<&str> = nodes.iter().map(String::as_str).collect();
        Ok(match self.kv_index()?.matched_request(prompt, &urls) {
            Some(found) => found.into_iter().map(|m| m.map(|m| m.tokens)).collect(),
            None => vec![None; nodes.len()],
        })
    }

    /// The index's figures: `blocks`, `evicted`, `used` and `fell_back` (candidates priced from
    /// it, and from the table because it was not live for them), and per stream `(node, rank,
    /// blocks, events, orphans, unknown_tokens, live)`.
    fn kv_index_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let index = self.kv_index()?;
        let out = PyDict::new(py);
        out.set_item("blocks", index.len())?;
        out.set_item("evicted", index.evicted())?;
        out.set_item("used", index.used.load(Ordering::Relaxed))?;
        out.set_item("fell_back", index.fell_back.load(Ordering::Relaxed))?;
        let streams: Vec<_> = index
            .streams()
            .into_iter()
            .map(|s| (s.node, s.rank, s.blocks, s.events, s.orphans, s.unknown_tokens, s.live))
            .collect();
        out.set_item("streams", streams)?;
        Ok(out)
    }

    /// Sets (or with `None` lifts) a node's hard cap on requests in flight.
    fn set_max_concurrency(&self, url: &str, max_concurrency: Option<u32>) -> PyResult<()> {
        // Through the spec, so that later updates of the node (discovery) keep the cap.
        self.engine.registry.update(url, |spec| spec.max_concurrency = max_concurrency.filter(|&m| m > 0))?;
        Ok(())
    }

    /// Models served by the registered nodes, deduplicated.
    fn models(&self) -> Vec<String> {
        self.engine.registry.load().models().into_iter().map(str::to_owned).collect()
    }

    /// Requests waiting for a node with room.
    #[getter]
    fn queued(&self) -> usize {
        self.engine.admission.queued()
    }

    /// How long requests waited in the queue for a node with room (those that queued).
    fn queue_wait(&self) -> HistogramView {
        self.engine.admission.waited.snapshot().into()
    }

    /// Retries taken since the start.
    #[getter]
    fn retries(&self) -> u64 {
        self.engine.retry_budget.total()
    }

    /// Requests received per model (`other`: a model no node declares; `none`: no model).
    fn model_requests(&self) -> HashMap<String, u64> {
        self.engine.registry.model_requests().into_iter().collect()
    }

    /// Counts one inference request into the proxy's gate. Raises `Draining` while the proxy
    /// drains and `ProxyOverloaded` at `max_requests`; call `leave_request` when it is done.
    fn enter_request(&self) -> PyResult<()> {
        self.engine
            .gate
            .enter()
            .map_err(|refusal| super::errors::refusal_to_pyerr(refusal, self.engine.gate.max_requests()))
    }

    fn leave_request(&self) {
        self.engine.gate.leave();
    }

    /// Inference requests being served now, by any side of the proxy.
    #[getter]
    fn serving(&self) -> usize {
        self.engine.gate.serving()
    }

    /// Stops taking new inference requests (they get 503 `draining`).
    fn start_draining(&self) {
        self.engine.gate.start_draining();
    }

    #[getter]
    fn draining(&self) -> bool {
        self.engine.gate.draining()
    }

    /// The node the policy would choose now, without sending anything or taking a permit.
    #[pyo3(signature = (model=None, role="hybrid", affinity=None))]
    fn select(&self, model: Option<&str>, role: &str, affinity: Option<&str>) -> PyResult<String> {
        let ctx = SelectCtx { role: role_of(role)?, model, affinity, ..SelectCtx::default() };
        let node = self.engine.choose(&ctx)?;
        Ok(node.url().to_owned())
    }

    /// The canonical URL of a node record, once every rule of the node table holds for it.
    /// Raises `InvalidNode` for a node the table would refuse, without adding it.
    #[staticmethod]
    fn check_node(record: NodeRecord) -> PyResult<String> {
        Ok(record.checked(None)?.0.normalized)
    }

    /// The canonical form of a node URL (scheme and host lower-cased, no trailing slash).
    #[staticmethod]
    fn normalize_url(url: &str) -> PyResult<String> {
        Ok(NodeUrl::parse(url)?.normalized)
    }

    /// Refuses (`InvalidRequest`, naming the field) a body whose numbers would size the proxy's
    /// own work past its settings: `n` and `best_of` past `max_n`. `forward` checks it too; a
    /// flow that builds on the body first checks it before.
    fn check_asks(&self, body: &[u8]) -> PyResult<()> {
        let info = inspect(body)?;
        Ok(self.engine.check_asks(&info)?)
    }

    /// The routing fields of a request body: `model`, `stream`, `n`, `best_of`, `user`,
    /// `session_id`, `max_tokens`.
    #[staticmethod]
    fn inspect<'py>(py: Python<'py>, body: &[u8]) -> PyResult<Bound<'py, PyDict>> {
        let info = inspect(body)?;
        let out = PyDict::new(py);
        out.set_item("model", info.model.as_deref())?;
        out.set_item("stream", info.stream)?;
        out.set_item("n", info.n)?;
        out.set_item("best_of", info.best_of)?;
        out.set_item("user", info.user.as_deref())?;
        out.set_item("session_id", info.session_id.as_deref())?;
        out.set_item("max_tokens", info.max_tokens)?;
        Ok(out)
    }

    /// The raw JSON text of a top-level member of `body` (`None` when absent), so that it can
    /// be passed on byte for byte.
    #[staticmethod]
    fn member(body: &[u8], key: &str) -> PyResult<Option<String>> {
        Ok(crate::inspect::member(body, key)?.map(str::to_owned))
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
        let out = patch(body, &set, &remove)?;
        Ok(PyBytes::new(py, &out))
    }

    /// Selects a node for the request in `body` and forwards it. Returns a future of the
    /// running loop that resolves to a `Response` once the node's response head has arrived;
    /// cancelling it cancels the upstream request. When every candidate is at its cap the
    /// request waits in the queue first.
    #[pyo3(signature = (path, body, headers=Vec::new(), method="POST", role="hybrid", node=None, trace=None, tenant=None))]
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
        trace: Option<PyRef<'_, Trace>>,
        tenant: Option<PyRef<'_, TenantTicket>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid HTTP method {method:?}")))?;
        let role = role_of(role)?;
        if self.shutdown.is_cancelled() {
            return Err(PyRuntimeError::new_err("this Router is closed"));
        }
        let bridge = self.bridge(py)?;
        let body = Bytes::copy_from_slice(body);
        let headers = header_map(&headers);
        let info = inspect(&body)?;
        self.engine.check_asks(&info)?;
        let place = trace.map(|t| t.place());
        let class = tenant.as_ref().map_or(Class { priority: info.priority.unwrap_or(0), tenant: 0 }, |t| t.class);
        // A prefill's answer is not the client's: only the other legs count tokens.
        let meter = tenant.filter(|_| role != Role::Prefill).map(|t| Arc::clone(&t.pass));
        let admitted = if let Some(url) = node {
            self.engine.registry.load().count_request(info.model.as_deref());
            Admitted::Now(self.engine.admit_on(url)?)
        } else {
            let trace = place.as_ref().map(|(trace, span)| traced(trace, span.as_ref()));
            let ctx = SelectCtx { class, trace, ..select_ctx(role, &headers, &info) };
            self.engine.admit(&ctx)?
        };
        drop(info);

        let future = bridge.get().create_future(py)?;
        let exchange = Arc::new(Exchange::new(self.engine.config.forward.stream_buffer_limit));
        let reply = Reply {
            future: Some(future.clone().unbind()),
            bridge: bridge.clone_ref(py),
            bridge_for_response: Some(bridge),
        };
        let job = Job {
            engine: Arc::clone(&self.engine),
            retry: node.is_none(),
            admitted,
            request: ForwardRequest { method, path_and_query: path, headers, extra: Vec::new(), body },
            role,
            exchange: Arc::clone(&exchange),
            trace: place,
            class,
            meter,
        };
        let shutdown = self.shutdown.clone();
        let task = self.runtime.spawn(async move { job.run(reply, shutdown).await });
        exchange.set_task(task.abort_handle());
        future.call_method1(pyo3::intern!(py, "add_done_callback"), (AbortOnCancel(exchange),))?;
        Ok(future)
    }

    /// Starts LMDeploy DistServe's flow: its requests read their links and keep their sessions
    /// in the returned core; `connect(prefill, decode, done)` is asked, on this loop, for a
    /// pair that is not connected.
    fn start_distserve(
        &self,
        py: Python<'_>,
        settings: DistServeSettings,
        connect: Py<PyAny>,
    ) -> PyResult<DistServeCore> {
        let bridge = self.bridge(py)?;
        DistServeCore::start(py, &self.engine, self.runtime, bridge, settings, connect)
    }

    /// Replaces the tenants with the tenants file's entries (a tenant kept by name keeps its
    /// window and counts).
    fn set_tenants(&self, entries: Vec<TenantEntry>) {
        let specs: Vec<TenantSpec> = entries.into_iter().map(Into::into).collect();
        self.engine.tenants.set(&specs);
    }

    /// Whether tenants are configured (then inference needs a tenant's key or an API key).
    #[getter]
    fn tenants_configured(&self) -> bool {
        self.engine.tenants.configured()
    }

    /// Whether `key` is a tenant's.
    fn tenant_key_known(&self, key: &[u8]) -> bool {
        self.engine.tenants.by_key(key).is_some()
    }

    /// Admits a request by its key's tenant: its queue class (the body's `priority`, else
    /// `priority`, bounded by the tenant), and the tenant's pass. Raises `RateLimited` (or
    /// `QuotaExceeded`) when the tenant is over a limit.
    #[pyo3(signature = (key, body, priority=None))]
    fn admit_tenant(&self, key: Option<&[u8]>, body: &[u8], priority: Option<i32>) -> PyResult<TenantTicket> {
        let info = inspect(body)?;
        let asked = info.priority.or(priority);
        let tenant = key.filter(|_| self.engine.tenants.configured()).and_then(|k| self.engine.tenants.by_key(k));
        let Some(tenant) = tenant else {
            return Ok(TenantTicket::new(None, Class { priority: asked.unwrap_or(0), tenant: 0 }));
        };
        let estimate = estimate_tokens(info.prompt.map_or(0, <[u8]>::len));
        let pass = tenant.admit(estimate, asked).map_err(|limited| limited_to_pyerr(&limited))?;
        let class = pass.class;
        Ok(TenantTicket::new(Some(pass), class))
    }

    /// Every tenant: limits, current window, tokens today, requests in flight and counts.
    fn tenants<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for tenant in self.engine.tenants.all() {
            list.append(tenant_dict(py, &tenant)?)?;
        }
        Ok(list)
    }

    /// Each tenant's requests and tokens here since the last call (for the replicas' sync).
    fn take_tenant_usage(&self) -> Vec<(String, u64, u64)> {
        self.engine
            .tenants
            .all()
            .iter()
            .map(|t| {
                let (requests, tokens) = t.take_local();
                (t.name.clone(), requests, tokens)
            })
            .collect()
    }

    /// Debits what other replicas used since the last sync from tenant `name`'s window.
    fn absorb_tenant_usage(&self, name: &str, requests: u64, tokens: u64) {
        if let Some(tenant) = self.engine.tenants.by_name(name) {
            tenant.absorb(requests, tokens);
        }
    }

    /// The trace of a request that came with `traceparent` (the caller's; else a new one), or
    /// `None` when requests are not traced.
    #[pyo3(signature = (traceparent=None))]
    fn trace(&self, traceparent: Option<&[u8]>) -> Option<Trace> {
        let tracer = self.engine.tracer.as_ref()?;
        Some(Trace::root(tracer.begin(traceparent, "pdproxy.request")))
    }

    /// Stops serving: requests in flight end now (their readers get an error) and new ones
    /// are refused. The router leaves its event loop when it is dropped, so that the endings
    /// of those requests still reach their readers.
    fn close(&self, py: Python<'_>) {
        self.shutdown.cancel();
        if let Some(tracer) = &self.engine.tracer {
            // The last requests' spans go out before the process ends.
            py.detach(|| tracer.flush(std::time::Duration::from_secs(2)));
        }
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

impl Router {
    fn kv_index(&self) -> PyResult<Arc<KvIndex>> {
        self.engine.kv_index().ok_or_else(|| PyRuntimeError::new_err("the KV index is not started"))
    }

    fn lookup(&self, url: &str) -> PyResult<Arc<Node>> {
        Ok(self.engine.node(url)?)
    }

    /// The bridge to the running loop; the first call binds the router to it.
    pub(crate) fn bridge(&self, py: Python<'_>) -> PyResult<Py<LoopBridge>> {
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
            self.bridge.get().submit(Box::new(move |py| resolve(py, &future, Err(error.into()))));
        }
    }
}

/// One request's work on the runtime.
struct Job {
    engine: Arc<Engine>,
    /// May try another node when the first provably did not run the request.
    retry: bool,
    admitted: Admitted,
    request: ForwardRequest,
    role: Role,
    exchange: Arc<Exchange>,
    /// The request's trace and the span its parts go under (the root when `None`).
    trace: Option<(Arc<RequestTrace>, Option<OpenSpan>)>,
    class: Class,
    /// The tenant's pass that counts the answer's tokens.
    meter: Option<Arc<Mutex<Option<TenantPass>>>>,
}

impl Job {
    async fn run(self, mut reply: Reply, shutdown: CancellationToken) {
        let exchange = Arc::clone(&self.exchange);
        let deadline = self.engine.config.deadline(std::time::Instant::now());
        let out_of_time = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let (kind, message, outcome) = tokio::select! {
            // First: at the deadline, a node still owing its head fails the request in `send`.
            biased;
            () = self.forward_and_pump(&mut reply, deadline) => return,
            () = shutdown.cancelled() => (Kind::Cancelled, "the router is shutting down", Outcome::Cancelled),
            () = out_of_time => (Kind::Timeout, "the request took longer than its time limit", Outcome::Failed),
        };
        exchange.fail(Error::new(kind, message), outcome);
        reply.fail(Error::new(kind, message));
    }

    /// Forwards the request, hands the head to Python, then pumps the body.
    async fn forward_and_pump(self, reply: &mut Reply, deadline: Option<tokio::time::Instant>) {
        let Job { engine, retry, admitted, request, role, exchange, trace, class, meter } = self;
        let started = Instant::now();
        // Parsed again here: the request's fields borrow from its body, which this task owns.
        let Ok(info) = inspect(&request.body) else {
            return reply.fail(Error::new(Kind::InvalidRequest, "invalid body"));
        };
        let traced = trace.as_ref().map(|(trace, span)| traced(trace, span.as_ref()));
        let ctx = SelectCtx { trace: traced, class, ..select_ctx(role, &request.headers, &info) };
        let permit = match admitted {
            Admitted::Now(permit) => permit,
            Admitted::Queued(queued) => match engine.wait_for_permit(queued, &ctx).await {
                Ok(permit) => permit,
                Err(e) => return reply.fail(e),
            },
        };
        // Small answers cross into Python whole, with the head.
        let sent = match engine.send(&engine.forwarder, permit, &request, &ctx, retry, true, deadline).await {
            Ok(sent) => sent,
            Err(e) => return reply.fail(e),
        };
        let node = Arc::clone(sent.node());
        let crate::engine::Sent { mut permit, response } = sent;
        let outcome = response.outcome();
        let UpstreamResponse { status, headers, body } = response;
        let mut observe = |chunk: &[u8], events: u64| {
            if let Some(pass) = meter.as_ref().and_then(|m| m.lock().ok()).as_mut().and_then(|p| p.as_mut()) {
                pass.meter.observe(chunk, events);
            }
        };
        if status.is_server_error() {
            if let Some(pass) = meter.as_ref().and_then(|m| m.lock().ok()).as_mut().and_then(|p| p.as_mut()) {
                pass.fail();
            }
        }
        let (complete, stream) = match body {
            ResponseBody::Complete(bytes) => {
                observe(&bytes, 0);
                permit.answered_whole(&bytes);
                permit.set_outcome(outcome);
                drop(permit);
                (Some(bytes), None)
            }
            ResponseBody::Streaming(stream) => {
                // Held by the exchange from here, so that Python closing it releases it at once.
                exchange.attach(permit);
                (None, Some(stream))
            }
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
            let config = &engine.config.forward;
            let timeouts = StreamTimeouts { idle: config.stream_idle_timeout, stall: config.stream_stall_timeout };
            pump(&exchange, stream, started, timeouts, outcome, &mut observe).await;
        }
    }
}

/// Sweeps the engine's pool of node connections until the router closes or is gone.
/// Every few sweeps, it also hands the allocator's free pages back to the system.
async fn keep_swept(engine: std::sync::Weak<Engine>, shutdown: CancellationToken) {
    let mut sweeps = 0u32;
    loop {
        let Some(every) = engine.upgrade().map(|e| e.forwarder.sweep_interval()) else { return };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let Some(engine) = engine.upgrade() else { return };
        engine.forwarder.sweep(&engine.registry);
        sweeps = sweeps.wrapping_add(1);
        if sweeps % memory::COLLECT_EVERY_SWEEPS == 0 {
            memory::return_free_pages();
        }
    }
}

/// Cancels the upstream request when the forward future is cancelled.
#[pyclass(frozen)]
pub(crate) struct AbortOnCancel(pub(crate) Arc<Exchange>);

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0(pyo3::intern!(future.py(), "cancelled"))?.is_truthy()? {
            drop(self.0.close());
        }
        Ok(())
    }
}

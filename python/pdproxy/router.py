"""``Router``: pdproxy's routing core, embeddable in any asyncio program.

    async with pdproxy.Router(nodes=["http://127.0.0.1:8001"]) as router:
        response = await router.forward("/v1/chat/completions", body)
        async for chunk in response:
            ...

Selection, in-flight accounting and forwarding run in the Rust data plane; this class adds
model discovery and the lifecycle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

from . import _pdproxy
from ._json_types import JsonObject
from .config.checks import checked
from .config.settings import Settings
from .errors import NoNodeAvailable
from .fleet.model_cards import merged_card
from .fleet.model_discovery import ModelDiscovery
from .fleet.node_record import NodeRecord, configured_nodes
from .fleet.node_snapshot import Histogram, NodeSnapshot, histogram, node_snapshot

if TYPE_CHECKING:
    from ._pdproxy import NodeAddressRules, NodeInfo, NodeView, RoutingFields

__all__ = ["NodeSummary", "Router", "RouterStats"]

Headers = Sequence[tuple[bytes, bytes]]


class NodeSummary(TypedDict):
    """A node as a person reads it first (``Router.summary()``)."""

    url: str
    role: str
    state: str
    models: list[str]
    in_flight: int
    requests: int
    succeeded: int
    failed: int
    #: Seconds (None until a request has succeeded).
    mean_latency: float | None


class RouterStats(TypedDict):
    """Nodes, queue and policies in one snapshot (``Router.stats()``)."""

    nodes: list[NodeSnapshot]
    queued: int
    policies: dict[str, str]


class Router:
    """Routes OpenAI-style requests to a set of nodes.

    Args:
        nodes: nodes (base URLs, optionally with ``,key=value`` pairs as ``--node`` takes them),
            added to those in ``settings.routing.nodes``.
        settings: the configuration; keyword ``overrides`` replace single fields of it.
    """

    def __init__(
        self,
        nodes: Iterable[str] = (),
        *,
        settings: Settings | None = None,
        group: tuple[_pdproxy.SharedTable, int] | None = None,
        **overrides: object,
    ) -> None:
        base = settings or Settings()
        self.settings = checked(base.replace(**overrides) if overrides else base)
        # In a worker group (`pdproxy serve --workers N`), the nodes' counters live in the
        # group's shared table, as this worker's index.
        self._core = _pdproxy.Router(self.settings, group)
        self._discovery = ModelDiscovery(
            self._core,
            self.settings.timeouts.discovery,
            self.settings.timeouts.discovery_interval,
            self.settings.security.node_ca_file,
        )
        for record in (*configured_nodes(self.settings), *(NodeRecord.parse(n) for n in nodes)):
            self.add(record)

    async def start(self) -> None:
        """Discovers the models of nodes added without a model list (one round, then in the background)."""
        await self._discovery.start()

    async def aclose(self) -> None:
        await self._discovery.aclose()
        self._core.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def policies(self) -> dict[str, str]:
        """The routing policy of each role (``hybrid``, ``prefill``, ``decode``), and per-model
        overrides as ``model:NAME``."""
        return dict(self._core.policies)

    @property
    def core(self) -> _pdproxy.Router:
        """The data plane's router (the Rust edge serves requests with it)."""
        return self._core

    def enter_request(self) -> None:
        """Counts an inference request into the proxy's global gate; raises ``Draining`` while
        the proxy drains and ``ProxyOverloaded`` at ``max_requests``. Pair with ``leave_request``."""
        self._core.enter_request()

    def leave_request(self) -> None:
        self._core.leave_request()

    @property
    def serving(self) -> int:
        """Inference requests being served now, by the edge and the control plane together."""
        return self._core.serving

    def start_draining(self) -> None:
        """New inference requests get 503 ``draining`` from now on."""
        self._core.start_draining()

    @property
    def queued(self) -> int:
        """Requests waiting for a node with room."""
        return self._core.queued

    def queue_wait(self) -> Histogram:
        """How long queued requests waited (a histogram: ``bounds`` in seconds, per-bucket
        ``counts`` with +Inf last, ``sum``, ``count``)."""
        return histogram(self._core.queue_wait())

    @property
    def retries(self) -> int:
        """Requests retried on another node since the start."""
        return self._core.retries

    def model_requests(self) -> dict[str, int]:
        """Requests received per model (``other``: a model no node declares)."""
        return self._core.model_requests()

    def add_node(self, url: str, models: Sequence[str] | None = None, **attributes: object) -> str:
        """Adds a node, or updates a registered one; returns its normalised URL.

        ``attributes`` are those of ``NodeRecord`` (``role``: ``hybrid``, ``prefill`` or
        ``decode``, or LMDeploy's 1, 2, 3; ``speed`` weighs it in ``random`` and
        ``min_expected_latency``; ``max_concurrency`` caps its requests in flight; ``api_key`` is
        sent to it as a Bearer token; ``bootstrap_port``: an SGLang prefill node's bootstrap
        port; ``labels``) and ``add``'s ``address`` and ``verify``. Raises ``InvalidNode``.
        """
        options = {name: attributes.pop(name) for name in ("address", "verify") if name in attributes}
        fields = {"url": url, "models": None if models is None else list(models), **attributes}
        return self.add(NodeRecord.checked(fields), **options)  # type: ignore[arg-type]

    def add(self, record: NodeRecord, *, address: str | None = None, verify: bool = True) -> str:
        """Adds the node ``record`` describes, or updates it; returns its URL.

        Without ``models`` the node takes no traffic until discovery learns its list; declared
        ``models`` are checked against the node's ``/v1/models`` once (``verify``), and the
        node's answer wins. ``address`` (``HOST:PORT``) is where to connect instead of resolving
        the URL's host."""
        view, _ = self._core.add_node(record, address)
        self._watch(view.url, record.models is None or verify)
        return view.url

    async def register(
        self,
        record: NodeRecord,
        *,
        address: str | None = None,
        rules: NodeAddressRules | None = None,
        end_drain: bool = False,
        verify: bool = True,
    ) -> tuple[NodeView, bool]:
        """``add`` in one call to the data plane that answers with the node's view and whether
        it is new: the record (which may be unchecked) is checked there, and without
        ``address`` its host is resolved and its addresses checked by ``rules`` (off the event
        loop). ``end_drain``: a draining node takes requests again (its lease was renewed)."""
        if address is None and rules is not None:
            view, created = await asyncio.to_thread(self._core.add_node, record, None, rules, end_drain)
        else:
            view, created = self._core.add_node(record, address, None, end_drain)
        self._watch(view.url, record.models is None or verify)
        return view, created

    def _watch(self, url: str, unknown_or_verified: bool) -> None:
        if unknown_or_verified:
            self._discovery.watch(url)
        else:
            self._discovery.forget(url)

    def node(self, url: str) -> NodeInfo:
        """One node: its record (``api_key`` included, ``declared_models`` as registered,
        ``models`` as it serves them), ``state``, ``circuit`` and ``in_flight``. Raises
        ``NodeNotFound``."""
        return self._core.node(url)

    async def discover(self, url: str | None = None) -> NodeView | None:
        """Asks the node (without ``url``: every node) whose models are still unknown for them
        now (one probe each, concurrently, within ``discovery_timeout``). With ``url``: the
        node's view once it told its models (``None`` when it did not)."""
        if url is None:
            await self._discovery.probe_pending(unknown_only=True)
            return None
        return await self._discovery.probe(url)

    def models_unknown_because(self, url: str) -> str | None:
        """Why the node at ``url`` did not tell its models when asked (it takes no traffic until
        it does); ``None`` when it told them, declared them, or was not asked yet."""
        return self._discovery.failures().get(url)

    def refresh_bindings(self) -> int:
        """In a worker group: picks up nodes another worker removed and re-added (their shared
        counters moved); returns how many. Nothing to do outside a group."""
        return self._core.refresh_bindings()

    def remove_node(self, url: str) -> str:
        """Stops routing to a node; its requests in flight run to their end. Raises ``NodeNotFound``."""
        normalized = self._core.remove_node(url)
        self._discovery.forget(normalized)
        return normalized

    def set_node_state(self, url: str, state: str) -> None:
        """``healthy``, ``unhealthy``, ``draining`` or ``sleeping``; only healthy nodes are selected."""
        self._core.set_node_state(url, state)

    def drain_node(self, url: str) -> None:
        """Stops sending new requests to a node; those in flight finish."""
        self._core.set_node_state(url, "draining")

    def set_max_concurrency(self, url: str, max_concurrency: int | None) -> None:
        """Sets (or with ``None`` lifts) a node's hard cap on requests in flight."""
        self._core.set_max_concurrency(url, max_concurrency)

    def cache_flushed(self, url: str) -> None:
        """Tells the policies that a node's engine emptied its prefix cache (a flush sent to it
        directly: ``POST /flush_cache`` through pdproxy tells them itself), so that they forget
        what they learnt it holds rather than wait for its answers to show it."""
        self._core.cache_flushed(url)

    def views(self) -> list[NodeView]:
        """Every node, typed (``_pdproxy.NodeView``), copied at one moment: its record (never the
        key), state, counters, latencies, histograms, and what its engine last reported."""
        return self._core.views()

    def nodes(self) -> list[NodeSnapshot]:
        """The same as ``views()``, as dicts: url, role, models, state, in_flight, counts,
        latencies, histograms, engine."""
        return [node_snapshot(view) for view in self._core.views()]

    def summary(self) -> list[NodeSummary]:
        """Per node, what a person reads first (``nodes()`` has everything, histograms included)."""
        return [
            NodeSummary(
                url=node.url,
                role=node.role,
                state=node.state,
                models=node.models,
                in_flight=node.in_flight,
                requests=node.requests,
                succeeded=node.succeeded,
                failed=node.failed,
                mean_latency=node.mean_latency,
            )
            for node in self.views()
        ]

    def stats(self) -> RouterStats:
        """Nodes, queue and policies in one snapshot."""
        return RouterStats(nodes=self.nodes(), queued=self._core.queued, policies=self.policies)

    def models(self) -> list[str]:
        """The models served by the registered nodes, deduplicated."""
        return self._core.models()

    def model_card(self, model: str) -> JsonObject:
        """OpenAI's ``Model`` for ``model``, with what the healthy nodes serving it said about it
        in their ``/v1/models`` (``max_model_len`` and the rest), merged (see ``fleet.model_cards``)."""
        serving = (n.url for n in self.views() if n.state == "healthy" and model in n.models)
        cards = (self._discovery.card(url, model) for url in serving)
        return merged_card(model, (card for card in cards if card is not None))

    def select(self, model: str | None = None, *, role: str = "hybrid", affinity: str | None = None) -> str:
        """The URL of the node the policy would choose now (nothing is sent or counted)."""
        return self._core.select(model, role, affinity)

    @staticmethod
    def inspect(body: bytes) -> RoutingFields:
        """The routing fields of a request body (model, stream, n, user, session_id, max_tokens)."""
        return _pdproxy.Router.inspect(body)

    @staticmethod
    def patch(body: bytes, set: Mapping[str, object] | None = None, remove: Sequence[str] = ()) -> bytes:
        """A copy of ``body`` with top-level members set (to values ``json.dumps`` encodes) or
        removed; the rest keeps its bytes."""
        members = [(key, json.dumps(value)) for key, value in (set or {}).items()]
        return _pdproxy.Router.patch(body, members, list(remove))

    def forward(
        self,
        path: str,
        body: bytes,
        headers: Headers = (),
        method: str = "POST",
        *,
        role: str = "hybrid",
        node: str | None = None,
        trace: _pdproxy.Trace | None = None,
        tenant: _pdproxy.TenantTicket | None = None,
    ) -> asyncio.Future[_pdproxy.Response]:
        """Routes ``body`` by its ``model`` and sends it to the chosen node.

        Returns a future of the node's ``Response``. Raises at once ``InvalidRequest`` for a
        body that is not a JSON object, ``ModelNotFound`` or ``NoNodeAvailable`` when no node
        can take it, ``Overloaded`` when every node is at its limit and the queue is full; the
        future raises ``UpstreamError`` and its subclasses when the node fails, ``Overloaded``
        when the request waited in the queue too long. Cancelling it cancels the upstream request.
        ``node`` sends it to that node instead of selecting one (it must be healthy and have room).
        ``trace`` (from ``trace()``, or a span of it): the request's admission, selection and
        attempts are recorded under it, and each node gets the attempt's ``traceparent``.
        ``tenant`` (from ``admit``): the request queues at its priority and tenant, and the
        answer's tokens count for the tenant (except a prefill leg's).
        """
        try:
            return self._core.forward(
                path, body, headers if isinstance(headers, list) else list(headers), method, role, node, trace, tenant
            )
        except NoNodeAvailable as e:
            # Nodes whose models are unknown may be why: say which, and what they answered.
            failures = self._discovery.failures()
            if e.detail is None and failures:
                e.detail = "; ".join(f"node {url}: {why}" for url, why in failures.items())
            raise

    def admit(self, key: bytes | None, body: bytes, priority: int | None = None) -> _pdproxy.TenantTicket:
        """A request's admission by its key's tenant: its priority (the body's ``priority``, else
        ``priority``, bounded by the tenant's limit) and the tenant's pass, to give to
        ``forward`` and ``close`` when the request ends. Raises ``RateLimited`` (or
        ``QuotaExceeded``) when the tenant is over a limit."""
        return self._core.admit_tenant(key, body, priority)

    def trace(self, traceparent: bytes | None = None) -> _pdproxy.Trace | None:
        """Opens the trace of a request that came with ``traceparent`` (else a new trace);
        ``None`` when tracing is off (no ``otlp_endpoint``). Its root span is exported when the
        last reference to it goes."""
        return self._core.trace(traceparent)

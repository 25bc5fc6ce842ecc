"""Typed stubs of the data plane extension (Rust, built by maturin)."""

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Literal, Protocol, TypedDict, final, type_check_only

# The data plane reads these by attribute or key (rust/src/py/config.rs, rust/src/py/node.rs,
# rust/src/py/tenants.rs), or answers in their shape (`NodeFields`, for `Router.node`); their
# fields are declared once, in Python.
from .config.settings import Settings
from .fleet.node_record import NodeRecord
from .fleet.node_snapshot import NodeFields
from .server.tenants import TenantEntry, TenantLimits

__version__: str
#: The routing policies the data plane knows, by name (the settings' ``POLICY_KINDS``).
POLICY_NAMES: tuple[str, ...]
#: Every error the proxy answers with, by its exception class's name: (status, type, code,
#: default Retry-After); ``pdproxy.errors`` reads its classes' answers from here.
ERRORS: dict[str, tuple[int, str, str, int | None]]
#: Inference endpoints, routed by the body's model.
INFERENCE_PATHS: tuple[str, ...]
#: The paths each prefill/decode protocol sends through a prefill and a decode node.
PD_PATHS: dict[str, list[str]]

def error_body(message: str, kind: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error envelope every error answer of the proxy carries."""

def client_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request with these headers carries (``Authorization: Bearer KEY``, else
    ``x-api-key: KEY``), as the edge reads it."""

def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The id of a request with these headers: its own ``x-request-id``, else a new one, as the
    edge gives its answers."""

def pd_prefill_body(protocol: str, path: str, body: bytes) -> bytes:
    """The prefill leg's body for ``protocol`` (``lmdeploy``, ``vllm``; ``sglang`` shares one
    body between its legs), from the client's ``body`` sent to ``path``."""

# The shapes of the data plane's answers (dicts built in rust/src/py/). They exist for the type
# checker only: import them under `typing.TYPE_CHECKING`.

@type_check_only
class NodeInfo(NodeFields):
    """One node, as `Router.node(url)` answers: its record with the key, and its state."""

    api_key: str | None
    state: str
    circuit: str
    in_flight: int

@type_check_only
class RoutingFields(TypedDict):
    """The fields of a request body that routing reads."""

    model: str | None
    stream: bool
    n: int | None
    best_of: int | None
    user: str | None
    session_id: str | None
    max_tokens: int | None

@type_check_only
class TenantWindow(TypedDict):
    """The current minute's window of one limit, as `x-ratelimit-*` tell it."""

    limit: int
    remaining: int
    reset_seconds: float

@type_check_only
class TenantSnapshot(TypedDict):
    """One tenant: its limits, its windows (None: no such limit), tokens today and counts."""

    name: str
    limits: TenantLimits
    requests: TenantWindow | None
    tokens: TenantWindow | None
    tokens_today: int
    in_flight: int
    total_requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    estimated: int
    #: Requests refused, by the limit they were over.
    rejected: dict[str, int]

@final
class NodeAddressRules:
    """Where nodes may be: the allowed networks (none: any) and this proxy's own port (a
    local address at that port is the proxy itself). The rules refuse the unspecified
    address, cloud metadata addresses, link-local, multicast and reserved ones, IPv6 forms of
    a refused IPv4 address (mapped, 6to4, Teredo, NAT64), and addresses outside the networks."""

    def __new__(cls, allowed: list[str] = ..., own_port: int | None = None) -> NodeAddressRules:
        """`allowed`: networks as `ADDRESS/PREFIX`. Raises `ValueError` for one that is not."""

    def check(self, record: NodeRecord) -> tuple[str, str]:
        """The canonical URL of `record` and the `HOST:PORT` its host resolves to, once every
        rule holds (as `Router.add_node` checks them). Blocks while the name resolves.

        Raises:
            InvalidNode: a rule is broken.
            NodeUnresolvable: the host does not resolve.
        """

    def check_literal(self, url: str) -> None:
        """Raises `InvalidNode` when the URL's host is an address the rules refuse (a name is
        checked once it resolves, when the node is added)."""

@final
class HistogramReading:
    """A histogram, copied: per-bucket (not cumulative) `counts`, one more than `bounds` (+Inf
    last), in seconds; `sum` and `count` of the observations."""

    @property
    def bounds(self) -> list[float]: ...
    @property
    def counts(self) -> list[int]: ...
    @property
    def sum(self) -> float: ...
    @property
    def count(self) -> int: ...

@final
class LatencyHistograms:
    """A node's histograms: seconds from admission to the end of the body (`duration`), to the
    first byte (`ttft`), and between chunks (`itl`)."""

    @property
    def duration(self) -> HistogramReading: ...
    @property
    def ttft(self) -> HistogramReading: ...
    @property
    def itl(self) -> HistogramReading: ...

@final
class LearntReading:
    """What pdproxy learnt of a node's engine from its answers (None: not yet)."""

    @property
    def prefill_seconds_per_kib(self) -> float | None: ...
    @property
    def first_token_seconds(self) -> float | None: ...
    @property
    def decode_seconds(self) -> float | None: ...
    @property
    def decode_spread_seconds(self) -> float | None: ...
    @property
    def batch_slots(self) -> float | None: ...
    @property
    def seconds_per_request_in_flight(self) -> float | None: ...
    @property
    def prefill_bound_seconds_per_kib(self) -> float | None: ...
    @property
    def samples(self) -> float: ...
    @property
    def predicted_cached_bytes(self) -> int: ...
    @property
    def reported_cached_tokens(self) -> int: ...
    @property
    def first_token_lateness(self) -> HistogramReading:
        """The first bytes the routing policy priced (`scored`'s streams and prefill legs):
        seconds after the time priced for them (negative: before)."""

@final
class EngineReading:
    """What a node's engine last reported about itself (None: never read, or not reported)."""

    @property
    def running(self) -> int | None: ...
    @property
    def waiting(self) -> int | None: ...
    @property
    def kv_usage(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def kv_capacity_tokens(self) -> int | None: ...
    @property
    def transferred_tokens(self) -> int | None:
        """Prompt tokens whose KV came over a KV connector (a decode node's), apart from cache hits."""
    @property
    def age(self) -> float | None:
        """Seconds since the last good reading."""
    @property
    def fresh(self) -> bool:
        """Younger than `engine_metrics_max_age`: policies use it."""
    @property
    def sent_since(self) -> int | None: ...
    @property
    def requests_estimate(self) -> float | None: ...
    @property
    def others(self) -> int | None:
        """Requests the engine had at the reading that pdproxy cannot have sent, at least."""
    @property
    def restarts(self) -> int: ...
    @property
    def flushes(self) -> int:
        """Times pdproxy was told the engine's prefix cache was flushed (``POST /flush_cache``,
        ``Router.cache_flushed``)."""
    @property
    def failures(self) -> int: ...
    @property
    def failing(self) -> int:
        """Readings failed in a row."""
    @property
    def learnt(self) -> LearntReading: ...

@final
class NodeView:
    """One node as the control plane shows it, copied at one moment: what it was registered
    with (never its key: `has_api_key` only), its state and counters, its engine."""

    @property
    def url(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def role(self) -> str:
        """hybrid, prefill or decode."""
    @property
    def models(self) -> list[str]:
        """The models it serves (its own `/v1/models` once discovered)."""
    @property
    def declared_models(self) -> list[str] | None:
        """The models it was registered with (None: ask the node)."""
    @property
    def speed(self) -> float | None: ...
    @property
    def max_concurrency(self) -> int | None: ...
    @property
    def has_api_key(self) -> bool: ...
    @property
    def bootstrap_port(self) -> int | None: ...
    @property
    def lease_ttl(self) -> float | None: ...
    @property
    def labels(self) -> dict[str, str]: ...
    @property
    def address(self) -> str | None:
        """`HOST:PORT` it is connected to, when not resolved from the URL."""
    @property
    def state(self) -> str:
        """healthy, unhealthy, draining, sleeping or initializing."""
    @property
    def circuit(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def succeeded(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def client_errors(self) -> int:
        """Refused by the node as the client's error (4xx but 429): neither succeeded nor failed."""
    @property
    def connect_failures(self) -> int: ...
    @property
    def cancelled(self) -> int: ...
    @property
    def events(self) -> int:
        """Server-sent events forwarded."""
    @property
    def mean_latency(self) -> float | None:
        """Seconds (None until a request has succeeded)."""
    @property
    def recent_latency(self) -> float | None:
        """Mean of the recent durations, seconds."""
    @property
    def recent_latencies(self) -> list[float]:
        """Recent request durations, seconds."""
    @property
    def recent_latency_per_token(self) -> float | None:
        """Mean of the recent durations per event, seconds."""
    @property
    def mean_ttft(self) -> float | None: ...
    @property
    def ttft_ewma(self) -> float | None: ...
    @property
    def histograms(self) -> LatencyHistograms: ...
    @property
    def engine(self) -> EngineReading: ...
    @property
    def peer_unanswered(self) -> int:
        """The other replicas' requests here still waiting for their first byte (``--replica-listen``)."""
    @property
    def peer_prefill_ms_left(self) -> float:
        """The prefill the other replicas expect the node to still owe them, milliseconds."""
    @property
    def peer_in_flight(self) -> int:
        """The other replicas' requests here not yet ended."""

@final
class Router:
    """The node table, selection, admission and forwarding. Every method but `forward`
    returns at once."""

    def __new__(cls, config: Settings, group: tuple[SharedTable, int] | None = None) -> Router: ...
    @property
    def instance_id(self) -> str:
        """This proxy's id, as the requests it sends carry it in `x-pdproxy-via`."""
    @property
    def policies(self) -> list[tuple[str, str]]:
        """(scope, policy) pairs: each role, then per-model overrides as `model:NAME`."""

    @property
    def queued(self) -> int:
        """Requests waiting for a node with room."""

    def queue_wait(self) -> HistogramReading:
        """How long queued requests waited, in seconds."""

    @property
    def retries(self) -> int:
        """Retries taken since the start."""

    def model_requests(self) -> dict[str, int]:
        """Requests received per model (`other`: a model no node declares; `none`: no model)."""

    def enter_request(self) -> None:
        """Counts one inference request into the proxy's gate.

        Raises:
            Draining: the proxy drains.
            ProxyOverloaded: `max_requests` requests are being served.
        """

    def leave_request(self) -> None:
        """Counts out a request counted in by `enter_request`."""

    @property
    def serving(self) -> int:
        """Inference requests being served now (the edge's and the control plane's)."""

    def start_draining(self) -> None:
        """New inference requests are refused with `Draining` from now on."""

    @property
    def draining(self) -> bool: ...
    def add_node(
        self,
        record: NodeRecord,
        address: str | None = None,
        rules: NodeAddressRules | None = None,
        end_drain: bool = False,
    ) -> tuple[NodeView, bool]:
        """Adds a node (or updates a registered one) from its record, in one call: the URL
        parsed once, every rule of the node table checked once, without `address` the host
        resolved and its addresses checked by `rules` (the GIL released meanwhile: call it off
        the event loop), the node registered. Returns the node's view and whether it is new.

        Args:
            record: the node (its URL may be unnormalised: the view has the canonical one).
            address: `HOST:PORT` to connect to instead of resolving the URL's host (then
                `rules` are not applied).
            rules: where nodes may be; without them (and without `address`) the host is
                resolved at connect time.
            end_drain: a draining node takes requests again (its lease was renewed).

        Raises:
            InvalidNode: the URL is not a usable http URL, an attribute is invalid, or an
                address of the host is one the rules refuse.
            NodeUnresolvable: the host does not resolve.
        """

    def view(self, url: str) -> NodeView:
        """One node's view.

        Raises:
            NodeNotFound: no node with this URL is registered.
        """

    def views(self) -> list[NodeView]:
        """Every node's view, in the table's order."""

    def node(self, url: str) -> NodeInfo:
        """One node: its record (with the key), state, circuit and requests in flight.

        Raises:
            NodeNotFound: no node with this URL is registered.
        """

    def set_models(self, url: str, models: list[str]) -> NodeView:
        """Replaces the models of a registered node, keeping everything else; returns its view."""

    def remove_node(self, url: str) -> str:
        """Stops routing to a node; requests in flight run to their end.

        Raises:
            NodeNotFound: no node with this URL is registered.
        """

    def set_node_state(self, url: str, state: str) -> None:
        """`healthy`, `unhealthy`, `draining`, `sleeping` or `initializing`; only healthy
        nodes are selected."""

    def set_max_concurrency(self, url: str, max_concurrency: int | None) -> None:
        """Sets (or with None lifts) a node's hard cap on requests in flight."""

    def cache_flushed(self, url: str) -> None:
        """The node's engine flushed its prefix cache (``POST /flush_cache``, or a flush sent to it
        directly): what the policies learnt it holds is void.

        Raises:
            NodeNotFound: no node with this URL is registered.
        """

    def models(self) -> list[str]:
        """Models served by the registered nodes, deduplicated."""

    def engine_reading_asked(self, url: str) -> None:
        """Marks that a reading of a node's engine metrics is being asked for: the next
        `record_engine_report` then tells the requests the engine had that pdproxy cannot have
        sent (another replica's, or traffic that bypasses pdproxy). Raises `NodeNotFound`."""

    def record_engine_report(
        self,
        url: str,
        running: int,
        waiting: int,
        kv_usage: float | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        kv_capacity_tokens: int | None = None,
        transferred_tokens: int | None = None,
    ) -> None:
        """Records what a node's engine reported about itself (read from its `/metrics`): requests
        running and waiting, KV-cache usage (0 to 1), cumulative prompt and prefix-cached tokens,
        KV capacity in tokens, cumulative prompt tokens whose KV another engine sent. Policies
        use it until it is older than `engine_metrics_max_age`, counting the requests sent and
        finished since.

        Raises:
            NodeNotFound: no node with that URL is registered.
            ValueError: `kv_usage` is not a finite number.
        """

    def start_kv_index(
        self,
        template: tuple[bytes, bytes, bytes, bytes, bytes],
        max_blocks: int,
        vocabulary: list[bytes] | None = None,
        token_width: int | None = None,
    ) -> None:
        """Starts pricing cache hits from the engines' KV events (`select/kv_index`): block
        token ids decode through `vocabulary` (each id's bytes) or, without one, as
        `token_width` little-endian bytes each (the mock engine's tokenizer); chat prompts
        render through `template` (start, before_role, after_role, end, generation); at most
        `max_blocks` blocks are kept.

        Raises:
            ValueError: neither a vocabulary nor a token width of 1 to 8, or both.
        """

    def stop_kv_index(self) -> None:
        """Prices cache hits from the prefix table alone again."""

    def kv_stored(
        self, node: str, rank: int, hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
    ) -> None:
        """A `BlockStored` event of `node`'s rank `rank`.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_removed(self, node: str, rank: int, hashes: list[int]) -> None:
        """A `BlockRemoved` event.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_cleared(self, node: str, rank: int) -> None:
        """Everything `node`'s rank held is gone, or no longer known.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_live(self, node: str, rank: int, live: bool) -> None:
        """Whether `node`'s rank is followed with no gap (priced from the index when all its
        ranks are).

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_forget_node(self, node: str) -> None:
        """Forgets `node`'s ranks: it left the fleet.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_matched(self, prompt: bytes, nodes: list[str]) -> list[int | None]:
        """The tokens of a request's prompt (its raw `messages` or `prompt` JSON) each of
        `nodes` holds: `None` for a node the index is not live for, or for every node when the
        prompt cannot be rendered.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def kv_index_stats(self) -> dict[str, object]:
        """`blocks`, `evicted`, `used` and `fell_back` (candidates priced from the index, and
        from the table because it was not live for them), and `streams`: per engine rank
        `(node, rank, blocks, events, orphans, unknown_tokens, live)`.

        Raises:
            RuntimeError: the KV index is not started.
        """

    def record_engine_failure(self, url: str) -> None:
        """Counts a failed reading of a node's engine metrics.

        Raises:
            NodeNotFound: no node with that URL is registered.
        """

    def select(self, model: str | None = None, role: str = "hybrid", affinity: str | None = None) -> str:
        """The URL of the node the policy would choose now; nothing is sent or counted."""

    def refresh_bindings(self) -> int:
        """In a worker group: rebinds nodes whose shared slot another worker retired."""

    @staticmethod
    def check_node(record: NodeRecord) -> str:
        """The canonical URL of `record`; raises `InvalidNode` for a node the table would
        refuse, without adding it."""

    @staticmethod
    def normalize_url(url: str) -> str:
        """The canonical form of a node URL (scheme and host lower-cased, no trailing slash)."""

    def check_asks(self, body: bytes) -> None:
        """Raises `InvalidRequest` (naming the field) for a body whose `n` or `best_of` is past
        `max_n`; `forward` checks it too."""

    @staticmethod
    def inspect(body: bytes) -> RoutingFields:
        """The routing fields of a body: model, stream, n, best_of, user, session_id, max_tokens."""

    @staticmethod
    def member(body: bytes, key: str) -> str | None:
        """The raw JSON text of a top-level member of `body` (None when absent)."""

    @staticmethod
    def patch(body: bytes, set: Sequence[tuple[str, str]] = ..., remove: Sequence[str] = ...) -> bytes:
        """A copy of `body` with members set (values as JSON text) or removed."""

    def forward(
        self,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = ...,
        method: str = "POST",
        role: str = "hybrid",
        node: str | None = None,
        trace: Trace | None = None,
        tenant: TenantTicket | None = None,
    ) -> asyncio.Future[Response]:
        """Selects a node for `body` (by its `model`), or takes `node`, and sends the request;
        its admission, selection and attempts are spans under `trace`, when given.

        Raises at once:
            InvalidRequest: the body is not a JSON object or a field has the wrong type.
            ModelNotFound: no node serves the model.
            NoNodeAvailable: no node is registered, or none is healthy.
            Overloaded: every node is at its limit and the queue is full.

        The returned future raises `UpstreamConnectError`, `UpstreamTimeout` or `UpstreamError`
        when the node fails before its response head, `Overloaded` when the request waited in
        the queue too long. Cancelling it cancels the upstream request.
        """

    def start_distserve(
        self, settings: DistServeSettings, connect: Callable[[str, str, LinkDone], None]
    ) -> DistServeCore:
        """Starts LMDeploy DistServe's flow: its requests read their links and keep their
        sessions in the returned core; ``connect(prefill, decode, done)`` is asked, on this
        loop, for a pair that is not connected."""

    def set_tenants(self, entries: Sequence[TenantEntry]) -> None:
        """Replaces the tenants with the tenants file's entries; a tenant kept by name keeps its
        window and counts."""

    @property
    def tenants_configured(self) -> bool:
        """Whether tenants are configured."""

    def tenant_key_known(self, key: bytes) -> bool:
        """Whether `key` is a tenant's."""

    def admit_tenant(self, key: bytes | None, body: bytes, priority: int | None = None) -> TenantTicket:
        """Admits a request by its key's tenant; raises `RateLimited` or `QuotaExceeded`."""

    def tenants(self) -> list[TenantSnapshot]:
        """Every tenant: limits, window, tokens today, requests in flight and counts."""

    def take_tenant_usage(self) -> list[tuple[str, int, int]]:
        """Each tenant's requests and tokens here since the last call."""

    def absorb_tenant_usage(self, name: str, requests: int, tokens: int) -> None:
        """Debits other replicas' use from tenant `name`'s window."""

    def trace(self, traceparent: bytes | None = None) -> Trace | None:
        """The trace of a request that came with `traceparent` (else a new one); `None` when
        requests are not traced."""

    def close(self) -> None:
        """Stops serving: requests in flight end now (their readers get an error) and new
        ones are refused; the router leaves its event loop when it is dropped."""

@type_check_only
class DistServeSettings(Protocol):
    """What ``start_distserve`` reads (by attribute)."""

    @property
    def migration_protocol(self) -> int: ...
    @property
    def dummy_prefill(self) -> bool: ...
    @property
    def free_timeout(self) -> float: ...
    @property
    def free_attempts(self) -> int: ...
    @property
    def journal(self) -> Path | None: ...

@final
class LinkDone:
    """The answer to one link request."""

    def __call__(self, error: str | None = None) -> None:
        """``None``: connected; else why the pair could not be connected."""

@final
class DistServeCore:
    """LMDeploy DistServe's data-plane state: the links requests read, and the ledger of
    preserved prefill sessions."""

    def add(self, prefill: str, session_id: int, decode: str | None = None, api_key: str | None = None) -> int:
        """Records a session preserved on ``prefill`` for ``decode``; its id. A prefill node no
        longer registered is reached with ``api_key`` to free it."""

    def preserve(self, prefill: str, answer: bytes, decode: str, api_key: str | None = None) -> tuple[int, str]:
        """Records the session a prefill answer (its body) preserved on ``prefill`` for ``decode``:
        its id, and the decode's ``migration_request`` (JSON). Raises ``InvalidAnswer`` when the
        answer names no session."""

    def dummy_migration(self) -> str:
        """The ``migration_request`` of a dummy prefill (JSON)."""

    def describe(self, id: int) -> str | None:
        """Session ``id`` as a log names it, while it is held."""

    def consume(self, id: int) -> None:
        """Decode took session ``id`` over (nothing when it already ended)."""

    def free(
        self, id: int, keep_if_unreachable: bool = False
    ) -> asyncio.Future[Literal["freed", "lost", "consumed", "preserved"]]:
        """Frees session ``id`` on its prefill node, once whatever the number of callers; raises
        ``KeyError`` when it is not preserved any more."""

    def preserved(self, older_than: float = 0.0, prefill: str | None = None) -> list[tuple[int, str, int]]:
        """The sessions still preserved, older than ``older_than`` seconds and on ``prefill`` when
        given: (id, prefill node, session id) each."""

    def counts(self) -> tuple[int, float | None, int, int, int]:
        """(held now, the oldest one's age in seconds, consumed, freed, could not be freed)."""

    def take_last_failure(self) -> str | None:
        """Why the last session that could not be freed was not, once."""

    def forget_links(self, url: str) -> None:
        """The links of ``url`` were dropped: requests ask for them again."""

    def stop(self) -> None:
        """Ends the flow: requests no longer find it."""

@final
class TenantTicket:
    """A request's admission: its queue class and, with a tenant, the tenant's pass (settled
    when the request ends)."""

    @property
    def tenant(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The tenant's `x-ratelimit-*` headers at admission."""

    def fail(self) -> None:
        """Counts the request in its tenant's errors."""

    def close(self) -> None:
        """Settles the pass now: its slot given back, its tokens counted."""

@final
class Trace:
    """A place in a request's trace: its root (exported when the last reference goes), or a
    span under it made by `child` and ended by `end`."""

    @property
    def id(self) -> str:
        """The trace id (32 hex digits)."""

    @property
    def sampled(self) -> bool:
        """Whether the trace is recorded, or only passed on to the nodes."""

    def child(self, name: str) -> Trace:
        """A span under this one (`pdproxy.prefill`, `pdproxy.decode`)."""

    def annotate(self, attributes: dict[str, str]) -> None:
        """Attributes of the request, on its root span."""

    def fail(self, message: str) -> None:
        """Marks the request failed."""

    def end(self, status: int | None = None, error: str | None = None) -> None:
        """Ends this span (once; the root ends with the request)."""

@final
class Response:
    """A node's response: the head, and the body as an async iterator of byte batches."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers without hop-by-hop headers, as ASGI wants them."""

    @property
    def node(self) -> str:
        """URL of the node that answered."""

    @property
    def body(self) -> bytes | None:
        """The whole body when it was read before the head was handed over (small responses
        that are not event streams); None when it streams. Iteration yields it too."""

    @property
    def closed(self) -> bool:
        """True once `close()` was called."""

    def __aiter__(self) -> Response: ...
    def __anext__(self) -> asyncio.Future[bytes]:
        """Everything received so far, cut after the last complete server-sent event."""

    def close(self) -> None:
        """Stops reading: closes the node's connection and releases its in-flight count now."""

@final
class _LoopBridge:
    """Internal: wakes the event loop from the data plane's threads."""

    def __call__(self, *args: object, **kwargs: object) -> None: ...

@final
class SharedTable:
    """The node counters of a worker group, in a memory-mapped file every worker maps."""

    SLOTS: ClassVar[int]
    MAX_WORKERS: ClassVar[int]

    @staticmethod
    def create(path: str) -> SharedTable:
        """Creates a new table file (raises `ConfigError` if it exists)."""

    @staticmethod
    def open(path: str) -> SharedTable:
        """Maps an existing table file (raises `ConfigError` if it is not one of this build)."""

    def join(self, pid: int) -> int:
        """Attaches worker process `pid`; returns its index."""

    def workers(self) -> list[tuple[int, int]]:
        """Attached workers as (index, pid)."""

    def held(self, index: int) -> int:
        """The permits worker `index` holds now."""

    def reclaim(self, index: int, pid: int) -> int | None:
        """Detaches an exited worker, handing back its permits; how many, or None if not `pid`'s."""

    def recycle(self, grace: float) -> int:
        """Frees retired slots idle for at least `grace` seconds; returns how many."""

    def slots_in_use(self) -> tuple[int, int]:
        """(bound, retired) slots."""

    @property
    def epoch(self) -> int:
        """Bumped after every membership change."""

    def bump_epoch(self) -> int: ...
    @property
    def draining(self) -> bool:
        """Whether the group was asked to drain."""

    def set_draining(self) -> None: ...

@final
class EdgeListener:
    """The public address, bound at once (no `SO_REUSEPORT`: a taken port is refused)."""

    def __new__(cls, host: str, port: int, backlog: int) -> EdgeListener:
        """Binds `host:port`.

        Raises:
            ConfigError: the address cannot be bound (the port is taken, the host unknown).
        """

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...

@final
class Pipeline:
    """The edge's inference pipeline, for requests the control plane's ASGI app took."""

    def __new__(cls, router: Router, settings: Settings) -> Pipeline:
        """The pipeline of ``router``'s engine, with the settings the edge would have; its
        answers go to the running loop."""

    def serves(self, path: str) -> bool:
        """Whether a POST to ``path`` (as the client sent it) is an inference request."""

    def serve(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        body_error: str | None = None,
        client: tuple[str, int] | None = None,
    ) -> asyncio.Future[Response]:
        """Serves one inference request: ``target`` is its path and query as sent, ``body`` its
        body, or ``None`` with ``body_error`` (``too_large``, ``timeout``, ``broken``) saying why it
        could not be read, ``client`` the client's address. Resolves to the answer."""

    def check_key(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Raises ``Unauthorized`` unless a request with these headers may be served (its key,
        or its tenant's)."""

    @property
    def cors_enabled(self) -> bool:
        """Whether some origin may call the proxy from a browser (``--allow-origins``)."""

    def cors(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> tuple[tuple[int, list[tuple[bytes, bytes]], bytes] | None, list[tuple[bytes, bytes]]]:
        """A browser's CORS for a request, in one reading of its headers: ``(preflight,
        headers)``. A preflight's whole answer as ``(status, headers, body)`` (204 with what is
        allowed, or 400 ``cors_refused``); for any other request ``None``, and the headers its
        answer carries (the origin's permission; none for no origin or one not allowed)."""

    def shutdown(self) -> None:
        """Streams still running end (the proxy shuts down)."""

@final
class Edge:
    """The HTTP server of the data plane: inference requests served in Rust, the rest passed to
    the control plane's ASGI app on `control_socket`."""

    def __new__(
        cls,
        router: Router,
        listener: EdgeListener,
        settings: Settings,
        threads: int,
        max_connections: int,
        control_socket: str,
        control_stale_after: float,
    ) -> Edge:
        """Serves `listener` on `threads` threads, each with its own event loop, at most
        `max_connections` client connections at once (more are answered 503 and closed)."""
    def heartbeat(self) -> None:
        """Tells the edge the control plane's loop is alive."""

    def shutdown(self) -> int:
        """Stops accepting, ends running streams with a `draining` event, and waits (about two
        seconds at most) for connections to close; returns how many did not."""

    @property
    def connections(self) -> int:
        """Client connections open now."""

@final
class ReplicaShare:
    """Sends this replica's own load on every node to the other replicas (UDP) every interval,
    and stores the live ones' sums in the nodes' counters, which ``scored`` prices by."""

    def __new__(cls, router: Router, listen: str, peers: list[str], interval_ms: int) -> ReplicaShare:
        """Binds ``listen`` (``HOST:PORT``) and starts on ``router``'s runtime.

        Raises:
            ConfigError: the address cannot be bound.
        """
    @property
    def listen(self) -> str:
        """The address it listens on, ``HOST:PORT``."""
    def stats(self) -> tuple[int, int, int, int]:
        """Datagrams sent, received and refused as not this protocol, and the peers live now."""
    def close(self) -> None:
        """Stops sharing; the peers' load leaves the nodes."""

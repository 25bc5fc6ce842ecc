"""Settings: every default of pdproxy lives here.

The settings are pydantic models grouped by concern (server, shared registry, routing, limits,
timeouts, health, PD, security, tenants, observability), each validator beside its field.
``Settings`` holds one of each (``settings.health``, ``settings.timeouts``), and components take
the groups they need; the Rust data plane reads the groups by attribute (it declares no defaults
of its own). Inside its group a setting's field drops what the group's name already says
(``settings.health.interval``, ``settings.timeouts.connect``), but each setting keeps one flat
name (``health_interval``: its field's ``name=``, else the field's own; ``FLAT`` maps it to its
group), which the CLI (`pdproxy serve`), the environment (``PDPROXY_<NAME>``), a TOML file
(``--config``), ``Settings(**flat)``, ``--print-config`` and every refusal use; precedence is
CLI > environment > file > the defaults below. A bad value is refused with one line naming the
setting (``ConfigError``).

This module depends on nothing else in pdproxy but its error class and the policies' models
(``policies``: ``settings.routing.policies`` is each role's policy with its own knobs, built from
the routing settings). Checks that need the rest (the registry's URL, the tenants file, each
node, the ``OTEL_*`` environment) are ``checks.checked``, run before anything is served.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, ClassVar, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from pdproxy.config.policies import (
    ConsistentHashPolicy,
    Policy,
    PolicyRefused,
    PrefixPolicy,
    RolePolicies,
    ScoredPolicy,
)
from pdproxy.config.policies import parse as parse_policy
from pdproxy.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "FIELDS",
    "FLAT",
    "GROUPS",
    "LOG_LEVELS",
    "Settings",
    "defaults",
    "flat_name",
    "load_toml",
    "setting_flag",
    "setting_kind",
]

ENV_PREFIX = "PDPROXY_"
#: Settings that hold key material: never printed or logged.
SECRET_FIELDS = ("api_keys", "admin_keys", "otlp_headers", "node_api_key")

#: Log levels by every name LMDeploy's `--log-level` takes, as pdproxy (and granian) name them.
LOG_LEVELS = {
    "critical": "critical",
    "fatal": "critical",
    "error": "error",
    "warning": "warning",
    "warn": "warning",
    "info": "info",
    "request": "debug",  # LMDeploy's level between DEBUG and INFO
    "debug": "debug",
    "notset": "debug",
}
#: LMDeploy's DistServe transport choices (`lmdeploy serve proxy --migration-protocol/--link-type`).
MIGRATION_PROTOCOLS = ("RDMA", "NVLINK")
LINK_TYPES = ("RoCE", "IB")
#: `--help` shows routing, limits and timeouts together.
ROUTING_TITLE = "Routing, limits and timeouts"
#: The error type of a refusal whose message already names the setting.
REFUSED = "setting"
#: The error type of a refusal of a value whose message the setting's name goes before: the
#: name the error's location holds, the setting's flat one (a check shared by many settings
#: sees only its field's name, ``interval`` for ``health_interval``).
REFUSED_VALUE = "setting_value"

Default = TypeVar("Default")


def _refuse(message: str, **context: object) -> PydanticCustomError:
    """A refusal whose ``message`` (``str.format``-ed with ``context``) names the setting."""
    return PydanticCustomError(REFUSED, message.format(**context))


def _refuse_value(message: str, **context: object) -> PydanticCustomError:
    """A refusal of a value: ``message`` (``str.format``-ed with ``context``) says what is wrong
    with it, and ``settings_message`` puts the setting's flat name before it."""
    return PydanticCustomError(REFUSED_VALUE, message.format(**context))


def _setting(
    default: Default,
    help: str,
    *,
    name: str | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    env_aliases: tuple[str, ...] = (),
    shown_default: str | None = None,
) -> Default:
    """A setting's default, help text and CLI spelling (``name``: the setting's flat name, where
    its field's is shorter: ``health_interval`` for ``health.interval``, the field's pydantic
    alias; ``aliases``: LMDeploy's spellings, so existing launch scripts keep working;
    ``env_aliases``: environment variables read after ``PDPROXY_<NAME>``, such as LMDeploy's;
    ``shown_default``: what ``--help`` shows for a default that marks "unset", "" for nothing).
    Typed as its default (pydantic's ``Field`` is typed ``Any`` for the same reason: pydantic
    reads the field from it), so that mypy checks each default against its setting's type."""
    extra = {"flag": flag, "aliases": list(aliases), "env_aliases": list(env_aliases), "shown_default": shown_default}
    field: Default = Field(default, alias=name, description=help, json_schema_extra=extra)  # type: ignore[arg-type]
    return field


# Value types whose refusals the setting's flat name goes before (``settings_message``).
def _positive_seconds(value: float) -> float:
    if not value > 0:
        raise _refuse_value("must be a positive number of seconds, got {value}", value=value)
    return value


def _not_negative(value: float) -> float:
    if value < 0:
        raise _refuse_value("must not be negative, got {value}", value=value)
    return value


def _at_least_one(value: int) -> int:
    if value < 1:
        raise _refuse_value("must be at least 1, got {value}", value=value)
    return value


def _weight(value: float) -> float:
    if not 0 <= value < float("inf"):
        raise _refuse_value("must be a non-negative number, got {value}", value=value)
    return value


def _positive(value: float) -> float:
    if not 0 < value < float("inf"):
        raise _refuse_value("must be a positive number, got {value}", value=value)
    return value


def _share(value: float) -> float:
    if not 0 <= value <= 1:
        raise _refuse_value("must be between 0 and 1, got {value}", value=value)
    return value


def _several(value: object) -> object:
    """One text is one value (``nodes="http://a:1"``); a list is a tuple."""
    return (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value


Seconds = Annotated[float, AfterValidator(_positive_seconds)]
NotNegativeSeconds = Annotated[float, AfterValidator(_not_negative)]
NotNegativeNumber = Annotated[float, AfterValidator(_not_negative)]
AtLeastOne = Annotated[int, AfterValidator(_at_least_one)]
NotNegative = Annotated[int, AfterValidator(_not_negative)]
Share = Annotated[float, AfterValidator(_share)]
Weight = Annotated[float, AfterValidator(_weight)]
PositiveNumber = Annotated[float, AfterValidator(_positive)]
Several = Annotated[tuple[str, ...], BeforeValidator(_several)]


class SettingsGroup(BaseModel):
    """A group of settings (``pdproxy serve --help`` shows each under its ``title``). Built and
    dumped by the settings' flat names (``HealthSettings(health_interval=1.0)``); built by its
    fields' names too (``HealthSettings(interval=1.0)``)."""

    model_config = ConfigDict(
        frozen=True,
        strict=True,
        extra="forbid",
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
    )
    title: ClassVar[str] = ""


class ServerSettings(SettingsGroup):
    """Who serves the public address, and how the process lives."""

    title: ClassVar[str] = "Serving"

    host: str = _setting(
        "127.0.0.1",
        "Address to listen on.",
        aliases=("--server-name",),
    )
    port: int = _setting(
        8000,
        "Port to listen on.",
        aliases=("--server-port",),
    )
    demo: bool = _setting(
        False,
        "Start two built-in mock engines and route to them (try pdproxy without GPUs).",
    )
    demo_model: str = _setting(
        "pdproxy-demo",
        "Model name served by the demo mock engines.",
    )
    edge: str = _setting(
        "rust",
        (
            "Who serves the public address: rust (the data plane's HTTP server answers inference requests with no"
            " Python per request, and hands everything else to the control plane) or granian (the Python ASGI app"
            " serves everything, in --workers processes)."
        ),
    )
    edge_threads: NotNegative = _setting(
        0,
        "Threads of the Rust edge, which serve every request and the upstream connections (0: one per core).",
    )
    workers: AtLeastOne = _setting(
        1,
        (
            "With --edge granian: granian worker processes. With more than one they share one node table: "
            "membership, health and in-flight counts (so max_concurrency holds across all of them) live in shared"
            " memory, and one worker, the leader, runs the health checks. The Rust edge uses every core in one "
            "process (--edge-threads)."
        ),
    )
    log_level: str = _setting(
        "info",
        "Log level: debug, info, warning, error, critical (LMDeploy's names too, any case).",
    )
    drain_timeout: Seconds = _setting(
        30.0,
        "Seconds a drain (POST /drain, SIGTERM) waits for requests in flight before exiting.",
    )
    state_file: str = _setting(
        "",
        "JSON file where registered nodes are saved and reloaded at start (empty: off).",
    )
    disable_cache_status: bool = _setting(
        False,
        "Start without the nodes saved in --state-file (as LMDeploy's flag: forget the previous run's nodes).",
    )

    @model_validator(mode="after")
    def _one_edge(self) -> ServerSettings:
        if self.edge not in ("rust", "granian"):
            raise _refuse("edge must be rust or granian, got {value!r}", value=self.edge)
        if not 0 < self.port < 65536 and self.port != 0:
            raise _refuse("port must be between 1 and 65535, got {value}", value=self.port)
        level = LOG_LEVELS.get(self.log_level.lower())
        if level is None:
            raise _refuse(
                "log_level must be one of {names} (any case); got {value!r}",
                names=", ".join(LOG_LEVELS),
                value=self.log_level,
            )
        object.__setattr__(self, "log_level", level)  # frozen; still its construction
        return self


class RegistrySettings(SettingsGroup):
    """Node membership shared with other replicas through Redis."""

    title: ClassVar[str] = "Shared membership (--registry)"

    registry: str = _setting(
        "",
        (
            "Share node membership with other pdproxy replicas through Redis (redis://HOST:PORT/DB): a node "
            "registered on one is routed to by all; leases expire in Redis. Each replica keeps its own health "
            "view and in-flight counts. Empty: membership is this proxy's own."
        ),
    )
    namespace: str = _setting(
        "pdproxy",
        "Prefix of every Redis key and channel pdproxy uses (replicas that share nodes use the same one).",
        name="registry_namespace",
    )
    timeout: Seconds = _setting(
        2.0,
        "Seconds a call to Redis may take before the registry counts as unavailable.",
        name="registry_timeout",
    )
    reconcile_interval: Seconds = _setting(
        1.0,
        "Seconds between two full reads of the membership (a missed notice or an expired lease is seen by then).",
        name="registry_reconcile_interval",
    )
    max_backoff: Seconds = _setting(
        5.0,
        "Longest wait between two attempts to reach Redis again.",
        name="registry_max_backoff",
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not value:
            raise _refuse("registry_namespace must not be empty")
        return value


def _host_port(value: str, name: str) -> str:
    """``value`` as ``HOST:PORT`` (a port from 0 to 65535; an IPv6 host in brackets)."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise _refuse("{name} must be HOST:PORT, got {value}", name=name, value=value)
    return value


class ReplicaShareSettings(SettingsGroup):
    """Replicas in front of the same engines telling each other their load on every node (UDP)."""

    title: ClassVar[str] = "Load shared between replicas (--replica-listen)"

    listen: str = _setting(
        "",
        (
            "HOST:PORT to receive the other replicas' load on (UDP), and to share this one's with --replica-peer: "
            "each prices a node by every replica's requests waiting there for a first token, and the prefill they "
            "owe, not its own alone. Empty: not shared."
        ),
        name="replica_listen",
    )
    peers: Several = _setting(
        (),
        "Another replica's --replica-listen address (HOST:PORT); repeat for each. Each gets one datagram an interval.",
        name="replica_peers",
        flag="--replica-peer",
    )
    interval_ms: AtLeastOne = _setting(
        5,
        (
            "Milliseconds between two looks at this replica's load: a datagram goes to each peer when it changed, "
            "and at least every quarter of the peers' freshness; a peer silent for five intervals (and at least "
            "50 ms) stops counting (its load leaves the nodes)."
        ),
        name="replica_share_interval_ms",
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return _host_port(value, "replica_listen") if value else value

    @field_validator("peers")
    @classmethod
    def _peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_host_port(peer, "replica_peers") for peer in value)

    @model_validator(mode="after")
    def _sharing(self) -> ReplicaShareSettings:
        if self.peers and not self.listen:
            raise _refuse("--replica-peer needs --replica-listen: peers send their load there")
        return self


class DiscoverySettings(SettingsGroup):
    """Nodes found where fleets run: Kubernetes pods by label selector, DNS names."""

    title: ClassVar[str] = "Finding nodes (Kubernetes, DNS)"

    k8s_selector: str = _setting(
        "",
        (
            "Route to the Kubernetes pods this label selector matches (e.g. app=vllm): a pod is a node while it "
            "is Running, Ready, not terminating and has an IP. Empty: no Kubernetes discovery."
        ),
    )
    k8s_prefill_selector: str = _setting(
        "",
        "DistServe: pods this selector matches are prefill nodes (Kubernetes discovery without --k8s-selector too).",
    )
    k8s_decode_selector: str = _setting(
        "",
        "DistServe: pods this selector matches are decode nodes.",
    )
    k8s_namespace: str = _setting(
        "",
        "Namespace to watch. Empty: the proxy's own in a cluster, else the kubeconfig context's, else default.",
    )
    k8s_port: str = _setting(
        "",
        (
            "The pods' port: a number, or the name of a container port. Empty: the pdproxy.io/port annotation, "
            "else the container port named http, else the pod's only container port."
        ),
    )
    k8s_kubeconfig: str = _setting(
        "",
        "Kubeconfig file, to run outside the cluster. Empty: in-cluster config, else $KUBECONFIG or ~/.kube/config.",
    )
    k8s_context: str = _setting(
        "",
        "Kubeconfig context to use. Empty: its current context.",
    )
    k8s_relist_interval: Seconds = _setting(
        60.0,
        "Seconds between two full lists of the pods, which repair anything a watch missed.",
    )
    k8s_timeout: Seconds = _setting(
        10.0,
        "Seconds a call to the Kubernetes API may take (a list, the start of a watch).",
    )
    k8s_max_backoff: Seconds = _setting(
        30.0,
        "Longest wait between two attempts to reach the Kubernetes API again.",
    )
    node_dns: Several = _setting(
        (),
        (
            "Nodes behind a DNS name, re-resolved every --dns-interval: NAME:PORT for its A/AAAA records (a "
            "headless Service, a round-robin name), or srv:NAME for its SRV records (ports included); then "
            "optional ,key=value node attributes as --node takes them, e.g. prefill.vllm.svc:8000,role=prefill. "
            "Repeat for several."
        ),
    )
    dns_interval: Seconds = _setting(
        5.0,
        "Seconds between two resolutions of each --node-dns name.",
    )
    dns_timeout: Seconds = _setting(
        2.0,
        "Seconds a resolution may take before it counts as failed (the last answer is kept).",
    )
    dns_server: str = _setting(
        "",
        "DNS server to ask (HOST or HOST:PORT). Empty: the system's, from /etc/resolv.conf.",
    )


class RoutingSettings(SettingsGroup):
    """Which node serves a request, and what happens when one fails."""

    title: ClassVar[str] = ROUTING_TITLE

    nodes: Several = _setting(
        (),
        (
            "An inference server (LMDeploy, vLLM, SGLang api_server): its URL, then optional ,key=value node "
            "attributes: role (hybrid, prefill, decode), model (repeatable), speed, max_concurrency, api_key, "
            "bootstrap_port, lease_ttl, labels.NAME=VALUE (repeatable). Repeat for several; in the environment, "
            "separated by spaces; in TOML, strings or tables. Example: http://10.0.0.2:30000,role=prefill,model=qwen"
        ),
        flag="--node",
    )
    policy: str = _setting(
        "scored",
        (
            "Routing policy of every role (hybrid, and prefill and decode unless their own is given): "
            "min_expected_latency (LMDeploy's default), random, min_observed_latency, "
            "min_observed_latency_per_token, min_cache_usage (LMDeploy's), round_robin, least_requests, "
            "consistent_hash, prefix, least_engine_load, scored (or with weights of its own: "
            "scored:prefix=N,queue=N, and hidden, reported, future)."
        ),
        aliases=("--routing-strategy",),
    )
    prefill_policy: str = _setting(
        "",
        "Routing policy for prefill nodes (empty: --policy).",
    )
    decode_policy: str = _setting(
        "",
        "Routing policy for decode nodes (empty: --policy).",
    )
    model_policies: Several = _setting(
        (),
        "MODEL=POLICY: a routing policy for one model; repeat for several.",
        flag="--model-policy",
    )
    hash_load_factor: float = _setting(
        1.25,
        "consistent_hash: a node keeps a key while its in-flight count is below this times the average.",
    )
    prefix_block_bytes: AtLeastOne = _setting(
        256,
        "prefix: prompt bytes per cached block.",
    )
    prefix_max_blocks: AtLeastOne = _setting(
        1024,
        "prefix, scored: blocks of a prompt considered (its head; 1024 blocks of 256 bytes cover about 64k tokens).",
    )
    prefix_cache_entries: AtLeastOne = _setting(
        65536,
        "prefix: prefix-to-node entries remembered.",
    )
    prefix_balance_threshold: NotNegative = _setting(
        8,
        "prefix: leave a prefix's node when it has this many more requests than the least busy one.",
    )
    prefix_bytes_per_token: PositiveNumber = _setting(
        4.0,
        (
            "scored: prompt bytes per engine token, to size a node's share of the prefix table from the KV "
            "capacity its engine reports."
        ),
    )
    score_prefix_weight: Weight = _setting(
        2.0,
        (
            "scored: times a request's own prefill (in seconds, at that engine's learnt rate) counts for each "
            "request whose first token it delays there: the next to come, and those queued or prefilling; "
            "and times its wait for a place in a full batch counts for those that come after it."
        ),
    )
    score_queue_weight: Weight = _setting(
        1.0,
        (
            "scored: times the waits ahead of a request count in a node's cost: for a place in its engine's "
            "batch, and for the prefill owed to the requests sent there before."
        ),
    )
    score_hidden_weight: Weight = _setting(
        0.0,
        (
            "scored: times a node's recent lateness counts in its cost: how much later than priced its first "
            "tokens came, the work there others sent (other replicas, traffic that bypasses pdproxy)."
        ),
    )
    score_reported_weight: Weight = _setting(
        0.0,
        (
            "scored: times the queue a node's engine last reported counts among the requests waiting there, "
            "where it is longer than pdproxy's own count and the reading showed requests pdproxy cannot have "
            "sent (other replicas in front of the same engines: 1 helps them from a cold start); 0: pdproxy's own "
            "count alone."
        ),
    )
    score_future_weight: Weight = _setting(
        3.0,
        (
            "scored: times the wait that a node's recent traffic, kept up, makes a request meet counts in its "
            "cost, for the share of the prompt new to the fleet, held by no node and begun by no prompt sent "
            "lately (a new session's first turn: its next turns follow it there); the traffic is the prefill "
            "pdproxy sent there lately, or what the engine's KV events show it computed, where more; 0: off."
        ),
    )
    retries: NotNegative = _setting(
        2,
        (
            "Further nodes a request may try when one provably did not run it (connect failure, or a 429/503 "
            "answer before any byte); never after a node started work."
        ),
    )
    retry_budget_ratio: Share = _setting(
        0.2,
        "Retries may add at most this share of recent requests (plus the floor).",
    )
    retry_budget_floor: NotNegative = _setting(
        10,
        "Retries always allowed per 10 s, whatever the traffic.",
    )
    circuit_failures: NotNegative = _setting(
        5,
        "Consecutive failures that open a node's circuit (no traffic until a probe succeeds); 0: off.",
    )
    circuit_cooldown: Seconds = _setting(
        10.0,
        "Seconds an open circuit keeps traffic away before one request probes the node.",
    )

    @field_validator("model_policies")
    @classmethod
    def _model_policy_form(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            model, sep, _ = entry.partition("=")
            if not sep or not model.strip():
                raise _refuse("model policy {entry!r} must read MODEL=POLICY", entry=entry)
        return value

    @field_validator("hash_load_factor")
    @classmethod
    def _load_factor(cls, value: float) -> float:
        if not value >= 1:
            raise _refuse("hash_load_factor must be at least 1, got {value}", value=value)
        return value

    _policies: RolePolicies = PrivateAttr()

    @model_validator(mode="after")
    def _parse_policies(self) -> RoutingSettings:
        """Each role's policy and each model's, parsed once, with the knobs of its kind."""
        configured: dict[str, Policy] = {
            "consistent_hash": ConsistentHashPolicy(load_factor=self.hash_load_factor),
            "prefix": PrefixPolicy(
                block_bytes=self.prefix_block_bytes,
                max_blocks=self.prefix_max_blocks,
                cache_entries=self.prefix_cache_entries,
                balance_threshold=self.prefix_balance_threshold,
            ),
            "scored": ScoredPolicy(
                prefix=self.score_prefix_weight,
                queue=self.score_queue_weight,
                hidden=self.score_hidden_weight,
                reported=self.score_reported_weight,
                future=self.score_future_weight,
                block_bytes=self.prefix_block_bytes,
                max_blocks=self.prefix_max_blocks,
                cache_entries=self.prefix_cache_entries,
                bytes_per_token=self.prefix_bytes_per_token,
            ),
        }
        try:
            by_model: dict[str, Policy] = {}
            for entry in self.model_policies:
                model, _, name = entry.partition("=")  # its form: `_model_policy_form`
                by_model[model.strip()] = parse_policy(name, configured, f"model policy for {model.strip()}")
            self._policies = RolePolicies(
                hybrid=parse_policy(self.policy, configured, "policy"),
                # A role without a policy of its own takes the general one (`--routing-strategy`).
                prefill=parse_policy(self.prefill_policy or self.policy, configured, "prefill_policy"),
                decode=parse_policy(self.decode_policy or self.policy, configured, "decode_policy"),
                by_model=by_model,
            )
        except PolicyRefused as e:
            raise _refuse("{refusal}", refusal=str(e)) from None
        return self

    @property
    def policies(self) -> RolePolicies:
        """The policy of each role and model, each with its own knobs
        (``settings.routing.policies.hybrid``: ``ScoredPolicy(prefix=2.0, queue=1.0, ...)``)."""
        return self._policies


class LimitsSettings(SettingsGroup):
    """How much the proxy takes on: requests, bodies, buffers, connections."""

    title: ClassVar[str] = ROUTING_TITLE

    queue_size: NotNegative = _setting(
        256,
        "Requests that may wait when every node is at its limit (0: refuse at once with 429).",
    )
    max_requests: NotNegative = _setting(
        4096,
        (
            "Inference requests served at once by this proxy; past it 503 with Retry-After (0: no cap). With each"
            " stream's buffers bounded by --stream-buffer-limit, this bounds the proxy's memory."
        ),
    )
    max_body_size: AtLeastOne = _setting(
        8 << 20,
        "Largest request body accepted, in bytes (checked while it is read).",
    )
    max_n: AtLeastOne = _setting(
        128,
        (
            "Largest n (and best_of) a request may ask for; more is refused with 400 (OpenAI's own ceiling;"
            " SGLang's disaggregation sends one bootstrap entry per choice)."
        ),
    )
    max_connections: NotNegative = _setting(
        0,
        (
            "Client connections the Rust edge keeps open at once; past it a new one is answered 503 and closed "
            "at accept (0: half the open-file limit, less 64, which pdproxy raises to its hard limit at start)."
        ),
    )
    answer_buffer: AtLeastOne = _setting(
        16 << 20,
        (
            "Largest node answer the proxy reads whole (a prefill's answer, an error body), in bytes; past it the"
            " request fails with 502 and the node's connection is dropped."
        ),
        name="answer_buffer_limit",
    )
    prefetch: NotNegative = _setting(
        1 << 20,
        "Non-streaming responses up to this many bytes are read whole before forwarding.",
        name="prefetch_limit",
    )
    stream_buffer: AtLeastOne = _setting(
        1 << 20,
        "Bytes of a stream kept for a client that reads slowly before the node's stream is held back.",
        name="stream_buffer_limit",
    )
    pool_max_idle_per_node: AtLeastOne = _setting(
        256,
        "Idle keep-alive connections kept per node.",
    )
    runtime_threads: AtLeastOne = _setting(
        2,
        "Threads of the data plane's I/O runtime.",
    )


class TimeoutSettings(SettingsGroup):
    """How long each step may take."""

    title: ClassVar[str] = ROUTING_TITLE

    queue: Seconds = _setting(
        30.0,
        "Seconds a request may wait in the queue before 429.",
        name="queue_timeout",
    )
    connect: Seconds = _setting(
        2.0,
        "Seconds to connect to a node.",
        name="connect_timeout",
    )
    first_byte: Seconds = _setting(
        300.0,
        "Seconds from sending a request to a node until its response head (covers long prefills).",
        name="first_byte_timeout",
    )
    pool_idle: Seconds = _setting(
        4.0,
        (
            "Seconds an idle keep-alive connection to a node is kept: below the nodes' own keep-alive (uvicorn's"
            " 5 s, which vLLM, SGLang and LMDeploy serve with), so a node never closes one as it is reused."
        ),
        name="pool_idle_timeout",
    )
    request: NotNegativeSeconds = _setting(
        0.0,
        "Seconds a whole request may take, queueing and streaming included (0: no limit).",
        name="request_timeout",
    )
    stream_idle: Seconds = _setting(
        120.0,
        "Seconds a streaming response may stay silent before it is cut off.",
        name="stream_idle_timeout",
    )
    answer: Seconds = _setting(
        60.0,
        (
            "Seconds from a node's answer head to the end of its body, for answers that are not event streams and"
            " for every answer read whole (a node that drips one is cut off: 502)."
        ),
        name="answer_timeout",
    )
    body: Seconds = _setting(
        30.0,
        "Seconds a client may take to send its request body (then 408).",
        name="body_timeout",
    )
    header_read: Seconds = _setting(
        10.0,
        "Seconds a client may take to send a request's headers (Rust edge; then the connection closes).",
        name="header_read_timeout",
    )
    stream_stall: Seconds = _setting(
        60.0,
        "Seconds a client may stop reading a stream before it is cut off and the node freed.",
        name="stream_stall_timeout",
    )
    admin: Seconds = _setting(
        5.0,
        "Seconds for calls the management API makes to a node (/terminate).",
        name="admin_timeout",
    )
    discovery: Seconds = _setting(
        2.0,
        "Seconds to wait for a node's /v1/models when discovering its models.",
        name="discovery_timeout",
    )
    node_tcp_keepalive: Seconds = _setting(
        60.0,
        "Seconds of silence on a connection to a node before TCP keep-alive probes check it is still there.",
    )
    discovery_interval: Seconds = _setting(
        5.0,
        "Seconds between retries of model discovery for nodes that have not answered yet.",
    )


class HealthSettings(SettingsGroup):
    """Active health checks of the nodes."""

    title: ClassVar[str] = "Health checks"

    interval: Seconds = _setting(
        5.0,
        "Seconds between health checks of each node.",
        name="health_interval",
    )
    timeout: Seconds = _setting(
        2.0,
        "Seconds a node's /health may take.",
        name="health_timeout",
    )
    fall: AtLeastOne = _setting(
        3,
        "Consecutive failed checks that mark a node unhealthy.",
        name="health_fall",
    )
    rise: AtLeastOne = _setting(
        2,
        "Consecutive good checks that bring an unhealthy node back.",
        name="health_rise",
    )
    remove_after: NotNegativeSeconds = _setting(
        0.0,
        "Remove a node unhealthy for this many seconds (0: never remove).",
        name="health_remove_after",
    )


class EngineMetricsSettings(SettingsGroup):
    """Readings of each engine's own /metrics, which the load-aware policies route by."""

    title: ClassVar[str] = "Engine metrics (each node's /metrics)"

    interval: NotNegativeSeconds = _setting(
        2.0,
        (
            "Seconds between readings of each node's /metrics (running and waiting requests, KV-cache usage "
            "and prefix-cache hits, in vLLM's, SGLang's or LMDeploy's names), at most 0.5 while an engine "
            "reports requests waiting; 0: never read them."
        ),
        name="engine_metrics_interval",
    )
    timeout: Seconds = _setting(
        1.0,
        "Seconds a node's /metrics may take.",
        name="engine_metrics_timeout",
    )
    max_age: Seconds = _setting(
        10.0,
        "Seconds after which a node's engine figures are too old to route by.",
        name="engine_metrics_max_age",
    )
    concurrency: AtLeastOne = _setting(
        16,
        "Nodes whose /metrics are read at once.",
        name="engine_metrics_concurrency",
    )
    max_bytes: AtLeastOne = _setting(
        4 << 20,
        "Largest /metrics answer read from a node, in bytes (at least 1024).",
        name="engine_metrics_max_bytes",
    )

    @field_validator("max_bytes")
    @classmethod
    def _metrics_size(cls, value: int) -> int:
        if value < 1024:
            raise _refuse("engine_metrics_max_bytes must be at least 1024, got {value}", value=value)
        return value


class KvEventsSettings(SettingsGroup):
    """The engines' own KV-cache events, which make cache-aware routing exact (``kv_events``)."""

    title: ClassVar[str] = "KV events (vLLM's and SGLang's KV-cache events)"

    events: str = _setting(
        "",
        (
            "Where each node's engine publishes its KV-cache events (ZMQ): a template of the node's host, "
            "e.g. tcp://{host}:5557 for vLLM's --kv-events-config endpoint tcp://*:5557; 'auto': where its "
            "/server_info says (SGLang); empty: not followed (the prefix table alone)."
        ),
        name="kv_events",
    )
    events_replay: str = _setting(
        "",
        "The engines' replay endpoint, as --kv-events (e.g. tcp://{host}:5558): missed events are asked there.",
        name="kv_events_replay",
    )
    events_ranks: AtLeastOne = _setting(
        1,
        "Data-parallel ranks of each engine, each publishing one port after the one before.",
        name="kv_events_ranks",
    )
    events_topic: str = _setting("", "The topic the engines publish their events under.", name="kv_events_topic")
    tokenizer: str = _setting(
        "",
        (
            "The served model's tokenizer.json (or its directory), to read the events' token ids; "
            "'mock': the mock engine's (pdproxy mock-engine --simulate --kv-events)."
        ),
        name="kv_tokenizer",
    )
    chat_template: str = _setting(
        "role-tags",
        (
            "How the engines render chat messages: role-tags (<|role|>content<|end|>, then <|assistant|>), "
            "chatml (<|im_start|>role, content, <|im_end|>), or a JSON list of five strings: "
            "[start, before-role, after-role, end, generation]."
        ),
        name="kv_chat_template",
    )
    index_max_blocks: AtLeastOne = _setting(
        1_000_000,
        "KV blocks the index keeps at most, all nodes together (about 120 bytes each).",
        name="kv_index_max_blocks",
    )

    @model_validator(mode="after")
    def _kv_events(self) -> KvEventsSettings:
        if self.events and not self.tokenizer:
            raise _refuse("--kv-events needs --kv-tokenizer: the events carry token ids")
        if self.events and self.events != "auto" and not self.events.startswith(("tcp://", "ipc://")):
            raise _refuse(
                "kv_events must be a tcp:// or ipc:// endpoint template, or auto, got {value}", value=self.events
            )
        return self


class PdSettings(SettingsGroup):
    """Prefill/decode disaggregation."""

    title: ClassVar[str] = "Prefill/decode disaggregation (--serving-strategy DistServe)"

    serving_strategy: str = _setting(
        "Hybrid",
        (
            "Hybrid: each request to one node. DistServe: prefill on a prefill node, decode on a decode node, the"
            " KV cache migrated between them (LMDeploy's protocol)."
        ),
    )
    protocol: str = _setting(
        "lmdeploy",
        (
            "Disaggregation protocol with DistServe: lmdeploy (DistServe: migration handle, link pool), vllm "
            "(kv_transfer_params, NixlConnector) or sglang (bootstrap rendezvous, both legs at once)."
        ),
        name="pd_protocol",
    )
    dummy_prefill: bool = _setting(
        False,
        "DistServe without prefill nodes, to benchmark decode (as LMDeploy).",
    )
    migration_protocol: str = _setting(
        "RDMA",
        "DistServe (lmdeploy): how the engines move KV between them, as LMDeploy's proxy: RDMA or NVLINK.",
    )
    link_type: str = _setting(
        "RoCE",
        "DistServe (lmdeploy): the RDMA link type, as LMDeploy's proxy: RoCE or IB.",
    )
    disable_gdr: bool = _setting(
        False,
        "DistServe (lmdeploy): move KV through host memory instead of GPU-direct RDMA (as LMDeploy's flag).",
    )
    link_timeout: Seconds = _setting(
        10.0,
        "Seconds for each call of a link handshake.",
        name="pd_link_timeout",
    )
    link_attempts: AtLeastOne = _setting(
        3,
        "Handshake attempts per link before it fails.",
        name="pd_link_attempts",
    )
    link_backoff: Seconds = _setting(
        0.5,
        "Seconds before the first handshake retry (doubling).",
        name="pd_link_backoff",
    )
    link_wait_timeout: Seconds = _setting(
        30.0,
        "Seconds a request waits for its link to connect.",
        name="pd_link_wait_timeout",
    )
    session_ttl: Seconds = _setting(
        600.0,
        "Seconds after which a preserved prefill session is freed if decode never took it.",
        name="pd_session_ttl",
    )
    free_timeout: Seconds = _setting(
        5.0,
        "Seconds for each /distserve/free_cache call.",
        name="pd_free_timeout",
    )
    free_attempts: AtLeastOne = _setting(
        3,
        "Attempts to free a preserved session.",
        name="pd_free_attempts",
    )
    warmup_concurrency: AtLeastOne = _setting(
        8,
        "Handshakes run at once by /distserve/connection_warmup.",
        name="pd_warmup_concurrency",
    )

    @field_validator("serving_strategy")
    @classmethod
    def _strategy(cls, value: str) -> str:
        if value not in ("Hybrid", "DistServe"):
            raise _refuse("serving_strategy must be Hybrid or DistServe, got {value!r}", value=value)
        return value

    @field_validator("protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        if value not in ("lmdeploy", "vllm", "sglang"):
            raise _refuse("pd_protocol must be lmdeploy, vllm or sglang, got {value!r}", value=value)
        return value

    @field_validator("migration_protocol")
    @classmethod
    def _migration(cls, value: str) -> str:
        if value.upper() not in MIGRATION_PROTOCOLS:
            raise _refuse("migration_protocol must be RDMA or NVLINK, got {value!r}", value=value)
        return value.upper()

    @field_validator("link_type")
    @classmethod
    def _link(cls, value: str) -> str:
        link_type = {t.lower(): t for t in LINK_TYPES}.get(value.lower())
        if link_type is None:
            raise _refuse("link_type must be RoCE or IB, got {value!r}", value=value)
        return link_type


class SecuritySettings(SettingsGroup):
    """Keys, TLS, CORS and which nodes may be added."""

    title: ClassVar[str] = "Keys, TLS and CORS"

    api_keys: Several = _setting(
        (),
        (
            "API key clients must send as `Authorization: Bearer KEY` for inference; repeat for several "
            "(environment: separated by spaces). None: inference is open."
        ),
    )
    admin_keys: Several = _setting(
        (),
        (
            "Key for the management API (/nodes/*); repeat for several. When API keys are set and admin keys are "
            "not, management requires an API key."
        ),
    )
    api_keys_file: str = _setting(
        "",
        (
            "File of API keys, one per line (# starts a comment), added to --api-keys: keys given on the command "
            "line are visible to every user of the machine (ps)."
        ),
    )
    admin_keys_file: str = _setting(
        "",
        "File of admin keys, one per line, added to --admin-keys.",
    )
    keyless_registration_cidrs: Several = _setting(
        (),
        (
            "Networks (e.g. 10.0.0.0/8) whose hosts may POST /nodes/add without a key while keys guard "
            "management, so that unchanged LMDeploy api_servers (which send none) can register; only for networks"
            " you trust. Repeat for several."
        ),
        flag="--keyless-registration-from",
    )
    allow_node_cidrs: Several = _setting(
        (),
        ("Only nodes whose addresses fall in these networks may be added (e.g. 10.0.0.0/8); repeat for several."),
        flag="--allow-node-cidr",
    )
    ssl: bool = _setting(
        False,
        (
            "Serve HTTPS, as LMDeploy's --ssl: the certificate and key come from SSL_CERTFILE and SSL_KEYFILE "
            "(LMDeploy's variables) or --ssl-certfile/--ssl-keyfile."
        ),
    )
    ssl_certfile: str = _setting(
        "",
        "With --ssl: the server's certificate chain (PEM).",
        env_aliases=("SSL_CERTFILE",),
    )
    ssl_keyfile: str = _setting(
        "",
        "With --ssl: the server's private key (PEM).",
        env_aliases=("SSL_KEYFILE",),
    )
    node_ca_file: str = _setting(
        "",
        "CA certificates (PEM) that https:// nodes are verified against (empty: the system's roots).",
    )
    node_api_key: str = _setting(
        "",
        (
            "Key sent as `Authorization: Bearer` to every node that has none of its own (--node without api_key=,"
            " nodes found in Kubernetes or DNS, added by /add_worker or /nodes/add); the peers' --api-key."
        ),
    )
    allow_origins: Several = _setting(
        ("*",),
        (
            "CORS on the inference routes, as LMDeploy's api_server: origins browsers may call from (* for any); "
            "several after one flag or repeated. Management routes never answer CORS."
        ),
    )
    allow_credentials: bool = _setting(
        False,
        "CORS: allow credentials (needs explicit --allow-origins, never *).",
    )
    allow_methods: Several = _setting(
        ("*",),
        "CORS: methods browsers may use (* for any).",
    )
    allow_headers: Several = _setting(
        ("*",),
        "CORS: request headers browsers may send (* for any).",
    )

    @field_validator("allow_node_cidrs", "keyless_registration_cidrs")
    @classmethod
    def _networks(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as e:
                why = str(e)
                raise _refuse(
                    "{name}: {cidr!r} is not a network ({why})", name=info.field_name, cidr=cidr, why=why
                ) from None
        return value

    @model_validator(mode="after")
    def _keys_and_tls(self) -> SecuritySettings:
        for keys, path in (("api_keys", self.api_keys_file), ("admin_keys", self.admin_keys_file)):
            if path:
                given: tuple[str, ...] = getattr(self, keys)
                extra = tuple(k for k in _read_keys(path) if k not in given)
                object.__setattr__(self, keys, (*given, *extra))  # frozen; still its construction
        if any(not key for key in (*self.api_keys, *self.admin_keys)):
            raise _refuse("api_keys and admin_keys must not contain empty keys")
        if self.ssl and not (self.ssl_certfile and self.ssl_keyfile):
            raise _refuse(
                "--ssl needs a certificate and its key: set SSL_CERTFILE and SSL_KEYFILE (as for LMDeploy) "
                "or --ssl-certfile and --ssl-keyfile"
            )
        if self.allow_credentials and "*" in self.allow_origins:
            raise _refuse("--allow-credentials needs the origins named in --allow-origins: never * with credentials")
        return self


class TenantSettings(SettingsGroup):
    """Per-key limits, priorities and usage."""

    title: ClassVar[str] = "Tenants: per-key limits, priorities and usage"

    file: str = _setting(
        "",
        (
            "TOML file of tenants: each one's API keys, limits (requests and tokens per minute, requests at once,"
            " a daily token budget) and priority. Reloaded when it changes and on SIGHUP. With tenants, inference"
            " needs a tenant's key or an API key."
        ),
        name="tenants_file",
    )
    sync_interval: Seconds = _setting(
        1.0,
        (
            "With --registry: seconds between two exchanges of tenant usage with the other replicas (a limit "
            "holds across replicas within what they admit in one interval)."
        ),
        name="tenant_sync_interval",
    )


class ObservabilitySettings(SettingsGroup):
    """Access log and tracing."""

    title: ClassVar[str] = "Metrics, access log and tracing (OpenTelemetry, OTLP/HTTP)"

    metrics_port: NotNegative = _setting(
        0,
        (
            "Also serve /metrics on this port, for scrapers kept apart from the traffic (the same key rules as "
            "on the serving port). 0: only on the serving port."
        ),
        aliases=("--prometheus-port",),
    )
    metrics_host: str = _setting(
        "",
        "Address the --metrics-port listener binds. Empty: --host.",
        aliases=("--prometheus-host",),
    )
    access_log: bool = _setting(
        False,
        "Write one line per inference request to stdout.",
    )
    access_log_format: str = _setting(
        "text",
        "Access log lines: text or json.",
    )
    otlp_endpoint: str = _setting(
        "",
        (
            "Trace requests and export their spans over OTLP/HTTP (JSON) to this URL, e.g. "
            "http://127.0.0.1:4318/v1/traces. Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or "
            "OTEL_EXPORTER_OTLP_ENDPOINT plus /v1/traces; neither: requests are not traced (and the client's "
            "traceparent reaches the node unchanged)."
        ),
    )
    otlp_headers: Several = _setting(
        (),
        (
            "NAME=VALUE header sent with every export (repeat for several). Unset: "
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS or OTEL_EXPORTER_OTLP_HEADERS."
        ),
        flag="--otlp-header",
    )
    service_name: str = _setting(
        "",
        "service.name of the spans. Unset: OTEL_SERVICE_NAME, else pdproxy.",
    )
    trace_sampler: str = _setting(
        "",
        (
            "Which traces are recorded: always_on, always_off, traceidratio, parentbased_always_on, "
            "parentbased_always_off, parentbased_traceidratio. Unset: OTEL_TRACES_SAMPLER, else "
            "parentbased_always_on. Unrecorded traces are still passed on to the nodes."
        ),
    )
    trace_sampler_arg: float = _setting(
        -1.0,
        "The ratio of the traceidratio samplers (0 to 1). Unset: OTEL_TRACES_SAMPLER_ARG, else 1.",
        shown_default="",  # -1 marks it unset
    )

    @field_validator("access_log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("text", "json"):
            raise _refuse("access_log_format must be text or json, got {value!r}", value=value)
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value and not value.startswith("http://"):
            raise _refuse(
                "otlp_endpoint must be an http:// URL (export to a local collector), got {value!r}", value=value
            )
        return value

    @field_validator("otlp_headers")
    @classmethod
    def _headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any("=" not in header for header in value):
            raise _refuse("otlp_headers must be NAME=VALUE pairs")
        return value

    @field_validator("trace_sampler_arg")
    @classmethod
    def _ratio(cls, value: float) -> float:
        if value != -1.0 and not 0 <= value <= 1:  # -1: unset, OTEL_TRACES_SAMPLER_ARG decides
            raise _refuse("trace_sampler_arg must be between 0 and 1, got {value}", value=value)
        return value


#: The groups, in the order `pdproxy serve --help` shows them.
GROUPS: tuple[type[SettingsGroup], ...] = (
    ServerSettings,
    DiscoverySettings,
    RegistrySettings,
    RoutingSettings,
    LimitsSettings,
    TimeoutSettings,
    PdSettings,
    SecuritySettings,
    HealthSettings,
    EngineMetricsSettings,
    KvEventsSettings,
    ReplicaShareSettings,
    TenantSettings,
    ObservabilitySettings,
)


class Settings(BaseModel):
    """Configuration of a pdproxy server or embedded router: one attribute per group
    (``settings.health.interval``, ``settings.timeouts.connect``).

    Built from the settings' own names, flat (``Settings(health_interval=1.0)``, as the CLI, the
    environment and the TOML file spell them; ``FLAT`` says which group holds each), or from
    whole groups (``Settings(health=HealthSettings(interval=1.0))``)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    # The order of the flat settings (``flat``, ``--print-config``) follows these.
    server: ServerSettings = Field(default_factory=ServerSettings)
    membership: RegistrySettings = Field(default_factory=RegistrySettings)
    replicas: ReplicaShareSettings = Field(default_factory=ReplicaShareSettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    engine_metrics: EngineMetricsSettings = Field(default_factory=EngineMetricsSettings)
    kv: KvEventsSettings = Field(default_factory=KvEventsSettings)
    pd: PdSettings = Field(default_factory=PdSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    tenants: TenantSettings = Field(default_factory=TenantSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)

    def __init__(self, **values: object) -> None:
        try:
            # Values of any type: checking them is pydantic's job here, and a refusal is a ConfigError.
            super().__init__(**_grouped(values, None))
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None

    def replace(self, **changes: object) -> Settings:
        """A copy with some settings changed (flat names or whole groups; the groups they touch
        validated again)."""
        try:
            groups = _grouped(changes, self)
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None
        unknown = [name for name in groups if name not in GROUP_ATTRS]
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]}")
        return self.model_copy(update=groups)

    def flat(self, mode: str = "python") -> dict[str, object]:
        """Every setting by its own name (``health_interval``), as the CLI, the environment and
        the TOML file name them."""
        out: dict[str, object] = {}
        for attr in GROUP_ATTRS:
            out.update(getattr(self, attr).model_dump(mode=mode))
        return out

    def to_json(self) -> str:
        return self.model_dump_json()

    def redacted(self) -> dict[str, object]:
        """The settings, flat, with key material hidden, for printing and logs (nodes' keys too:
        ``NodeRecord.redacted``)."""
        out = self.flat(mode="json")
        for name in SECRET_FIELDS:
            value = out[name]
            out[name] = ["<hidden>"] * len(value) if isinstance(value, list) else "<hidden>" if value else ""
        return out

    @classmethod
    def from_json(cls, text: str) -> Settings:
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None

    @classmethod
    def from_toml(cls, path: str | Path) -> Settings:
        return cls(**load_toml(path))

    @classmethod
    def group_of(cls, name: str) -> type[SettingsGroup]:
        """The group that declares setting ``name``."""
        return GROUP_CLASSES[FLAT[name]]


#: Each group's attribute on ``Settings`` and its class.
GROUP_CLASSES: dict[str, type[SettingsGroup]] = {
    attr: field.annotation  # type: ignore[misc]
    for attr, field in Settings.model_fields.items()
}
GROUP_ATTRS = tuple(GROUP_CLASSES)


def flat_name(name: str, field: FieldInfo) -> str:
    """The flat name of the setting that a group declares as field ``name``: its alias
    (``health_interval`` for ``interval``), else the field's name."""
    return field.alias or name


#: Each setting's flat name and the attribute of the group that holds it (``health_interval``:
#: ``health``), built once from the groups.
FLAT: dict[str, str] = {
    flat_name(name, field): attr for attr, group in GROUP_CLASSES.items() for name, field in group.model_fields.items()
}
#: Each setting's flat name and its field (default, help, CLI spelling).
FIELDS: dict[str, FieldInfo] = {
    flat_name(name, field): field for group in GROUP_CLASSES.values() for name, field in group.model_fields.items()
}


def _grouped(values: Mapping[str, object], base: Settings | None) -> dict[str, object]:
    """``values`` by group: each group given by setting names built (over ``base``'s, if any),
    groups given whole kept, and unknown names passed on for pydantic to refuse."""
    out: dict[str, object] = {}
    fields: dict[str, dict[str, object]] = {}
    for name, value in values.items():
        attr = FLAT.get(name)
        if attr is None:
            out[name] = value
        else:
            fields.setdefault(attr, {})[name] = value
    for attr, given in fields.items():
        if attr in out:
            raise ConfigError(f"{attr} is given whole and by its settings ({', '.join(given)})")
        current = getattr(base, attr).model_dump() if base is not None else {}
        out[attr] = GROUP_CLASSES[attr](**{**current, **given})
    return out


@functools.cache
def defaults() -> Settings:
    """Every setting at its default (for code that also runs outside ``pdproxy serve``)."""
    return Settings()


def settings_message(error: ValidationError) -> str:
    """The first problem of ``error`` in one line, naming the setting."""
    first = error.errors()[0]
    if first["type"] == REFUSED:
        return first["msg"]
    loc = first["loc"]
    if len(loc) > 1 and loc[0] in GROUP_ATTRS:
        loc = loc[1:]  # a setting is named by its own name, not its group's
    where = ".".join(str(part) for part in loc)
    if first["type"] == REFUSED_VALUE:
        return f"{where} {first['msg']}"
    if first["type"] == "extra_forbidden":
        return f"unknown setting {where}"
    return f"{where}: {first['msg']}" if where else first["msg"]


def setting_flag(name: str, field: FieldInfo) -> str:
    """The command-line flag of setting ``name`` (``field``, of any settings model): its own
    spelling (``--node`` for ``nodes``), else its name with dashes."""
    extra = field.json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return str(flag) if flag else "--" + name.replace("_", "-")


def setting_kind(field: FieldInfo) -> type:
    """The Python type of a setting as the CLI reads it: str, int, float, bool or tuple."""
    annotation = field.annotation
    return tuple if getattr(annotation, "__origin__", None) is tuple else annotation  # type: ignore[return-value]


def _read_keys(path: str) -> list[str]:
    """Keys from a file: one per line, blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise _refuse("cannot read the key file {path}: {why}", path=path, why=e.strerror or str(e)) from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def read_toml(path: str | Path, what: str) -> dict[str, object]:
    """The TOML file at ``path``; a file that cannot be read or parsed is one ``ConfigError``
    naming ``what`` it is (``config file``, ``tenants file``)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the {what} {path} is not valid TOML: {e}") from None


@functools.cache
def _option_keys() -> dict[str, str]:
    """Each setting's key in a settings file, the option's name with underscores (``node`` for
    ``--node``), and the setting it sets."""
    return {setting_flag(name, field).removeprefix("--").replace("-", "_"): name for name, field in FIELDS.items()}


@functools.cache
def toml_keys() -> dict[str, str]:
    """Each top-level key a settings file may use, and the setting it sets: the option keys, and
    each setting's own name where that differs (``nodes``: the older spelling, and what
    ``--print-config`` shows)."""
    return {**{name: name for name in FIELDS}, **_option_keys()}


def _unknown_key(key: str) -> str:
    closest = difflib.get_close_matches(key, list(_option_keys()), n=1, cutoff=0.6)
    return f"{key} (did you mean {closest[0]}?)" if closest else key


def load_toml(path: str | Path) -> dict[str, object]:
    """Reads a TOML settings file: top-level keys are the options' names with underscores
    (``node = [...]``; ``toml_keys``)."""
    read = read_toml(path, "config file")
    keys = toml_keys()
    unknown = sorted(key for key in read if key not in keys)
    if unknown:
        raise ConfigError(f"unknown setting(s) in {path}: {', '.join(_unknown_key(k) for k in unknown)}")
    data: dict[str, object] = {}
    for key, value in read.items():
        name = keys[key]
        if name in data:
            raise ConfigError(f"{path}: {name} is given twice (as {_spellings(name, read)})")
        data[name] = value
    nodes = data.get("nodes")
    if isinstance(nodes, list):
        # A node may be a table of what /nodes/add would say of it: kept as its one-word form.
        data["nodes"] = [_node_text(n) if isinstance(n, Mapping) else n for n in nodes]
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def _spellings(name: str, read: Mapping[str, object]) -> str:
    return " and ".join(key for key, setting in toml_keys().items() if setting == name and key in read)


def _node_text(table: Mapping[str, object]) -> str:
    """A node table as the one-word form ``URL,key=value,...`` (checked when it is read:
    ``NodeRecord.parse``)."""
    parts = [str(table.get("url", ""))]
    for key, value in table.items():
        if isinstance(value, list):
            parts += [f"{key}={v}" for v in value]
        elif isinstance(value, Mapping):
            parts += [f"{key}.{k}={v}" for k, v in value.items()]
        elif key != "url":
            parts.append(f"{key}={value}")
    return ",".join(parts)

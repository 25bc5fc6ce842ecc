"""Settings: every default of pdproxy lives here.

The CLI (`pdproxy serve`), the environment (``PDPROXY_<FIELD>``), a TOML file (``--config``)
and the embedded ``Router`` all read these fields; precedence is CLI > environment > file >
the defaults below. The Rust data plane reads the same object by attribute and declares no
defaults of its own.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _pdproxy
from .errors import ConfigError
from .group import MAX_WORKERS
from .membership import check_url as check_registry_url
from .node_spec import NodeSpec
from .tenants import load as load_tenants
from .tracing import otel_settings

__all__ = ["ENV_PREFIX", "Settings"]

ENV_PREFIX = "PDPROXY_"
#: Settings that hold key material: never printed or logged.
SECRET_FIELDS = ("api_keys", "admin_keys", "otlp_headers")


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


def _opt(
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    section: str = "proxy",
    env_aliases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Field metadata: the help text and CLI spelling of a setting (``aliases``: LMDeploy's
    spellings, so existing launch scripts keep working; ``env_aliases``: environment variables
    read after ``PDPROXY_<NAME>``, such as LMDeploy's)."""
    return {"help": help, "flag": flag, "aliases": aliases, "section": section, "env_aliases": env_aliases}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Configuration of a pdproxy server or embedded router."""

    host: str = field(
        default="127.0.0.1", metadata=_opt("Address to listen on.", aliases=("--server-name",), section="server")
    )
    port: int = field(default=8000, metadata=_opt("Port to listen on.", aliases=("--server-port",), section="server"))
    nodes: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "An inference server (LMDeploy, vLLM, SGLang api_server): its URL, optionally followed by "
            ",key=value pairs: role (hybrid, prefill, decode), model (repeatable), speed, max_concurrency, "
            "api_key, bootstrap_port; e.g. http://10.0.0.2:30000,role=prefill,model=qwen. Repeat for several; "
            "in the environment, separated by spaces; in TOML, strings or tables.",
            flag="--node",
        ),
    )
    demo: bool = field(
        default=False,
        metadata=_opt(
            "Start two built-in mock engines and route to them (try pdproxy without GPUs).", section="server"
        ),
    )
    demo_model: str = field(
        default="pdproxy-demo", metadata=_opt("Model name served by the demo mock engines.", section="server")
    )
    edge: str = field(
        default="rust",
        metadata=_opt(
            "Who serves the public address: rust (the data plane's HTTP server answers inference requests "
            "with no Python per request, and hands everything else to the control plane) or granian (the "
            "Python ASGI app serves everything, in --workers processes).",
            section="server",
        ),
    )
    edge_threads: int = field(
        default=0,
        metadata=_opt(
            "Threads of the Rust edge, which serve every request and the upstream connections (0: one per core).",
            section="server",
        ),
    )
    workers: int = field(
        default=1,
        metadata=_opt(
            "With --edge granian: granian worker processes. With more than one they share one node table: "
            "membership, health and in-flight counts (so max_concurrency holds across all of them) live in "
            "shared memory, and one worker, the leader, runs the health checks. The Rust edge uses every "
            "core in one process (--edge-threads).",
            section="server",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_opt(
            "Log level: debug, info, warning, error, critical (LMDeploy's names too, any case).", section="server"
        ),
    )
    policy: str = field(
        default="scored",
        metadata=_opt(
            "Routing policy of every role (hybrid, and prefill and decode unless their own is given): "
            "min_expected_latency (LMDeploy's default), random, min_observed_latency, "
            "min_observed_latency_per_token, min_cache_usage (LMDeploy's), round_robin, least_requests, "
            "consistent_hash, prefix, least_engine_load, scored (or scored:prefix=N,queue=N,kv=N,load=N).",
            aliases=("--routing-strategy",),
        ),
    )
    prefill_policy: str = field(default="", metadata=_opt("Routing policy for prefill nodes (empty: --policy)."))
    decode_policy: str = field(default="", metadata=_opt("Routing policy for decode nodes (empty: --policy)."))
    model_policies: tuple[str, ...] = field(
        default=(),
        metadata=_opt("MODEL=POLICY: a routing policy for one model; repeat for several.", flag="--model-policy"),
    )
    hash_load_factor: float = field(
        default=1.25,
        metadata=_opt("consistent_hash: a node keeps a key while its in-flight count is below this times the average."),
    )
    prefix_block_bytes: int = field(default=256, metadata=_opt("prefix: prompt bytes per cached block."))
    prefix_max_blocks: int = field(default=64, metadata=_opt("prefix: blocks of a prompt considered (its head)."))
    prefix_cache_entries: int = field(default=65536, metadata=_opt("prefix: prefix-to-node entries remembered."))
    prefix_balance_threshold: int = field(
        default=8,
        metadata=_opt("prefix: leave a prefix's node when it has this many more requests than the least busy one."),
    )
    prefix_bytes_per_token: float = field(
        default=4.0,
        metadata=_opt(
            "scored: prompt bytes per engine token, to size a node's share of the prefix table from the KV "
            "capacity its engine reports."
        ),
    )
    score_prefix_weight: float = field(
        default=2.0,
        metadata=_opt(
            "scored: cost of each KiB of the prompt a node would have to prefill (not in its cache), against "
            "1 for each KiB of prompts already waiting there for their first token."
        ),
    )
    score_queue_weight: float = field(
        default=0.5,
        metadata=_opt(
            "scored: cost of each request waiting for a place in the node's engine's batch (0.5: the best "
            "of 0.25, 0.5 and 1 in bench/fleet.py)."
        ),
    )
    score_kv_weight: float = field(
        default=1.0, metadata=_opt("scored: cost of a full KV cache (scaled by the engine's usage, 0 to 1).")
    )
    score_load_weight: float = field(
        default=0.0,
        metadata=_opt("scored: cost of each request pdproxy has in flight on the node, decoding ones included."),
    )
    engine_metrics_interval: float = field(
        default=2.0,
        metadata=_opt(
            "Seconds between readings of each node's /metrics (running and waiting requests, KV-cache usage "
            "and prefix-cache hits, in vLLM's, SGLang's or LMDeploy's names); 0: never read them.",
            section="health",
        ),
    )
    engine_metrics_timeout: float = field(
        default=1.0, metadata=_opt("Seconds a node's /metrics may take.", section="health")
    )
    engine_metrics_max_age: float = field(
        default=10.0,
        metadata=_opt("Seconds after which a node's engine figures are too old to route by.", section="health"),
    )
    engine_metrics_concurrency: int = field(
        default=16, metadata=_opt("Nodes whose /metrics are read at once.", section="health")
    )
    engine_metrics_max_bytes: int = field(
        default=4 << 20, metadata=_opt("Largest /metrics answer read from a node, in bytes.", section="health")
    )
    queue_size: int = field(
        default=256,
        metadata=_opt("Requests that may wait when every node is at its limit (0: refuse at once with 429)."),
    )
    queue_timeout: float = field(default=30.0, metadata=_opt("Seconds a request may wait in the queue before 429."))
    runtime_threads: int = field(default=2, metadata=_opt("Threads of the data plane's I/O runtime."))
    connect_timeout: float = field(default=2.0, metadata=_opt("Seconds to connect to a node."))
    first_byte_timeout: float = field(
        default=300.0,
        metadata=_opt("Seconds from sending a request to a node until its response head (covers long prefills)."),
    )
    pool_idle_timeout: float = field(
        default=60.0, metadata=_opt("Seconds an idle keep-alive connection to a node is kept.")
    )
    pool_max_idle_per_node: int = field(default=256, metadata=_opt("Idle keep-alive connections kept per node."))
    prefetch_limit: int = field(
        default=1 << 20,
        metadata=_opt("Non-streaming responses up to this many bytes are read whole before forwarding."),
    )
    request_timeout: float = field(
        default=0.0,
        metadata=_opt("Seconds a whole request may take, queueing and streaming included (0: no limit)."),
    )
    retries: int = field(
        default=2,
        metadata=_opt(
            "Further nodes a request may try when one provably did not run it (connect failure, or a 429/503 "
            "answer before any byte); never after a node started work."
        ),
    )
    retry_budget_ratio: float = field(
        default=0.2, metadata=_opt("Retries may add at most this share of recent requests (plus the floor).")
    )
    retry_budget_floor: int = field(default=10, metadata=_opt("Retries always allowed per 10 s, whatever the traffic."))
    circuit_failures: int = field(
        default=5,
        metadata=_opt("Consecutive failures that open a node's circuit (no traffic until a probe succeeds); 0: off."),
    )
    circuit_cooldown: float = field(
        default=10.0, metadata=_opt("Seconds an open circuit keeps traffic away before one request probes the node.")
    )
    stream_idle_timeout: float = field(
        default=120.0, metadata=_opt("Seconds a streaming response may stay silent before it is cut off.")
    )
    stream_buffer_limit: int = field(
        default=1 << 20,
        metadata=_opt("Bytes of a stream kept for a client that reads slowly before the node's stream is held back."),
    )
    max_requests: int = field(
        default=4096,
        metadata=_opt(
            "Inference requests served at once by this proxy; past it 503 with Retry-After (0: no cap). With "
            "each stream's buffers bounded by --stream-buffer-limit, this bounds the proxy's memory."
        ),
    )
    body_timeout: float = field(
        default=30.0, metadata=_opt("Seconds a client may take to send its request body (then 408).")
    )
    header_read_timeout: float = field(
        default=10.0,
        metadata=_opt("Seconds a client may take to send a request's headers (Rust edge; then the connection closes)."),
    )
    stream_stall_timeout: float = field(
        default=60.0,
        metadata=_opt("Seconds a client may stop reading a stream before it is cut off and the node freed."),
    )
    drain_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "Seconds a drain (POST /drain, SIGTERM) waits for requests in flight before exiting.", section="server"
        ),
    )
    access_log: bool = field(
        default=False, metadata=_opt("Write one line per inference request to stdout.", section="server")
    )
    access_log_format: str = field(default="text", metadata=_opt("Access log lines: text or json.", section="server"))
    max_body_size: int = field(
        default=8 << 20, metadata=_opt("Largest request body accepted, in bytes (checked while it is read).")
    )
    serving_strategy: str = field(
        default="Hybrid",
        metadata=_opt(
            "Hybrid: each request to one node. DistServe: prefill on a prefill node, decode on a decode node, "
            "the KV cache migrated between them (LMDeploy's protocol).",
            section="pd",
        ),
    )
    pd_protocol: str = field(
        default="lmdeploy",
        metadata=_opt(
            "Disaggregation protocol with DistServe: lmdeploy (DistServe: migration handle, link pool), vllm "
            "(kv_transfer_params, NixlConnector) or sglang (bootstrap rendezvous, both legs at once).",
            section="pd",
        ),
    )
    dummy_prefill: bool = field(
        default=False,
        metadata=_opt("DistServe without prefill nodes, to benchmark decode (as LMDeploy).", section="pd"),
    )
    migration_protocol: str = field(
        default="RDMA",
        metadata=_opt(
            "DistServe (lmdeploy): how the engines move KV between them, as LMDeploy's proxy: RDMA or NVLINK.",
            section="pd",
        ),
    )
    link_type: str = field(
        default="RoCE",
        metadata=_opt("DistServe (lmdeploy): the RDMA link type, as LMDeploy's proxy: RoCE or IB.", section="pd"),
    )
    disable_gdr: bool = field(
        default=False,
        metadata=_opt(
            "DistServe (lmdeploy): move KV through host memory instead of GPU-direct RDMA (as LMDeploy's flag).",
            section="pd",
        ),
    )
    pd_link_timeout: float = field(
        default=10.0, metadata=_opt("Seconds for each call of a link handshake.", section="pd")
    )
    pd_link_attempts: int = field(
        default=3, metadata=_opt("Handshake attempts per link before it fails.", section="pd")
    )
    pd_link_backoff: float = field(
        default=0.5, metadata=_opt("Seconds before the first handshake retry (doubling).", section="pd")
    )
    pd_link_wait_timeout: float = field(
        default=30.0, metadata=_opt("Seconds a request waits for its link to connect.", section="pd")
    )
    pd_session_ttl: float = field(
        default=600.0,
        metadata=_opt(
            "Seconds after which a preserved prefill session is freed if decode never took it.", section="pd"
        ),
    )
    pd_free_timeout: float = field(
        default=5.0, metadata=_opt("Seconds for each /distserve/free_cache call.", section="pd")
    )
    pd_free_attempts: int = field(default=3, metadata=_opt("Attempts to free a preserved session.", section="pd"))
    pd_warmup_concurrency: int = field(
        default=8, metadata=_opt("Handshakes run at once by /distserve/connection_warmup.", section="pd")
    )
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "API key clients must send as `Authorization: Bearer KEY` for inference; repeat for several "
            "(environment: separated by spaces). None: inference is open.",
            section="security",
        ),
    )
    admin_keys: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "Key for the management API (/nodes/*); repeat for several. When API keys are set and admin keys "
            "are not, management requires an API key.",
            section="security",
        ),
    )
    keyless_registration_cidrs: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "Networks (e.g. 10.0.0.0/8) whose hosts may POST /nodes/add without a key while keys guard "
            "management, so that unchanged LMDeploy api_servers (which send none) can register; only for "
            "networks you trust. Repeat for several.",
            flag="--keyless-registration-from",
            section="security",
        ),
    )
    ssl: bool = field(
        default=False,
        metadata=_opt(
            "Serve HTTPS, as LMDeploy's --ssl: the certificate and key come from SSL_CERTFILE and SSL_KEYFILE "
            "(LMDeploy's variables) or --ssl-certfile/--ssl-keyfile.",
            section="security",
        ),
    )
    ssl_certfile: str = field(
        default="",
        metadata=_opt(
            "With --ssl: the server's certificate chain (PEM).", section="security", env_aliases=("SSL_CERTFILE",)
        ),
    )
    ssl_keyfile: str = field(
        default="",
        metadata=_opt("With --ssl: the server's private key (PEM).", section="security", env_aliases=("SSL_KEYFILE",)),
    )
    node_ca_file: str = field(
        default="",
        metadata=_opt(
            "CA certificates (PEM) that https:// nodes are verified against (empty: the system's roots).",
            section="security",
        ),
    )
    allow_origins: tuple[str, ...] = field(
        default=("*",),
        metadata=_opt(
            "CORS on the inference routes, as LMDeploy's api_server: origins browsers may call from (* for any); "
            "several after one flag or repeated. Management routes never answer CORS.",
            section="security",
        ),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=_opt("CORS: allow credentials (needs explicit --allow-origins, never *).", section="security"),
    )
    allow_methods: tuple[str, ...] = field(
        default=("*",), metadata=_opt("CORS: methods browsers may use (* for any).", section="security")
    )
    allow_headers: tuple[str, ...] = field(
        default=("*",), metadata=_opt("CORS: request headers browsers may send (* for any).", section="security")
    )
    api_keys_file: str = field(
        default="",
        metadata=_opt(
            "File of API keys, one per line (# starts a comment), added to --api-keys: keys given on the "
            "command line are visible to every user of the machine (ps).",
            section="security",
        ),
    )
    admin_keys_file: str = field(
        default="",
        metadata=_opt("File of admin keys, one per line, added to --admin-keys.", section="security"),
    )
    tenants_file: str = field(
        default="",
        metadata=_opt(
            "TOML file of tenants: each one's API keys, limits (requests and tokens per minute, requests at "
            "once, a daily token budget) and priority. Reloaded when it changes and on SIGHUP. With tenants, "
            "inference needs a tenant's key or an API key.",
            section="tenants",
        ),
    )
    tenant_sync_interval: float = field(
        default=1.0,
        metadata=_opt(
            "With --registry: seconds between two exchanges of tenant usage with the other replicas (a "
            "limit holds across replicas within what they admit in one interval).",
            section="tenants",
        ),
    )
    allow_node_cidrs: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "Only nodes whose addresses fall in these networks may be added (e.g. 10.0.0.0/8); repeat for several.",
            flag="--allow-node-cidr",
            section="security",
        ),
    )
    health_interval: float = field(
        default=5.0, metadata=_opt("Seconds between health checks of each node.", section="health")
    )
    health_timeout: float = field(default=2.0, metadata=_opt("Seconds a node's /health may take.", section="health"))
    health_fall: int = field(
        default=3, metadata=_opt("Consecutive failed checks that mark a node unhealthy.", section="health")
    )
    health_rise: int = field(
        default=2, metadata=_opt("Consecutive good checks that bring an unhealthy node back.", section="health")
    )
    health_remove_after: float = field(
        default=0.0,
        metadata=_opt("Remove a node unhealthy for this many seconds (0: never remove).", section="health"),
    )
    admin_timeout: float = field(
        default=5.0, metadata=_opt("Seconds for calls the management API makes to a node (/terminate).")
    )
    registry: str = field(
        default="",
        metadata=_opt(
            "Share node membership with other pdproxy replicas through Redis (redis://HOST:PORT/DB): a node "
            "registered on one is routed to by all; leases expire in Redis. Each replica keeps its own health "
            "view and in-flight counts. Empty: membership is this proxy's own."
        ),
    )
    state_file: str = field(
        default="",
        metadata=_opt(
            "JSON file where registered nodes are saved and reloaded at start (empty: off).", section="server"
        ),
    )
    disable_cache_status: bool = field(
        default=False,
        metadata=_opt(
            "Start without the nodes saved in --state-file (as LMDeploy's flag: forget the previous run's nodes).",
            section="server",
        ),
    )
    discovery_timeout: float = field(
        default=2.0, metadata=_opt("Seconds to wait for a node's /v1/models when discovering its models.")
    )
    discovery_interval: float = field(
        default=5.0, metadata=_opt("Seconds between retries of model discovery for nodes that have not answered yet.")
    )
    otlp_endpoint: str = field(
        default="",
        metadata=_opt(
            "Trace requests and export their spans over OTLP/HTTP (JSON) to this URL, e.g. "
            "http://127.0.0.1:4318/v1/traces. Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or "
            "OTEL_EXPORTER_OTLP_ENDPOINT plus /v1/traces; neither: requests are not traced (and the "
            "client's traceparent reaches the node unchanged).",
            section="tracing",
        ),
    )
    otlp_headers: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "NAME=VALUE header sent with every export (repeat for several). Unset: "
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS or OTEL_EXPORTER_OTLP_HEADERS.",
            flag="--otlp-header",
            section="tracing",
        ),
    )
    service_name: str = field(
        default="",
        metadata=_opt("service.name of the spans. Unset: OTEL_SERVICE_NAME, else pdproxy.", section="tracing"),
    )
    trace_sampler: str = field(
        default="",
        metadata=_opt(
            "Which traces are recorded: always_on, always_off, traceidratio, parentbased_always_on, "
            "parentbased_always_off, parentbased_traceidratio. Unset: OTEL_TRACES_SAMPLER, else "
            "parentbased_always_on. Unrecorded traces are still passed on to the nodes.",
            section="tracing",
        ),
    )
    trace_sampler_arg: float = field(
        default=-1.0,
        metadata=_opt(
            "The ratio of the traceidratio samplers (0 to 1). Unset: OTEL_TRACES_SAMPLER_ARG, else 1.",
            section="tracing",
        ),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if field_type(f) is tuple and isinstance(value, str | list):
                object.__setattr__(self, f.name, (value,) if isinstance(value, str) else tuple(value))
        for keys, path in (("api_keys", self.api_keys_file), ("admin_keys", self.admin_keys_file)):
            if path:
                extra = tuple(k for k in _read_keys(path) if k not in getattr(self, keys))
                object.__setattr__(self, keys, (*getattr(self, keys), *extra))
        for name, value in otel_settings(self, os.environ).items():
            object.__setattr__(self, name, value)
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        self._check_choices()
        self._check_numbers()
        self._check_security()
        self._check_features()
        self.node_specs()  # each node parses

    def _check_choices(self) -> None:
        if not 0 < self.port < 65536 and self.port != 0:
            raise ConfigError(f"port must be between 1 and 65535, got {self.port}")
        if self.edge not in ("rust", "granian"):
            raise ConfigError(f"edge must be rust or granian, got {self.edge!r}")
        if self.workers > MAX_WORKERS:
            raise ConfigError(f"--workers is at most {MAX_WORKERS}, got {self.workers}")
        if self.edge == "rust" and self.workers != 1:
            raise ConfigError("--workers is for --edge granian; the Rust edge uses every core in one process")
        if self.edge_threads < 0:
            raise ConfigError(f"edge_threads must not be negative, got {self.edge_threads}")
        if self.registry:
            check_registry_url(self.registry)
        if self.serving_strategy not in ("Hybrid", "DistServe"):
            raise ConfigError(f"serving_strategy must be Hybrid or DistServe, got {self.serving_strategy!r}")
        if self.access_log_format not in ("text", "json"):
            raise ConfigError(f"access_log_format must be text or json, got {self.access_log_format!r}")
        if self.pd_protocol not in ("lmdeploy", "vllm", "sglang"):
            raise ConfigError(f"pd_protocol must be lmdeploy, vllm or sglang, got {self.pd_protocol!r}")
        if self.migration_protocol.upper() not in MIGRATION_PROTOCOLS:
            raise ConfigError(f"migration_protocol must be RDMA or NVLINK, got {self.migration_protocol!r}")
        object.__setattr__(self, "migration_protocol", self.migration_protocol.upper())
        link_type = {t.lower(): t for t in LINK_TYPES}.get(self.link_type.lower())
        if link_type is None:
            raise ConfigError(f"link_type must be RoCE or IB, got {self.link_type!r}")
        object.__setattr__(self, "link_type", link_type)
        level = LOG_LEVELS.get(self.log_level.lower())
        if level is None:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)} (any case); got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)
        self._check_policies()

    def _check_policies(self) -> None:
        """Names the data plane knows (its list: `_pdproxy.POLICY_NAMES`), for every role and model."""
        known = _pdproxy.POLICY_NAMES
        named = [("policy", self.policy), ("prefill_policy", self.prefill_policy or self.policy)]
        named.append(("decode_policy", self.decode_policy or self.policy))
        for entry in self.model_policies:
            model, sep, name = entry.partition("=")
            if not sep or not model.strip():
                raise ConfigError(f"model policy {entry!r} must read MODEL=POLICY")
            named.append((f"model policy for {model.strip()}", name))
        for what, name in named:
            # `scored:prefix=2,queue=0.5` names the policy and its weights (the data plane checks those).
            base, weighted, _ = name.strip().partition(":")
            if base not in known:
                raise ConfigError(f"unknown routing policy {name!r} ({what}); known: {', '.join(known)}")
            if weighted and base != "scored":
                raise ConfigError(f"routing policy {name!r} ({what}): only scored takes weights (scored:queue=0.5)")

    def _check_numbers(self) -> None:
        for name in (
            "workers",
            "runtime_threads",
            "pool_max_idle_per_node",
            "max_body_size",
            "stream_buffer_limit",
            "prefix_block_bytes",
            "prefix_max_blocks",
            "prefix_cache_entries",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "connect_timeout",
            "first_byte_timeout",
            "queue_timeout",
            "stream_idle_timeout",
            "circuit_cooldown",
            "body_timeout",
            "header_read_timeout",
            "stream_stall_timeout",
            "drain_timeout",
            "pool_idle_timeout",
            "discovery_timeout",
            "discovery_interval",
            "health_interval",
            "health_timeout",
            "admin_timeout",
            "tenant_sync_interval",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        for name in ("pd_link_attempts", "pd_free_attempts", "pd_warmup_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("pd_link_timeout", "pd_link_backoff", "pd_link_wait_timeout", "pd_session_ttl", "pd_free_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.health_fall < 1 or self.health_rise < 1:
            raise ConfigError("health_fall and health_rise must be at least 1")
        if self.health_remove_after < 0:
            raise ConfigError(f"health_remove_after must not be negative, got {self.health_remove_after}")
        if self.request_timeout < 0:
            raise ConfigError(f"request_timeout must not be negative, got {self.request_timeout}")
        if not 0 <= self.retry_budget_ratio <= 1:
            raise ConfigError(f"retry_budget_ratio must be between 0 and 1, got {self.retry_budget_ratio}")
        for name in ("score_prefix_weight", "score_queue_weight", "score_kv_weight", "score_load_weight"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a non-negative number, got {getattr(self, name)}")
        if not 0 < self.prefix_bytes_per_token < float("inf"):
            raise ConfigError(f"prefix_bytes_per_token must be a positive number, got {self.prefix_bytes_per_token}")
        if not 0 <= self.engine_metrics_interval < float("inf"):
            raise ConfigError(f"engine_metrics_interval must not be negative, got {self.engine_metrics_interval}")
        for name in ("engine_metrics_timeout", "engine_metrics_max_age"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.engine_metrics_concurrency < 1:
            raise ConfigError(f"engine_metrics_concurrency must be at least 1, got {self.engine_metrics_concurrency}")
        if self.engine_metrics_max_bytes < 1024:
            raise ConfigError(f"engine_metrics_max_bytes must be at least 1024, got {self.engine_metrics_max_bytes}")
        if not self.hash_load_factor >= 1:
            raise ConfigError(f"hash_load_factor must be at least 1, got {self.hash_load_factor}")
        for name in (
            "prefix_balance_threshold",
            "queue_size",
            "retries",
            "retry_budget_floor",
            "circuit_failures",
            "max_requests",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.prefetch_limit < 0:
            raise ConfigError(f"prefetch_limit must not be negative, got {self.prefetch_limit}")

    def _check_security(self) -> None:
        for name in ("allow_node_cidrs", "keyless_registration_cidrs"):
            for cidr in getattr(self, name):
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError as e:
                    raise ConfigError(f"{name}: {cidr!r} is not a network ({e})") from None
        if any(not key for key in (*self.api_keys, *self.admin_keys)):
            raise ConfigError("api_keys and admin_keys must not contain empty keys")
        if self.ssl and not (self.ssl_certfile and self.ssl_keyfile):
            raise ConfigError(
                "--ssl needs a certificate and its key: set SSL_CERTFILE and SSL_KEYFILE (as for LMDeploy) "
                "or --ssl-certfile and --ssl-keyfile"
            )
        if self.allow_credentials and "*" in self.allow_origins:
            raise ConfigError(
                "--allow-credentials needs the origins named in --allow-origins: never * with credentials"
            )

    def node_specs(self) -> tuple[NodeSpec, ...]:
        """The configured nodes, each with what it declares."""
        specs = tuple(NodeSpec.parse(text) for text in self.nodes)
        for spec in specs:
            try:
                _pdproxy.Router.check_node(spec.url, spec.role, spec.speed, spec.api_key)
            except ValueError as e:
                raise ConfigError(f"node {spec.url}: {e}") from None
        return specs

    def _check_features(self) -> None:
        if self.tenants_file:
            load_tenants(self.tenants_file)  # a bad file stops the start, naming its problem
        if self.otlp_endpoint and not self.otlp_endpoint.startswith("http://"):
            raise ConfigError(
                f"otlp_endpoint must be an http:// URL (export to a local collector), got {self.otlp_endpoint!r}"
            )
        if any("=" not in header for header in self.otlp_headers):
            raise ConfigError("otlp_headers must be NAME=VALUE pairs")
        if not 0 <= self.trace_sampler_arg <= 1:
            raise ConfigError(f"trace_sampler_arg must be between 0 and 1, got {self.trace_sampler_arg}")

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def redacted(self) -> dict[str, Any]:
        """The settings with key material hidden, for printing and logs."""
        out = dataclasses.asdict(self)
        for name in SECRET_FIELDS:
            out[name] = ["<hidden>"] * len(out[name])
        out["nodes"] = [spec.redacted() for spec in self.node_specs()]
        return out

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls(**_coerce(json.loads(text)))

    @classmethod
    def from_toml(cls, path: str | Path) -> Settings:
        return cls(**load_toml(path))


def _read_keys(path: str) -> list[str]:
    """Keys from a file: one per line, blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the key file {path}: {e.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def load_toml(path: str | Path) -> dict[str, Any]:
    """Reads a TOML settings file: top-level keys are field names (``nodes = [...]``)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) in {path}: {', '.join(unknown)}")
    nodes = data.get("nodes")
    if isinstance(nodes, list):
        # A node may be a table of what /nodes/add would say of it: kept as its one-word form.
        where = f"{path}: nodes"
        data["nodes"] = [NodeSpec.from_table(n, where).text() if isinstance(n, dict) else n for n in nodes]
    return _coerce(data)


def _coerce(data: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def _check_type(name: str, value: Any, annotation: Any) -> None:
    expected = _TYPES.get(annotation if isinstance(annotation, str) else str(annotation))
    if expected is None:
        return
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if expected is tuple:
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if not ok:
        raise ConfigError(f"{name} must be of type {annotation}, got {value!r}")


_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool, "tuple[str, ...]": tuple}


def field_type(f: dataclasses.Field[Any]) -> type:
    """The Python type of a settings field (annotations are strings under `from __future__`)."""
    return _TYPES[f.type if isinstance(f.type, str) else str(f.type)]

"""What each flag of the peer routers becomes in pdproxy: a setting, a note (taken, with no
effect of its own, and why), or a refusal (and why). Every dest of every router's parser has a
rule here (tests/peers/test_peer_cli.py walks them all); a flag's rule is the same for every router
that has it, except where one router gives it another meaning (``BY_ROUTER``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .plan import Plan, Refused, Worker

__all__ = ["BY_ROUTER", "POLICIES", "RULES", "Rule", "rule_of"]

Kind = Literal["setting", "note", "refuse"]


@dataclass(frozen=True)
class Rule:
    """What a flag becomes. ``says`` is the one line ``pdproxy --help`` shows for it (for a
    note or a refusal, the reason); ``apply`` takes the flag's value as the peer's parser read
    it (may note it, or raise ``Refused``)."""

    kind: Kind
    says: str
    apply: Callable[[Plan, str, object], None] | None = None


def to(setting: str, convert: Callable[[object], object] = lambda v: v, says: str = "") -> Rule:
    """The flag's value, converted, is the pdproxy setting ``setting``."""

    def apply(plan: Plan, flag: str, value: object) -> None:
        plan.set(setting, convert(value))

    return Rule("setting", says or f"--{setting.replace('_', '-')}", apply)


def note(why: str) -> Rule:
    def apply(plan: Plan, flag: str, value: object) -> None:
        plan.note(flag, why)

    return Rule("note", why, apply)


def refuse(why: str) -> Rule:
    def apply(plan: Plan, flag: str, value: object) -> None:
        raise Refused(flag, why)

    return Rule("refuse", why, apply)


def custom(says: str, apply: Callable[[Plan, str, object], None], kind: Kind = "setting") -> Rule:
    return Rule(kind, says, apply)


# --------------------------------------------------------------------------------------------
# Policies

#: Each peer policy name: the pdproxy policy that does its job, and why that one.
POLICIES: dict[str, tuple[str, str]] = {
    "random": ("random", "the same"),
    "round_robin": ("round_robin", "the same"),
    "cache_aware": (
        "scored",
        "it prices each node's uncached prompt, queued work and KV use together where cache_aware switches "
        "between prefix match and balance at thresholds; it routed better in bench/fleet.py",
    ),
    "kv_aware": ("scored", "scored routes on the engines' own prefix-cache and KV figures"),
    "bucket": (
        "scored",
        "scored weighs each prefill node's queued prompt bytes, which bucketing by length approximates",
    ),
    "power_of_two": (
        "least_requests",
        "it reads every node's in-flight count without a lock, so it takes the least loaded, not the better of two",
    ),
    "least_load": ("least_engine_load", "both route on the engines' reported load"),
    "consistent_hash": ("consistent_hash", "rendezvous hashing with bounded load"),
    "consistent_hashing": ("consistent_hash", "rendezvous hashing with bounded load"),
    "rendezvous_hash": ("consistent_hash", "it is rendezvous hashing (with bounded load)"),
    "sticky_least_loaded": (
        "consistent_hash",
        "a session keeps its node while that node is under --hash-load-factor times the average, else moves",
    ),
    "manual": (
        "consistent_hash",
        "the routing key (x-smg-routing-key, x-session-id, x-user-id, the body's session_id or user) picks the "
        "node by rendezvous hashing, with no table of keys to keep",
    ),
    "prefix_hash": ("prefix", "it hashes the prompt's head and balances past a threshold"),
}

#: Peer policies pdproxy does not have, with why.
NO_POLICY = {
    "passthrough": "it hands every request to the one worker a client names; pdproxy picks the node itself",
}


def _policy(role: str) -> Callable[[Plan, str, object], None]:
    def apply(plan: Plan, flag: str, value: object) -> None:
        name = str(value)
        if name in NO_POLICY:
            raise Refused(flag, f"{name}: {NO_POLICY[name]}")
        if name not in POLICIES:
            known = ", ".join(sorted((*POLICIES, *NO_POLICY)))
            raise Refused(flag, f"unknown policy {name!r}; the ones pdproxy reads: {known}")
        plan.policies[role] = name

    return apply


_POLICY_SAYS = "its pdproxy policy: " + "; ".join(
    f"{peer} -> {ours}" for peer, (ours, _) in POLICIES.items() if peer != ours
)


# --------------------------------------------------------------------------------------------
# Workers and prefill/decode


def _urls(plan: Plan, flag: str, value: object) -> None:
    for item in (str(item) for item in _items(value)):
        # lmdeploy-router's docs write `--worker-urls A,B`, which its parser keeps as one URL.
        urls = [url.strip() for url in item.split(",") if url.strip()]
        if len(urls) > 1:
            plan.note(flag, f"{item!r} is read as {len(urls)} URLs (its parser keeps it as one, which no worker has)")
        _hybrids(plan, flag, urls)


def _hybrids(plan: Plan, flag: str, urls: list[str]) -> None:
    for url in urls:
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in ("", "http", "https"):
            raise Refused(
                flag, f"{url}: pdproxy routes HTTP(S) workers, not {scheme}:// (the gateway's gRPC/ZMQ modes)"
            )
        plan.workers.append(Worker(url))


def _prefills(plan: Plan, flag: str, value: object) -> None:
    for entry in _items(value):
        words = [str(word) for word in _items(entry)]
        if not words or len(words) > 2:
            raise Refused(flag, f"takes URL [BOOTSTRAP_PORT|none], got {' '.join(words)!r}")
        port: int | None = None
        if len(words) == 2 and words[1].lower() != "none":
            try:
                port = int(words[1])
            except ValueError:
                raise Refused(flag, f"bootstrap port {words[1]!r} is neither a port nor none") from None
        plan.workers.append(Worker(words[0], "prefill", port))


def _decodes(plan: Plan, flag: str, value: object) -> None:
    for entry in _items(value):
        plan.workers += [Worker(str(url), "decode") for url in _items(entry)]


def _pd(protocol: str) -> Callable[[Plan, str, object], None]:
    def apply(plan: Plan, flag: str, value: object) -> None:
        if value:
            plan.pd_protocol = protocol

    return apply


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, list | tuple) else [] if value is None else [value]


# --------------------------------------------------------------------------------------------
# Conversions


def _selector(value: object) -> str:
    """``k=v k2=v2`` (their list) as one label selector, ``k=v,k2=v2``."""
    return ",".join(str(item) for item in _items(value))


def _number(value: object) -> float:
    """A value the peer's parser read as a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"not a number: {value!r}")
    return value


def _seconds(value: object) -> float:
    return float(_number(value))


def _log_level(value: object) -> str:
    return {"warn": "warning"}.get(str(value), str(value))


def _retries(value: object) -> int:
    # Their count is of attempts (--disable-retries is "retry_max_retries=1"); pdproxy's is of further nodes.
    return max(0, int(_number(value)) - 1)


def _cap(value: object) -> int:
    return max(0, int(_number(value)))  # their -1 (off) is pdproxy's 0


def _service_discovery(plan: Plan, flag: str, value: object) -> None:
    if not value:
        return
    if not any(plan.given.get(key) for key in ("selector", "prefill_selector", "decode_selector")):
        raise Refused(flag, "needs --selector (or --prefill-selector and --decode-selector) to know which pods")
    for theirs, ours in (
        ("selector", "k8s_selector"),
        ("prefill_selector", "k8s_prefill_selector"),
        ("decode_selector", "k8s_decode_selector"),
    ):
        if plan.given.get(theirs):
            plan.set(ours, _selector(plan.given[theirs]))
    if "service_discovery_namespace" not in plan.given:
        plan.note(
            flag,
            "without --service-discovery-namespace pdproxy watches its own namespace (the peer watched every one); "
            "name it to watch another",
        )


def _selectors_only_with_discovery(plan: Plan, flag: str, value: object) -> None:
    if not plan.given.get("service_discovery"):
        plan.note(flag, "has an effect only with --service-discovery (as for the peer)")
    # with it, --service-discovery's rule applies the selectors


def _namespace(plan: Plan, flag: str, value: object) -> None:
    if plan.given.get("service_discovery"):
        plan.set("k8s_namespace", str(value))
    else:
        plan.note(flag, "has an effect only with --service-discovery")


def _discovery_port(plan: Plan, flag: str, value: object) -> None:
    if plan.given.get("service_discovery"):
        plan.set("k8s_port", str(value))
    else:
        plan.note(flag, "has an effect only with --service-discovery")


def _health_endpoint(plan: Plan, flag: str, value: object) -> None:
    if value != "/health":
        raise Refused(flag, "pdproxy checks GET /health, which vLLM, SGLang and LMDeploy servers all answer")
    plan.note(flag, "pdproxy checks GET /health")


def _ca_files(plan: Plan, flag: str, value: object) -> None:
    files = [str(item) for item in _items(value)]
    if len(files) > 1:
        raise Refused(flag, "pdproxy takes one CA file (--node-ca-file): put the certificates in one PEM file")
    if files:
        plan.set("node_ca_file", files[0])


def _tls(setting: str) -> Callable[[Plan, str, object], None]:
    def apply(plan: Plan, flag: str, value: object) -> None:
        plan.set("ssl", True)
        plan.set(setting, str(value))

    return apply


def _tracing(plan: Plan, flag: str, value: object) -> None:
    if not value:
        return
    endpoint = str(plan.given.get("otlp_traces_endpoint", "localhost:4317"))
    if not endpoint.startswith("http://"):
        raise Refused(
            flag,
            f"pdproxy exports OTLP over HTTP, not gRPC ({endpoint}): give --otlp-traces-endpoint "
            "http://COLLECTOR:4318/v1/traces",
        )
    plan.set("otlp_endpoint", endpoint)


def _otlp_endpoint(plan: Plan, flag: str, value: object) -> None:
    if not plan.given.get("enable_trace"):
        plan.note(flag, "has an effect only with --enable-trace")


def _control_plane_keys(plan: Plan, flag: str, value: object) -> None:
    keys = []
    for entry in _items(value):
        parts = str(entry).split(":", 3)
        if len(parts) != 4:
            raise Refused(flag, "takes id:name:role:key entries")
        role, key = parts[2], parts[3]
        if role.lower() != "admin":
            raise Refused(flag, f"role {role!r}: pdproxy's management keys are all admin keys (--admin-keys)")
        keys.append(key)
    plan.set("admin_keys", tuple(keys))


def _backend(plan: Plan, flag: str, value: object) -> None:
    if value in ("anthropic", "gemini"):
        raise Refused(flag, f"{value}: pdproxy routes to OpenAI-compatible servers")
    plan.note(flag, "pdproxy tells vLLM, SGLang and LMDeploy nodes apart by themselves")


def _history(plan: Plan, flag: str, value: object) -> None:
    if value not in ("memory", "none"):
        raise Refused(flag, f"{value}: pdproxy keeps no response history; the engines answer /v1/responses")
    plan.note(flag, "pdproxy keeps no response history; the engines answer /v1/responses")


def _keep_unhealthy(plan: Plan, flag: str, value: object) -> None:
    if value:
        plan.note(flag, "pdproxy keeps an unhealthy node and probes it again; give --health-remove-after to drop it")
    else:
        plan.note(flag, "pdproxy keeps an unhealthy node and probes it again (as asked)")


def _disable_overload(plan: Plan, flag: str, value: object) -> None:
    plan.note(flag, "pdproxy leaves no node out for its queue; scored weighs each node's queue instead")


def _lmdeploy_choice(setting: str) -> Callable[[Plan, str, object], None]:
    def apply(plan: Plan, flag: str, value: object) -> None:
        plan.set(setting, str(value).upper())

    return apply


def _lmdeploy_flag(setting: str) -> Callable[[Plan, str, object], None]:
    def apply(plan: Plan, flag: str, value: object) -> None:
        plan.set(setting, bool(value))

    return apply


# --------------------------------------------------------------------------------------------
# Reasons shared by many flags

_STARTUP = "pdproxy serves at once and takes each worker as it becomes healthy; it never waits for them at start"
_NO_BACKOFF = "pdproxy retries at once on another node, never the same one, so there is no backoff to tune"
_NO_CACHE_TREE = "pdproxy's prefix table is bounded and evicts as it goes: there is no tree to size or sweep"
_THRESHOLDS = "cache_aware's switch between prefix match and balance; pdproxy's scored weighs both at once"
_GRPC = "the gateway's gRPC mode (it tokenizes and parses itself); pdproxy routes HTTP workers on the request"
_PARSES = (
    "the gateway parses the engines' output; pdproxy passes it on as the engine wrote it: give the engine this flag"
)
_HISTORY = "history backends: pdproxy keeps no response history; the engines answer /v1/responses"
_MESH = "router mesh (HA): pdproxy replicas share one node table through --registry instead"
_WASM = "WASM middleware is not part of pdproxy"
_MULTIMODAL = "the gateway's multimodal processing; pdproxy passes images on to the engine as sent"
_JWT = "pdproxy checks API keys (--api-keys, --tenants-file), not JWTs"
_TENANTS = "pdproxy's tenants (per-key limits, priorities, rates) are set with --tenants-file"
_KV_EVENTS = "KV events: pdproxy routes on the engines' /metrics figures (issue 33 brings KV events)"
_SMG_LOAD = "SMG's overload model; pdproxy's scored prices each node's queue and KV use instead of cutting it off"
_DP = (
    "data-parallel ranks inside one server: pdproxy routes between servers; give each rank's server as a worker "
    "or let the engine balance its ranks"
)
_IGW = "IGW mode (the gateway's multi-model worker API and gRPC workers); pdproxy routes several models already"
_BUCKETS = "pdproxy's latency histograms have fixed buckets"
_LOG_DIR = "pdproxy logs to stderr: redirect it to a file (or let the service manager keep it)"
_REQUEST_ID = "pdproxy takes the request id from x-request-id (and sends one on to the node)"


RULES: dict[str, Rule] = {
    # serving
    "host": to("host"),
    "port": to("port"),
    "log_level": to("log_level", _log_level),
    "log_dir": note(_LOG_DIR),
    "log_json": note("pdproxy's access log is JSON with --access-log-format json; its other lines are text"),
    "log_mm_timing": note(_MULTIMODAL),
    "shutdown_grace_period_secs": to("drain_timeout", _seconds),
    "max_payload_size": to("max_body_size"),
    "cors_allowed_origins": to("allow_origins", lambda v: tuple(str(o) for o in _items(v))),
    "request_id_headers": note(_REQUEST_ID),
    "header_read_timeout_secs": to("header_read_timeout", _seconds),
    "idle_connection_timeout_secs": note("pdproxy closes idle client connections on the edge's own timeout"),
    "health_check_port": note("pdproxy answers /health, /liveness and /readiness on its serving port"),
    "jemalloc_prof_dir": note("pdproxy does not use jemalloc"),
    "prometheus_port": to("metrics_port", says="--metrics-port (a second listener serving /metrics)"),
    "prometheus_host": to("metrics_host"),
    "prometheus_duration_buckets": note(_BUCKETS),
    "enable_trace": custom("--otlp-endpoint (OTLP over HTTP)", _tracing),
    "otlp_traces_endpoint": custom("with --enable-trace, --otlp-endpoint", _otlp_endpoint),
    # workers and PD
    "worker_urls": custom("--node URL (hybrid)", _urls),
    "prefill": custom("--node URL,role=prefill[,bootstrap_port=N]", _prefills),
    "decode": custom("--node URL,role=decode", _decodes),
    "pd_disaggregation": custom("--serving-strategy DistServe --pd-protocol sglang", _pd("sglang")),
    "vllm_pd_disaggregation": custom("--serving-strategy DistServe --pd-protocol vllm", _pd("vllm")),
    "lmdeploy_pd_disaggregation": custom("--serving-strategy DistServe --pd-protocol lmdeploy", _pd("lmdeploy")),
    "lmdeploy_migration_protocol": custom("--migration-protocol", _lmdeploy_choice("migration_protocol")),
    "lmdeploy_rdma_link_type": custom("--link-type", _lmdeploy_choice("link_type")),
    "lmdeploy_disable_gdr": custom("--disable-gdr", _lmdeploy_flag("disable_gdr")),
    "lmdeploy_dummy_prefill": custom("--dummy-prefill", _lmdeploy_flag("dummy_prefill")),
    "kv_connector": note("pdproxy's vLLM protocol serves NIXL, Mooncake and MoRI-IO prefill nodes alike"),
    "mini_lb": note("pdproxy is the load balancer of the prefill/decode pairs itself"),
    "epd_disaggregation": refuse("encode/prefill/decode (EPD) disaggregation is not part of pdproxy"),
    "encode": refuse("encode workers (EPD) are not part of pdproxy"),
    "encode_policy": refuse("encode workers (EPD) are not part of pdproxy"),
    "encode_selector": refuse("encode workers (EPD) are not part of pdproxy"),
    "vllm_discovery_address": refuse(
        "vLLM's ZMQ registration; name the prefill and decode servers (--prefill, --decode) or find them in Kubernetes"
    ),
    "pd_admission_wait_secs": note("pdproxy queues a PD request for its decode node like any other (--queue-timeout)"),
    "prefill_max_inflight_requests_per_worker": note("give each prefill node a cap with --node URL,max_concurrency=N"),
    "prefill_queue_size": note("pdproxy has one queue (--queue-size) for every role"),
    "prefill_queue_timeout_secs": note("pdproxy has one queue timeout (--queue-timeout) for every role"),
    "pd_kv_events": note(_KV_EVENTS),
    # policies
    "policy": custom(_POLICY_SAYS, _policy("policy")),
    "prefill_policy": custom("--prefill-policy (the names as for --policy)", _policy("prefill_policy")),
    "decode_policy": custom("--decode-policy (the names as for --policy)", _policy("decode_policy")),
    "cache_threshold": note(_THRESHOLDS),
    "balance_abs_threshold": note(_THRESHOLDS),
    "balance_rel_threshold": note(_THRESHOLDS),
    "balance_token_usage_threshold": note(_THRESHOLDS),
    "overload_token_usage_threshold": note(_THRESHOLDS),
    "eviction_interval_secs": note(_NO_CACHE_TREE),
    "max_tree_size": note(_NO_CACHE_TREE),
    "bucket_adjust_interval_secs": note("bucket is taken as scored, which has no buckets to adjust"),
    "max_idle_secs": note("pdproxy's consistent_hash keeps no table of keys: a key's node follows from its hash"),
    "assignment_mode": note("pdproxy's consistent_hash places a new key by its hash, with bounded load"),
    "prefix_token_count": note("pdproxy's prefix policy hashes the prompt's head in blocks (--prefix-block-bytes)"),
    "prefix_hash_load_factor": to("hash_load_factor", _number),
    "prefix_hash_balance_abs_threshold": to("prefix_balance_threshold"),
    "least_load_kv_pressure_weight": note("least_engine_load weighs the engines' own figures"),
    "least_load_default_throughput": note("least_engine_load weighs the engines' own figures"),
    "least_load_mean_prefill_tokens": note("least_engine_load weighs the engines' own figures"),
    "least_load_max_waiting_requests": note("least_engine_load weighs the engines' own figures"),
    "power_of_two_load_metric": note("power_of_two is taken as least_requests, which compares requests in flight"),
    "routing_key_override": note("pdproxy's consistent_hash always keys on x-smg-routing-key / x-session-id / user"),
    "routing_key_headers": note("pdproxy keys on x-smg-routing-key, x-session-id, x-user-id, then the body's fields"),
    "kv_index": note(_NO_CACHE_TREE),
    "cache_index": note(_NO_CACHE_TREE),
    "cache_ttl_secs": note(_NO_CACHE_TREE),
    "cache_boundaries": note(_NO_CACHE_TREE),
    "block_size": note(_NO_CACHE_TREE),
    "selection_policy": note(_THRESHOLDS),
    "selection_accounting_ttl_ms": note(_THRESHOLDS),
    "overlap_decay": note(_THRESHOLDS),
    "selection_temperature": note(_THRESHOLDS),
    "router_temperature": note(_THRESHOLDS),
    "kv_penalty_host": note(_KV_EVENTS),
    "kv_penalty_external": note(_KV_EVENTS),
    "kv_penalty_disk": note(_KV_EVENTS),
    "kv_aware_session_affinity_ttl_secs": note(_KV_EVENTS),
    "kv_event_source": note(_KV_EVENTS),
    "kv_event_replay_source": note(_KV_EVENTS),
    "kv_event_block_size": note(_KV_EVENTS),
    "kv_event_model": note(_KV_EVENTS),
    "worker_warmup_secs": note(_SMG_LOAD),
    "worker_warmup_share": note(_SMG_LOAD),
    "worker_warmup_blocks": note(_SMG_LOAD),
    "worker_warmup_thin_ratio": note(_SMG_LOAD),
    "worker_warmup_divert_every": note(_SMG_LOAD),
    "worker_overload_waiting_requests": note(_SMG_LOAD),
    "worker_overload_token_usage": note(_SMG_LOAD),
    "worker_overload_protection": note(_SMG_LOAD),
    "disable_worker_overload_protection": custom(_SMG_LOAD, _disable_overload, "note"),
    "worker_overload_shed": note(_SMG_LOAD),
    "worker_stall_secs": note("pdproxy's health checks and circuit breaker take a silent node out"),
    "worker_wedge_secs": note("pdproxy's health checks and circuit breaker take a silent node out"),
    "worker_stale_secs": note("pdproxy's health checks and circuit breaker take a silent node out"),
    "load_monitor_interval": note("pdproxy reads the engines' load every --engine-metrics-interval"),
    "disable_load_monitoring": note("pdproxy reads the engines' load every --engine-metrics-interval (0: never)"),
    "dp_aware": refuse(_DP),
    "dp_minimum_tokens_scheduler": refuse(_DP),
    "intra_node_data_parallel_size": custom(
        "1 only: " + _DP, lambda plan, flag, value: _dp_size(plan, flag, value), "note"
    ),
    "enable_igw": refuse(_IGW),
    "enable_program_scheduling": refuse("vllm-router's program scheduling is not part of pdproxy"),
    "program_scheduling_config_json": refuse("vllm-router's program scheduling is not part of pdproxy"),
    # startup and health
    "worker_startup_timeout_secs": note(_STARTUP),
    "worker_startup_check_interval": note(_STARTUP),
    "worker_startup_delay": note(_STARTUP),
    "health_failure_threshold": to("health_fall"),
    "health_success_threshold": to("health_rise"),
    "health_check_timeout_secs": to("health_timeout", _seconds),
    "health_check_interval_secs": to("health_interval", _seconds),
    "health_check_endpoint": custom("GET /health only", _health_endpoint, "note"),
    "disable_health_check": refuse("pdproxy needs its health checks to route around failed nodes (GET /health)"),
    "remove_unhealthy_workers": custom("--health-remove-after", _keep_unhealthy, "note"),
    # timeouts, retries, circuit breaker
    "request_timeout_secs": to("request_timeout", _seconds),
    "upstream_pool_idle_timeout_secs": to("pool_idle_timeout", _seconds),
    "upstream_http2": note("pdproxy speaks HTTP/1.1 to nodes, as vLLM, SGLang and LMDeploy serve"),
    "stream_body_stall_timeout_secs": to("body_timeout", _seconds),
    "sse_keepalive_secs": note("pdproxy forwards the engine's own stream, keep-alives included"),
    "max_buffered_request_bytes": note("pdproxy holds every request body whole (up to --max-body-size)"),
    "retry_max_retries": to("retries", _retries, "--retries (theirs counts the first attempt)"),
    "retry_initial_backoff_ms": note(_NO_BACKOFF),
    "retry_max_backoff_ms": note(_NO_BACKOFF),
    "retry_backoff_multiplier": note(_NO_BACKOFF),
    "retry_jitter_factor": note(_NO_BACKOFF),
    "disable_retries": custom("--retries 0", lambda plan, flag, value: plan.set("retries", 0) if value else None),
    "cb_failure_threshold": to("circuit_failures"),
    "cb_timeout_duration_secs": to("circuit_cooldown", _seconds),
    "cb_success_threshold": note("pdproxy closes a circuit on its first successful probe"),
    "cb_window_duration_secs": note("pdproxy counts consecutive failures, not failures in a window"),
    "disable_circuit_breaker": custom(
        "--circuit-failures 0", lambda plan, flag, value: plan.set("circuit_failures", 0) if value else None
    ),
    # admission
    "max_concurrent_requests": to("max_requests", _cap, "--max-requests (their -1, no cap, is 0)"),
    "queue_size": to("queue_size"),
    "queue_timeout_secs": to("queue_timeout", _seconds),
    "rate_limit_tokens_per_second": note(
        "pdproxy caps requests in flight (--max-requests), not their rate; per-key rates are --tenants-file's"
    ),
    "max_background_responses": note("the engines answer /v1/responses, background ones included"),
    "priority_scheduler_enabled": note("pdproxy's queue always serves the more urgent request first (priority)"),
    "priority_scheduler_default_max_class": note(_TENANTS),
    "priority_scheduler_config": refuse(_TENANTS),
    "priority_scheduler_tenant_metric_top_n": note(_TENANTS),
    "tenant_rate_limit_enabled": refuse(_TENANTS),
    "tenant_rate_limit_config": refuse(_TENANTS),
    "trust_tenant_header": refuse(_TENANTS),
    "tenant_header_name": refuse(_TENANTS),
    "tenant_api_key": refuse(_TENANTS),
    "storage_context_headers": refuse(_HISTORY),
    "job_queue_capacity": note("pdproxy adds and removes nodes at once, with no job queue"),
    "job_queue_concurrency": note("pdproxy adds and removes nodes at once, with no job queue"),
    # Kubernetes and other discovery
    "service_discovery": custom("--k8s-selector (and the per-role selectors)", _service_discovery),
    "selector": custom("with --service-discovery, --k8s-selector", _selectors_only_with_discovery),
    "prefill_selector": custom("with --service-discovery, --k8s-prefill-selector", _selectors_only_with_discovery),
    "decode_selector": custom("with --service-discovery, --k8s-decode-selector", _selectors_only_with_discovery),
    "service_discovery_port": custom("--k8s-port", _discovery_port),
    "service_discovery_namespace": custom("--k8s-namespace", _namespace),
    "router_selector": refuse(_MESH),
    "discovery_provider": custom(
        "kubernetes: as --service-discovery",
        lambda plan, flag, value: _discovery_provider(plan, flag, value),
    ),
    "discovery_file": refuse("pdproxy reads its nodes from --config (TOML nodes), not a JSON manifest"),
    "discovery_check_interval_secs": note(
        "pdproxy watches pods as they change and relists every --k8s-relist-interval"
    ),
    "kv_connector_annotation": note("pdproxy reads the KV connector from the engine, not a pod annotation"),
    "kv_engine_id_annotation": note("pdproxy reads the KV engine id from the engine, not a pod annotation"),
    "model_id_from": refuse("pdproxy takes each node's models from its /v1/models"),
    "model_alias": refuse("pdproxy serves the model names the engines serve"),
    # keys and TLS
    "api_key": to("node_api_key", str, "--node-api-key (sent to every node)"),
    "control_plane_api_keys": custom("--admin-keys (admin role)", _control_plane_keys),
    "control_plane_audit_enabled": note("pdproxy logs every node it adds or removes"),
    "jwt_issuer": refuse(_JWT),
    "jwt_audience": refuse(_JWT),
    "jwt_jwks_uri": refuse(_JWT),
    "jwt_role_mapping": refuse(_JWT),
    "tls_cert_path": custom("--ssl --ssl-certfile", _tls("ssl_certfile")),
    "tls_key_path": custom("--ssl --ssl-keyfile", _tls("ssl_keyfile")),
    "ca_cert_paths": custom("--node-ca-file", _ca_files),
    "client_cert_path": refuse("pdproxy does not present client certificates to nodes"),
    "client_key_path": refuse("pdproxy does not present client certificates to nodes"),
    # the gateway's own processing (gRPC, tokenizers, parsers, MCP, WASM, history, RL, mesh)
    "model_path": note(_GRPC),
    "tokenizer_path": note(_GRPC),
    "chat_template": refuse(_PARSES),
    "disable_tokenizer_autoload": note(_GRPC),
    "parser": note(_GRPC),
    "tokenizer_cache_enable_l0": note(_GRPC),
    "tokenizer_cache_l0_max_entries": note(_GRPC),
    "tokenizer_cache_enable_l1": note(_GRPC),
    "tokenizer_cache_l0_max_memory": note(_GRPC),
    "tokenizer_cache_l1_max_memory": note(_GRPC),
    "reasoning_parser": refuse(_PARSES),
    "tool_call_parser": refuse(_PARSES),
    "mcp_config_path": refuse("MCP tools are not part of pdproxy"),
    "backend": custom("told apart by itself", _backend, "note"),
    "zmq_engine_count": refuse(_GRPC),
    "history_backend": custom("none (no response history)", _history, "note"),
    "history_memory_max_responses": note(_HISTORY),
    "history_memory_max_items": note(_HISTORY),
    "history_memory_retention_secs": note(_HISTORY),
    "schema_config": refuse(_HISTORY),
    "enable_wasm": refuse(_WASM),
    "storage_hook_wasm_path": refuse(_WASM),
    "wasm_middleware": refuse(_WASM),
    "wasm_middleware_sha256": refuse(_WASM),
    "wasm_middleware_routes": refuse(_WASM),
    "enable_rl": refuse("the gateway's RL control plane (/v1/rl) is not part of pdproxy"),
    "rl_control_timeout_secs": refuse("the gateway's RL control plane (/v1/rl) is not part of pdproxy"),
    "rl_fanout_concurrency": refuse("the gateway's RL control plane (/v1/rl) is not part of pdproxy"),
    "multimodal_tensor_transport": note(_MULTIMODAL),
    "multimodal_shm_min_bytes": note(_MULTIMODAL),
    "multimodal_max_inflight_bytes": note(_MULTIMODAL),
    "mm_per_request_image_limit": note(_MULTIMODAL),
    "mm_processing": note(_MULTIMODAL),
    "mm_pixel_cache_mb": note(_MULTIMODAL),
    "mm_pixel_rdma": note(_MULTIMODAL),
    "mm_allowed_media_domains": note(_MULTIMODAL),
    "mm_allow_private_media_hosts": note(_MULTIMODAL),
    "rdma_listen_ip": note(_MULTIMODAL),
    "rdma_slot_ttl_s": note(_MULTIMODAL),
    "enable_mesh": refuse(_MESH),
    "mesh_server_name": refuse(_MESH),
    "mesh_host": refuse(_MESH),
    "mesh_advertise_host": refuse(_MESH),
    "mesh_port": refuse(_MESH),
    "mesh_peer_urls": refuse(_MESH),
    "mesh_tls_ca_cert": refuse(_MESH),
    "mesh_tls_cert": refuse(_MESH),
    "mesh_tls_key": refuse(_MESH),
}

for _name in (
    "oracle_wallet_path",
    "oracle_tns_alias",
    "oracle_connect_descriptor",
    "oracle_username",
    "oracle_password",
    "oracle_external_auth",
    "oracle_pool_min",
    "oracle_pool_max",
    "oracle_pool_timeout_secs",
    "postgres_db_url",
    "postgres_pool_max",
    "postgres_op_timeout_secs",
    "redis_url",
    "redis_pool_max",
    "redis_retention_days",
    "redis_op_timeout_secs",
):
    RULES[_name] = refuse(_HISTORY)


def _dp_size(plan: Plan, flag: str, value: object) -> None:
    if _number(value) > 1:
        raise Refused(flag, _DP)
    plan.note(flag, "1: one rank per server, as pdproxy routes")


def _discovery_provider(plan: Plan, flag: str, value: object) -> None:
    if value == "kubernetes":
        _service_discovery(plan, flag, True)
    else:
        raise Refused(flag, f"{value}: pdproxy finds nodes in Kubernetes and DNS (--node-dns), or reads --config")


#: Where one router gives a flag its own meaning.
BY_ROUTER: dict[str, dict[str, Rule]] = {}


def rule_of(router: str, dest: str) -> Rule | None:
    """The rule of ``router``'s flag ``dest``, if pdproxy has one."""
    return BY_ROUTER.get(router, {}).get(dest) or RULES.get(dest)

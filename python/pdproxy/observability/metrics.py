"""``GET /metrics``: Prometheus text built at scrape time from one snapshot of the data
plane's counters (no per-request work in Python), plus the control plane's own state."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdproxy import __version__

if TYPE_CHECKING:
    from pdproxy._pdproxy import HistogramReading, NodeView, TenantSnapshot
    from pdproxy.fleet.node_sources import NodeSource
    from pdproxy.pd.lmdeploy import DistServeStatus
    from pdproxy.server.group import GroupSummary
    from pdproxy.server.supervisor import Supervisor

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
STATES = ("healthy", "unhealthy", "draining", "sleeping", "initializing")
#: A tenant's windows, by what they count.
WINDOWS: tuple[Literal["requests", "tokens"], ...] = ("requests", "tokens")
#: The shared table's node slots, by use.
SLOT_USES: tuple[Literal["bound", "retired", "total"], ...] = ("bound", "retired", "total")
#: How preserved prefill sessions ended.
SESSION_ENDS: tuple[Literal["consumed", "freed", "free_failures"], ...] = ("consumed", "freed", "free_failures")


def _histograms(nodes: list[NodeView]) -> Iterator[HistogramMetricFamily]:
    """Per node, its histograms (one reading of each per node)."""
    labels = ["node", "role"]
    duration = HistogramMetricFamily(
        "pdproxy_request_duration_seconds", "Requests from admission to the end of the body", labels=labels
    )
    ttft = HistogramMetricFamily("pdproxy_ttft_seconds", "Streams: time to the first byte of the body", labels=labels)
    itl = HistogramMetricFamily(
        "pdproxy_itl_seconds", "Streams: gaps between chunks (inter-token latency)", labels=labels
    )
    lateness = HistogramMetricFamily(
        "pdproxy_first_token_lateness_seconds",
        "First bytes the routing policy priced: seconds after the time priced for them (negative: before)",
        labels=labels,
    )
    for node in nodes:
        histograms = node.histograms
        _add_histogram(duration, [node.url, node.role], histograms.duration)
        _add_histogram(ttft, [node.url, node.role], histograms.ttft)
        _add_histogram(itl, [node.url, node.role], histograms.itl)
        if (priced := node.engine.learnt.first_token_lateness).count:  # where a policy prices them
            _add_histogram(lateness, [node.url, node.role], priced)
    yield from (duration, ttft, itl, lateness)


def _add_histogram(family: HistogramMetricFamily, labels: list[str], h: HistogramReading) -> None:
    """One series from the data plane's reading (per-bucket counts, +Inf last)."""
    cumulative, buckets = 0, []
    for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    family.add_metric(labels, buckets, h.sum)


class PdproxyCollector(Collector):
    def __init__(self, app: Supervisor) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        router, fleet = self.app.router, self.app.fleet
        if router is None:
            return
        nodes = router.core.views()
        info = GaugeMetricFamily("pdproxy_build_info", "pdproxy's version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info

        requests = CounterMetricFamily(
            "pdproxy_requests", "Requests sent to nodes, by how they ended", labels=["node", "role", "outcome"]
        )
        connect = CounterMetricFamily(
            "pdproxy_connect_failures", "Requests that could not connect to the node", labels=["node"]
        )
        events = CounterMetricFamily("pdproxy_events", "Server-sent events forwarded", labels=["node"])
        in_flight = GaugeMetricFamily("pdproxy_node_in_flight", "Requests in flight per node", labels=["node", "role"])
        state = GaugeMetricFamily("pdproxy_node_state", "1 for the node's current state", labels=["node", "state"])
        circuit = GaugeMetricFamily(
            "pdproxy_node_circuit_open", "1 when the node's circuit is open or half-open", labels=["node"]
        )
        for n in nodes:
            # How the requests sent to the node ended.
            outcomes = (
                ("succeeded", n.succeeded),
                ("failed", n.failed),
                ("client_errors", n.client_errors),
                ("cancelled", n.cancelled),
            )
            for outcome, count in outcomes:
                requests.add_metric([n.url, n.role, outcome], count)
            connect.add_metric([n.url], n.connect_failures)
            events.add_metric([n.url], n.events)
            in_flight.add_metric([n.url, n.role], n.in_flight)
            for s in STATES:
                state.add_metric([n.url, s], 1 if n.state == s else 0)
            circuit.add_metric([n.url], 0 if n.circuit == "closed" else 1)
        yield from (requests, connect, events, in_flight, state, circuit)
        yield from _engine_metrics(nodes)
        yield from _histograms(nodes)

        queued = GaugeMetricFamily("pdproxy_queue_depth", "Requests waiting for a node with room")
        queued.add_metric([], router.queued)
        retries = CounterMetricFamily("pdproxy_retries", "Requests retried on another node")
        retries.add_metric([], router.retries)
        serving = GaugeMetricFamily("pdproxy_requests_in_flight", "Inference requests being served by the proxy")
        serving.add_metric([], self.app.in_flight)
        by_model = CounterMetricFamily("pdproxy_model_requests", "Requests received, by model", labels=["model"])
        for model, count in sorted(router.model_requests().items()):
            by_model.add_metric([model], count)
        waited = HistogramMetricFamily(
            "pdproxy_queue_wait_seconds", "Time queued requests waited for a node with room, served or not"
        )
        _add_histogram(waited, [], router.core.queue_wait())
        yield from (queued, waited, retries, serving, by_model)

        if fleet is not None and fleet.health.last_round is not None:
            age = GaugeMetricFamily(
                "pdproxy_health_round_age_seconds", "Seconds since the last round of health checks completed"
            )
            age.add_metric([], time.monotonic() - fleet.health.last_round)
            yield age

        if fleet is not None and fleet.sources:
            yield from _source_metrics(fleet.sources)
        if fleet is not None and fleet.kv_events is not None:
            yield from _kv_index_metrics(router.core.kv_index_stats())
        if fleet is not None and fleet.replica_share is not None:
            yield from _replica_share_metrics(fleet.replica_share.stats())

        kept = fleet.pd.kept() if fleet is not None and fleet.pd is not None else None
        if kept is not None:
            yield from _pd_metrics(kept)
        if self.app.group is not None:
            yield from _group_metrics(self.app.group.summary())
        tenants = router.core.tenants()
        if tenants:
            yield from _tenant_metrics(tenants)


def _source_metrics(sources: list[NodeSource]) -> Iterator[Metric]:
    """Per node source (kubernetes, dns): whether it reaches where it looks, and what it did."""
    labels = ["source"]
    up = GaugeMetricFamily(
        "pdproxy_discovery_up", "1 while a node source reaches where it looks (its nodes stay anyway)", labels=labels
    )
    nodes = GaugeMetricFamily("pdproxy_discovery_nodes", "Nodes a source found and keeps", labels=labels)
    synced = GaugeMetricFamily(
        "pdproxy_discovery_sync_age_seconds", "Seconds since a source last read the whole truth", labels=labels
    )
    restarts = CounterMetricFamily(
        "pdproxy_discovery_restarts", "Full reads started over, by reason", labels=[*labels, "reason"]
    )
    events = CounterMetricFamily("pdproxy_discovery_events", "Watch events applied, by type", labels=[*labels, "type"])
    now = time.monotonic()
    for source in sources:
        state = source.state
        up.add_metric([source.name], 1.0 if state.up else 0.0)
        nodes.add_metric([source.name], source.node_count())
        if state.synced_at is not None:
            synced.add_metric([source.name], now - state.synced_at)
        for reason, count in state.restarts.items():
            restarts.add_metric([source.name, reason], count)
        for kind, count in state.events.items():
            events.add_metric([source.name, kind], count)
    yield from (up, nodes, synced, restarts, events)


def _replica_share_metrics(stats: tuple[int, int, int, int]) -> Iterator[Metric]:
    """Load shared with the other replicas (``--replica-listen``): datagrams by direction, and
    the peers whose last one is fresh."""
    sent, received, malformed, live = stats
    datagrams = CounterMetricFamily(
        "pdproxy_replica_share_datagrams",
        "Datagrams of load shared with other replicas: sent, received, or refused as not this protocol",
        labels=["direction"],
    )
    for direction, count in (("sent", sent), ("received", received), ("malformed", malformed)):
        datagrams.add_metric([direction], count)
    peers = GaugeMetricFamily("pdproxy_replica_share_peers_live", "Other replicas whose load is fresh")
    peers.add_metric([], live)
    yield from (datagrams, peers)


def _kv_index_metrics(stats: Mapping[str, object]) -> Iterator[Metric]:
    """The KV index: live per engine rank (0: priced from the prefix table), its blocks, and
    how many candidates were priced from it and from the table."""
    live = GaugeMetricFamily(
        "pdproxy_kv_events_live", "1 while the rank's KV events are followed with no gap", labels=["node", "rank"]
    )
    held = GaugeMetricFamily(
        "pdproxy_kv_index_node_blocks", "KV blocks the index holds for the rank", labels=["node", "rank"]
    )
    streams = stats["streams"] if isinstance(stats["streams"], list) else []
    for node, rank, blocks, _events, _orphans, _unknown, is_live in streams:
        live.add_metric([node, str(rank)], 1 if is_live else 0)
        held.add_metric([node, str(rank)], blocks)
    blocks = GaugeMetricFamily("pdproxy_kv_index_blocks", "KV blocks in the index, all nodes together")
    blocks.add_metric([], float(stats["blocks"]))  # type: ignore[arg-type]
    priced = CounterMetricFamily(
        "pdproxy_kv_index_priced", "Candidates whose cache hits were priced, by source", labels=["source"]
    )
    priced.add_metric(["index"], float(stats["used"]))  # type: ignore[arg-type]
    priced.add_metric(["table"], float(stats["fell_back"]))  # type: ignore[arg-type]
    yield from (live, held, blocks, priced)


def _tenant_metrics(tenants: list[TenantSnapshot]) -> Iterator[Metric]:
    """Per tenant (the tenants file bounds the label's values)."""
    requests = CounterMetricFamily("pdproxy_tenant_requests", "Requests admitted, by tenant", labels=["tenant"])
    errors = CounterMetricFamily("pdproxy_tenant_errors", "Admitted requests that failed", labels=["tenant"])
    tokens = CounterMetricFamily(
        "pdproxy_tenant_tokens", "Tokens used (the node's usage, else estimated)", labels=["tenant", "kind"]
    )
    rejected = CounterMetricFamily(
        "pdproxy_tenant_rejected", "Requests refused over a limit, by limit", labels=["tenant", "limit"]
    )
    in_flight = GaugeMetricFamily("pdproxy_tenant_in_flight", "Requests being served", labels=["tenant"])
    today = GaugeMetricFamily("pdproxy_tenant_tokens_today", "Tokens used this UTC day", labels=["tenant"])
    remaining = GaugeMetricFamily(
        "pdproxy_tenant_remaining", "What the current minute's window has left", labels=["tenant", "kind"]
    )
    for t in tenants:
        name = t["name"]
        requests.add_metric([name], t["total_requests"])
        errors.add_metric([name], t["errors"])
        tokens.add_metric([name, "prompt"], t["prompt_tokens"])
        tokens.add_metric([name, "completion"], t["completion_tokens"])
        for limit, count in t["rejected"].items():
            rejected.add_metric([name, limit], count)
        in_flight.add_metric([name], t["in_flight"])
        today.add_metric([name], t["tokens_today"])
        for kind in WINDOWS:
            window = t[kind]
            if window is not None:
                remaining.add_metric([name, kind], window["remaining"])
    yield from (requests, errors, tokens, rejected, in_flight, today, remaining)


def _engine_metrics(nodes: list[NodeView]) -> Iterator[Metric]:
    """What each node's engine last reported (its /metrics, read by pdproxy)."""
    labels = ["node"]
    running = GaugeMetricFamily("pdproxy_engine_running", "Requests the node's engine reports running", labels=labels)
    waiting = GaugeMetricFamily("pdproxy_engine_waiting", "Requests the node's engine reports waiting", labels=labels)
    kv = GaugeMetricFamily(
        "pdproxy_engine_kv_usage", "KV-cache usage the node's engine reports (0 to 1)", labels=labels
    )
    hit = GaugeMetricFamily(
        "pdproxy_engine_prefix_cache_hit_ratio",
        "Prompt tokens the node's engine found in its prefix cache, over all it looked up",
        labels=labels,
    )
    transferred = GaugeMetricFamily(
        "pdproxy_engine_transferred_tokens",
        "Prompt tokens whose KV the node's engine received from another (a decode node's connector), as it last said",
        labels=labels,
    )
    age = GaugeMetricFamily("pdproxy_engine_report_age_seconds", "Age of the engine's last report", labels=labels)
    failures = CounterMetricFamily(
        "pdproxy_engine_report_failures", "Readings of the engine's /metrics that failed", labels=labels
    )
    restarts = CounterMetricFamily(
        "pdproxy_engine_restarts", "Times the engine's counters went back (a restart)", labels=labels
    )
    for n in nodes:
        e, url = n.engine, [n.url]
        failures.add_metric(url, e.failures)
        restarts.add_metric(url, e.restarts)
        reported, running_now, waiting_now = e.age, e.running, e.waiting
        if reported is None or running_now is None or waiting_now is None:
            continue  # never read (the three are known together)
        age.add_metric(url, reported)
        running.add_metric(url, running_now)
        waiting.add_metric(url, waiting_now)
        if e.kv_usage is not None:
            kv.add_metric(url, e.kv_usage)
        if e.prompt_tokens and e.cached_tokens is not None:
            hit.add_metric(url, e.cached_tokens / e.prompt_tokens)
        if e.transferred_tokens is not None:
            transferred.add_metric(url, e.transferred_tokens)
    yield from (running, waiting, kv, hit, transferred, age, failures, restarts)


def _group_metrics(summary: GroupSummary) -> Iterator[Metric]:
    """A worker group: node series above are the group's; these say which worker answered."""
    worker = GaugeMetricFamily(
        "pdproxy_group_worker",
        "1, labelled with the answering worker and whether it leads",
        labels=("worker", "leader"),
    )
    worker.add_metric([str(summary["worker"]), "true" if summary["leader"] else "false"], 1)
    workers = GaugeMetricFamily("pdproxy_group_workers", "Worker processes attached to the group")
    workers.add_metric([], len(summary["workers"]))
    slots = GaugeMetricFamily("pdproxy_group_node_slots", "Node slots of the shared table, by use", labels=["use"])
    for use in SLOT_USES:
        slots.add_metric([use], summary["slots"][use])
    yield from (worker, workers, slots)


def _pd_metrics(status: DistServeStatus) -> Iterator[Metric]:
    links = GaugeMetricFamily("pdproxy_pd_links", "Prefill-decode links by state", labels=["state"])
    handshake = GaugeMetricFamily(
        "pdproxy_pd_handshake_seconds", "Duration of each link's last handshake", labels=["prefill", "decode"]
    )
    counts: dict[str, int] = {"connected": 0, "connecting": 0, "failed": 0}
    for link in status["links"]:
        counts[link["state"]] = counts.get(link["state"], 0) + 1
        if link["handshake_seconds"] is not None:
            handshake.add_metric([link["prefill"], link["decode"]], link["handshake_seconds"])
    for name, value in counts.items():
        links.add_metric([name], value)
    ledger = status["ledger"]
    preserved = GaugeMetricFamily("pdproxy_pd_preserved_sessions", "Prefill sessions held until decode takes them")
    preserved.add_metric([], ledger["preserved"])
    ended = CounterMetricFamily("pdproxy_pd_sessions", "Preserved prefill sessions, by how they ended", labels=["end"])
    for end in SESSION_ENDS:
        ended.add_metric([end], ledger[end])
    yield from (links, handshake, preserved, ended)


def registry_for(app: Supervisor) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(PdproxyCollector(app))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_open_fds, ...
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return bytes(generate_latest(registry))

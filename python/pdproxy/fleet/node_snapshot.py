"""The dict shapes of ``Router.nodes()`` and ``Router.queue_wait()``, public API that embedders
read by key, built here from the data plane's typed views (``_pdproxy.NodeView``,
``HistogramReading``). The control plane itself reads the views; these dicts are for users."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from pdproxy._pdproxy import EngineReading, HistogramReading, LearntReading, NodeView


class Histogram(TypedDict):
    """A histogram: per-bucket `counts` (one more than `bounds`: +Inf last), `sum`, `count`."""

    bounds: list[float]
    counts: list[int]
    sum: float
    count: int


class NodeHistograms(TypedDict):
    """Seconds from admission to the end of the body, to the first byte, between chunks."""

    duration: Histogram
    ttft: Histogram
    itl: Histogram


class LearntSpeed(TypedDict):
    """What pdproxy learnt of a node's engine from its answers (None: not yet); `scored` prices
    each choice with it."""

    #: Seconds of prefill per KiB of prompt not in the engine's cache.
    prefill_seconds_per_kib: float | None
    #: Seconds to a first token besides the prefill.
    first_token_seconds: float | None
    #: Seconds a request decodes after its first token.
    decode_seconds: float | None
    #: How far a request's decoding is from that, on the mean: near 0 where answers are
    #: alike in length (a full batch's places then free as its oldest requests end).
    decode_spread_seconds: float | None
    #: Requests the engine runs at once while others wait.
    batch_slots: float | None
    #: A whole request's seconds per request in flight when it was sent.
    seconds_per_request_in_flight: float | None
    #: Prefill is no slower than this (seconds per KiB), from whole answers.
    prefill_bound_seconds_per_kib: float | None
    #: First tokens behind the prefill figures (weighted: recent ones count more).
    samples: float
    #: Of the answers that said what the engine found in its cache: the hits the routing
    #: policy predicted for them (prompt bytes), and those the engine reported (tokens).
    predicted_cached_bytes: int
    reported_cached_tokens: int
    #: The first bytes the policy priced (``scored``'s streams and prefill legs): seconds by
    #: which each came after the time priced for it (negative: before). How far off its
    #: prices are, per node.
    first_token_lateness: Histogram


class EngineReport(TypedDict):
    """What a node's engine last reported about itself (None: never read, or not reported)."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    kv_capacity_tokens: int | None
    #: Prompt tokens whose KV came over a KV connector (a decode node's), apart from cache hits.
    transferred_tokens: int | None
    #: Seconds since the last good reading.
    age: float | None
    #: Younger than `engine_metrics_max_age`: policies use it.
    fresh: bool
    #: Requests sent to the node since the reading (while fresh).
    sent_since: int | None
    requests_estimate: float | None
    #: Requests the engine had at the reading that pdproxy cannot have sent (another replica's,
    #: traffic that bypasses it), at least (while fresh).
    others: int | None
    restarts: int
    #: Times pdproxy was told its prefix cache was flushed (``POST /flush_cache``, ``Router.cache_flushed``).
    flushes: int
    failures: int
    #: Readings failed in a row.
    failing: int
    learnt: LearntSpeed


class NodeFields(TypedDict):
    """What a node was registered with, and where it is reached (``Router.node`` adds the key)."""

    url: str
    generation: int
    role: str
    #: The models it serves (its own `/v1/models` once discovered).
    models: list[str]
    #: The models it was registered with (None: ask the node).
    declared_models: list[str] | None
    speed: float | None
    max_concurrency: int | None
    has_api_key: bool
    bootstrap_port: int | None
    lease_ttl: float | None
    labels: dict[str, str]
    #: `HOST:PORT` it is connected to, when not resolved from the URL.
    address: str | None


class NodeSnapshot(NodeFields):
    """One node in ``Router.nodes()``: its record (never the key), state and counters."""

    state: str
    circuit: str
    in_flight: int
    requests: int
    succeeded: int
    failed: int
    #: Refused by the node as the client's error (4xx but 429): neither succeeded nor failed.
    client_errors: int
    connect_failures: int
    cancelled: int
    events: int
    #: Seconds (None until a request has succeeded).
    mean_latency: float | None
    recent_latency: float | None
    recent_latencies: list[float]
    recent_latency_per_token: float | None
    mean_ttft: float | None
    ttft_ewma: float | None
    histograms: NodeHistograms
    engine: EngineReport


def histogram(h: HistogramReading) -> Histogram:
    return Histogram(bounds=h.bounds, counts=h.counts, sum=h.sum, count=h.count)


def learnt_speed(learnt: LearntReading) -> LearntSpeed:
    return LearntSpeed(
        prefill_seconds_per_kib=learnt.prefill_seconds_per_kib,
        first_token_seconds=learnt.first_token_seconds,
        decode_seconds=learnt.decode_seconds,
        decode_spread_seconds=learnt.decode_spread_seconds,
        batch_slots=learnt.batch_slots,
        seconds_per_request_in_flight=learnt.seconds_per_request_in_flight,
        prefill_bound_seconds_per_kib=learnt.prefill_bound_seconds_per_kib,
        samples=learnt.samples,
        predicted_cached_bytes=learnt.predicted_cached_bytes,
        reported_cached_tokens=learnt.reported_cached_tokens,
        first_token_lateness=histogram(learnt.first_token_lateness),
    )


def engine_report(engine: EngineReading) -> EngineReport:
    return EngineReport(
        running=engine.running,
        waiting=engine.waiting,
        kv_usage=engine.kv_usage,
        prompt_tokens=engine.prompt_tokens,
        cached_tokens=engine.cached_tokens,
        kv_capacity_tokens=engine.kv_capacity_tokens,
        transferred_tokens=engine.transferred_tokens,
        age=engine.age,
        fresh=engine.fresh,
        sent_since=engine.sent_since,
        requests_estimate=engine.requests_estimate,
        others=engine.others,
        restarts=engine.restarts,
        flushes=engine.flushes,
        failures=engine.failures,
        failing=engine.failing,
        learnt=learnt_speed(engine.learnt),
    )


def node_snapshot(view: NodeView) -> NodeSnapshot:
    histograms = view.histograms
    return NodeSnapshot(
        url=view.url,
        generation=view.generation,
        role=view.role,
        models=view.models,
        declared_models=view.declared_models,
        speed=view.speed,
        max_concurrency=view.max_concurrency,
        has_api_key=view.has_api_key,
        bootstrap_port=view.bootstrap_port,
        lease_ttl=view.lease_ttl,
        labels=view.labels,
        address=view.address,
        state=view.state,
        circuit=view.circuit,
        in_flight=view.in_flight,
        requests=view.requests,
        succeeded=view.succeeded,
        failed=view.failed,
        client_errors=view.client_errors,
        connect_failures=view.connect_failures,
        cancelled=view.cancelled,
        events=view.events,
        mean_latency=view.mean_latency,
        recent_latency=view.recent_latency,
        recent_latencies=view.recent_latencies,
        recent_latency_per_token=view.recent_latency_per_token,
        mean_ttft=view.mean_ttft,
        ttft_ewma=view.ttft_ewma,
        histograms=NodeHistograms(
            duration=histogram(histograms.duration), ttft=histogram(histograms.ttft), itl=histogram(histograms.itl)
        ),
        engine=engine_report(view.engine),
    )

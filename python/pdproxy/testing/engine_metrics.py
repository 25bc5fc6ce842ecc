"""``GET /metrics`` of the mock engine, in the dialect of the engine it imitates.

The names, label sets and types are the real engines' (all three export through
prometheus_client, as this does, so the text is what they serve):

- vLLM 0.32 (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; checked against a real
  server's, recorded in ``tests/fixtures/vllm-0.32.0.json``): labels ``model_name``, ``engine``;
  gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0.32 no longer exports ``vllm:gpu_cache_usage_perc``);
  counters ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (in tokens),
  ``vllm:prompt_tokens``, ``vllm:generation_tokens``; the info gauge ``vllm:cache_config_info``
  with the labels of its CacheConfig (``block_size``, ``num_gpu_blocks``,
  ``kv_cache_size_tokens`` among 37); ``vllm:engine_sleep_state``.
- SGLang (``python/sglang/srt/metrics/collector.py``): scheduler gauges labelled
  ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``: ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:num_used_tokens``,
  ``sglang:max_total_num_tokens``, ``sglang:cache_hit_rate`` (the last prefill batch's);
  tokenizer counters labelled ``model_name``: ``sglang:prompt_tokens``,
  ``sglang:cached_tokens``, ``sglang:generation_tokens``.
- LMDeploy (``lmdeploy/metrics/loggers.py``, ``PrometheusStatLogger``): labels
  ``model_name``, ``engine``; gauges ``lmdeploy:num_requests_running``,
  ``lmdeploy:num_requests_waiting``, ``lmdeploy:gpu_cache_usage_perc``,
  ``lmdeploy:prefix_cache_hit_rate``; counters ``lmdeploy:prompt_tokens``,
  ``lmdeploy:cached_tokens``, ``lmdeploy:generation_tokens``.

Counters are named without ``_total`` here; prometheus_client adds it to the samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DIALECTS = ("lmdeploy", "vllm", "sglang")


@dataclass(frozen=True)
class EngineFigures:
    """What an engine reports about itself at one moment."""

    model: str
    running: int
    waiting: int
    #: Fraction of KV blocks held by running requests.
    kv_usage: float
    kv_blocks: int
    kv_block_tokens: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    #: The last prefill batch's cache hit rate (SGLang's gauge).
    last_hit_rate: float
    #: Put to sleep (vLLM's POST /sleep): its sleep-state gauge says so.
    asleep: bool = False
    #: Prompt tokens whose KV a prefill engine sent (a vLLM decode node's NIXL reads).
    transferred_tokens: int = 0


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


#: vLLM 0.32's `vllm:cache_config_info` labels (its CacheConfig, as a CPU server reports it),
#: with plain values; the figures' block size and count go over them.
VLLM_CACHE_CONFIG = {
    "_block_size_resolved": "True",
    "block_size": "128",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "engine": "0",
    "gpu_memory_utilization": "0.9",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "None",
    "kv_cache_memory_bytes": "None",
    "kv_cache_size_tokens": "0",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks": "0",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "None",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "None",
    "skip_page_size_padded": "False",
    "sliding_window": "None",
    "swa_bounded_replay": "False",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}


def _vllm(f: EngineFigures) -> Iterator[Metric]:
    labels = {"model_name": f.model, "engine": "0"}
    yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, f.running)
    yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, f.waiting)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, f.kv_usage)
    yield _counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels,
        f.prompt_tokens,
    )
    yield _counter(
        "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, f.cached_tokens
    )
    yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, f.prompt_tokens)
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*labels, "source"],
    )
    computed = max(0, f.prompt_tokens - f.cached_tokens - f.transferred_tokens)
    for source, tokens in (
        ("local_compute", computed),
        ("local_cache_hit", f.cached_tokens),
        ("external_kv_transfer", f.transferred_tokens),
    ):
        by_source.add_metric([*labels.values(), source], tokens)
    yield by_source
    yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, f.generation_tokens)
    config = {**VLLM_CACHE_CONFIG, "block_size": str(f.kv_block_tokens), "num_gpu_blocks": str(f.kv_blocks)}
    config["kv_cache_size_tokens"] = str(f.kv_blocks * f.kv_block_tokens)
    yield _gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", config, 1)
    sleep = GaugeMetricFamily(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake.",
        labels=[*labels, "sleep_state"],
    )
    for state, value in (("awake", not f.asleep), ("weights_offloaded", f.asleep), ("discard_all", False)):
        sleep.add_metric([*labels.values(), state], float(value))
    yield sleep


def _sglang(f: EngineFigures) -> Iterator[Metric]:
    scheduler = {"model_name": f.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    capacity = f.kv_blocks * f.kv_block_tokens
    yield _gauge("sglang:num_running_reqs", "The number of running requests.", scheduler, f.running)
    yield _gauge("sglang:num_used_tokens", "The number of used tokens.", scheduler, round(f.kv_usage * capacity))
    yield _gauge("sglang:token_usage", "The token usage.", scheduler, f.kv_usage)
    yield _gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", scheduler, f.waiting)
    yield _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", scheduler, f.last_hit_rate)
    yield _gauge(
        "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", scheduler, capacity
    )
    tokenizer = {"model_name": f.model}
    yield _counter("sglang:prompt_tokens", "Number of prefill tokens processed.", tokenizer, f.prompt_tokens)
    yield _counter("sglang:generation_tokens", "Number of generation tokens processed.", tokenizer, f.generation_tokens)
    yield _counter("sglang:cached_tokens", "Number of cached prompt tokens.", tokenizer, f.cached_tokens)


def _lmdeploy(f: EngineFigures) -> Iterator[Metric]:
    labels = {"model_name": f.model, "engine": "0"}
    yield _gauge("lmdeploy:num_requests_running", "Number of requests in model execution batches.", labels, f.running)
    yield _gauge("lmdeploy:num_requests_waiting", "Number of requests waiting to be processed.", labels, f.waiting)
    yield _gauge("lmdeploy:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", labels, f.kv_usage)
    hit_rate = f.cached_tokens / f.prompt_tokens if f.prompt_tokens else 0.0
    yield _gauge(
        "lmdeploy:prefix_cache_hit_rate",
        "Prefix-cache hit rate. 1 means 100 percent of queried prefix tokens hit.",
        labels,
        hit_rate,
    )
    yield _counter("lmdeploy:prompt_tokens", "Number of prefill tokens processed.", labels, f.prompt_tokens)
    yield _counter("lmdeploy:generation_tokens", "Number of generation tokens processed.", labels, f.generation_tokens)
    yield _counter("lmdeploy:cached_tokens", "Total prefix-cached input tokens served.", labels, f.cached_tokens)


_WRITERS = {"vllm": _vllm, "sglang": _sglang, "lmdeploy": _lmdeploy}


class _Figures(Collector):
    def __init__(self, dialect: str, figures: EngineFigures) -> None:
        self._write = _WRITERS[dialect]
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        return self._write(self._figures)


def render(dialect: str, figures: EngineFigures) -> bytes:
    """The engine's ``/metrics`` text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(dialect, figures))
    return bytes(generate_latest(registry))

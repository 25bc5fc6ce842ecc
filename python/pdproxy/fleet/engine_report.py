"""Reading an engine's ``/metrics``: requests running and waiting, KV-cache usage and capacity,
prefix-cache counters, from the Prometheus text vLLM, SGLang and LMDeploy serve.

The names are the engines' own (see ``pdproxy.testing.engine_metrics``, which serves them the
way the engines do, for the sources):

=============  ===============================  ==================================  ====================================
figure         vLLM                             SGLang                              LMDeploy
=============  ===============================  ==================================  ====================================
running        vllm:num_requests_running        sglang:num_running_reqs             lmdeploy:num_requests_running
waiting        vllm:num_requests_waiting        sglang:num_queue_reqs               lmdeploy:num_requests_waiting
KV usage       vllm:kv_cache_usage_perc         sglang:token_usage                  lmdeploy:gpu_cache_usage_perc
               (or vllm:gpu_cache_usage_perc)
prompt tokens  vllm:prefix_cache_queries_total  sglang:prompt_tokens_total          lmdeploy:prompt_tokens_total
cached tokens  vllm:prefix_cache_hits_total     sglang:cached_tokens_total          lmdeploy:cached_tokens_total
KV capacity    vllm:cache_config_info labels    sglang:max_total_num_tokens         (not exported)
               block_size x num_gpu_blocks
transferred    vllm:prompt_tokens_by_source     (not exported)                      (not exported)
               {source="external_kv_transfer"}
asleep         vllm:engine_sleep_state          (not exported)                      (its /health says sleeping)
               {sleep_state="awake"} == 0
=============  ===============================  ==================================  ====================================

An engine with several schedulers (data parallel ranks, one series each) is one node: counts and
capacities add up, usage is their mean. Names written with ``_`` for ``:`` (as some exporters
rewrite them) are read too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["EngineReading", "parse"]

#: figure -> metric names, first found wins; per dialect.
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prompt_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "cached_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "cached_tokens": ("sglang:cached_tokens_total",),
        "kv_capacity_tokens": ("sglang:max_total_num_tokens",),
    },
    "lmdeploy": {
        "running": ("lmdeploy:num_requests_running",),
        "waiting": ("lmdeploy:num_requests_waiting",),
        "kv_usage": ("lmdeploy:gpu_cache_usage_perc",),
        "prompt_tokens": ("lmdeploy:prompt_tokens_total",),
        "cached_tokens": ("lmdeploy:cached_tokens_total",),
    },
}
_VLLM_CACHE_CONFIG = "vllm:cache_config_info"
#: vLLM's sleep mode: per engine, 1 in the series of its state (awake, weights_offloaded, discard_all).
_VLLM_SLEEP_STATE = "vllm:engine_sleep_state"
#: Prompt tokens by where their KV came from; a decode node's KV connector is `external_kv_transfer`.
_VLLM_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
_PREFIXES = tuple(f"{dialect}_" for dialect in _NAMES)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineReading:
    """One reading of an engine's metrics (``None``: the engine does not export it)."""

    dialect: str
    running: int
    waiting: int
    kv_usage: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    kv_capacity_tokens: int | None
    #: Prompt tokens whose KV another engine sent (a decode node's connector), not cache hits.
    transferred_tokens: int | None = None
    #: The engine says it is asleep (vLLM's sleep mode): it answers /health but cannot serve.
    asleep: bool = False


def _canonical(name: str) -> str:
    """``vllm_num_requests_running`` -> ``vllm:num_requests_running``."""
    if name.startswith(_PREFIXES):
        prefix, _, rest = name.partition("_")
        return f"{prefix}:{rest}"
    return name


def _samples(text: str) -> dict[str, list[tuple[str, float]]]:
    """Every sample of the families pdproxy reads: name -> [(labels text, value)]."""
    wanted = {name for names in _NAMES.values() for group in names.values() for name in group}
    wanted.update((_VLLM_CACHE_CONFIG, _VLLM_SLEEP_STATE, _VLLM_BY_SOURCE))
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            end = line.rfind("}")
            if end < brace:
                continue
            name, labels, rest = line[:brace], line[brace + 1 : end], line[end + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        name = _canonical(name)
        if name not in wanted:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value == value:  # not NaN
            out.setdefault(name, []).append((labels, value))
    return out


def _vllm_capacity(samples: list[tuple[str, float]]) -> int | None:
    total = 0
    for labels, _ in samples:
        found = dict(_LABEL.findall(labels))
        try:
            total += int(found["block_size"]) * int(found["num_gpu_blocks"])
        except (KeyError, ValueError):
            continue
    return total or None


def _vllm_transferred(samples: list[tuple[str, float]] | None) -> int | None:
    if samples is None:
        return None
    external = [v for labels, v in samples if dict(_LABEL.findall(labels)).get("source") == "external_kv_transfer"]
    return int(sum(external))


def _vllm_asleep(samples: list[tuple[str, float]]) -> bool:
    """Whether an engine's ``awake`` series is 0 (with data parallel ranks: any of them)."""
    return any(dict(_LABEL.findall(labels)).get("sleep_state") == "awake" and not value for labels, value in samples)


def parse(text: str) -> EngineReading | None:
    """The figures in an engine's ``/metrics`` text; None when it has none of them."""
    samples = _samples(text)
    for dialect, names in _NAMES.items():
        if not any(name in samples for name in names["running"] + names["waiting"]):
            continue

        def values(figure: str, names: dict[str, tuple[str, ...]] = names) -> list[float] | None:
            for name in names.get(figure, ()):
                if name in samples:
                    return [value for _, value in samples[name]]
            return None

        def total(figure: str) -> int | None:
            found = values(figure)
            return None if found is None else int(sum(found))

        usage = values("kv_usage")
        capacity = total("kv_capacity_tokens")
        if dialect == "vllm" and _VLLM_CACHE_CONFIG in samples:
            capacity = _vllm_capacity(samples[_VLLM_CACHE_CONFIG])
        return EngineReading(
            dialect=dialect,
            running=total("running") or 0,
            waiting=total("waiting") or 0,
            kv_usage=min(1.0, max(0.0, sum(usage) / len(usage))) if usage else None,
            prompt_tokens=total("prompt_tokens"),
            cached_tokens=total("cached_tokens"),
            kv_capacity_tokens=capacity,
            transferred_tokens=_vllm_transferred(samples.get(_VLLM_BY_SOURCE)) if dialect == "vllm" else None,
            asleep=dialect == "vllm" and _vllm_asleep(samples.get(_VLLM_SLEEP_STATE, [])),
        )
    return None

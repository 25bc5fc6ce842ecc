"""Engine state in the node table: the simulated engines' KV cache and batching, pdproxy reading
their /metrics in each engine's dialect (and failing or stale readings), and the policies that
route by what the engines report. Real engines on real sockets (the mock engine's serving-engine
simulation), a real `pdproxy serve`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.fleet.engine_report import parse
from pdproxy.testing import MockEngine
from pdproxy.testing.batching import ContinuousBatcher, EngineModel
from pdproxy.testing.kv_cache import PagedKvCache
from servers import Process, eventually, pdproxy_serve

MODEL = "m"


def engine(dialect: str = "vllm", **overrides: Any) -> MockEngine:
    """A simulated engine: 2 requests at once, slow decode steps (a long answer keeps it busy)."""
    options: dict[str, Any] = {
        "max_batch": 2,
        "kv_blocks": 256,
        "kv_block_tokens": 16,
        "decode_step_ms": 40.0,
        "prompt_tokens_details": True,
    }
    return MockEngine(model=MODEL, simulate=True, metrics_dialect=dialect, **{**options, **overrides})


def body(prompt: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def status(http: aiohttp.ClientSession, proxy: Process, url: str) -> dict[str, Any]:
    async with http.get(proxy.url + "/nodes/status") as r:
        assert r.status == 200
        return dict((await r.json())[url]["engine"])


@contextlib.asynccontextmanager
async def busy(http: aiohttp.ClientSession, target: MockEngine, requests: int) -> AsyncIterator[None]:
    """``requests`` long answers sent straight to the engine (not through pdproxy), for as long
    as the block lasts."""

    async def one(i: int) -> None:
        async with http.post(target.url + "/v1/chat/completions", json=body(f"busy {i}", 400, True)) as r:
            async for _ in r.content.iter_any():
                pass

    tasks = [asyncio.create_task(one(i)) for i in range(requests)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def serve(tmp_path: Path, engines: list[MockEngine], *extra: str) -> contextlib.AbstractContextManager[Process]:
    nodes = [arg for e in engines for arg in ("--node", f"{e.url},model={MODEL}")]
    return pdproxy_serve(tmp_path, *nodes, "--engine-metrics-interval", "0.2", *extra)


# -- the simulation -------------------------------------------------------------------------------


def test_kv_cache_reuses_prefixes_and_evicts_the_least_recently_released() -> None:
    cache = PagedKvCache(4)
    a, b, c = [b"a1", b"a2"], [b"b1", b"b2"], [b"c1", b"c2"]
    assert cache.allocate(a, private=0) == 0
    cache.release(a, private=0)
    assert cache.allocate(b, private=0) == 0
    cache.release(b, private=0)
    assert cache.cached_prefix(a) == 2
    assert cache.cached_prefix(b) == 2
    # Room for c: a, released first, goes; its deepest block before its first.
    assert cache.allocate(c, private=0) == 0
    assert cache.cached_prefix(a) == 0
    assert cache.cached_prefix(b) == 2
    assert cache.evicted == 2
    # Held blocks are never evicted: nothing fits beside b and c held.
    assert cache.allocate(b, private=0) == 2
    assert cache.allocate([b"d1"], private=0) is None
    assert cache.usage() == 1.0


def test_a_flushed_kv_cache_finds_nothing_and_running_sequences_keep_their_blocks_unshared() -> None:
    cache = PagedKvCache(8)
    a, b = [b"a1", b"a2"], [b"b1", b"b2"]
    assert cache.allocate(a, private=1) == 0
    cache.release(a, private=1)
    assert cache.allocate(b, private=0) == 0  # b runs through the flush
    renamed = cache.flush()
    assert cache.cached_prefix(a) == cache.cached_prefix(b) == 0
    assert (cache.cached, cache.used) == (0, 2)
    assert set(renamed) == set(b)
    # A new sequence with b's prompt computes it afresh beside the old one's blocks ...
    assert cache.allocate(b, private=0) == 0
    assert cache.used == 4
    # ... and the old one's, released by their new names, are not kept for reuse.
    cache.release([renamed[block] for block in b], private=0)
    assert (cache.cached, cache.used) == (0, 2)
    cache.release(b, private=0)
    assert cache.cached_prefix(b) == 2


async def test_the_oracles_estimate_waits_for_room_in_the_kv_cache() -> None:
    # Long contexts fill the cache before the batch is full: a request that does not fit beside
    # the running one waits for it to finish (the fleet benchmark's oracle routes by this).
    model = EngineModel(
        kv_blocks=64,
        kv_block_tokens=16,
        max_batch=16,
        max_step_tokens=1024,
        prefill_ms_per_token=0.0,
        decode_step_ms=10.0,
        decode_step_ms_per_seq=0.0,
    )
    batcher = ContinuousBatcher(model)
    try:
        running = batcher.submit([b"%d" % i for i in range(40)], [], prompt_tokens=640, output_tokens=128)
        await eventually(lambda: running.admitted, "the long request admitted")
        assert batcher.cache.used == 48
        fits = batcher.estimate_ttft([], prompt_tokens=16, output_tokens=16)
        waits = batcher.estimate_ttft([], prompt_tokens=320, output_tokens=16)
        assert fits < 0.05
        assert waits > fits + 0.8, (fits, waits)  # about 120 steps of 10 ms
    finally:
        await batcher.aclose()


async def test_reset_prefix_cache_empties_the_cache_and_a_restart_zeroes_the_counters(
    http: aiohttp.ClientSession,
) -> None:
    # vLLM's POST /reset_prefix_cache keeps the cumulative counters; a restarted engine (the
    # fleet benchmark's RESTART) shows them back at zero.
    async with engine() as e:
        prompt = "a prompt worth caching " * 40

        async def cached_tokens() -> int:
            async with http.post(e.url + "/v1/chat/completions", json=body(prompt)) as r:
                assert r.status == 200, await r.text()
                return int((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

        async def prompt_tokens_counter() -> int | None:
            async with http.get(e.url + "/metrics") as r:
                reading = parse(await r.text())
            assert reading is not None
            return reading.prompt_tokens

        assert await cached_tokens() == 0
        assert await cached_tokens() > 0
        counted = await prompt_tokens_counter()
        assert counted is not None
        assert counted > 0
        async with http.post(e.url + "/reset_prefix_cache") as r:
            assert r.status == 200
            assert await r.read() == b""
        assert await prompt_tokens_counter() == counted
        assert await cached_tokens() == 0
        async with http.get(e.url + "/mock/stats") as r:
            assert (await r.json())["flushes"] == 1
        assert await cached_tokens() > 0
        assert e.state.batcher is not None
        e.state.batcher.restart()
        assert await prompt_tokens_counter() == 0
        assert await cached_tokens() == 0


async def test_a_simulated_engine_reuses_cached_prompts_and_queues_past_its_batch(
    http: aiohttp.ClientSession,
) -> None:
    async with engine() as e:
        prompt = "the same long question " * 40
        usages = []
        for _ in range(2):
            async with http.post(e.url + "/v1/chat/completions", json=body(prompt)) as r:
                assert r.status == 200, await r.text()
                usages.append((await r.json())["usage"])
        assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] > 64
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        # The second finds every full block of the first's prompt in the cache.
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= usages[1]["prompt_tokens"] - 16
        async with busy(http, e, 5):

            async def two_running_three_waiting() -> bool:
                async with http.get(e.url + "/metrics") as r:
                    reading = parse(await r.text())
                assert reading is not None
                return (reading.running, reading.waiting) == (2, 3)

            await eventually(two_running_three_waiting, "2 running and 3 waiting", timeout=15)


# -- reading the engines' /metrics ----------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "lmdeploy"])
async def test_engine_figures_are_read_in_each_engines_dialect(
    tmp_path: Path, http: aiohttp.ClientSession, dialect: str
) -> None:
    async with engine(dialect) as e:
        with serve(tmp_path, [e]) as proxy:
            async with http.post(e.url + "/v1/chat/completions", json=body("warm " * 80)) as r:
                assert r.status == 200
            async with busy(http, e, 3):

                async def read() -> bool:
                    s = await status(http, proxy, e.url)
                    return s["fresh"] and (s["running"], s["waiting"]) == (2, 1)

                await eventually(read, "the engine's 2 running and 1 waiting in /nodes/status", timeout=15)
                s = await status(http, proxy, e.url)
                assert s["dialect"] == dialect
                assert s["last_error"] is None
                assert 0 < s["kv_usage"] < 1
                assert s["prompt_tokens"] >= 80
                assert s["failures"] == 0
                # vLLM and SGLang say how large their cache is; LMDeploy does not.
                assert s["kv_capacity_tokens"] == (None if dialect == "lmdeploy" else 256 * 16)
                async with http.get(proxy.url + "/metrics") as r:
                    text = await r.text()
                assert f'pdproxy_engine_running{{node="{e.url}"}} 2.0' in text
                assert f'pdproxy_engine_waiting{{node="{e.url}"}} 1.0' in text


async def test_an_engine_put_to_sleep_gets_no_traffic_until_it_wakes(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    # vLLM's sleep mode: /health still answers 200, only /metrics says the engine is asleep.
    async with engine() as sleeper, engine() as other:
        with serve(tmp_path, [sleeper, other], "--policy", "round_robin") as proxy:

            async def state_is(wanted: str) -> bool:
                async with http.get(proxy.url + "/nodes/status") as r:
                    return bool((await r.json())[sleeper.url]["state"] == wanted)

            await eventually(lambda: state_is("healthy"), "both nodes healthy", timeout=15)
            async with http.post(sleeper.url + "/sleep", params={"level": "1"}) as r:
                assert r.status == 200
            await eventually(lambda: state_is("sleeping"), "the sleeping engine out of routing", timeout=15)
            async with http.get(sleeper.url + "/mock/stats") as r:
                before = (await r.json())["requests"]
            for _ in range(6):
                async with http.post(proxy.url + "/v1/chat/completions", json=body("hello")) as r:
                    assert r.status == 200
            async with http.get(sleeper.url + "/mock/stats") as r:
                assert (await r.json())["requests"] == before, "no request reached the sleeping engine"
            await asyncio.sleep(1.0)  # health checks keep answering 200 meanwhile: it stays out
            assert await state_is("sleeping")
            async with http.post(sleeper.url + "/wake_up") as r:
                assert r.status == 200
            await eventually(lambda: state_is("healthy"), "the woken engine back in routing", timeout=15)


def test_vllms_sleep_state_is_read() -> None:
    awake = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0',
        ]
    )
    reading = parse(awake)
    assert reading is not None
    assert not reading.asleep
    asleep = parse(awake.replace('"awake"} 1.0', '"awake"} 0.0'))
    assert asleep is not None
    assert asleep.asleep


async def test_failing_readings_are_counted_shown_and_their_figures_expire(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with engine("sglang") as e:
        with serve(tmp_path, [e], "--engine-metrics-max-age", "1") as proxy:

            async def fresh() -> bool:
                s = await status(http, proxy, e.url)
                return bool(s["fresh"]) and s["last_error"] is None

            await eventually(fresh, "a first reading", timeout=15)
            for knobs, error in (
                ({"metrics_status": 500}, "/metrics answered 500"),
                ({"metrics_status": 200, "metrics_body": "foreign"}, "no vLLM, SGLang or LMDeploy engine metrics"),
                ({"metrics_body": "huge"}, "larger than"),
            ):
                async with http.post(e.url + "/mock/config", json=knobs) as r:
                    assert r.status == 200
                before = (await status(http, proxy, e.url))["failures"]

                async def failing(error: str = error, before: int = before) -> bool:
                    s = await status(http, proxy, e.url)
                    return s["failures"] > before and error in (s["last_error"] or "")

                await eventually(failing, f"the failure {error!r} shown", timeout=15)

            # A second past the last good reading, its figures are no longer routed by (nor shown
            # as current on the dashboard), but the last ones are kept for the status page.
            async def expired() -> bool:
                return not (await status(http, proxy, e.url))["fresh"]

            await eventually(expired, "the figures to expire", timeout=5)
            s = await status(http, proxy, e.url)
            assert s["running"] == 0
            assert s["age"] >= 1
            assert s["failing"] >= 3
            async with http.get(proxy.url + "/metrics") as r:
                text = await r.text()
            assert f'pdproxy_engine_report_failures_total{{node="{e.url}"}}' in text
            async with http.post(e.url + "/mock/config", json={"metrics_body": "prometheus"}) as r:
                assert r.status == 200
            await eventually(fresh, "a good reading again", timeout=15)
            assert (await status(http, proxy, e.url))["failing"] == 0


# -- policies that use the engines' state ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["least_engine_load", "min_cache_usage", "scored"])
async def test_the_engine_aware_policies_avoid_an_engine_busy_with_others_traffic(
    tmp_path: Path, http: aiohttp.ClientSession, policy: str
) -> None:
    """The busy engine's load comes from clients pdproxy never saw: only its /metrics tell."""
    async with engine("vllm") as loaded, engine("lmdeploy") as idle:
        with serve(tmp_path, [loaded, idle], "--policy", policy) as proxy:
            async with busy(http, loaded, 4):
                # Both engines' reports: a node with none yet has no cache usage to compare, and
                # under a loaded machine the idle engine's first reading can come after the busy one's.
                async def seen() -> bool:
                    s = await status(http, proxy, loaded.url)
                    return (
                        bool(s["fresh"]) and s["waiting"] == 2 and bool((await status(http, proxy, idle.url))["fresh"])
                    )

                await eventually(seen, "both engines' reports, the busy one's queue, in /nodes/status", timeout=15)
                before = idle.state.requests
                for i in range(6):
                    async with http.post(proxy.url + "/v1/chat/completions", json=body(f"question {i}")) as r:
                        assert r.status == 200, await r.text()
                assert idle.state.requests - before == 6


async def test_scored_keeps_a_prompt_where_its_prefix_is_cached(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with engine() as a, engine() as b, engine() as c:
        with serve(tmp_path, [a, b, c], "--policy", "scored") as proxy:
            system = "You are a careful assistant who answers briefly. " * 30
            cached = []
            for i in range(4):
                payload = body("")
                payload["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]
                async with http.post(proxy.url + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200, await r.text()
                    cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            served = sorted(e.state.requests for e in (a, b, c))
            assert served == [0, 0, 4], served
            # Every request after the first found the system prompt in that engine's cache.
            assert cached[0] == 0, cached
            assert min(cached[1:]) >= len(system) // 4 - 16, cached


def test_weights_of_scored_are_checked_at_startup(tmp_path: Path) -> None:
    import subprocess
    import sys

    for spec, error in (
        ("scored:depth=2", "scored weights"),
        ("prefix:queue=1", "only scored takes weights"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "pdproxy", "serve", "--port", "0", "--policy", spec],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode != 0, (spec, done.stderr)
        assert error in done.stderr + done.stdout, (spec, done.stderr)

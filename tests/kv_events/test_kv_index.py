"""pdproxy following simulated engines' KV events (``--kv-events``): it routes a prompt to the
engine that holds it even when pdproxy never sent it there, knows a flushed engine cold, and
says in ``/nodes/status`` which nodes it prices from the events and which it cannot."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from otlp_receiver import attributes, otlp_receiver
from pdproxy.testing.mock_engine import MockEngine
from servers import eventually, pdproxy_serve

MODEL = "kv-model"
#: Simulated engines publishing their KV events; their caches hold 256 blocks of 16 tokens.
ENGINE = {
    "model": MODEL,
    "simulate": True,
    "kv_blocks": 256,
    "decode_step_ms": 1.0,
    # Slow enough prefills that a cache hit, not a stale load reading, decides where a prompt goes.
    "prefill_ms_per_token": 0.5,
    "metrics_dialect": "vllm",
    "prompt_tokens_details": True,
    "kv_events": "tcp://127.0.0.1:0",
    "kv_events_replay": "tcp://127.0.0.1:0",
}


def prompt(i: int) -> str:
    return f"document {i}: " + " ".join(f"word{i}-{k}" for k in range(120))


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


async def ask(http: aiohttp.ClientSession, url: str, text: str) -> dict[str, Any]:
    async with http.post(url + "/v1/chat/completions", json=chat(text)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def status(http: aiohttp.ClientSession, proxy: str) -> dict[str, Any]:
    async with http.get(proxy + "/nodes/status") as r:
        return await r.json()


def serve(tmp_path: Any, *engines: MockEngine, extra: tuple[str, ...] = ()) -> Any:
    nodes = [arg for e in engines for arg in ("--node", e.url)]
    return pdproxy_serve(
        tmp_path, *nodes, "--policy", "scored", "--kv-events", "auto", "--kv-tokenizer", "mock", *extra
    )


@contextlib.asynccontextmanager
async def followed(
    tmp_path: Any, *settings: dict[str, Any]
) -> AsyncIterator[tuple[list[MockEngine], aiohttp.ClientSession, Any]]:
    """Engines of ``settings`` behind ``pdproxy serve --kv-events auto``, once the data plane
    prices every publishing one from its events."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(MockEngine(**s)) for s in settings]
        http = await stack.enter_async_context(aiohttp.ClientSession())
        proxy = await stack.enter_async_context(serve(tmp_path, *engines))
        publishing = sum("kv_events" in s for s in settings)
        await eventually(lambda: _all_live(http, proxy.url, publishing), what="the publishing nodes followed live")
        yield engines, http, proxy


async def test_a_prompt_goes_where_the_engine_says_it_is_held(tmp_path: Any) -> None:
    async with followed(tmp_path, ENGINE, ENGINE) as ((a, b), http, proxy):
        # Prompts sent to the engines directly (a batch job, another router): pdproxy never saw them.
        held = {i: (a if i % 2 else b) for i in range(6)}
        for i, engine in held.items():
            await ask(http, engine.url, prompt(i))
        for engine in (a, b):
            # Each prompt fills at least this many blocks of 16 mock tokens (4 bytes each).
            least = sum(len(prompt(i)) // 64 for i, e in held.items() if e is engine)
            await eventually(
                lambda e=engine, n=least: _blocks(http, proxy.url, e.url, lambda held_: held_ >= n),
                what="every prompt's blocks indexed",
            )
        for i, engine in held.items():
            before = engine.state.requests
            answer = await ask(http, proxy.url, prompt(i) + " and a question")
            assert engine.state.requests == before + 1, f"prompt {i} went to the engine that holds it"
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        nodes = await status(http, proxy.url)
        used = [n["kv_events"] for n in nodes.values()]
        assert all(u["live"] for u in used), used


async def test_a_flushed_engine_is_known_cold(tmp_path: Any) -> None:
    async with followed(tmp_path, ENGINE, ENGINE) as ((a, _), http, proxy):
        await ask(http, a.url, prompt(1))
        await eventually(lambda: _blocks(http, proxy.url, a.url, lambda n: n > 0), what="its blocks indexed")
        async with http.post(a.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        await eventually(lambda: _blocks(http, proxy.url, a.url, lambda n: n == 0), what="the flush known")


async def test_a_node_without_events_is_priced_by_the_table_and_says_so(tmp_path: Any) -> None:
    quiet = {k: v for k, v in ENGINE.items() if not k.startswith("kv_events")}
    async with followed(tmp_path, ENGINE, quiet) as ((a, b), http, proxy):
        nodes = await status(http, proxy.url)
        assert nodes[a.url]["kv_events"]["live"] is True
        silent = nodes[b.url]["kv_events"]
        assert silent["live"] is False
        assert "no KV event publisher" in silent["error"]
        await ask(http, proxy.url, prompt(3))  # still served


async def test_prefill_goes_to_the_holder_and_the_trace_says_what_the_pair_holds(tmp_path: Any) -> None:
    # Simulated engines play the roles (they answer the vLLM legs as plain completions): what is
    # tested is where pdproxy sends each leg, and what its trace says.
    async with (
        MockEngine(**ENGINE) as cold,
        MockEngine(**ENGINE) as holder,
        MockEngine(**ENGINE) as decode,
        aiohttp.ClientSession() as http,
    ):
        nodes = [f"{cold.url},role=prefill", f"{holder.url},role=prefill", f"{decode.url},role=decode"]
        with otlp_receiver() as otlp:
            args = ("--serving-strategy", "DistServe", "--pd-protocol", "vllm", "--otlp-endpoint", otlp.url)
            async with serve(tmp_path, extra=(*[a for n in nodes for a in ("--node", n)], *args)) as proxy:
                await eventually(lambda: _all_live(http, proxy.url, 3), what="the three nodes' KV events followed live")

                async def traced(text: str) -> dict[str, str]:
                    trace_id = secrets.token_hex(16)
                    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat(text), headers=headers) as r:
                        assert r.status == 200, await r.text()
                    await eventually(lambda: bool(otlp.named(trace_id, "pdproxy.request")), what="the trace")
                    (root,) = otlp.named(trace_id, "pdproxy.request")
                    return attributes(root)

                await ask(http, holder.url, prompt(5))
                least = len(prompt(5)) // 64
                await eventually(lambda: _blocks(http, proxy.url, holder.url, lambda n: n >= least), what="indexed")
                before = holder.state.requests
                held = await traced(prompt(5))
                assert holder.state.requests == before + 1, "the prefill went to the node that holds the prompt"
                assert int(held["pdproxy.kv_index.prefill_cached_tokens"]) >= least * 16
                assert held["pdproxy.kv_index.decode_cached_tokens"] == "0"
                assert held["pdproxy.kv_index.decode_holds_prompt"] == "false"

                await ask(http, decode.url, prompt(6))
                await eventually(lambda: _blocks(http, proxy.url, decode.url, lambda n: n >= least), what="indexed")
                held = await traced(prompt(6))
                assert held["pdproxy.kv_index.decode_holds_prompt"] == "true", held


async def _all_live(http: aiohttp.ClientSession, proxy: str, count: int) -> bool:
    nodes = await status(http, proxy)
    return sum(bool(n.get("kv_events") and n["kv_events"]["live"]) for n in nodes.values()) >= count


async def _blocks(http: aiohttp.ClientSession, proxy: str, node: str, check: Any) -> bool:
    ranks = (await status(http, proxy))[node]["kv_events"]["ranks"]
    return bool(check(sum(r.get("blocks", 0) for r in ranks.values())))

"""The fleet benchmark's engines, in one process: ``--count`` simulated mock engines on
consecutive ports, and the oracle, a router on ``--oracle-port`` that sees every engine's exact
KV cache and queue (it runs beside them) and sends each request to the engine that would give
it its first token soonest (``ContinuousBatcher.estimate_ttft``: the waits for a place in the
batch and for room in the KV cache, the prefill ahead and its own), counting the prefill it adds
for the requests behind it.

    python bench/fleet_engines.py --port 21000 --count 8 --oracle-port 21100 --model m \\
        --engine '{"kv_blocks": 512, ...}'

``--engine`` is one engine's simulation options for all of them, or a list with each engine's
own (engines of unequal speed). On the oracle's port:

- ``POST /fleet/reset`` empties every engine's cache and counters, and its KV events' replay
  buffer (between runs);
- ``POST /fleet/flush?engine=I`` empties engine I's prefix cache, as vLLM's
  ``POST /reset_prefix_cache`` does (its counters go on);
- ``POST /fleet/restart?engine=I`` makes engine I look restarted: its cache empty and its
  cumulative ``/metrics`` counters back to zero (requests in flight finish, no downtime);
- ``GET /fleet/stats`` gives each engine's ``/mock/stats``.

A flush or restart answers with the requests each engine had received until then, so that the
client can tell the share of traffic an engine got before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

import aiohttp
import uvloop
from aiohttp import web

from pdproxy.testing import MockEngine, MockSettings
from pdproxy.testing.tokens import TOKEN_BYTES, block_hashes, count_tokens, render_prompt

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


def oracle_app(engines: list[MockEngine]) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    client: dict[str, aiohttp.ClientSession] = {}

    def choose(body: dict[str, object]) -> MockEngine:
        prompt = render_prompt(body)
        block = engines[0].settings.kv_block_tokens
        hashes = block_hashes(prompt, block)[: len(prompt.encode()) // (block * TOKEN_BYTES)]
        tokens = count_tokens(prompt)
        answer = body.get("max_tokens")
        answer_tokens = answer if isinstance(answer, int) else 0

        def cost(engine: MockEngine) -> tuple[float, int]:
            # Its own first token, plus the prefill it adds: the time every later request on
            # that engine waits for it (a greedy choice by first token alone spreads a popular
            # prompt over every engine as soon as queues form, and thrashes their caches).
            batcher = engine.state.batcher
            assert batcher is not None
            added = batcher.uncached_tokens(hashes, tokens) * batcher.model.prefill_ms_per_token / 1000
            ttft = batcher.estimate_ttft(hashes, tokens, answer_tokens)
            return ttft + added, len(batcher.running) + len(batcher.waiting)

        return min(engines, key=cost)

    async def route(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response(
                {"error": {"message": "invalid JSON", "type": "invalid_request_error"}}, status=400
            )
        engine = choose(body)
        session = client.setdefault("s", aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)))
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with session.post(engine.url + request.path, data=raw, headers=headers) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def models(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as session, session.get(engines[0].url + "/v1/models") as r:
            return web.json_response(await r.json())

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def reset(request: web.Request) -> web.Response:
        for engine in engines:
            state = engine.state
            state.requests = state.completed = state.disconnected = 0
            state.records.clear()
            if state.batcher is not None:
                state.batcher.reset()
            if state.kv_events is not None:
                # As a freshly started engine: no earlier run's events kept for replay, which a
                # router joining now would otherwise replay (thousands of batches) during its run.
                state.kv_events.restart()
        return web.json_response({"reset": len(engines)})

    def target(request: web.Request) -> MockEngine:
        """The engine ``?engine=I`` names (HTTP 400 when it names none)."""
        try:
            return engines[int(request.query["engine"])]
        except (KeyError, ValueError, IndexError):
            raise web.HTTPBadRequest(text=f"engine must be one of 0-{len(engines) - 1}") from None

    def received() -> list[int]:
        return [engine.state.requests for engine in engines]

    async def flush(request: web.Request) -> web.Response:
        engine = target(request)
        engine.state.flush_cache()
        return web.json_response({"engine": engine.url, "requests": received()})

    async def restart(request: web.Request) -> web.Response:
        engine = target(request)
        assert engine.state.batcher is not None
        engine.state.batcher.restart()
        return web.json_response({"engine": engine.url, "requests": received()})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({engine.url: engine.state.stats() for engine in engines})

    async def close(app: web.Application) -> None:
        if "s" in client:
            await client["s"].close()

    app.router.add_post("/v1/chat/completions", route)
    app.router.add_post("/v1/completions", route)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/fleet/reset", reset)
    app.router.add_post("/fleet/flush", flush)
    app.router.add_post("/fleet/restart", restart)
    app.router.add_get("/fleet/stats", stats)
    app.on_cleanup.append(close)
    return app


async def serve(args: argparse.Namespace) -> None:
    given = json.loads(args.engine)
    shapes = given if isinstance(given, list) else [given] * args.count
    dialects = args.dialects.split(",")
    engines = [
        MockEngine(
            MockSettings(
                port=args.port + i,
                model=args.model,
                simulate=True,
                metrics_dialect=dialects[i % len(dialects)],
                # As long a context as its KV cache holds (vLLM's answers refuse longer ones).
                max_model_len=shape.get("kv_blocks", 2048) * shape.get("kv_block_tokens", 16),
                # Playing vLLM too, its answers say how many prompt tokens were cached (as vLLM's
                # --enable-prompt-tokens-details): the client's cache hit rate is read from them.
                prompt_tokens_details=True,
                # Their KV events, when a router follows them (any free ports; /server_info says which).
                **(
                    {"kv_events": "tcp://127.0.0.1:0", "kv_events_replay": "tcp://127.0.0.1:0"}
                    if args.kv_events
                    else {}
                ),
                **shape,
            )
        )
        for i, shape in enumerate(shapes)
    ]
    for engine in engines:
        await engine.start()
    runner = web.AppRunner(oracle_app(engines), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.oracle_port, backlog=1024).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fleet: {len(engines)} engines from port {args.port}, oracle on {args.oracle_port}", flush=True)
    await stop.wait()
    await runner.cleanup()
    for engine in engines:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="port of the first engine")
    parser.add_argument("--count", type=int, default=8, help="engines, when --engine is one for all")
    parser.add_argument("--oracle-port", type=int, required=True)
    parser.add_argument("--model", default="fleet-model")
    parser.add_argument(
        "--engine", default="{}", help="simulation options of every engine, as JSON: one object, or a list (one each)"
    )
    parser.add_argument("--dialects", default="vllm", help="metrics dialects, given to the engines in turn")
    parser.add_argument("--kv-events", action="store_true", help="the engines publish their KV events (ZMQ)")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(serve(args))


if __name__ == "__main__":
    main()

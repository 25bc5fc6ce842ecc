"""Failure handling in the data plane: retries only of what provably did not run, within a
budget; circuit breaking; through the embedded Router against in-process mock engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

import pdproxy
from pdproxy.testing import FAULT_HEADER, MockEngine, MockSettings
from servers import chat_body, eventually, free_port


def body(stream: bool = False) -> bytes:
    return json.dumps(chat_body("m", stream=stream, max_tokens=3)).encode()


async def call(router: pdproxy.Router, headers: list[tuple[bytes, bytes]] | None = None) -> pdproxy.Response:
    response = await router.forward("/v1/chat/completions", body(), headers or [])
    b"".join([chunk async for chunk in response])
    return response


def node(router: pdproxy.Router, url: str) -> dict:  # type: ignore[type-arg]
    return next(n for n in router.nodes() if n["url"] == url)


@pytest.fixture
async def live() -> AsyncIterator[MockEngine]:
    async with MockEngine(model="m") as engine:
        yield engine


async def test_connect_failures_are_retried_on_another_node(live: MockEngine) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with pdproxy.Router(policy="round_robin", circuit_failures=0) as router:
        router.add_node(dead, ["m"])
        router.add_node(live.url, ["m"])
        for _ in range(6):
            assert (await call(router)).status == 200
        assert node(router, dead)["connect_failures"] >= 1
        assert node(router, live.url)["succeeded"] == 6, "every request was served, none lost"
        assert all(n["in_flight"] == 0 for n in router.nodes())


async def test_refusals_before_work_are_retried(live: MockEngine) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", fault="status=503")) as busy,
        pdproxy.Router(policy="round_robin", circuit_failures=0) as router,
    ):
        router.add_node(busy.url, ["m"])
        router.add_node(live.url, ["m"])
        for _ in range(4):
            response = await call(router)
            assert (response.status, response.node) == (200, live.url)
        assert busy.state.requests >= 1
        assert live.state.requests == 4


async def test_work_that_may_have_run_is_never_retried(live: MockEngine) -> None:
    async with MockEngine(model="m") as other, pdproxy.Router(policy="round_robin") as router:
        router.add_node(other.url, ["m"])
        router.add_node(live.url, ["m"])
        # The node accepted the request, then dropped the connection: it may have done work.
        with pytest.raises(pdproxy.UpstreamError):
            await call(router, [(FAULT_HEADER.encode(), b"drop_after=0")])
        # A 4xx is the client's problem: passed through, not retried.
        response = await call(router, [(FAULT_HEADER.encode(), b"status=400")])
        assert response.status == 400
        assert other.state.requests + live.state.requests == 2, "each request reached exactly one node"


async def test_retry_budget_and_limit(live: MockEngine) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # Round robin: every other request goes to the dead node, whatever the default policy prefers.
    budget = {"retry_budget_floor": 0, "retry_budget_ratio": 0.0, "circuit_failures": 0}
    async with pdproxy.Router(policy="round_robin", **budget) as router:
        router.add_node(dead, ["m"])
        router.add_node(live.url, ["m"], max_concurrency=1)
        router.set_node_state(live.url, "healthy")
        failures = 0
        for _ in range(6):
            try:
                await call(router)
            except pdproxy.UpstreamConnectError:
                failures += 1
        assert failures >= 1, "with no budget, a connect failure reaches the client"
    async with pdproxy.Router(retries=0, circuit_failures=0) as router:
        router.add_node(dead, ["m"])
        with pytest.raises(pdproxy.UpstreamConnectError):
            await call(router)


async def test_circuit_opens_probes_and_closes(live: MockEngine) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    async with pdproxy.Router(policy="round_robin", circuit_failures=2, circuit_cooldown=0.3) as router:
        router.add_node(dead, ["m"])
        router.add_node(live.url, ["m"])
        for _ in range(8):
            assert (await call(router)).status == 200
        assert node(router, dead)["circuit"] == "open"
        assert node(router, dead)["connect_failures"] == 2, "an open circuit keeps requests away"
        # The node comes back; after the cooldown one request probes it and closes the circuit.
        async with MockEngine(MockSettings(port=port, model="m")):
            # A fixed wait: the cooldown (0.3 s) is time itself, and it ends unseen until a request probes.
            await asyncio.sleep(0.35)
            for _ in range(6):
                assert (await call(router)).status == 200
            assert node(router, dead)["circuit"] == "closed"
            assert node(router, dead)["succeeded"] >= 1


# Through `pdproxy serve`: the global cap, slow bodies, bad input, draining.

from pathlib import Path  # noqa: E402

import aiohttp  # noqa: E402

from servers import pdproxy_serve  # noqa: E402


async def raw_exchange(url: str, payload: bytes, read_timeout: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), read_timeout)
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.usefixtures("edge")
async def test_global_cap(tmp_path: Path, live: MockEngine, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path, "--node", f"{live.url},model=m", "--max-requests", "1") as proxy:
        slow = asyncio.ensure_future(
            http.post(proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "ttft_ms=500"})
        )
        await eventually(lambda: live.state.active > 0, "the slow request at the node")
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 503
            assert r.headers["x-pdproxy-error"] == "overloaded"
            assert "retry-after" in r.headers
        async with await slow as r:
            assert r.status == 200


@pytest.mark.usefixtures("edge")
async def test_slow_and_bad_bodies(tmp_path: Path, live: MockEngine, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path, "--node", f"{live.url},model=m", "--body-timeout", "0.3") as proxy:
        # A body that never finishes arriving: 408, not a hung handler.
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
        )
        answer = await raw_exchange(proxy.url, head + b'{"model": "m"')
        assert answer.startswith(b"HTTP/1.1 408")
        for bad in (
            b"[" * 5000 + b"]" * 5000,
            b'{"model": "\xff\xfe"}',
            b'{"model": "m", "stream": "yes"}',
            b"\x00" * 100,
        ):
            async with http.post(
                proxy.url + "/v1/chat/completions", data=bad, headers={"content-type": "application/json"}
            ) as r:
                assert r.status == 400, bad[:20]
                assert (await r.json())["error"]["code"] == "invalid_request"
        async with http.get(proxy.url + "/health") as r:
            assert r.status == 200, "the proxy is still up"


@pytest.mark.usefixtures("edge")
async def test_drain_finishes_streams_then_exits_cleanly(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", token_delay_ms=50)) as slow_engine,
        pdproxy_serve(tmp_path, "--node", f"{slow_engine.url},model=m", "--drain-timeout", "10") as proxy,
    ):
        body = chat_body("m", stream=True, max_tokens=10, ignore_eos=True)
        async with http.post(proxy.url + "/v1/chat/completions", json=body) as stream:
            first = await stream.content.readline()
            assert first.startswith(b"data: ")
            async with http.post(proxy.url + "/drain") as r:
                assert r.status == 202
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status == 503
                assert r.headers["x-pdproxy-error"] == "draining"
                assert r.headers["connection"] == "close"
            async with http.get(proxy.url + "/ready") as r:
                assert r.status == 503
            rest = await stream.read()
        assert rest.endswith(b"data: [DONE]\n\n"), "the stream in flight finished"
        assert proxy.proc.wait(timeout=15) == 0, "pdproxy exits 0 after a clean drain"

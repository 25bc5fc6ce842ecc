"""Failure handling in the data plane: retries only of what provably did not run, within a
budget; circuit breaking; through the embedded Router against in-process mock engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

import pdproxy
from pdproxy.testing import FAULT_HEADER, MockEngine, MockSettings
from servers import chat_body, free_port


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
    async with pdproxy.Router(retry_budget_floor=0, retry_budget_ratio=0.0, circuit_failures=0) as router:
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
            await asyncio.sleep(0.35)
            for _ in range(6):
                assert (await call(router)).status == 200
            assert node(router, dead)["circuit"] == "closed"
            assert node(router, dead)["succeeded"] >= 1

"""Per-node limits, admission, node states and policies, through the embedded Router
against in-process mock engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

import pdproxy
from pdproxy.testing import FAULT_HEADER, MockEngine
from servers import chat_body, eventually

SLOW = [(FAULT_HEADER.encode(), b"token_delay_ms=30")]


def body(model: str = "m", **extra: object) -> bytes:
    return json.dumps(chat_body(model, stream=True, max_tokens=5, **extra)).encode()


async def drain(response: pdproxy.Response) -> bytes:
    return b"".join([chunk async for chunk in response])


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(model="m") as engine:
        yield engine


async def test_cap_is_never_exceeded_and_the_queue_drains(engine: MockEngine) -> None:
    async with pdproxy.Router(queue_size=16, queue_timeout=10) as router:
        router.add_node(engine.url, ["m"], max_concurrency=2)
        peak = 0

        async def one() -> bytes:
            nonlocal peak
            response = await router.forward("/v1/chat/completions", body(), headers=SLOW)
            peak = max(peak, router.nodes()[0]["in_flight"], engine.state.active)
            return await drain(response)

        tasks = [asyncio.create_task(one()) for _ in range(8)]
        await eventually(lambda: router.queued == 6, "six requests queued behind the cap of two")
        results = await asyncio.gather(*tasks)
        assert all(r.endswith(b"data: [DONE]\n\n") for r in results)
        assert peak <= 2
        assert router.nodes()[0]["in_flight"] == 0
        assert router.queued == 0
        assert router.nodes()[0]["succeeded"] == 8


async def test_full_queue_is_refused_with_retry_after(engine: MockEngine) -> None:
    async with pdproxy.Router(queue_size=1, queue_timeout=10) as router:
        router.add_node(engine.url, ["m"], max_concurrency=1)
        first = await router.forward("/v1/chat/completions", body(), headers=SLOW)
        queued = router.forward("/v1/chat/completions", body(), headers=SLOW)
        with pytest.raises(pdproxy.Overloaded) as info:
            router.forward("/v1/chat/completions", body(), headers=SLOW)
        assert info.value.status == 429
        assert 1 <= info.value.retry_after <= 60
        assert (b"retry-after", str(info.value.retry_after).encode()) in info.value.headers()
        await drain(first)
        await drain(await queued)
        assert router.nodes()[0]["in_flight"] == 0


async def test_queue_wait_times_out(engine: MockEngine) -> None:
    async with pdproxy.Router(queue_size=4, queue_timeout=0.2) as router:
        router.add_node(engine.url, ["m"], max_concurrency=1)
        hog = await router.forward("/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"ttft_ms=2000")])
        with pytest.raises(pdproxy.Overloaded):
            await router.forward("/v1/chat/completions", body())
        assert router.queued == 0
        hog.close()
        assert router.nodes()[0]["in_flight"] == 0
        # The wait is recorded although it ended without a node: in the bucket up to 0.25 s.
        waited = router.queue_wait()
        assert waited["count"] == 1
        assert waited["counts"][waited["bounds"].index(0.25)] == 1
        assert waited["sum"] >= 0.2


async def test_no_queue_means_429_at_once(engine: MockEngine) -> None:
    async with pdproxy.Router(queue_size=0) as router:
        router.add_node(engine.url, ["m"], max_concurrency=1)
        hog = await router.forward("/v1/chat/completions", body(), headers=SLOW)
        with pytest.raises(pdproxy.Overloaded):
            router.forward("/v1/chat/completions", body())
        hog.close()


async def test_raising_the_cap_admits_waiters_on_the_next_release(engine: MockEngine) -> None:
    async with pdproxy.Router(queue_timeout=10) as router:
        router.add_node(engine.url, ["m"], max_concurrency=1)
        first = await router.forward("/v1/chat/completions", body(), headers=SLOW)
        waiting = router.forward("/v1/chat/completions", body())
        assert router.queued == 1
        router.set_max_concurrency(engine.url, None)
        assert router.nodes()[0]["max_concurrency"] is None
        await drain(first)
        second = await waiting
        assert second.status == 200
        assert (await drain(second)).endswith(b"data: [DONE]\n\n")
        assert router.queued == 0
        assert router.nodes()[0]["in_flight"] == 0


async def test_unhealthy_draining_and_sleeping_nodes_take_nothing(engine: MockEngine) -> None:
    async with MockEngine(model="m") as other, pdproxy.Router(policy="round_robin") as router:
        router.add_node(engine.url, ["m"])
        router.add_node(other.url, ["m"])
        for state in ("unhealthy", "draining", "sleeping"):
            router.set_node_state(engine.url, state)
            for _ in range(4):
                response = await router.forward("/v1/chat/completions", body())
                assert response.node == other.url
                await drain(response)
        router.set_node_state(other.url, "unhealthy")
        with pytest.raises(pdproxy.NoNodeAvailable) as info:
            router.forward("/v1/chat/completions", body())
        assert info.value.status == 503
        assert info.value.retry_after is not None
        states = {n["url"]: n["state"] for n in router.nodes()}
        assert states == {engine.url: "sleeping", other.url: "unhealthy"}
        with pytest.raises(pdproxy.InvalidNode):
            router.set_node_state(engine.url, "tired")
        with pytest.raises(pdproxy.NodeNotFound):
            router.set_node_state("http://127.0.0.1:1", "healthy")


@pytest.mark.parametrize("header", [b"x-session-id", b"x-smg-routing-key", b"x-user-id"])
async def test_session_affinity_sticks_to_one_node(engine: MockEngine, header: bytes) -> None:
    async with MockEngine(model="m") as other, pdproxy.Router(policy="consistent_hash") as router:
        router.add_node(engine.url, ["m"])
        router.add_node(other.url, ["m"])
        for key in ("alice", "bob", "carol"):
            served = set()
            for _ in range(5):
                response = await router.forward("/v1/chat/completions", body(), headers=[(header, key.encode())])
                served.add(response.node)
                await drain(response)
            assert len(served) == 1, key
        # The body's `user` is a key too.
        assert router.select("m", affinity="alice") == router.select("m", affinity="alice")


async def test_roles_are_routed_apart(engine: MockEngine) -> None:
    async with MockEngine(model="m", role="prefill") as prefill, pdproxy.Router() as router:
        router.add_node(engine.url, ["m"])
        router.add_node(prefill.url, ["m"], role="2")  # LMDeploy's integer for Prefill
        assert router.select("m") == engine.url
        assert router.select("m", role="prefill") == prefill.url
        with pytest.raises(pdproxy.NoNodeAvailable):
            router.select("m", role="decode")
        response = await router.forward("/v1/chat/completions", body(), role="prefill")
        assert response.node == prefill.url
        await drain(response)
        roles = {n["url"]: n["role"] for n in router.nodes()}
        assert roles == {engine.url: "hybrid", prefill.url: "prefill"}
        assert all(n["in_flight"] == 0 and n["requests"] <= 1 for n in router.nodes()), "select() counts nothing"


async def test_stats_record_latency_events_and_ttft(engine: MockEngine) -> None:
    async with pdproxy.Router(policy="min_observed_latency") as router:
        router.add_node(engine.url, ["m"])
        for _ in range(3):
            await drain(await router.forward("/v1/chat/completions", body()))
        node = router.nodes()[0]
        assert node["succeeded"] == 3
        assert node["events"] == 3 * 7  # 5 tokens, the final chunk and [DONE]
        assert node["recent_latency"] > 0
        assert 0 < node["mean_ttft"] <= node["recent_latency"]
        assert node["recent_latency_per_token"] < node["recent_latency"]


def test_inspect_and_patch() -> None:
    raw = b'{"model":"m","stream":true,"session_id":7,"messages":[],"max_tokens":9}'
    info = pdproxy.Router.inspect(raw)
    assert info == {
        "model": "m",
        "stream": True,
        "n": None,
        "best_of": None,
        "user": None,
        "session_id": "7",
        "max_tokens": 9,
    }
    patched = pdproxy.Router.patch(raw, {"max_tokens": 1, "stream": False, "with_cache": True}, remove=["session_id"])
    assert patched == b'{"model":"m","stream":false,"messages":[],"max_tokens":1,"with_cache":true}'
    with pytest.raises(pdproxy.InvalidRequest):
        pdproxy.Router.inspect(b'{"n": "two"}')


async def test_close_ends_streams_in_flight(engine: MockEngine) -> None:
    router = pdproxy.Router(nodes=[engine.url])
    await router.start()
    response = await router.forward(
        "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"token_delay_ms=200")]
    )
    await router.aclose()
    with pytest.raises(pdproxy.UpstreamError):
        await drain(response)
    assert router.nodes()[0]["in_flight"] == 0


async def test_request_timeout_covers_head_and_stream(engine: MockEngine) -> None:
    async with pdproxy.Router(nodes=[engine.url], request_timeout=0.3) as router:
        with pytest.raises(pdproxy.UpstreamTimeout):
            await router.forward("/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"hang")])
        response = await router.forward(
            "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"token_delay_ms=100")]
        )
        received = b""
        with pytest.raises(pdproxy.UpstreamTimeout):
            async for chunk in response:
                received += chunk
        assert received.count(b"data: ") >= 1, "the events before the limit were delivered"
        node = router.nodes()[0]
        assert (node["in_flight"], node["failed"]) == (0, 2)

"""`pdproxy.Router` embedded in a plain asyncio program, against in-process mock engines."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator

import pytest

import pdproxy
from pdproxy.fleet.node_snapshot import EngineReport, LearntSpeed, NodeSnapshot
from pdproxy.testing import FAULT_HEADER, MockEngine
from servers import chat_body, eventually, free_port


def body(model: str | None = "m", stream: bool = True, **extra: object) -> bytes:
    return json.dumps(chat_body(model, stream=stream, **extra)).encode()


def in_flight(router: pdproxy.Router) -> int:
    return sum(n["in_flight"] for n in router.nodes())


@pytest.fixture
async def engines() -> AsyncIterator[list[MockEngine]]:
    async with MockEngine(model="m") as a, MockEngine(model="m") as b:
        yield [a, b]


async def test_forward_and_stream(engines: list[MockEngine]) -> None:
    async with pdproxy.Router(nodes=[e.url for e in engines]) as router:
        assert router.models() == ["m"]
        response = await router.forward("/v1/chat/completions", body())
        assert response.status == 200
        assert (b"content-type", b"text/event-stream") in response.headers
        assert response.body is None
        received = b"".join([chunk async for chunk in response])
        assert received.endswith(b"data: [DONE]\n\n")
        # Every batch holds whole events, so the joined body splits cleanly.
        assert all(block.startswith(b"data: ") for block in received.split(b"\n\n") if block)
        stats = {n["url"]: n for n in router.nodes()}
        assert stats[response.node]["succeeded"] == 1
        assert in_flight(router) == 0


async def test_batches_are_whole_events(engines: list[MockEngine]) -> None:
    async with pdproxy.Router(nodes=[engines[0].url]) as router:
        response = await router.forward(
            "/v1/completions",
            json.dumps({"model": "m", "prompt": "p", "stream": True}).encode(),
            headers=[(FAULT_HEADER.encode(), b"fragment=3")],
        )
        async for chunk in response:
            assert chunk.endswith(b"\n\n"), chunk
            assert chunk.startswith(b"data: ")


async def test_non_stream_body_arrives_with_the_head(engines: list[MockEngine]) -> None:
    async with pdproxy.Router(nodes=[engines[0].url]) as router:
        response = await router.forward("/v1/chat/completions", body(stream=False))
        assert response.body is not None
        assert json.loads(response.body)["object"] == "chat.completion"
        assert [chunk async for chunk in response] == [response.body]
        assert in_flight(router) == 0


async def test_add_remove_and_discovery(engines: list[MockEngine]) -> None:
    async with pdproxy.Router() as router:
        url = router.add_node(engines[0].url + "/")
        assert url == engines[0].url
        await router._discovery.probe_pending()
        assert router.nodes()[0]["models"] == ["m"]
        router.add_node(engines[1].url, models=["x", "m", "x"])
        assert router.models() == ["m", "x"]
        assert router.remove_node(engines[1].url) == engines[1].url
        with pytest.raises(pdproxy.NodeNotFound):
            router.remove_node(engines[1].url)
        with pytest.raises(pdproxy.InvalidNode):
            router.add_node("ftp://files:21")
        assert [n["url"] for n in router.nodes()] == [engines[0].url]


async def test_errors_before_any_node_is_asked() -> None:
    async with pdproxy.Router() as router:
        with pytest.raises(pdproxy.NoNodeAvailable):
            router.forward("/v1/chat/completions", body())
        router.add_node("127.0.0.1:1", models=["m"])
        with pytest.raises(pdproxy.ModelNotFound):
            router.forward("/v1/chat/completions", body("other"))
        with pytest.raises(pdproxy.InvalidRequest):
            router.forward("/v1/chat/completions", b"[]")
        with pytest.raises(pdproxy.InvalidRequest):
            router.forward("/v1/chat/completions", b'{"stream": "yes"}')


async def test_connect_failure() -> None:
    port = free_port()  # nothing listens here
    async with pdproxy.Router(nodes=[f"127.0.0.1:{port},model=m"]) as router:
        with pytest.raises(pdproxy.UpstreamConnectError) as info:
            await router.forward("/v1/chat/completions", body())
        assert isinstance(info.value, ConnectionError)
        assert info.value.status == 503
        node = router.nodes()[0]
        assert (node["failed"], node["in_flight"]) == (1, 0)
        # Whoever reads the traceback learns the node and the cause; a client's answer (message) neither.
        assert f"node http://127.0.0.1:{port}" in str(info.value)
        assert "refused" in str(info.value).lower()
        assert "127.0.0.1" not in info.value.message


async def test_nodes_that_never_told_their_models_are_named_in_the_error() -> None:
    port = free_port()  # nothing listens here
    async with pdproxy.Router(nodes=[f"127.0.0.1:{port}"]) as router:
        with pytest.raises(pdproxy.NoNodeAvailable) as info:
            await router.forward("/v1/chat/completions", body())
        assert f"node http://127.0.0.1:{port}: /v1/models failed" in str(info.value)
        assert "127.0.0.1" not in info.value.message
        assert router.nodes()[0]["requests"] == 0, "no request went to a node of unknown models"


async def test_a_nodes_probe_answers_with_its_models_when_the_background_probe_told_them_first(
    engines: list[MockEngine],
) -> None:
    """A registration waits for the node's models (``discover(url)``); when the background probe
    (every pending node) got them first, it still answers with them."""
    async with pdproxy.Router() as router:
        url = router.add_node(engines[0].url)
        await router.discover()  # the background loop's probe, ahead of the registration's
        view = await router.discover(url)
        assert view is not None
        assert view.models == ["m"]


async def test_integer_roles_and_a_short_summary(engines: list[MockEngine]) -> None:
    async with pdproxy.Router() as router:
        for role, name in ((1, "hybrid"), (2, "prefill"), (3, "decode")):
            url = router.add_node(f"http://127.0.0.{role}:9", ["m"], role=role, verify=False)
            assert next(n["role"] for n in router.nodes() if n["url"] == url) == name
        router.add_node(engines[0].url)
        await router.discover()
        response = await router.forward("/v1/chat/completions", body(), node=engines[0].url)
        assert b"".join([chunk async for chunk in response]).endswith(b"data: [DONE]\n\n")
        summary = router.summary()
        assert [n["url"] for n in summary] == [n["url"] for n in router.nodes()]
        served = next(n for n in summary if n["url"] == engines[0].url)
        assert (served["requests"], served["succeeded"], served["in_flight"], served["models"]) == (1, 1, 0, ["m"])
        assert served["mean_latency"] > 0
        assert len(repr(summary)) < 250 * len(summary), "a summary, not the histograms"


async def test_nodes_is_the_views_as_the_documented_dicts(engines: list[MockEngine]) -> None:
    """`Router.nodes()` (public, read by key) carries every key its TypedDicts declare, in their
    order, with the values of the typed views the control plane reads."""
    async with pdproxy.Router(nodes=[engines[0].url]) as router:
        response = await router.forward("/v1/chat/completions", body())
        _ = [chunk async for chunk in response]
        [node], [view] = router.nodes(), router.views()
        assert list(node) == list(NodeSnapshot.__annotations__)
        assert list(node["engine"]) == list(EngineReport.__annotations__)
        assert list(node["engine"]["learnt"]) == list(LearntSpeed.__annotations__)
        assert list(node["histograms"]) == ["duration", "ttft", "itl"]
        assert (node["url"], node["succeeded"], node["events"]) == (view.url, view.succeeded, view.events)
        assert node["succeeded"] == 1
        assert node["events"] > 0
        duration = node["histograms"]["duration"]
        assert duration == {
            "bounds": view.histograms.duration.bounds,
            "counts": view.histograms.duration.counts,
            "sum": view.histograms.duration.sum,
            "count": 1,
        }
        assert len(duration["counts"]) == len(duration["bounds"]) + 1
        assert node["engine"]["failures"] == view.engine.failures
        assert router.stats()["nodes"] == router.nodes()


async def test_first_byte_timeout(engines: list[MockEngine]) -> None:
    async with pdproxy.Router(nodes=[engines[0].url], first_byte_timeout=0.2) as router:
        with pytest.raises(pdproxy.UpstreamTimeout):
            await router.forward("/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"hang")])
        assert in_flight(router) == 0
    await eventually(lambda: engines[0].state.disconnected == 1)


async def test_close_cancels_the_upstream_at_once(engines: list[MockEngine]) -> None:
    engine = engines[0]
    async with pdproxy.Router(nodes=[engine.url]) as router:
        response = await router.forward(
            "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"token_delay_ms=500")]
        )
        first = await response.__anext__()
        assert first.startswith(b"data: ")
        assert in_flight(router) == 1
        response.close()
        assert response.closed
        assert in_flight(router) == 0
        assert [chunk async for chunk in response] == []
        await eventually(lambda: engine.state.disconnected == 1)
        assert router.nodes()[0]["cancelled"] == 1


async def test_close_while_waiting_for_a_batch(engines: list[MockEngine]) -> None:
    engine = engines[0]
    async with pdproxy.Router(nodes=[engine.url]) as router:
        response = await router.forward(
            "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"ttft_ms=5000")]
        )
        waiting = asyncio.ensure_future(response.__anext__())
        await asyncio.sleep(0)  # the reader's first turn: it waits for a batch from then on
        response.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 2)
        await eventually(lambda: in_flight(router) == 0)
        await eventually(lambda: engine.state.disconnected == 1)


async def test_cancelling_the_pending_forward(engines: list[MockEngine]) -> None:
    engine = engines[0]
    async with pdproxy.Router(nodes=[engine.url]) as router:
        pending = router.forward("/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"hang")])
        await eventually(lambda: engine.state.active == 1)
        pending.cancel()
        await eventually(lambda: in_flight(router) == 0)
        await eventually(lambda: engine.state.disconnected == 1)


async def test_dropping_an_unread_response_releases_the_node(engines: list[MockEngine]) -> None:
    engine = engines[0]
    async with pdproxy.Router(nodes=[engine.url]) as router:
        response = await router.forward(
            "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"token_delay_ms=500")]
        )
        assert in_flight(router) == 1
        del response
        gc.collect()
        # The runtime may hold the resolved future for a moment after handing it over.
        await eventually(lambda: (gc.collect(), in_flight(router))[1] == 0)
        await eventually(lambda: engine.state.disconnected == 1)


async def test_removed_node_keeps_counting_until_its_requests_end(engines: list[MockEngine]) -> None:
    engine = engines[0]
    async with pdproxy.Router(nodes=[engine.url]) as router:
        response = await router.forward(
            "/v1/chat/completions", body(), headers=[(FAULT_HEADER.encode(), b"token_delay_ms=20")]
        )
        router.remove_node(engine.url)
        assert router.nodes() == []
        received = b"".join([chunk async for chunk in response])
        assert received.endswith(b"data: [DONE]\n\n")  # the stream finished on the removed node


async def test_settings_reach_the_data_plane() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        pdproxy.Router(policy="nope")
    with pytest.raises(pdproxy.ConfigError):
        pdproxy.Router(connect_timeout=0)
    router = pdproxy.Router(policy="round_robin", decode_policy="prefix", model_policies=("m=random",))
    assert router.policies == {
        "hybrid": "round_robin",
        "prefill": "round_robin",  # the general policy, as LMDeploy's --routing-strategy
        "decode": "prefix",
        "model:m": "random",
    }

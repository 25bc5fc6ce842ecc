"""The mock engine speaks the OpenAI API as LMDeploy's api_server does, deterministically,
and its fault knobs do what they say."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdproxy.errors import ConfigError
from pdproxy.testing import FAULT_HEADER, MockEngine, MockSettings, parse_faults
from pdproxy.testing.faults import FaultSpecError
from servers import chat_body, eventually


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        yield engine


def events(raw: bytes) -> list[str]:
    """The data fields of an SSE body."""
    assert raw.endswith(b"\n\n")
    return [block.removeprefix(b"data: ").decode() for block in raw.split(b"\n\n") if block]


async def test_models_and_health(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.get(engine.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "m"
    async with http.get(engine.url + "/health") as r:
        assert r.status == 200
        assert (await r.json())["status"] == "healthy"
    async with http.post(engine.url + "/mock/health", json={"status": "unhealthy"}) as r:
        assert r.status == 200
    async with http.get(engine.url + "/health") as r:
        assert r.status == 503
        assert (await r.json())["status"] == "unhealthy"


async def test_sleeping_engine_refuses_inference(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/mock/health", json={"status": "sleeping"}) as r:
        assert r.status == 200
    async with http.get(engine.url + "/health") as r:
        assert r.status == 200
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("m")) as r:
        assert r.status == 503


async def test_chat_non_stream_is_deterministic_and_honours_max_tokens(
    engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    answers = []
    for _ in range(2):
        async with http.post(engine.url + "/v1/chat/completions", json=chat_body("m", max_tokens=5)) as r:
            assert r.status == 200
            answers.append(await r.json())
    first, second = answers
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + 5


async def test_ignore_eos_runs_to_max_tokens(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(
        engine.url + "/v1/chat/completions", json=chat_body("m", max_tokens=100, ignore_eos=True)
    ) as r:
        answer = await r.json()
    assert answer["usage"]["completion_tokens"] == 100
    assert answer["choices"][0]["finish_reason"] == "length"
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("m", max_tokens=-1)) as r:
        assert r.status == 400


async def test_stream_matches_non_stream(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("m")) as r:
        whole = await r.json()
    body = chat_body("m", stream=True, stream_options={"include_usage": True})
    async with http.post(engine.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = await r.read()
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


async def test_completions_stream(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    body = {"model": "m", "prompt": "once upon", "max_tokens": 3, "stream": True}
    async with http.post(engine.url + "/v1/completions", json=body) as r:
        data = events(await r.read())
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_records_what_it_sent(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(
        engine.url + "/v1/chat/completions", json=chat_body("m", stream=True), headers={"x-request-id": "r1"}
    ) as r:
        raw = await r.read()
    (record,) = engine.state.records
    assert record["headers"]["x-request-id"] == "r1"
    assert record["sent_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_bad_requests(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/v1/chat/completions", data=b"{not json") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_request"
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("other")) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    async with http.post(engine.url + "/v1/completions", json={"model": "m"}) as r:
        assert r.status == 400
    async with http.post(
        engine.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "bogus"}
    ) as r:
        assert r.status == 400


async def test_terminate_needs_permission(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.get(engine.url + "/terminate") as r:
        assert r.status == 400
        assert "error" in await r.json()
    assert not engine.state.terminated.is_set()


async def test_terminate_when_allowed(http: aiohttp.ClientSession) -> None:
    engine = MockEngine(MockSettings(port=0, model="m", allow_terminate=True))
    serving = asyncio.create_task(engine.serve_forever())
    await asyncio.wait_for(_started(engine), 5)
    async with http.get(engine.url + "/terminate") as r:
        assert r.status == 200
    await asyncio.wait_for(serving, 5)  # the engine stops by itself


async def _started(engine: MockEngine) -> None:
    while engine._runner is None or not engine._runner.addresses:
        await asyncio.sleep(0.01)
    engine.port = engine._runner.addresses[0][1]


async def test_fault_status(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(
        engine.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "status=503"}
    ) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "mock_fault"


async def test_fault_drop_after(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            engine.url + "/v1/chat/completions",
            json=chat_body("m", stream=True),
            headers={FAULT_HEADER: "drop_after=2"},
        ) as r:
            async for chunk in r.content.iter_any():
                received += chunk
    assert received.count(b"data: ") == 2
    assert engine.state.disconnected == 1


async def test_fault_hang_then_client_leaves(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            engine.url + "/v1/chat/completions",
            json=chat_body("m"),
            headers={FAULT_HEADER: "hang"},
            timeout=aiohttp.ClientTimeout(total=0.3),
        ):
            pass
    # The engine sees the closed connection and stops working on the request.
    await eventually(lambda: engine.state.disconnected == 1, "the engine to see the closed connection", timeout=2)
    assert engine.state.disconnected == 1
    assert engine.state.active == 0


async def test_fragmented_stream_has_same_bytes(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    bodies = []
    for fault in ("", "fragment=5"):
        headers = {FAULT_HEADER: fault} if fault else {}
        async with http.post(
            engine.url + "/v1/completions", json={"model": "m", "prompt": "p", "stream": True}, headers=headers
        ) as r:
            bodies.append(await r.read())
    # Only the id and the timestamp may differ between the two answers.
    normalised = [re.sub(rb'"id":"cmpl-\d+","object":"text_completion","created":\d+', b"", b) for b in bodies]
    assert normalised[0] == normalised[1]


def test_fault_spec_parsing() -> None:
    faults = parse_faults("status=503; drop_after=2, hang; ttft_ms=1.5; fragment=3")
    assert (faults.status, faults.drop_after, faults.hang, faults.ttft_ms, faults.fragment) == (503, 2, True, 1.5, 3)
    assert parse_faults("").merged(parse_faults("token_delay_ms=5")).token_delay_ms == 5
    for bad in ("status=abc", "status=42", "nope", "fragment=0"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def test_settings_refuse_in_one_line_naming_the_setting() -> None:
    base = MockSettings(port=0, model="m")
    assert MockSettings.of({"ttft_ms": 5}, base) == MockSettings(port=0, model="m", ttft_ms=5.0), "an int is a float"
    for values, message in (
        ({"port": "8001"}, "port: Input should be a valid integer"),
        ({"max_batch": True}, "max_batch: Input should be a valid integer"),
        ({"simulate": 1}, "simulate: Input should be a valid boolean"),
        ({"role": "chef"}, "role must be one of hybrid, prefill, decode, got 'chef'"),
        ({"kv_blocks": 0}, "kv_blocks must be at least 1, got 0"),
        ({"decode_step_ms": -1.0}, "decode_step_ms must not be negative, got -1.0"),
        ({"fault": "nope"}, "unknown fault knob 'nope'"),
        ({"ssl_keyfile": "k.pem"}, "ssl_certfile and ssl_keyfile go together"),
        ({"kv_events": "tcp://127.0.0.1:0"}, "kv_events needs simulate: the events follow the simulated KV cache"),
        ({"nope": 1}, "unknown setting nope"),
    ):
        with pytest.raises(ConfigError) as refused:
            MockSettings.of(values, base)
        assert str(refused.value) == message


async def test_p2p_initialize_takes_what_lmdeploy_engines_take(engine: MockEngine, http: aiohttp.ClientSession) -> None:
    """DistServeInitRequest's enums as integers; anything else is a validation error (422)."""
    base = {"local_engine_id": engine.url, "remote_engine_id": "http://peer:1", "rank": None, "tcp_config": None}
    for wrong in (
        {"protocol": 9, "rdma_config": None},
        {"protocol": "RDMA", "rdma_config": {"with_gdr": True, "link_type": 2}},
        {"protocol": 2, "rdma_config": {"with_gdr": True, "link_type": 3}},
        {"protocol": 2, "rdma_config": {"with_gdr": "yes", "link_type": 1}},
        {"protocol": 2, "rdma_config": None},
    ):
        async with http.post(engine.url + "/distserve/p2p_initialize", json={**base, **wrong}) as r:
            assert r.status == 422, wrong
    nvlink = {"protocol": 3, "rdma_config": {"with_gdr": False, "link_type": 1}, "nvlink_config": None}
    async with http.post(engine.url + "/distserve/p2p_initialize", json={**base, **nvlink}) as r:
        assert r.status == 200
        assert (await r.json())["kvtransfer_endpoint_info"][0]["protocol"] == 3
    async with http.get(engine.url + "/mock/ledger") as r:
        transport = (await r.json())["transport"]["http://peer:1"]
    assert transport == {"protocol": "NVLINK", "rdma": {"with_gdr": False, "link_type": "IB"}, "nvlink": None}
    connect = {
        "remote_engine_id": "http://peer:1",
        "remote_engine_endpoint_info": {},
        "remote_kvtransfer_endpoint_info": [],
    }
    async with http.post(engine.url + "/distserve/p2p_connect", json={**connect, "protocol": 2}) as r:
        assert r.status == 500, "a connection over another protocol than the link's fails"
    async with http.post(engine.url + "/distserve/p2p_connect", json={**connect, "protocol": 3}) as r:
        assert r.status == 200

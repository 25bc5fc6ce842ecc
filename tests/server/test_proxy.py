"""`pdproxy serve` under granian, in front of mock engines, all real processes on real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import json
import pathlib
import uuid

import aiohttp
import pytest

from pdproxy.testing import FAULT_HEADER, MockEngine
from servers import Process, chat_body, eventually, get_json, pdproxy_serve, wait_until

# Against both edges (see the `edge` fixture).
pytestmark = pytest.mark.usefixtures("edge")


def record_for(engines: dict[str, Process], request_id: str) -> tuple[str, dict]:
    """The engine that served ``request_id`` and what it recorded about it."""
    for name, engine in engines.items():
        for record in get_json(engine.url + "/mock/requests"):
            if record["headers"].get("x-request-id") == request_id:
                return name, record
    raise AssertionError(f"no engine received request {request_id}")


async def test_models_are_the_deduplicated_union(proxy: Process, http: aiohttp.ClientSession) -> None:
    async with http.get(proxy.url + "/v1/models") as r:
        assert r.status == 200
        listing = await r.json()
    assert listing["object"] == "list"
    assert sorted(card["id"] for card in listing["data"]) == ["alpha", "beta"]
    async with http.get(proxy.url + "/v1/models/alpha") as r:
        assert r.status == 200
        assert await r.json() == next(card for card in listing["data"] if card["id"] == "alpha")
    for missing in ("gamma", "org/gamma"):
        async with http.get(proxy.url + f"/v1/models/{missing}") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"


async def test_stream_is_byte_for_byte(
    proxy: Process, engines: dict[str, Process], http: aiohttp.ClientSession
) -> None:
    for fault in ("", "fragment=7", "token_delay_ms=2"):
        request_id = uuid.uuid4().hex
        headers = {"x-request-id": request_id} | ({FAULT_HEADER: fault} if fault else {})
        body = chat_body("alpha", stream=True, stream_options={"include_usage": True})
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            received = await r.read()
        name, record = record_for(engines, request_id)
        assert name.startswith("alpha")
        assert record["sent_sha256"] == hashlib.sha256(received).hexdigest(), fault
        assert received.endswith(b"data: [DONE]\n\n")


async def test_non_stream(proxy: Process, engines: dict[str, Process], http: aiohttp.ClientSession) -> None:
    request_id = uuid.uuid4().hex
    body = {"model": "beta", "prompt": "tell me", "max_tokens": 4}
    async with http.post(proxy.url + "/v1/completions", json=body, headers={"x-request-id": request_id}) as r:
        assert r.status == 200
        received = await r.read()
    name, record = record_for(engines, request_id)
    assert name == "beta"
    assert record["sent_sha256"] == hashlib.sha256(received).hexdigest()
    assert json.loads(received)["usage"]["completion_tokens"] == 4
    assert record["body"] == body


async def test_round_robin_spreads_a_model_over_its_nodes(
    proxy: Process, engines: dict[str, Process], http: aiohttp.ClientSession
) -> None:
    before = {n: get_json(engines[n].url + "/mock/stats")["requests"] for n in ("alpha-1", "alpha-2", "beta")}
    for _ in range(6):
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("alpha")) as r:
            assert r.status == 200
    after = {n: get_json(engines[n].url + "/mock/stats")["requests"] for n in ("alpha-1", "alpha-2", "beta")}
    assert after["alpha-1"] - before["alpha-1"] == 3
    assert after["alpha-2"] - before["alpha-2"] == 3
    assert after["beta"] == before["beta"]


async def test_upstream_error_passes_through(proxy: Process, http: aiohttp.ClientSession) -> None:
    for status in (400, 429, 500, 503):
        async with http.post(
            proxy.url + "/v1/chat/completions", json=chat_body("alpha"), headers={FAULT_HEADER: f"status={status}"}
        ) as r:
            assert r.status == status
            assert (await r.json())["error"]["code"] == "mock_fault"
            assert "x-pdproxy-error" not in r.headers  # the node's error, not the proxy's


async def test_proxy_errors_use_the_openai_envelope(proxy: Process, http: aiohttp.ClientSession) -> None:
    cases = [
        (chat_body("no-such-model"), 404, "model_not_found"),
        (b"{not json", 400, "invalid_request"),
        (b"[1, 2]", 400, "invalid_request"),
        (json.dumps({"model": 7}).encode(), 400, "invalid_request"),
    ]
    json_type = {"content-type": "application/json"}
    for body, status, code in cases:
        kwargs = {"json": body} if isinstance(body, dict) else {"data": body, "headers": json_type}
        async with http.post(proxy.url + "/v1/chat/completions", **kwargs) as r:
            assert r.status == status, body
            error = (await r.json())["error"]
            assert error["code"] == code
            assert set(error) == {"message", "type", "param", "code"}
            assert r.headers["x-pdproxy-error"] == code
    async with http.post(
        proxy.url + "/v1/chat/completions",
        data=b"model=alpha",
        headers={"content-type": "application/x-www-form-urlencoded"},
    ) as r:
        assert r.status == 415
        assert (await r.json())["error"]["code"] == "unsupported_media_type"
    async with http.get(proxy.url + "/v1/nothing-here") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_found"
    async with http.get(proxy.url + "/v1/chat/completions") as r:
        assert r.status == 405


async def test_request_without_model_goes_to_any_node(proxy: Process, http: aiohttp.ClientSession) -> None:
    # The engines accept a request without `model` (vLLM does too), so it must be routed.
    async with http.post(proxy.url + "/v1/chat/completions", json=chat_body(None)) as r:
        assert r.status == 200


async def test_mid_stream_drop_ends_with_an_error_event(proxy: Process, http: aiohttp.ClientSession) -> None:
    async with http.post(
        proxy.url + "/v1/chat/completions",
        json=chat_body("alpha", stream=True),
        headers={FAULT_HEADER: "drop_after=3"},
    ) as r:
        assert r.status == 200
        received = await r.read()
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) == 4
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_error"
    assert b"[DONE]" not in received


async def _disconnect_mid_stream(proxy: Process, fault: str, read_events: int) -> None:
    """Sends a streaming request on a raw socket, reads some events, then hangs up."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(chat_body("beta", stream=True, prompt=uuid.uuid4().hex)).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"{FAULT_HEADER}: {fault}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    seen = b""
    while seen.count(b"data: ") < read_events:
        seen += await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    await writer.wait_closed()


async def test_client_disconnect_mid_stream_cancels_upstream(proxy: Process, engines: dict[str, Process]) -> None:
    beta = engines["beta"]
    before = get_json(beta.url + "/mock/stats")["disconnected"]
    # 200 ms between tokens: the stream would run for seconds if nobody cancelled it.
    await _disconnect_mid_stream(proxy, "token_delay_ms=200", read_events=2)
    wait_until(
        lambda: get_json(beta.url + "/mock/stats")["disconnected"] == before + 1,
        timeout=2,  # far below the ~4 s the stream would take to finish
        what="the engine to see its connection closed",
    )
    assert get_json(beta.url + "/mock/stats")["active"] == 0


async def test_client_disconnect_before_the_head_cancels_upstream(proxy: Process, engines: dict[str, Process]) -> None:
    beta = engines["beta"]
    before = get_json(beta.url + "/mock/stats")["disconnected"]
    host, port = proxy.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(chat_body("beta", prompt=uuid.uuid4().hex)).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"{FAULT_HEADER}: hang\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    wait_until(
        lambda: get_json(beta.url + "/mock/stats")["active"] == 1, timeout=5, what="the request to reach the engine"
    )
    writer.close()
    await writer.wait_closed()
    wait_until(
        lambda: get_json(beta.url + "/mock/stats")["disconnected"] == before + 1,
        timeout=2,
        what="the hanging upstream request to be cancelled",
    )


async def test_body_over_limit_is_refused(engines: dict[str, Process], tmp_path, http: aiohttp.ClientSession) -> None:

    async with pdproxy_serve(tmp_path, "--node", engines["beta"].url, "--max-body-size", "1000") as small:
        big = chat_body("beta", prompt="x" * 2000)
        async with http.post(small.url + "/v1/chat/completions", json=big) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
        async with http.post(small.url + "/v1/chat/completions", json=chat_body("beta")) as r:
            assert r.status == 200


async def test_browsers_may_call_the_inference_routes_but_not_management(
    proxy: Process, http: aiohttp.ClientSession
) -> None:
    """By default as LMDeploy's api_server: any origin, any method and header, no credentials."""
    origin = {"origin": "https://chat.example"}
    ask = {**origin, "access-control-request-method": "POST", "access-control-request-headers": "Content-Type, X-Foo"}
    async with http.options(proxy.url + "/v1/chat/completions", headers=ask) as r:
        assert r.status == 204
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.headers["access-control-allow-headers"] == "content-type, x-foo"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in r.headers
    for body in (chat_body("alpha"), chat_body("nope")):  # answers and the proxy's errors alike
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=origin) as r:
            assert r.headers["access-control-allow-origin"] == "*", r.status
    async with http.get(proxy.url + "/v1/models", headers=origin) as r:
        assert r.headers["access-control-allow-origin"] == "*"
    async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("alpha")) as r:
        assert "access-control-allow-origin" not in r.headers, "no Origin, no CORS"
    async with http.options(proxy.url + "/nodes/add", headers=ask) as r:
        assert r.status == 405
        assert "access-control-allow-origin" not in r.headers, "management answers no CORS"
    async with http.get(proxy.url + "/nodes/status", headers=origin) as r:
        assert "access-control-allow-origin" not in r.headers


async def test_cors_with_named_origins_and_credentials(
    engines: dict[str, Process], tmp_path: pathlib.Path, http: aiohttp.ClientSession
) -> None:
    args = ("--allow-origins", "https://a.example", "https://b.example", "--allow-credentials")
    async with pdproxy_serve(tmp_path, "--node", engines["alpha-1"].url, *args) as p:
        ask = {"access-control-request-method": "POST"}
        async with http.options(p.url + "/v1/completions", headers={**ask, "origin": "https://b.example"}) as r:
            assert r.status == 204
            assert r.headers["access-control-allow-origin"] == "https://b.example", "never * with credentials"
            assert r.headers["access-control-allow-credentials"] == "true"
            assert r.headers["vary"] == "Origin"
        async with http.options(p.url + "/v1/completions", headers={**ask, "origin": "https://evil.example"}) as r:
            assert r.status == 400
            assert r.headers["x-pdproxy-error"] == "cors_refused"
            assert "access-control-allow-origin" not in r.headers
        body = chat_body("alpha")
        async with http.post(
            p.url + "/v1/chat/completions", json=body, headers={"origin": "https://evil.example"}
        ) as r:
            assert r.status == 200
            assert "access-control-allow-origin" not in r.headers, "the browser keeps the answer from that page"


async def test_model_cards_keep_what_the_engines_say(tmp_path: pathlib.Path, http: aiohttp.ClientSession) -> None:
    # vLLM's card carries max_model_len, root and parent; through pdproxy a client still reads them,
    # and where two nodes disagree it reads the limit that holds on both.
    async with (
        MockEngine(model="m", max_model_len=2048) as a,
        MockEngine(model="m", max_model_len=8192) as b,
        pdproxy_serve(tmp_path, "--node", a.url) as proxy,
    ):
        await eventually(lambda: models_listed(http, proxy.url, {"m"}), what="the node's model")
        async with http.get(a.url + "/v1/models") as r:
            direct = (await r.json())["data"][0]
        async with http.get(proxy.url + "/v1/models") as r:
            assert (await r.json())["data"] == [direct], "one node: its card as it gave it"
        async with http.post(proxy.url + "/nodes/add", json={"url": b.url}) as r:
            assert r.status == 200
        await eventually(lambda: healthy_nodes(http, proxy.url, 2), what="the second node healthy")
        async with http.get(proxy.url + "/v1/models/m") as r:
            card = await r.json()
    assert card["max_model_len"] == 2048, "the smaller context: a request that fits it fits either node"
    assert (card["id"], card["root"], card["parent"], card["owned_by"]) == ("m", "m", None, "pdproxy-mock")


async def models_listed(http: aiohttp.ClientSession, url: str, wanted: set[str]) -> bool:
    async with http.get(url + "/v1/models") as r:
        return r.status == 200 and {m["id"] for m in (await r.json())["data"]} == wanted


async def healthy_nodes(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    async with http.get(url + "/nodes/status") as r:
        return sum(n["state"] == "healthy" for n in (await r.json()).values()) == count

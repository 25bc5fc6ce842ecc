"""The ASGI app driven in-process over the ASGI protocol, to watch what a socket test cannot:
the router's in-flight counts while a client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdproxy.config.settings import Settings
from pdproxy.server.app import create_app
from pdproxy.testing import FAULT_HEADER, MockEngine
from servers import chat_body, eventually


class Client:
    """One ASGI HTTP connection: feeds the request body, records what the app sends, and can
    disconnect at any moment."""

    def __init__(self, body: bytes) -> None:
        self._messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._messages.put_nowait({"type": "http.request", "body": body, "more_body": False})
        self.sent: list[dict[str, Any]] = []
        self.body_messages = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        return await self._messages.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.body_messages.set()

    def disconnect(self) -> None:
        self._messages.put_nowait({"type": "http.disconnect"})


def scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": headers,
        "http_version": "1.1",
        "scheme": "http",
    }


@pytest.fixture
async def engine():  # type: ignore[no-untyped-def]
    async with MockEngine(model="m") as engine:
        yield engine


async def test_disconnect_mid_stream_releases_the_node(engine: MockEngine) -> None:
    app = create_app(Settings(nodes=(engine.url,)))
    await app.startup()
    try:
        client = Client(json.dumps(chat_body("m", stream=True)).encode())
        headers = [(b"content-type", b"application/json"), (FAULT_HEADER.encode(), b"token_delay_ms=300")]
        handling = asyncio.create_task(app(scope("/v1/chat/completions", headers), client.receive, client.send))
        await asyncio.wait_for(client.body_messages.wait(), 5)
        assert app.supervisor.router is not None
        assert app.supervisor.router.nodes()[0]["in_flight"] == 1
        client.disconnect()
        await asyncio.wait_for(handling, 1)  # returns at once, not when the stream would end
        # The data plane's task ends on its own runtime once cancelled: its permit goes then.
        router = app.supervisor.router
        await eventually(lambda: router.nodes()[0]["in_flight"] == 0, timeout=2, what="the node released")
        assert router.nodes()[0]["cancelled"] == 1
        await eventually(lambda: engine.state.disconnected, "the engine to see the client leave", timeout=2)
        assert engine.state.disconnected == 1
        # The app never claimed a normal end of the stream.
        assert not any(m["type"] == "http.response.body" and not m.get("more_body") for m in client.sent)
    finally:
        await app.shutdown()


async def test_completed_stream_ends_the_response(engine: MockEngine) -> None:
    app = create_app(Settings(nodes=(engine.url,)))
    await app.startup()
    try:
        client = Client(json.dumps(chat_body("m", stream=True)).encode())
        await app(scope("/v1/chat/completions", []), client.receive, client.send)
        assert client.sent[0]["status"] == 200
        assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        body = b"".join(m.get("body", b"") for m in client.sent[1:])
        assert body.endswith(b"data: [DONE]\n\n")
        assert app.supervisor.router is not None
        assert app.supervisor.router.nodes()[0]["in_flight"] == 0
    finally:
        await app.shutdown()


async def run(app, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> Client:  # type: ignore[no-untyped-def]
    client = Client(json.dumps(body).encode())
    await app(scope("/v1/chat/completions", headers or []), client.receive, client.send)
    return client


def head(client: Client) -> tuple[int, dict[bytes, bytes]]:
    start = client.sent[0]
    return start["status"], dict(start["headers"])


async def test_no_healthy_node_is_503_with_retry_after(engine: MockEngine) -> None:
    app = create_app(Settings(nodes=(engine.url,)))
    await app.startup()
    try:
        assert app.supervisor.router is not None
        app.supervisor.router.set_node_state(engine.url, "unhealthy")
        client = await run(app, chat_body("m"))
        status, headers = head(client)
        assert status == 503
        assert headers[b"x-pdproxy-error"] == b"no_healthy_node"
        assert int(headers[b"retry-after"]) >= 1
        assert json.loads(client.sent[1]["body"])["error"]["code"] == "no_healthy_node"
    finally:
        await app.shutdown()


async def test_full_node_without_queue_is_429_with_retry_after(engine: MockEngine) -> None:
    app = create_app(Settings(nodes=(engine.url,), queue_size=0))
    await app.startup()
    try:
        assert app.supervisor.router is not None
        app.supervisor.router.set_max_concurrency(engine.url, 1)
        slow = [(FAULT_HEADER.encode(), b"token_delay_ms=100")]
        first = asyncio.create_task(run(app, chat_body("m", stream=True), slow))
        router = app.supervisor.router
        await eventually(lambda: router.nodes()[0]["in_flight"] > 0, "the first request at the node")
        client = await run(app, chat_body("m"))
        status, headers = head(client)
        assert status == 429
        assert headers[b"x-pdproxy-error"] == b"overloaded"
        assert 1 <= int(headers[b"retry-after"]) <= 60
        await first
        assert head(first.result())[0] == 200
    finally:
        await app.shutdown()

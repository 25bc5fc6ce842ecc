"""What a broken or hostile node may do to the proxy (issue "Hardening, round two"), each against
a node that writes its bytes by hand (`raw_node`): replayed requests, early answers, ambiguous
framing, bodies that fail at once, connections to removed nodes, slow drips and endless answers.
Each of these failed before its fix."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from pdproxy.testing.raw_node import TOO_LARGE, RawNode, RawRequest, answer_early, endless_answer, read_and_drop
from servers import Process, chat_body, eventually, pdproxy_serve

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).

CHAT = "/v1/chat/completions"


async def add(http: aiohttp.ClientSession, proxy: str, url: str, role: int = 1, **fields: Any) -> None:
    body = {"url": url, "status": {"models": ["m"], "role": role, **fields}}
    async with http.post(proxy + "/nodes/add", json=body) as r:
        assert r.status == 200, await r.text()


async def node_status(http: aiohttp.ClientSession, proxy: str, url: str) -> dict[str, Any]:
    async with http.get(proxy + "/nodes/status") as r:
        return dict((await r.json())[url])


async def chat(
    http: aiohttp.ClientSession, proxy: str, body: dict[str, Any] | None = None, data: bytes | None = None
) -> tuple[int, dict[str, Any] | str, aiohttp.typedefs.LooseHeaders]:
    kwargs: dict[str, Any] = {"data": io.BytesIO(data), "headers": {"content-type": "application/json"}} if data else {}
    async with http.post(proxy + CHAT, json=None if data else (body or chat_body("m")), **kwargs) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
async def node() -> AsyncIterator[RawNode]:
    async with RawNode() as node:
        yield node


@pytest.fixture
async def proxy(tmp_path: Path, node: RawNode, http: aiohttp.ClientSession) -> AsyncIterator[Process]:
    """`pdproxy serve` in front of the raw node alone, with its circuit quick to open."""
    async with pdproxy_serve(tmp_path, "--circuit-failures", "3", "--circuit-cooldown", "60") as proxy:
        await add(http, proxy.url, node.url)
        yield proxy


# 3. A request the node may have read is never sent again on another pooled connection.


async def test_a_request_the_node_read_is_not_replayed_on_pooled_connections(
    node: RawNode, proxy: Process, http: aiohttp.ClientSession
) -> None:
    # Six connections in the pool: six requests at once, answered after all six arrived.
    arrived = asyncio.Event()
    waiting: list[RawRequest] = []

    async def held(request: RawRequest) -> bool:
        await request.body()
        waiting.append(request)
        if len(waiting) == 6:
            arrived.set()
        await arrived.wait()
        await request.answer(200, b'{"choices": []}')
        return True

    node.behave = held
    answers = await asyncio.gather(*(chat(http, proxy.url) for _ in range(6)))
    assert [status for status, _, _ in answers] == [200] * 6
    assert node.serving == 6

    node.behave = read_and_drop
    node.received.clear()
    status, body, _ = await chat(http, proxy.url)
    assert status == 502, body
    assert len(node.received) == 1, f"the node received the request {len(node.received)} times"


# 5. A node's early answer (it refused the body before reading it) reaches the client.


@pytest.mark.parametrize("linger", [True, False], ids=["lingering-close", "hard-close"])
async def test_an_early_answer_is_relayed_and_is_not_a_connect_failure(
    node: RawNode, proxy: Process, http: aiohttp.ClientSession, linger: bool
) -> None:
    node.behave = answer_early(linger)
    big = json.dumps(chat_body("m", prompt="x" * (4 << 20))).encode()
    for _ in range(5):
        status, body, headers = await chat(http, proxy.url, data=big)
        assert status == 413, body
        assert body == json.loads(TOO_LARGE)
        assert "x-pdproxy-error" not in headers, "the node's own answer"
    state = await node_status(http, proxy.url, node.url)
    assert state["circuit"] == "closed", state


# 6. The node's framing is read strictly (RFC 9112 section 6.3): anything ambiguous is a 502.

AMBIGUOUS = {
    "chunked-and-length": b"transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "conflicting-lengths": b"content-length: 5\r\ncontent-length: 3\r\n\r\nhello",
    "signed-length": b"content-length: +5\r\n\r\nhello",
    "gzip-then-chunked": b"transfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked-twice": b"transfer-encoding: chunked, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize(("head", "rest"), [*[("200 OK", v) for v in AMBIGUOUS.values()]], ids=list(AMBIGUOUS))
async def test_ambiguous_framing_is_a_502(
    node: RawNode, proxy: Process, http: aiohttp.ClientSession, head: str, rest: bytes
) -> None:
    await _answers_with(node, f"HTTP/1.1 {head}\r\ncontent-type: application/json\r\n".encode() + rest)
    status, body, _ = await chat(http, proxy.url)
    assert status == 502, body
    assert isinstance(body, dict), body
    assert body["error"]["code"] == "upstream_invalid_response", body
    await node.wait_idle()
    assert node.serving == 0, "the node's connection is closed"


@pytest.mark.parametrize("status", [999, 101, 600])
async def test_a_status_no_node_may_send_is_a_502(
    node: RawNode, proxy: Process, http: aiohttp.ClientSession, status: int
) -> None:
    await _answers_with(node, f"HTTP/1.1 {status} Odd\r\ncontent-length: 2\r\nupgrade: x\r\n\r\nhi".encode())
    code, body, _ = await chat(http, proxy.url)
    assert code == 502, body
    assert isinstance(body, dict), body
    assert body["error"]["code"] == "upstream_invalid_response", body


async def _answers_with(node: RawNode, raw: bytes) -> None:
    async def answer(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(raw)
        await request.writer.drain()
        await asyncio.sleep(5)  # keeps the connection: the proxy must be the one to close it
        return False

    node.behave = answer


# 7. A body that fails on its first read is a 502, not an empty reply; data before a failure is delivered.


async def test_a_body_that_fails_at_once_is_a_502(node: RawNode, proxy: Process, http: aiohttp.ClientSession) -> None:
    big = 8 << 20  # over the prefetch limit: the body is relayed, not read whole first
    await _answers_with(
        node, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    )
    status, body, _ = await chat(http, proxy.url)
    assert status == 502, body

    async def reset(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {big}\r\n\r\n".encode()
        )
        await request.writer.drain()
        await asyncio.sleep(0.2)  # a fixed wait, the node's behaviour: the head, a pause, then a reset
        sock = request.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return False

    node.behave = reset
    status, body, _ = await chat(http, proxy.url)
    assert status == 502, body


async def test_events_before_a_broken_chunk_are_delivered(
    node: RawNode, proxy: Process, http: aiohttp.ClientSession
) -> None:
    event = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
    await _answers_with(
        node,
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunk + b"zz\r\n",
    )
    async with http.post(proxy.url + CHAT, json=chat_body("m", stream=True)) as r:
        assert r.status == 200
        got = await r.read()
    assert got.startswith(event), got
    assert b'"error"' in got[len(event) :], "then the terminal error event"


# 8. The pool keeps no connection to a removed node, nor one idle past its timeout.


async def test_connections_to_removed_nodes_are_closed(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with RawNode() as node:
        await node.listen(40)  # one node behind 41 addresses
        async with pdproxy_serve(tmp_path, "--pool-idle-timeout", "30") as proxy:
            before = 0
            for cycle, port in enumerate(node.ports[1:]):
                if cycle == 1:  # what the first cycle opened for good (the control plane's sessions)
                    await eventually(lambda: node.open == 0, timeout=15, what="the first node's connections closed")
                    before = open_fds(proxy.proc.pid)
                url = f"http://127.0.0.1:{port}"
                await add(http, proxy.url, url)
                await asyncio.gather(*(chat(http, proxy.url) for _ in range(3)))
                async with http.post(proxy.url + "/nodes/remove", json={"url": url}) as r:
                    assert r.status == 200, await r.text()
            await eventually(lambda: node.serving == 0, timeout=5, what="the data plane's connections closed")
            # The control plane's (health checks, model discovery) soon after.
            await eventually(lambda: node.open == 0, timeout=15, what="every connection to a removed node closed")
            assert open_fds(proxy.proc.pid) <= before + 2


async def test_idle_connections_are_closed_after_their_timeout(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with RawNode() as node, pdproxy_serve(tmp_path, "--pool-idle-timeout", "1") as proxy:
        await add(http, proxy.url, node.url)
        await asyncio.gather(*(chat(http, proxy.url) for _ in range(4)))
        assert node.serving >= 1
        await eventually(lambda: node.serving == 0, timeout=5, what="idle connections closed")


# 9. A node that drips a non-streaming answer is cut off.


async def test_a_slow_drip_is_cut_off(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async def drip(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        for _ in range(100000):
            request.writer.write(b" ")
            await request.writer.drain()
            await asyncio.sleep(0.2)  # a fixed pace, the node's behaviour: a byte every 0.2 s
        return False

    async with RawNode(drip) as node, pdproxy_serve(tmp_path, "--answer-timeout", "2") as proxy:
        await add(http, proxy.url, node.url)
        started = asyncio.get_running_loop().time()
        status, body, _ = await chat(http, proxy.url)
        took = asyncio.get_running_loop().time() - started
        assert status == 502, body
        assert took < 10, took
        await node.wait_idle()
        assert node.serving == 0


# 2. Every body the proxy reads whole is bounded, in size and in time.


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# SGLang's prefill answer is not the client's: decode's is relayed, the prefill's read to its end
# (bounded) in the background.
@pytest.mark.parametrize(("protocol", "answered"), [("vllm", 502), ("sglang", 200), ("lmdeploy", 502)])
async def test_an_endless_prefill_answer_is_cut_off(
    tmp_path: Path, http: aiohttp.ClientSession, protocol: str, answered: int
) -> None:
    args = ("--serving-strategy", "DistServe", "--pd-protocol", protocol, "--answer-buffer-limit", str(4 << 20))
    async with (
        RawNode(endless_answer) as prefill,
        MockEngine(model="m", role="decode") as decode,
        pdproxy_serve(tmp_path, *args) as proxy,
    ):
        # The mock decode meets the prefill at its bootstrap port (SGLang): the raw node's own.
        await add(http, proxy.url, prefill.url, role=2, bootstrap_port=prefill.port)
        await add(http, proxy.url, decode.url, role=3)
        before = rss(proxy.proc.pid)
        status, body, _ = await asyncio.wait_for(chat(http, proxy.url), 20)
        assert status == answered, body
        assert rss(proxy.proc.pid) - before < 64 << 20
        await prefill.wait_idle()
        assert prefill.serving == 0, "the prefill node's connection is dropped"


async def test_an_endless_error_body_is_cut_off(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async def endless_500(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(
            b"HTTP/1.1 500 Oops\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        while True:
            request.writer.write(b"10000\r\n" + b" " * 0x10000 + b"\r\n")
            await request.writer.drain()

    args = ("--serving-strategy", "DistServe", "--pd-protocol", "vllm", "--answer-buffer-limit", str(4 << 20))
    async with (
        MockEngine(model="m", role="prefill") as prefill,
        RawNode(endless_500) as decode,
        pdproxy_serve(tmp_path, *args) as proxy,
    ):
        await add(http, proxy.url, prefill.url, role=2)
        await add(http, proxy.url, decode.url, role=3)
        status, body, _ = await asyncio.wait_for(chat(http, proxy.url), 20)
        assert status == 502, body
        await decode.wait_idle()
        assert decode.serving == 0

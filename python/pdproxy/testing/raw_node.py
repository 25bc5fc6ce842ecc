"""A node that speaks HTTP/1.1 byte by byte, for tests and benchmarks of what a broken or hostile
node may send: it answers `/health` and `/v1/models` as a node should (so the proxy keeps routing
to it) and hands every other request, head read and body not yet, to the caller's ``behave``::

    async def drop(request: RawRequest) -> bool:
        await request.body()
        return False  # closes the connection without an answer

    async with RawNode(drop) as node:
        print(node.url)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

#: Largest request head the node reads.
MAX_HEAD = 64 << 10
#: The paths of inference requests: `received` and `serving` count these (the rest are the
#: control plane's calls, such as LMDeploy's `/distserve/*`, or a peer's, such as a mock decode's).
INFERENCE_PREFIXES = ("/v1/", "/generate")


@dataclass
class RawRequest:
    method: str
    path: str
    headers: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def length(self) -> int:
        return int(self.headers.get("content-length", "0"))

    async def body(self) -> bytes:
        """The request's body, read whole (by its `content-length`)."""
        return await self.reader.readexactly(self.length)

    async def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        """A plain keep-alive answer."""
        self.writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await self.writer.drain()


#: What the node does with an inference request; returning True keeps the connection for the next one.
Behaviour = Callable[[RawRequest], Awaitable[bool]]


async def answer_ok(request: RawRequest) -> bool:
    """A well-behaved node's non-streaming chat answer."""
    await request.body()
    await request.answer(200, b'{"id": "x", "choices": [{"message": {"content": "ok"}}]}')
    return True


async def read_and_drop(request: RawRequest) -> bool:
    """Reads the request whole, then closes the connection without an answer (a node that dies
    while it works: the request may have run)."""
    await request.body()
    return False


#: The answer of a node that refuses a body without reading it.
TOO_LARGE = b'{"error": {"message": "request entity too large", "code": "too_large"}}'
#: `SO_LINGER` on, with no time: `close` resets the connection at once.
_RESET_ON_CLOSE = b"\x01\x00\x00\x00\x00\x00\x00\x00"


def answer_early(linger: bool) -> Behaviour:
    """A gateway that answers 413 before it reads the body, then closes: after a while of reading
    what comes (``linger``, as nginx does), or at once, which resets the connection."""

    async def too_large(request: RawRequest) -> bool:
        request.writer.write(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(TOO_LARGE)}\r\n\r\n".encode()
            + TOO_LARGE
        )
        await request.writer.drain()
        if linger:
            request.writer.write_eof()
            await asyncio.sleep(0.3)
        else:
            sock = request.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        return False

    return too_large


async def endless_answer(request: RawRequest) -> bool:
    """Answers 200 and never ends the body, as fast as the proxy reads (an endless prefill);
    LMDeploy's link calls and the mock decode's SGLang rendezvous get what they ask for."""
    await request.body()
    if request.path.startswith(("/distserve/", "/mock/")):
        await request.answer(200, b'{"ok": true}')
        return True
    request.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    piece = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    while True:
        request.writer.write(piece)
        await request.writer.drain()


@dataclass
class RawNode:
    """The node on a free port of 127.0.0.1. ``behave`` may be replaced while it serves."""

    behave: Behaviour = answer_ok
    model: str = "m"
    #: The inference requests it received (method and path), in order; every other request
    #: goes to ``behave`` too.
    received: list[tuple[str, str]] = field(default_factory=list)
    #: Connections accepted, and open now; and open now among those that carried an inference
    #: request (the data plane's: the control plane's health checks keep connections of their own).
    accepted: int = 0
    open: int = 0
    serving: int = 0
    ports: list[int] = field(default_factory=list)
    _servers: list[asyncio.Server] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Set while no connection that carried an inference request is open.
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def listen(self, count: int = 1) -> RawNode:
        """Listens on ``count`` free ports (the same node behind several addresses)."""
        for _ in range(count):
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_HEAD)
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])
        return self

    async def __aenter__(self) -> RawNode:
        return await self.listen()

    async def __aexit__(self, *_: object) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        carried = [False]
        try:
            while await self._one(reader, writer, carried):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # the node stops: its connections end with it
        finally:
            self.open -= 1
            self.serving -= carried[0]
            if not self.serving:
                self._idle.set()
            self._tasks.discard(task)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, carried: list[bool]) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        line, *lines = head.decode("latin-1").split("\r\n")
        method, path, _ = line.split(" ", 2)
        headers = {}
        for header in lines:
            name, sep, value = header.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        request = RawRequest(method, path, headers, reader, writer)
        if path == "/health":
            await request.answer(200, b"ok", "text/plain")
            return True
        if path == "/v1/models":
            await request.answer(200, json.dumps({"object": "list", "data": [{"id": self.model}]}).encode())
            return True
        if method == "GET":
            await request.answer(404, b'{"error": "not here"}')
            return True
        if path.startswith(INFERENCE_PREFIXES):
            self.received.append((method, path))
            if not carried[0]:
                carried[0] = True
                self.serving += 1
                self._idle.clear()
        return await self.behave(request)

    async def wait_idle(self, within: float = 10.0) -> None:
        """Until every connection that carried an inference request has closed (at most
        ``within`` seconds: the caller checks ``serving``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._idle.wait()

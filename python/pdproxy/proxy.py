"""The hot path: forward one inference request and stream the node's answer back.

Per chunk batch, Python does one ``await send(...)``; everything else (parsing, selection,
SSE framing, accounting) happens in the data plane.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from ._pdproxy import Response
from .errors import InvalidRequest, PdproxyError, RequestTooLarge, UpstreamError
from .router import Router

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class ClientWatch:
    """Watches ``receive()`` for ``http.disconnect`` while the response is produced.

    granian's ``send`` does not fail after the client went away, so without this watch a
    stream would keep its node busy until the node finished generating. The watching task
    starts only once the request has taken ``delay`` seconds: most requests finish sooner,
    and for them the task would cost more than the rest of the handler.
    """

    __slots__ = ("_on_disconnect", "_receive", "_task", "_timer", "gone")

    def __init__(self, receive: Receive, delay: float) -> None:
        self.gone = False
        self._on_disconnect: Callable[[], object] | None = None
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(delay, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._on_disconnect is not None:
            self._on_disconnect()

    def on_disconnect(self, callback: Callable[[], object]) -> None:
        """Calls ``callback`` when the client disconnects (at once if it already has)."""
        self._on_disconnect = callback
        if self.gone:
            callback()

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise InvalidRequest("invalid content-length header") from None
            if declared > limit:
                raise RequestTooLarge(f"request body is larger than {limit} bytes")
            break
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise RequestTooLarge(f"request body is larger than {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def send_error(send: Send, error: PdproxyError) -> None:
    await send({"type": "http.response.start", "status": error.status, "headers": error.headers()})
    await send({"type": "http.response.body", "body": error.body()})


def _stream_error_event(error: PdproxyError) -> bytes:
    """The terminal event of a stream that failed after its head was sent (OpenAI clients
    raise on a ``data:`` object with an ``error`` key)."""
    payload = {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)


#: Seconds a request runs before its client is watched for a disconnect (see ClientWatch).
DISCONNECT_WATCH_DELAY = 0.01


async def forward(router: Router, max_body_size: int, scope: Scope, receive: Receive, send: Send) -> None:
    """Handles one inference request end to end."""
    try:
        body = await read_body(scope, receive, max_body_size)
    except ClientGone:
        return
    except PdproxyError as e:
        await send_error(send, e)
        return
    path = scope["path"]
    if scope.get("query_string"):
        path = f"{path}?{scope['query_string'].decode('latin-1')}"

    watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY)
    response: Response | None = None
    try:
        try:
            pending = router.forward(path, body, scope["headers"])
        except PdproxyError as e:
            await send_error(send, e)
            return
        watch.on_disconnect(pending.cancel)
        try:
            response = await pending
        except asyncio.CancelledError:
            if watch.gone:  # the client left while the node was working: nothing to answer
                return
            raise
        except PdproxyError as e:
            await send_error(send, e)
            return
        watch.on_disconnect(response.close)
        await send({"type": "http.response.start", "status": response.status, "headers": response.headers})
        if response.body is not None:
            await send({"type": "http.response.body", "body": response.body})
            return
        await _stream_body(response, send)
    finally:
        watch.stop()
        if response is not None:
            response.close()


async def _stream_body(response: Response, send: Send) -> None:
    try:
        async for chunk in response:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as e:
        if _is_event_stream(response.headers):
            await send({"type": "http.response.body", "body": _stream_error_event(e), "more_body": False})
            return
        raise
    if response.closed:  # cut short because the client left: there is nobody to tell
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})

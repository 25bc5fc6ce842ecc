"""Inference requests the ASGI app takes (``--edge granian``, or the app mounted in another
server). Their bodies are read here; everything else (keys, checks, tenants, the node's
choice, PD, the answer, the access log and the trace) is the data plane's pipeline, the one the
Rust edge serves its own requests with. Per batch of a streamed answer, Python does one
``await send(...)``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdproxy._pdproxy import Pipeline
from pdproxy.errors import ClientGone, InvalidRequest, RequestTooLarge
from pdproxy.server.asgi_types import HTTPReceive, HTTPScope, Send
from pdproxy.server.responses import read_body

#: Seconds a request runs before its client is watched for a disconnect (see ClientWatch).
DISCONNECT_WATCH_DELAY = 0.01


class ClientWatch:
    """Watches ``receive()`` for ``http.disconnect`` while the response is produced.

    granian's ``send`` does not fail after the client went away, so without this watch a
    stream would keep its node busy until the node finished generating. The watching task
    starts only once the request has taken ``delay`` seconds: most requests finish sooner,
    and for them the task would cost more than the rest of the handler.
    """

    __slots__ = ("_on_disconnect", "_receive", "_task", "_timer", "gone")

    def __init__(self, receive: HTTPReceive, delay: float) -> None:
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


def path_as_sent(scope: HTTPScope) -> str:
    """The request's path as the client sent it, percent-encoding and all (without the query):
    what routes it, so that a path which decodes into an inference route is not served as one."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw else str(scope["path"])


async def serve(
    pipeline: Pipeline, scope: HTTPScope, receive: HTTPReceive, send: Send, max_body_size: int, body_timeout: float
) -> None:
    """Serves one inference request through the pipeline."""
    body, error = await _read(scope, receive, max_body_size, body_timeout)
    target = path_as_sent(scope)
    if scope.get("query_string"):
        target = f"{target}?{scope['query_string'].decode('latin-1')}"
    client = scope.get("client")
    watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY)
    try:
        pending = pipeline.serve(
            scope["method"],
            target,
            list(scope["headers"]),
            body,
            error,
            (str(client[0]), int(client[1])) if client else None,
        )
        watch.on_disconnect(pending.cancel)
        try:
            response = await pending
        except asyncio.CancelledError:
            if watch.gone:  # the client left before the answer: nobody to answer
                return
            raise
        watch.on_disconnect(response.close)
        await send({"type": "http.response.start", "status": response.status, "headers": response.headers})
        if response.body is not None:
            await send({"type": "http.response.body", "body": response.body})
            return
        try:
            async for chunk in response:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            response.close()
        if not watch.gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watch.stop()


async def _read(scope: HTTPScope, receive: HTTPReceive, limit: int, seconds: float) -> tuple[bytes | None, str | None]:
    """The request's body, or why it could not be read (the pipeline answers for it)."""
    declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
    try:
        async with asyncio.timeout(seconds):
            return await read_body(receive, limit, declared), None
    except RequestTooLarge:
        return None, "too_large"
    except TimeoutError:
        return None, "timeout"
    except (ClientGone, InvalidRequest):
        return None, "broken"

"""The hot path: forward one inference request and stream the node's answer back.

Per chunk batch, Python does one ``await send(...)``; everything else (parsing, selection,
SSE framing, accounting) happens in the data plane.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import NamedTuple

from ._pdproxy import Response, TenantTicket, Trace
from .access import AccessLog, Record
from .asgi_types import HTTPReceive, HTTPScope, Send, SendMessage
from .auth import bearer
from .errors import (
    ClientGone,
    InvalidRequest,
    LoopDetected,
    NotFound,
    PdproxyError,
    RequestTimeout,
    UnsupportedMediaType,
    UpstreamError,
)
from .pd import PdAdapter
from .pd.relay import PdRequest, with_echo
from .responses import check_media_type, read_body, send_error
from .router import Router
from .tracing import current_trace_id, trace_id_of

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


class ClientHeaders(NamedTuple):
    upstream: list[tuple[bytes, bytes]]
    request_id: bytes
    content_type: bytes | None
    content_length: bytes | None
    content_encoding: bytes | None
    via: bytes | None
    traceparent: bytes | None
    priority: int | None

    def came_back(self, instance: str) -> bool:
        """Whether the request already went through this proxy (its id in ``x-pdproxy-via``)."""
        return self.via is not None and instance.encode() in (i.strip() for i in self.via.split(b","))


def upstream_headers(scope: HTTPScope) -> ClientHeaders:
    """The client's headers plus the proxy's: ``x-request-id`` (the client's, or a new one)
    and ``X-Forwarded-For/Host/Proto``; with the few the handler reads, in one pass. The data
    plane drops hop-by-hop headers and the client's key (``authorization``, ``x-api-key``)."""
    headers: list[tuple[bytes, bytes]] = []
    request_id = forwarded_for = host = content_type = content_length = content_encoding = via = traceparent = None
    priority: int | None = None
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            request_id = value
        elif name == b"content-type":
            content_type = value
        elif name == b"content-length":
            content_length = value
        elif name == b"content-encoding":
            content_encoding = value.strip().lower()
        elif name == b"x-pdproxy-via":
            via = value
        elif name == b"traceparent":
            traceparent = value
        elif name == b"x-pdproxy-priority":
            priority = _integer(value)
        elif name == b"x-forwarded-for":
            forwarded_for = value
            continue
        elif name == b"host":
            host = value
        elif name in (b"x-forwarded-host", b"x-forwarded-proto"):
            continue  # ours replace whatever the client claimed
        headers.append((name, value))
    if request_id is None:
        request_id = uuid.uuid4().hex.encode()
        headers.append((b"x-request-id", request_id))
    client = scope.get("client")
    if client:
        peer = client[0].encode()
        headers.append((b"x-forwarded-for", forwarded_for + b", " + peer if forwarded_for else peer))
    if host is not None:
        headers.append((b"x-forwarded-host", host))
    headers.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
    return ClientHeaders(
        headers, request_id, content_type, content_length, content_encoding, via, traceparent, priority
    )


def _integer(value: bytes) -> int | None:
    try:
        return int(value.strip())
    except ValueError:
        return None


def path_as_sent(scope: HTTPScope) -> str:
    """The request's path as the client sent it, percent-encoding and all (without the query):
    what routes it, so that a path which decodes into an inference route is not served as one."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw else str(scope["path"])


def plain_path(path: str) -> bool:
    """Whether a pass-through path stays under ``/v1/``: no dot-segments, and no encoded dots or
    separators that a node might decode into one (the edge's check, ``request::plain_path``)."""
    lowered = path.lower()
    encoded = any(s in lowered for s in ("%2e", "%2f", "%5c")) or "\\" in path
    return not encoded and not any(segment in (".", "..") for segment in path.split("/"))


def _stream_error_event(error: PdproxyError) -> bytes:
    """The terminal event of a stream that failed after its head was sent (OpenAI clients
    raise on a ``data:`` object with an ``error`` key)."""
    payload = {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)


async def forward(
    router: Router,
    max_body_size: int,
    scope: HTTPScope,
    receive: HTTPReceive,
    send: Send,
    *,
    body_timeout: float,
    require_model: bool = False,
    pd: PdAdapter | None = None,
    access: AccessLog | None = None,
) -> None:
    """Handles one inference request end to end. ``require_model``: a pass-through path is
    routed only when its body names a model. ``pd``: chat and completions go through
    prefill and decode nodes. ``access``: one access-log line for the request."""
    client_headers = upstream_headers(scope)
    trace = router.trace(client_headers.traceparent)
    trace_id = trace.id if trace is not None else trace_id_of(client_headers.traceparent)
    record = access.record(scope, client_headers.request_id) if access is not None else None
    if record is not None:
        record.trace_id = trace_id
        send = record.wrap(send)
    if trace is not None:
        trace.annotate(
            {
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "pdproxy.request_id": client_headers.request_id.decode("latin-1"),
            }
        )
        send = _traced_send(trace, send)
    token = current_trace_id.set(trace_id)
    gone = False
    try:
        gone = await _serve(
            router,
            max_body_size,
            scope,
            receive,
            send,
            require_model,
            pd,
            body_timeout,
            client_headers,
            record,
            trace,
        )
    finally:
        current_trace_id.reset(token)
        if record is not None:
            record.finish(gone)


def _counted(ticket: TenantTicket, send: Send) -> Send:
    """Counts an error answer in the tenant's errors."""

    async def observed(message: SendMessage) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 500:
            ticket.fail()
        await send(message)

    return observed


def _traced_send(trace: Trace, send: Send) -> Send:
    """Notes the answer's status on the request's root span."""

    async def observed(message: SendMessage) -> None:
        if message["type"] == "http.response.start":
            trace.annotate({"http.response.status_code": str(message["status"])})
            if message["status"] >= 500:
                trace.fail(f"answered {message['status']}")
        await send(message)

    return observed


async def _serve(
    router: Router,
    max_body_size: int,
    scope: HTTPScope,
    receive: HTTPReceive,
    send: Send,
    require_model: bool,
    pd: PdAdapter | None,
    body_timeout: float,
    client_headers: ClientHeaders,
    record: Record | None,
    trace: Trace | None,
) -> bool:
    """Serves the request; returns whether the client went away before the end."""
    echo = [(b"x-request-id", client_headers.request_id)]
    try:
        if client_headers.came_back(router.core.instance_id):
            raise LoopDetected("the request came back to this proxy: one of its nodes routes to it again")
        check_media_type(client_headers.content_type)
        if client_headers.content_encoding not in (None, b"identity"):
            coding = client_headers.content_encoding.decode("latin-1")
            raise UnsupportedMediaType(f"compressed request bodies are not accepted (content-encoding: {coding})")
        try:
            async with asyncio.timeout(body_timeout):
                body = await read_body(receive, max_body_size, client_headers.content_length)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {body_timeout:g}s") from None
        if require_model and not plain_path(path_as_sent(scope)):
            raise InvalidRequest("the path may not contain dot-segments or encoded separators")
        model = Router.inspect(body)["model"] if require_model or record is not None or trace is not None else None
        if record is not None:
            record.model = model
        if trace is not None and model:
            trace.annotate({"pdproxy.model": model})
        if require_model and not model:
            raise NotFound(f"no route for {scope['path']} without a model in the body")
        # Without tenants the data plane reads the body's priority itself.
        ticket = (
            router.admit(bearer(scope["headers"]), body, client_headers.priority)
            if router.core.tenants_configured or client_headers.priority is not None
            else None
        )
    except ClientGone:
        # Gone, or its body's framing broke (a server ends the body the same way for both):
        # an answer is due in the second case, and harmless in the first.
        await send_error(send, InvalidRequest("the request body could not be read"), echo)
        return True
    except PdproxyError as e:
        await send_error(send, e, echo)
        return False
    try:
        return await _forward_admitted(router, scope, receive, send, pd, body, client_headers, record, trace, ticket)
    finally:
        if ticket is not None:
            ticket.close()


async def _forward_admitted(
    router: Router,
    scope: HTTPScope,
    receive: HTTPReceive,
    send: Send,
    pd: PdAdapter | None,
    body: bytes,
    client_headers: ClientHeaders,
    record: Record | None,
    trace: Trace | None,
    ticket: TenantTicket | None,
) -> bool:
    """Forwards a request its tenant admitted; its answers carry the tenant's rate headers."""
    headers = client_headers.upstream
    echo = [(b"x-request-id", client_headers.request_id)]
    if ticket is not None and ticket.tenant is not None:
        echo.extend(ticket.headers)
        send = _counted(ticket, send)
    # The path as the client sent it (not decoded), as the edge forwards it.
    path = path_as_sent(scope)
    if scope.get("query_string"):
        path = f"{path}?{scope['query_string'].decode('latin-1')}"
    if pd is not None and scope["path"] in pd.paths:
        return await _disaggregated(router, pd, path, body, headers, receive, send, echo, trace, ticket)

    watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY)
    response: Response | None = None
    try:
        try:
            pending = router.forward(path, body, headers, trace=trace, tenant=ticket)
        except PdproxyError as e:
            await send_error(send, e, echo)
            return False
        watch.on_disconnect(pending.cancel)
        try:
            response = await pending
        except asyncio.CancelledError:
            if watch.gone:  # the client left while the node was working: nothing to answer
                return True
            raise
        except PdproxyError as e:
            await send_error(send, e, echo)
            return False
        if record is not None:
            record.node = response.node
        if trace is not None:
            trace.annotate({"pdproxy.node": response.node})
        watch.on_disconnect(response.close)
        response_headers = with_echo(response.headers, echo)
        await send({"type": "http.response.start", "status": response.status, "headers": response_headers})
        if response.body is not None:
            await send({"type": "http.response.body", "body": response.body})
            return False
        await stream_body(response, send)
        return watch.gone
    finally:
        watch.stop()
        if response is not None:
            response.close()


async def _disaggregated(
    router: Router,
    pd: PdAdapter,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    receive: HTTPReceive,
    send: Send,
    echo: list[tuple[bytes, bytes]],
    trace: Trace | None,
    ticket: TenantTicket | None,
) -> bool:
    """Runs the prefill-decode flow as one task that a client disconnect cancels at any stage.
    Returns whether the client went away."""
    try:
        router.core.check_asks(body)  # before a flow builds anything on the body's numbers
    except PdproxyError as e:
        await send_error(send, e, echo)
        return False
    watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY)
    flow = asyncio.ensure_future(pd.handle(PdRequest(path, body, headers, send, echo, trace, ticket)))
    watch.on_disconnect(flow.cancel)
    try:
        await flow
    except asyncio.CancelledError:
        if not watch.gone:
            raise
    except PdproxyError as e:
        await send_error(send, e, echo)
    finally:
        watch.stop()
    return watch.gone


async def stream_body(response: Response, send: Send, on_first: Callable[[], object] | None = None) -> None:
    """Sends a streamed body; ``on_first`` runs when its first batch arrives."""
    try:
        async for chunk in response:
            if on_first is not None:
                on_first()
                on_first = None
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as e:
        if _is_event_stream(response.headers):
            await send({"type": "http.response.body", "body": _stream_error_event(e), "more_body": False})
            return
        raise
    if response.closed:  # cut short because the client left: there is nobody to tell
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


__all__ = ["ClientWatch", "InvalidRequest", "forward", "stream_body", "upstream_headers"]

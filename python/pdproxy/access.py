"""The access log: one line per inference request, written by a background thread so the
event loop never waits on the terminal or a file. Off unless asked for (``--access-log``).

A line tells when the request arrived (UTC, ISO 8601 with milliseconds) and the client's
address, the request id, method and path, the model, the node, the status, how the request
ended and in which phase (``completed``, ``client_cancel@ttfb``, ``client_cancel@stream``,
``upstream_error@stream``, ``no_healthy_node@admission``...), bytes and events sent to the
client, time to first byte and duration, and the trace id (the request's, or the caller's
``traceparent`` when requests are not traced here). Never keys or bodies."""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import queue
import sys
import time
from typing import TypedDict

from .asgi_types import HTTPScope, Send, SendMessage

log = logging.getLogger("pdproxy.access")


class AccessLine(TypedDict):
    """One line of the access log, in its order (the Rust edge writes the same fields)."""

    #: When the request arrived: UTC, ISO 8601 with milliseconds.
    time: str
    client: str | None
    request_id: str
    method: str
    path: str
    model: str | None
    node: str | None
    status: int | None
    #: How it ended, and in which phase: ``completed``, ``client_cancel@ttfb``...
    cause: str
    bytes: int
    events: int
    #: Seconds to the first byte of the answer, and to its end.
    ttfb: float | None
    duration: float
    trace_id: str | None


class AccessLog:
    def __init__(self, fmt: str) -> None:
        self.json = fmt == "json"
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        log.addHandler(logging.handlers.QueueHandler(self._queue))
        log.setLevel(logging.INFO)
        log.propagate = False
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()

    def record(self, scope: HTTPScope, request_id: bytes) -> Record:
        return Record(self, scope, request_id)

    def write(self, fields: AccessLine) -> None:
        if self.json:
            log.info(json.dumps(fields, separators=(",", ":")))
        else:
            log.info(" ".join(f"{k}={escape(v) if isinstance(v, str) else v}" for k, v in fields.items()))


def escape(value: str) -> str:
    """A text-line field that cannot break its line or forge another field: backslashes,
    spaces and control characters are written as escapes (as the edge's writer does)."""
    return value.translate(_ESCAPES)


_ESCAPES = {
    **{c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)},
    ord("\\"): "\\\\",
    ord(" "): "\\x20",
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
}


class Record:
    """What is known of one request, filled in as it goes."""

    __slots__ = (
        "arrived",
        "bytes",
        "events",
        "first_byte",
        "log",
        "model",
        "node",
        "proxy_error",
        "request_id",
        "scope",
        "started",
        "status",
        "stream_error",
        "trace_id",
    )

    def __init__(self, access: AccessLog, scope: HTTPScope, request_id: bytes) -> None:
        self.log = access
        self.scope = scope
        self.request_id = request_id
        self.started = time.monotonic()
        self.arrived = time.time()
        self.status: int | None = None
        self.first_byte: float | None = None
        self.bytes = 0
        self.events = 0
        self.model: str | None = None
        self.node: str | None = None
        self.proxy_error: str | None = None
        self.stream_error = False
        self.trace_id: str | None = None

    def wrap(self, send: Send) -> Send:
        async def observed(message: SendMessage) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-pdproxy-error":
                        self.proxy_error = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    if self.first_byte is None:
                        self.first_byte = time.monotonic() - self.started
                    self.bytes += len(chunk)
                    self.events += chunk.count(b"\n\n")
                    self.stream_error = chunk.startswith(b'data: {"error"')
            await send(message)

        return observed

    def finish(self, client_gone: bool) -> None:
        if client_gone:
            cause = f"client_cancel@{'ttfb' if self.status is None else 'stream'}"
        elif self.proxy_error is not None:
            cause = f"{self.proxy_error}@{'admission' if self.proxy_error != 'upstream_error' else 'ttfb'}"
        elif self.stream_error:
            cause = "upstream_error@stream"
        elif self.status is not None and self.status >= 400:
            cause = "upstream_status@ttfb"
        else:
            cause = "completed"
        client = self.scope.get("client")
        self.log.write(
            AccessLine(
                time=utc_timestamp(self.arrived),
                client=client[0] if client else None,
                request_id=self.request_id.decode("latin-1"),
                method=self.scope["method"],
                path=self.scope["path"],
                model=self.model,
                node=self.node,
                status=self.status,
                cause=cause,
                bytes=self.bytes,
                events=self.events,
                ttfb=None if self.first_byte is None else round(self.first_byte, 6),
                duration=round(time.monotonic() - self.started, 6),
                trace_id=self.trace_id,
            )
        )


def utc_timestamp(at: float) -> str:
    """``at`` (seconds since the epoch) as the Rust edge writes it: ``2026-12-01T09:30:00.123Z``."""
    moment = datetime.datetime.fromtimestamp(int(at), datetime.UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{int(at * 1000) % 1000:03d}Z"

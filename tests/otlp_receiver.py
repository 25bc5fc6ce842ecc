"""A local OTLP/HTTP trace receiver for the tests: records every span it is sent (JSON encoding)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, url: str) -> None:
        self.url = url
        self.spans: list[dict[str, Any]] = []
        self.resources: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["traceId"] == trace_id]

    def named(self, trace_id: str, name: str) -> list[dict[str, Any]]:
        return [s for s in self.trace(trace_id) if s["name"] == name]


def attributes(span: dict[str, Any]) -> dict[str, str]:
    return {a["key"]: a["value"]["stringValue"] for a in span.get("attributes", [])}


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            request = json.loads(body)
            with receiver.lock:
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                for resource_spans in request["resourceSpans"]:
                    receiver.resources.append(resource_spans["resource"])
                    for scope in resource_spans["scopeSpans"]:
                        receiver.spans.extend(scope["spans"])
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()

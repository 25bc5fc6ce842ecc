"""``/metrics`` on a port of its own (``--metrics-port``; the SGLang gateway's and vllm-router's
``--prometheus-port``), for scrapers kept apart from the traffic.

It answers ``GET /metrics`` (and ``HEAD``) and nothing else, through the application itself, so
the key rules (admin keys, or same-site checks without them), the error bodies and the
exposition are those of the serving port, whichever edge serves. In a worker group every worker
listens on it (``SO_REUSEPORT``), as they do on the serving port.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError
from pdproxy.server.asgi_types import HTTPScope, Receive, ReceiveMessage, Scope, Send, SendMessage

__all__ = ["MetricsListener"]

PATH = "/metrics"
#: Where every other request is sent instead: a path no route has, so the answer is the app's 404.
ELSEWHERE = "/not-on-the-metrics-port"

App = Callable[[Scope, Receive, Send], Awaitable[None]]


class MetricsListener:
    def __init__(self, app: App, settings: Settings) -> None:
        self._app = app
        self._settings = settings
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listens; raises ``ConfigError`` when the port cannot be taken."""
        settings = self._settings
        server = web.Application()
        server.router.add_route("*", "/{path:.*}", self._answer)
        self._runner = web.AppRunner(server, access_log=None, handle_signals=False)
        await self._runner.setup()
        host = settings.observability.metrics_host or settings.server.host
        site = web.TCPSite(
            self._runner, host, settings.observability.metrics_port, ssl_context=_tls(settings), reuse_port=True
        )
        try:
            await site.start()
        except OSError as e:
            await self.aclose()
            where = f"{host}:{settings.observability.metrics_port}"
            raise ConfigError(f"--metrics-port: cannot listen on {where}: {e.strerror}") from None

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        # Only /metrics: the rest of the API stays on the serving port.
        wanted = request.path == PATH and request.method in ("GET", "HEAD")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        scope: HTTPScope = {
            "type": "http",
            "method": "GET" if wanted else request.method,
            "path": PATH if wanted else ELSEWHERE,
            "raw_path": None,
            "query_string": b"",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
            "client": (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None,
            "scheme": "https" if request.secure else "http",
        }
        status = 500
        headers: list[tuple[bytes, bytes]] = []
        body = bytearray()

        async def receive() -> ReceiveMessage:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: SendMessage) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers.extend(message.get("headers", []))
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        await self._app(scope, receive, send)
        response = web.Response(status=status, body=b"" if request.method == "HEAD" else bytes(body))
        for name, value in headers:
            if name.lower() != b"content-length":
                response.headers[name.decode("latin-1")] = value.decode("latin-1")
        return response


def _tls(settings: Settings) -> ssl.SSLContext | None:
    """The serving port's certificate, when it serves HTTPS (keys travel on this port too)."""
    if not settings.security.ssl:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.security.ssl_certfile, settings.security.ssl_keyfile)
    return context

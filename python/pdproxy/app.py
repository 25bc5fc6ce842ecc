"""The ASGI application: a plain dict routes requests; no framework sits on the hot path."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any

from . import management, proxy
from .config import Settings
from .errors import PdproxyError, error_body
from .proxy import Receive, Scope, Send
from .router import Router

__all__ = ["SETTINGS_ENV", "ProxyApp", "app_from_environment", "create_app"]

log = logging.getLogger("pdproxy")

#: How `pdproxy serve` hands its settings to granian's worker processes.
SETTINGS_ENV = "_PDPROXY_SERVE_SETTINGS"

#: Allocations between two young-generation collections when serving (CPython's default: 700).
GC_THRESHOLD = 50_000

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class ProxyApp:
    """The pdproxy ASGI app. The router is built at lifespan startup, inside the worker
    process, so that the data plane's threads start after any fork."""

    def __init__(self, settings: Settings, tune_gc: bool = False) -> None:
        self.settings = settings
        #: Only when serving: an embedding process's garbage collector is not ours to tune.
        self.tune_gc = tune_gc
        self.router: Router | None = None
        self._reads: dict[str, Callable[[Router], tuple[int, list[tuple[bytes, bytes]], bytes]]] = {
            "/v1/models": management.models,
            "/health": management.health,
        }

    async def startup(self) -> None:
        if self.tune_gc:
            # Per request the hot path allocates a few short-lived containers (futures, dicts);
            # with the default threshold the cycle collector runs every few hundred requests
            # and scans everything. Startup objects are frozen out of its reach instead.
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        self.router = Router(settings=self.settings)
        await self.router.start()
        log.info("pdproxy routing to %d node(s); policies %s", len(self.router.nodes()), self.router.policies)

    async def shutdown(self) -> None:
        if self.router is not None:
            await self.router.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        router = self.router
        if router is None:  # a server without lifespan support
            await self.startup()
            router = self.router
            assert router is not None
        path, method = scope["path"], scope["method"]
        if path in INFERENCE_PATHS:
            if method == "POST":
                await proxy.forward(router, self.settings.max_body_size, scope, receive, send)
            else:
                await _send_plain_error(send, 405, f"{method} is not allowed on {path}", "method_not_allowed")
            return
        read = self._reads.get(path)
        if read is None:
            await _send_plain_error(send, 404, f"no route for {path}", "not_found")
        elif method != "GET":
            await _send_plain_error(send, 405, f"{method} is not allowed on {path}", "method_not_allowed")
        else:
            status, headers, body = read(router)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except (PdproxyError, ValueError) as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _send_plain_error(send: Send, status: int, message: str, code: str) -> None:
    headers = [(b"content-type", b"application/json"), (b"x-pdproxy-error", code.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(message, type="invalid_request_error", code=code)})


def create_app(settings: Settings | None = None) -> ProxyApp:
    return ProxyApp(settings or Settings())


def app_from_environment() -> ProxyApp:
    """The factory granian's workers call: settings come from `pdproxy serve` via the environment."""
    raw: Any = os.environ.get(SETTINGS_ENV)
    return ProxyApp(Settings.from_json(raw) if raw else Settings(), tune_gc=True)

"""The ASGI application: plain dicts route requests; no framework sits on the hot path. It
dispatches; the ``Supervisor`` owns the parts it dispatches to."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypedDict, cast
from urllib.parse import unquote

from pydantic import BaseModel

from pdproxy import _pdproxy
from pdproxy._json_types import JsonObject
from pdproxy.config.settings import Settings
from pdproxy.errors import MethodNotAllowed, ModelNotFound, NotFound, PdproxyError
from pdproxy.fleet.fleet import Fleet
from pdproxy.management.nodes_api import ROUTES
from pdproxy.management.openapi import schema
from pdproxy.management.peer_routes import health_generate as peer_health_generate
from pdproxy.management.peer_routes import readiness as peer_readiness
from pdproxy.management.route_table import PlainText, WithHeaders, template_of, templates
from pdproxy.observability import dashboard
from pdproxy.observability.metrics import CONTENT_TYPE, render
from pdproxy.observability.metrics_listener import MetricsListener
from pdproxy.router import Router
from pdproxy.server import inference
from pdproxy.server.asgi_types import Headers, HTTPReceive, HTTPScope, Receive, Scope, Send, SendMessage
from pdproxy.server.auth import Keys
from pdproxy.server.responses import JSON_HEADERS, send_error, send_json, send_text
from pdproxy.server.supervisor import Supervisor
from pdproxy.server.tenants import usage as tenant_usage

__all__ = ["SETTINGS_ENV", "ProxyApp", "app_from_environment", "create_app"]

log = logging.getLogger("pdproxy")

#: How `pdproxy serve` hands its settings, and its own pid, to granian's worker processes.
SETTINGS_ENV = "_PDPROXY_SERVE_SETTINGS"
MAIN_PID_ENV = "_PDPROXY_SERVE_PID"

#: Inference endpoints routed by the body's model; other POSTs under /v1/ are passed through
#: too when their body names a model.
INFERENCE_PATHS = frozenset(_pdproxy.INFERENCE_PATHS)


class ProxyApp:
    """The pdproxy ASGI app: dispatches each request (keys, CORS, routes); what it dispatches to
    is the ``supervisor``'s (router, fleet, PD flow, drain, readiness)."""

    def __init__(
        self,
        settings: Settings,
        tune_gc: bool = False,
        exit_when_drained: bool = False,
        behind_edge: bool = False,
    ) -> None:
        self.settings = settings
        self.supervisor = Supervisor(settings, tune_gc=tune_gc, exit_when_drained=exit_when_drained)
        #: Served by the Rust edge over a private socket: it tells the client's address (PEER_HEADER).
        self.behind_edge = behind_edge
        self.keys = Keys(
            settings.security.api_keys,
            settings.security.admin_keys,
            settings.server.host,
            settings.security.keyless_registration_cidrs,
        )
        self._admin = {(route.method, route.path): route for route in ROUTES}
        self._metrics_listener: MetricsListener | None = None
        #: The data plane's pipeline, for the inference requests this app takes itself.
        self.pipeline: _pdproxy.Pipeline | None = None
        #: The routes with a parameter in their path (`/workers/{worker_id}`), by prefix.
        self._templates = templates(ROUTES)
        #: What GET answers, by path (and `/v1/models/{model}`, a model id may hold slashes).
        self._get_routes: dict[str, Callable[[HTTPScope, Send], Awaitable[None]]] = {
            "/": self._index,
            "/v1/models": self._models,
            "/health": self._health,
            "/ready": self._ready,
            "/liveness": self._liveness,
            "/readiness": self._readiness,
            "/health_generate": self._health_generate,
            "/dashboard": self._dashboard,
            "/dashboard/data": self._dashboard_data,
            "/metrics": self._metrics,
            "/usage": self._usage,
            "/openapi.json": self._openapi,
        }

    async def startup(self) -> None:
        await self.supervisor.start()
        assert self.supervisor.router is not None
        self.pipeline = _pdproxy.Pipeline(self.supervisor.router.core, self.settings)
        if self.settings.observability.metrics_port:
            self._metrics_listener = MetricsListener(self, self.settings)
            await self._metrics_listener.start()

    async def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()  # streams still running end with a terminal event
        if self._metrics_listener is not None:
            await self._metrics_listener.aclose()
        await self.supervisor.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if not self.supervisor.started:  # a server without lifespan support
                await self.startup()
            pipeline = self.pipeline
            assert pipeline is not None
            send = _with_request_id(send, scope)
            if pipeline.cors_enabled:  # browsers' CORS, by the edge's rules (rust/src/edge/cors.rs)
                preflight, cors_headers = pipeline.cors(scope["method"], scope["path"], list(scope["headers"]))
                if preflight is not None:
                    status, answer_headers, body = preflight
                    await send({"type": "http.response.start", "status": status, "headers": answer_headers})
                    await send({"type": "http.response.body", "body": body})
                    return
                send = _adding(send, cors_headers)
            try:
                # An http scope's receive gives that request's messages only (the ASGI protocol).
                await self._http(scope, cast(HTTPReceive, receive), send)
            except PdproxyError as e:
                await send_error(send, e)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: HTTPScope, receive: HTTPReceive, send: Send) -> None:
        supervisor = self.supervisor
        _take_peer(scope, trusted=self.behind_edge, https=self.settings.security.ssl)
        path, method = inference.path_as_sent(scope), scope["method"]
        pipeline = self.pipeline
        assert pipeline is not None
        if method == "POST" and pipeline.serves(path):
            settings = self.settings
            await inference.serve(pipeline, scope, receive, send, settings.limits.max_body_size, settings.timeouts.body)
            return
        if (method, path) == ("POST", "/drain"):
            self.keys.check_admin(scope["headers"])
            supervisor.drain()
            await send_json(send, 202, {"status": "draining", "in_flight": supervisor.in_flight})
            return
        route_path = template_of(path, self._templates)
        route = self._admin.get((method, route_path))
        if route is not None:
            if route.path == "/nodes/add":
                self.keys.check_registration(scope["headers"], (scope.get("client") or (None,))[0])
            else:
                self.keys.check_admin(scope["headers"])
            status, answer = await route.handler(self._fleet(), scope, receive)
            if isinstance(answer, PlainText):
                await send_text(send, status, answer.text)
                return
            headers = JSON_HEADERS
            if isinstance(answer, WithHeaders):
                headers = [*JSON_HEADERS, *((name.encode(), value.encode()) for name, value in answer.headers)]
                answer = answer.answer
            payload = answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer
            await send_json(send, status, payload, headers)
            return
        if (method, path) == ("HEAD", "/health"):  # load balancers' liveness probes
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": b""})
            return
        serve_get = self._get_routes.get(path) or (self._model_card if path.startswith("/v1/models/") else None)
        if method == "GET" and serve_get is not None:
            await serve_get(scope, send)
            return
        allowed = self._methods_of(route_path, path)
        if allowed:
            raise MethodNotAllowed(f"{method} is not allowed on {route_path}", allow=allowed)
        raise NotFound(f"no route for {method} {path}")

    def _methods_of(self, route_path: str, path: str) -> list[str]:
        """The methods ``path`` (matching the management route ``route_path``) is served with."""
        methods = {method for method, served in self._admin if served == route_path}
        if path in INFERENCE_PATHS or path == "/drain":
            methods.add("POST")
        if path in self._get_routes or path.startswith("/v1/models/"):
            methods.add("GET")
        if path == "/health":
            methods.add("HEAD")
        return sorted(methods)

    # The GET routes, each a method of its own (`_get_routes` maps their paths).

    async def _index(self, scope: HTTPScope, send: Send) -> None:
        """Where someone who opens the proxy's address in a browser finds what is here."""
        links = {"dashboard": "/dashboard", "api": "/openapi.json", "status": "/nodes/status", "health": "/health"}
        await send_json(send, 200, {"service": "pdproxy", "version": _pdproxy.__version__, **links})

    async def _models(self, scope: HTTPScope, send: Send) -> None:
        assert self.pipeline is not None
        self.pipeline.check_key(list(scope["headers"]))
        await send_json(send, 200, _model_list(self._router()))

    async def _model_card(self, scope: HTTPScope, send: Send) -> None:
        assert self.pipeline is not None
        self.pipeline.check_key(list(scope["headers"]))
        model = unquote(inference.path_as_sent(scope).removeprefix("/v1/models/"))
        await send_json(send, 200, _model_card(self._router(), model))

    async def _health(self, scope: HTTPScope, send: Send) -> None:
        # Alive, whatever the node sources say: they keep their nodes while they cannot look.
        fleet = self._fleet()
        sources = {"discovery": fleet.sources_status()} if fleet.sources else {}
        await send_json(send, 200, {"status": "healthy", **sources})

    async def _ready(self, scope: HTTPScope, send: Send) -> None:
        ready, answer = self.supervisor.readiness()
        await send_json(send, 200 if ready else 503, answer)

    async def _liveness(self, scope: HTTPScope, send: Send) -> None:
        """The SGLang gateway's and vllm-router's probe."""
        await send_text(send, 200, "OK")

    async def _readiness(self, scope: HTTPScope, send: Send) -> None:
        await send_json(send, *peer_readiness(self._fleet()))

    async def _health_generate(self, scope: HTTPScope, send: Send) -> None:
        """The peers' probe: can a healthy node generate."""
        await send_json(send, *await peer_health_generate(self._fleet()))

    async def _dashboard(self, scope: HTTPScope, send: Send) -> None:
        """A static page: its data is what the keys guard."""
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": dashboard.PAGE})

    async def _dashboard_data(self, scope: HTTPScope, send: Send) -> None:
        self.keys.check_admin(scope["headers"])
        await send_json(send, 200, dashboard.data(self.supervisor))

    async def _metrics(self, scope: HTTPScope, send: Send) -> None:
        self.keys.check_admin(scope["headers"])
        assert self.supervisor.metrics is not None
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", CONTENT_TYPE)]})
        await send({"type": "http.response.body", "body": render(self.supervisor.metrics)})

    async def _usage(self, scope: HTTPScope, send: Send) -> None:
        self.keys.check_admin(scope["headers"])
        await send_json(send, 200, tenant_usage(self._router()))

    async def _openapi(self, scope: HTTPScope, send: Send) -> None:
        await send_json(send, 200, schema())

    def _router(self) -> Router:
        assert self.supervisor.router is not None
        return self.supervisor.router

    def _fleet(self) -> Fleet:
        assert self.supervisor.fleet is not None
        return self.supervisor.fleet

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


def _adding(send: Send, headers: Headers) -> Send:
    """``send`` with ``headers`` added to the response's head."""
    if not headers:
        return send

    async def sending(message: SendMessage) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


def _with_request_id(send: Send, scope: HTTPScope) -> Send:
    """``send`` with every answer carrying ``x-request-id`` (the client's, else a new one, as the
    edge makes it), unless the answer has one already (the pipeline's answers do)."""

    async def sending(message: SendMessage) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(name == REQUEST_ID for name, _ in headers):
                headers.append((REQUEST_ID, _pdproxy.request_id(list(scope["headers"]))))
                message = {**message, "headers": headers}
        await send(message)

    return sending


REQUEST_ID = b"x-request-id"

#: How the Rust edge tells the control plane the client's address (its own peer is the edge).
PEER_HEADER = b"x-pdproxy-peer"


def _take_peer(scope: HTTPScope, trusted: bool, https: bool) -> None:
    """Removes the edge's peer header from the request; behind the edge (``trusted``: only the
    edge can reach this app's socket), its value becomes the ASGI client address, and the
    scheme the client used is the edge's (``https`` with ``--ssl``)."""
    headers = scope["headers"]
    if not any(name == PEER_HEADER for name, _ in headers):
        return
    peer = next(value for name, value in headers if name == PEER_HEADER)
    scope["headers"] = [(name, value) for name, value in headers if name != PEER_HEADER]
    if trusted:
        host, _, port = peer.decode("latin-1").rpartition(":")
        scope["client"] = (host.strip("[]"), int(port) if port.isdigit() else 0)
        scope["scheme"] = "https" if https else "http"


def _served_models(router: Router) -> list[str]:
    """Every model some healthy node serves, in registration order."""
    seen: list[str] = []
    for node in router.views():
        if node.state == "healthy":
            seen.extend(m for m in node.models if m not in seen)
    return seen


class ModelList(TypedDict):
    """OpenAI's ``GET /v1/models`` answer: each model's card as ``Router.model_card`` merges it."""

    object: str
    data: list[JsonObject]


def _model_list(router: Router) -> ModelList:
    """The OpenAI ``ModelList`` of every model some healthy node serves."""
    return ModelList(object="list", data=[router.model_card(m) for m in _served_models(router)])


def _model_card(router: Router, model: str) -> JsonObject:
    """OpenAI's ``GET /v1/models/{model}`` (a model id may hold slashes)."""
    if model not in _served_models(router):
        raise ModelNotFound(f"the model `{model}` does not exist")
    return router.model_card(model)


def create_app(settings: Settings | None = None) -> ProxyApp:
    return ProxyApp(settings or Settings())


def app_from_environment() -> ProxyApp:
    """The factory granian's workers call: settings come from `pdproxy serve` via the environment."""
    raw = os.environ.get(SETTINGS_ENV)
    _end_with_main_process(os.environ.get(MAIN_PID_ENV))
    return ProxyApp(Settings.from_json(raw) if raw else Settings(), tune_gc=True, exit_when_drained=True)


def _end_with_main_process(main_pid: str | None) -> None:
    """A worker ends when the `pdproxy serve` process that started it dies, however it dies:
    an orphaned worker would go on serving the port with nobody to manage it."""
    if main_pid is None or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if str(os.getppid()) != main_pid:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)

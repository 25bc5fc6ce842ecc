"""The ASGI application: plain dicts route requests; no framework sits on the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from . import background, dashboard, proxy
from .access import AccessLog
from .auth import Keys
from .config import Settings
from .cors import Cors, is_cors_path
from .errors import ModelNotFound, PdproxyError
from .fleet import Fleet
from .group import GROUP_ENV, Group
from .membership import Membership
from .membership import from_url as membership_from_url
from .membership.group_file import GroupFileMembership
from .metrics import CONTENT_TYPE, registry_for, render
from .nodes_api import ROUTES
from .openapi import schema
from .pd import make_adapter
from .responses import JSON_HEADERS, MethodNotAllowed, NotFound, Receive, Scope, Send, header, send_error, send_json
from .router import Router
from .tenants import TenantsFile, UsageSync
from .tenants import usage as tenant_usage

__all__ = ["SETTINGS_ENV", "ProxyApp", "app_from_environment", "create_app"]

log = logging.getLogger("pdproxy")

#: How `pdproxy serve` hands its settings, and its own pid, to granian's worker processes.
SETTINGS_ENV = "_PDPROXY_SERVE_SETTINGS"
MAIN_PID_ENV = "_PDPROXY_SERVE_PID"

#: Allocations between two young-generation collections when serving (CPython's default: 700).
GC_THRESHOLD = 50_000

#: Inference endpoints routed by the body's model; other POSTs under /v1/ are passed through
#: too when their body names a model.
INFERENCE_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/generate",
        "/pooling",
    }
)


class ProxyApp:
    """The pdproxy ASGI app. The router and the fleet are built at lifespan startup, inside
    the worker process, so that the data plane's threads start after any fork."""

    def __init__(
        self,
        settings: Settings,
        tune_gc: bool = False,
        exit_when_drained: bool = False,
        behind_edge: bool = False,
    ) -> None:
        self.settings = settings
        #: Only when serving: an embedding process's garbage collector is not ours to tune.
        self.tune_gc = tune_gc
        #: Only when serving under `pdproxy serve --edge granian`: a finished drain ends the process.
        self.exit_when_drained = exit_when_drained
        #: Served by the Rust edge over a private socket: it tells the client's address (PEER_HEADER).
        self.behind_edge = behind_edge
        self.keys = Keys(settings.api_keys, settings.admin_keys, settings.host, settings.keyless_registration_cidrs)
        self.cors = Cors(
            settings.allow_origins, settings.allow_credentials, settings.allow_methods, settings.allow_headers
        )
        self.router: Router | None = None
        self.fleet: Fleet | None = None
        self.distserve: Any = None
        self.access: AccessLog | None = None
        self.metrics: Any = None
        self._admin = {(route.method, route.path): route for route in ROUTES}
        #: The drain in progress; set once it is over.
        self.draining = False
        self.drained = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self.group: Group | None = None
        self._group_task: asyncio.Task[None] | None = None
        self._health_watch: asyncio.Task[None] | None = None
        self._admin_paths = {route.path for route in ROUTES}
        self.tenants: TenantsFile | None = None
        self.usage_sync: UsageSync | None = None

    async def startup(self) -> None:
        if self.tune_gc:
            # Per request the hot path allocates a few short-lived containers (futures, dicts);
            # with the default threshold the cycle collector runs every few hundred requests
            # and scans everything. Startup objects are frozen out of its reach instead.
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        # The fleet adds the configured nodes, so that they are checked and tracked like any other.
        self.access = AccessLog(self.settings.access_log_format) if self.settings.access_log else None
        self.metrics = registry_for(self)
        group_dir = os.environ.get(GROUP_ENV)
        self.group = Group(Path(group_dir)) if group_dir else None
        group = (self.group.table, self.group.index) if self.group else None
        self.router = Router(settings=self.settings.replace(nodes=()), group=group)
        await self.router.start()
        self.keys.tenants = self.router.core
        if self.settings.tenants_file:
            self.tenants = TenantsFile(self.router, self.settings.tenants_file)
            self.tenants.start()
            if self.settings.registry:
                self.usage_sync = UsageSync(self.router, self.settings.registry, self.settings.tenant_sync_interval)
                await self.usage_sync.start()
        self.fleet = Fleet(self.router, self.settings, self._membership())
        self.fleet.group = self.group
        if self.settings.serving_strategy == "DistServe":
            # Before the fleet starts, so that it sees every node the fleet adds and removes.
            self.distserve = make_adapter(
                self.router, self.settings, self.fleet, self.group.directory if self.group else None
            )
            await self.distserve.start()
            self.fleet.distserve = self.distserve
            self.fleet.on_removed.append(self.distserve.node_removed)
        await self.fleet.start(check_health=self.group is None)
        self._health_watch = background.start(self._watch_health(), "pdproxy-health-watch")
        if self.group is not None:
            self._group_task = background.start(
                self.group.run(on_lead=self._lead, leader_tick=self._leader_tick, signal_tick=self._group_signals),
                "pdproxy-group",
            )
        log.info("pdproxy routing to %d node(s); policies %s", len(self.router.nodes()), self.router.policies)

    def _membership(self) -> Membership | None:
        """Where node membership is shared: Redis (--registry), else the worker group's document."""
        if self.settings.registry:
            return membership_from_url(self.settings.registry)
        if self.group is not None:
            return GroupFileMembership(self.group.directory, self.group.table)
        return None

    async def _lead(self) -> None:
        """This worker became its group's leader."""
        assert self.fleet is not None
        await self.fleet.start_health()

    async def _leader_tick(self) -> None:
        assert self.fleet is not None
        self.fleet.publish_health()
        if isinstance(self.fleet.membership, GroupFileMembership):
            self.fleet.membership.expire()
        if self.distserve is not None and self.distserve.protocol == "lmdeploy":
            await self.distserve.adopt_orphans()

    def _group_signals(self) -> None:
        """Every worker, often: a drain asked of any worker, and nodes another worker re-added."""
        assert self.group is not None
        assert self.router is not None
        if self.group.table.draining and not self.draining:
            log.info("the group is draining")
            self.drain(initiator=False)
        self.router.refresh_bindings()

    async def _watch_health(self) -> None:
        """Says so when health checks stop completing (node states would be stale)."""
        assert self.fleet is not None
        warned = False
        while True:
            await asyncio.sleep(self.settings.health_interval)
            stale = self.fleet.health.stale()
            if stale is not None and not warned:
                log.warning("health checks have not completed for %.0f s: node states may be out of date", stale)
            elif stale is None and warned:
                log.info("health checks are completing again")
            warned = stale is not None

    def reload_tenants(self) -> None:
        """SIGHUP: reads the tenants file again."""
        if self.tenants is not None:
            self.tenants.reload()

    async def shutdown(self) -> None:
        if self.usage_sync is not None:
            await self.usage_sync.aclose()
        if self.tenants is not None:
            await self.tenants.aclose()
        await background.stop(self._health_watch)
        await background.stop(self._group_task)
        if self.distserve is not None:
            await self.distserve.aclose()
        if self.fleet is not None:
            await self.fleet.aclose()
        if self.router is not None:
            await self.router.aclose()
        if self.access is not None:
            self.access.stop()
        if self.group is not None:
            self.group.leave()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            origin = header(scope, b"origin") if self.cors.enabled else None
            if origin is not None and is_cors_path(scope["path"], INFERENCE_PATHS):
                if scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method") is not None:
                    await self._preflight(scope, origin, send)
                    return
                send = _adding(send, self.cors.response_headers(origin))
            try:
                await self._http(scope, receive, send)
            except PdproxyError as e:
                await send_error(send, e)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _preflight(self, scope: Scope, origin: bytes, send: Send) -> None:
        """A browser asks whether it may send its request (CORS): 204 with what is allowed."""
        try:
            method = header(scope, b"access-control-request-method") or b""
            allowed = self.cors.preflight(origin, method, header(scope, b"access-control-request-headers"))
        except PdproxyError as e:
            await send_error(send, e)
            return
        await send({"type": "http.response.start", "status": 204, "headers": allowed})
        await send({"type": "http.response.body", "body": b""})

    @property
    def in_flight(self) -> int:
        """Inference requests being served now, by the edge and by this app (one global count)."""
        return self.router.serving if self.router is not None else 0

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.router is None or self.fleet is None:  # a server without lifespan support
            await self.startup()
        router, fleet = self.router, self.fleet
        assert router is not None
        assert fleet is not None
        _take_peer(scope, trusted=self.behind_edge, https=self.settings.ssl)
        path, method = scope["path"], scope["method"]
        if method == "POST" and (path in INFERENCE_PATHS or path.startswith("/v1/")):
            self.keys.check_inference(scope["headers"])
            router.enter_request()  # Draining, or ProxyOverloaded at the global cap
            try:
                await self._forward(router, scope, receive, send, path)
            finally:
                router.leave_request()
            return
        if (method, path) == ("POST", "/drain"):
            self.keys.check_admin(scope["headers"])
            self.drain()
            await send_json(send, 202, {"status": "draining", "in_flight": self.in_flight})
            return
        route = self._admin.get((method, path))
        if route is not None:
            if route.path == "/nodes/add":
                self.keys.check_registration(scope["headers"], (scope.get("client") or (None,))[0])
            else:
                self.keys.check_admin(scope["headers"])
            status, payload = await route.handler(fleet, scope, receive)
            await send_json(send, status, payload)
            return
        if path in self._admin_paths or path in INFERENCE_PATHS:
            raise MethodNotAllowed(f"{method} is not allowed on {path}")
        if (method, path) == ("HEAD", "/health"):  # load balancers' liveness probes
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": b""})
            return
        if method != "GET":
            raise NotFound(f"no route for {method} {path}")
        if path == "/v1/models":
            self.keys.check_inference(scope["headers"])
            await send_json(send, 200, _model_list(router))
        elif path.startswith("/v1/models/"):
            self.keys.check_inference(scope["headers"])
            await send_json(send, 200, _model_card(router, path.removeprefix("/v1/models/")))
        elif path == "/health":
            await send_json(send, 200, {"status": "healthy"})
        elif path == "/ready":
            await self._ready(router, send)
        elif path == "/dashboard":  # a static page: its data is what the keys guard
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
            await send({"type": "http.response.body", "body": dashboard.PAGE})
        elif path == "/dashboard/data":
            self.keys.check_admin(scope["headers"])
            await send_json(send, 200, dashboard.data(self))
        elif path == "/metrics":
            self.keys.check_admin(scope["headers"])
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", CONTENT_TYPE)]})
            await send({"type": "http.response.body", "body": render(self.metrics)})
        elif path == "/usage":
            self.keys.check_admin(scope["headers"])
            await send_json(send, 200, tenant_usage(router))
        elif path == "/openapi.json":
            await send_json(send, 200, schema())
        else:
            raise NotFound(f"no route for {path}")

    async def _forward(self, router: Router, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        await proxy.forward(
            router,
            self.settings.max_body_size,
            scope,
            receive,
            send,
            require_model=path not in INFERENCE_PATHS,
            distserve=self.distserve,
            body_timeout=self.settings.body_timeout,
            access=self.access,
        )

    def drain(self, initiator: bool = True) -> None:
        """Stops taking new requests; once those in flight are done (or ``drain_timeout`` has
        passed) a served proxy exits, cleanly. In a worker group every worker drains, and the
        one asked (the ``initiator``) ends the group once the whole group is idle."""
        self.draining = True
        if self.router is not None:
            self.router.start_draining()
        if self.group is not None and initiator:
            self.group.table.set_draining()
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._finish_drain(initiator))

    async def _finish_drain(self, initiator: bool) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout):
                # The edge's requests and other workers' show only as counts: poll them.
                while self.in_flight or (self.group is not None and self._group_in_flight()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        log.info("drained (%d request(s) still in flight)", self.in_flight)
        self.drained.set()
        if self.exit_when_drained and initiator:
            # granian's main process stops the workers gracefully and exits 0.
            os.kill(os.getppid(), signal.SIGTERM)

    def _group_in_flight(self) -> int:
        """Requests in flight on any node, from any worker of the group."""
        assert self.router is not None
        return sum(n["in_flight"] for n in self.router.nodes())

    async def _ready(self, router: Router, send: Send) -> None:
        """Ready when a request could be routed now: a healthy node; with DistServe, a healthy
        prefill node and a healthy decode node."""
        healthy = [n["role"] for n in router.nodes() if n["state"] == "healthy"]
        needed = ("prefill", "decode") if self.distserve is not None else ("hybrid",)
        if self.distserve is not None and self.settings.dummy_prefill:
            needed = ("decode",)
        ready = all(role in healthy for role in needed) and not self.draining
        body = {"status": "ready" if ready else "not ready", "routable_nodes": len(healthy), "needs": list(needed)}
        await send_json(send, 200 if ready else 503, body)

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


def _adding(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """``send`` with ``headers`` added to the response's head."""
    if not headers:
        return send

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


#: How the Rust edge tells the control plane the client's address (its own peer is the edge).
PEER_HEADER = b"x-pdproxy-peer"


def _take_peer(scope: Scope, trusted: bool, https: bool) -> None:
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
    for node in router.nodes():
        if node["state"] == "healthy":
            seen.extend(m for m in node["models"] if m not in seen)
    return seen


def _card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "pdproxy"}


def _model_list(router: Router) -> dict[str, Any]:
    """The OpenAI ``ModelList`` of every model some healthy node serves."""
    return {"object": "list", "data": [_card(m) for m in _served_models(router)]}


def _model_card(router: Router, model: str) -> dict[str, Any]:
    """OpenAI's ``GET /v1/models/{model}`` (a model id may hold slashes)."""
    if model not in _served_models(router):
        raise ModelNotFound(f"the model `{model}` does not exist")
    return _card(model)


def create_app(settings: Settings | None = None) -> ProxyApp:
    return ProxyApp(settings or Settings())


def app_from_environment() -> ProxyApp:
    """The factory granian's workers call: settings come from `pdproxy serve` via the environment."""
    raw: Any = os.environ.get(SETTINGS_ENV)
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

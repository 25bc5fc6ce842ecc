"""The fleet: the nodes the proxy serves and everything kept about them besides the data
plane's table: how each registered (for LMDeploy-compatible status and the state file), its
lease, its health. Every way in (the CLI's --node, /nodes/*, the state file) goes through
here, so a node is checked, tracked and saved the same way whichever door it came through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from . import _pdproxy, background, state_file
from .config import Settings
from .errors import InvalidNode, NodeNotFound, UpstreamError
from .health import HealthChecker
from .router import Router
from .urls import check_node_url, parse_networks

log = logging.getLogger("pdproxy.fleet")

#: LMDeploy's EngineRole values, as its tooling reads and sends them.
ROLE_NUMBERS = {"hybrid": 1, "prefill": 2, "decode": 3}
#: How often leases are checked.
LEASE_TICK = 1.0


@dataclass
class Registration:
    url: str
    models: list[str] | None = None
    role: str = "hybrid"
    speed: float | None = None
    max_concurrency: int | None = None
    api_key: str | None = None
    lease_ttl: float | None = None
    lease_expires: float | None = None
    #: SGLang prefill nodes: the port of their bootstrap server.
    bootstrap_port: int | None = None

    def saved(self) -> dict[str, Any]:
        out = asdict(self)
        del out["lease_expires"]  # a reloaded lease starts over
        return out


class TerminateFailed(UpstreamError):
    """The node did not confirm its termination (it was removed all the same)."""

    code = "terminate_failed"


class Fleet:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.registrations: dict[str, Registration] = {}
        self._allowed = parse_networks(settings.allow_node_cidrs)
        self.health = HealthChecker(
            router,
            interval=settings.health_interval,
            timeout=settings.health_timeout,
            fall=settings.health_fall,
            rise=settings.health_rise,
            remove_after=settings.health_remove_after,
            on_remove=self._remove_quietly,
        )
        self._session: aiohttp.ClientSession | None = None
        self._lease_task: asyncio.Task[None] | None = None
        #: The disaggregation flow, when serving with DistServe (for the management API).
        self.distserve: Any = None
        #: Called with a node's URL once it is removed (links and sessions to clean up).
        self.on_removed: list[Callable[[str], None]] = []

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.admin_timeout))
        await self.health.start()
        saved = state_file.load(self.settings.state_file) if self.settings.state_file else []
        for entry in saved:
            try:
                await self.add(**{k: v for k, v in entry.items() if k in Registration.__dataclass_fields__})
            except (InvalidNode, TypeError) as e:
                log.error("saved node %s not restored: %s", entry.get("url"), e)
        for url in self.settings.nodes:
            await self.add(url)
        self._lease_task = background.start(self._expire_leases(), "pdproxy-leases")

    async def aclose(self) -> None:
        await background.stop(self._lease_task)
        await self.health.aclose()
        if self._session is not None:
            await self._session.close()

    async def add(
        self,
        url: str,
        models: list[str] | None = None,
        role: str = "hybrid",
        speed: float | None = None,
        max_concurrency: int | None = None,
        api_key: str | None = None,
        lease_ttl: float | None = None,
        bootstrap_port: int | None = None,
    ) -> tuple[Registration, bool]:
        """Adds a node, or updates (and renews the lease of) a registered one. Returns its
        registration and whether it is new."""
        await check_node_url(url, self._allowed)
        if lease_ttl is not None and not lease_ttl > 0:
            raise InvalidNode(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        normalized = self.router.add_node(
            url, models, role=role, speed=speed, max_concurrency=max_concurrency, api_key=api_key
        )
        created = normalized not in self.registrations
        expires = time.monotonic() + lease_ttl if lease_ttl is not None else None
        registration = Registration(
            normalized, models, role, speed, max_concurrency, api_key, lease_ttl, expires, bootstrap_port
        )
        self.registrations[normalized] = registration
        if not created and self.state_of(normalized) == "draining" and lease_ttl is not None:
            self.router.set_node_state(normalized, "healthy")  # a renewed lease ends the drain
        self.health.track(normalized, api_key)
        self._save()
        log.info("node %s %s (%s)", normalized, "added" if created else "updated", role)
        return registration, created

    def remove(self, url: str) -> str:
        """Removes a node everywhere. Raises ``NodeNotFound``."""
        normalized = self.router.remove_node(url)
        self.registrations.pop(normalized, None)
        self.health.forget(normalized)
        self._save()
        for hook in self.on_removed:
            hook(normalized)
        log.info("node %s removed", normalized)
        return normalized

    async def terminate(self, url: str) -> str:
        """Asks the node to stop (its ``/terminate``), then removes it. Raises ``NodeNotFound``,
        or ``TerminateFailed`` when the node did not confirm (it is removed all the same)."""
        normalized = self.lookup(url)
        registration = self.registrations.get(normalized)
        key = registration.api_key if registration else None
        headers = {"authorization": f"Bearer {key}"} if key else {}
        failure: str | None = None
        assert self._session is not None
        try:
            async with self._session.get(f"{normalized}/terminate", headers=headers, allow_redirects=False) as r:
                if r.status != 200:
                    failure = f"the node answered /terminate with {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            failure = f"the node could not be reached ({type(e).__name__})"
        self.remove(normalized)
        if failure is not None:
            raise TerminateFailed(f"node {normalized} was removed but did not confirm its termination: {failure}")
        return normalized

    def api_key_of(self, url: str) -> str | None:
        registration = self.registrations.get(url)
        return registration.api_key if registration else None

    def bootstrap_port_of(self, url: str) -> int | None:
        registration = self.registrations.get(url)
        return registration.bootstrap_port if registration else None

    def lookup(self, url: str) -> str:
        """The normalised URL of a registered node. Raises ``NodeNotFound``."""
        wanted = _pdproxy.Router.normalize_url(url)
        for node in self.router.nodes():
            if node["url"] == wanted:
                return str(node["url"])
        raise NodeNotFound(f"no node {url} is registered")

    def state_of(self, url: str) -> str | None:
        return next((n["state"] for n in self.router.nodes() if n["url"] == url), None)

    def status(self) -> dict[str, dict[str, Any]]:
        """Every node, keyed by URL: LMDeploy's keys (role as its integer, models, unfinished,
        latency, speed) and pdproxy's."""
        out: dict[str, dict[str, Any]] = {}
        now = time.monotonic()
        for node in self.router.nodes():
            url = node["url"]
            registration = self.registrations.get(url)
            health = self.health.nodes.get(url)
            lease = None
            if registration is not None and registration.lease_expires is not None:
                lease = {"ttl": registration.lease_ttl, "expires_in": round(registration.lease_expires - now, 3)}
            out[url] = {
                "role": ROLE_NUMBERS[node["role"]],
                "models": node["models"],
                "unfinished": node["in_flight"],
                "latency": node["recent_latencies"],
                "speed": node["speed"],
                "role_name": node["role"],
                "state": node["state"],
                "circuit": node["circuit"],
                "health": health.summary() if health else None,
                "in_flight": node["in_flight"],
                "max_concurrency": node["max_concurrency"],
                "requests": node["requests"],
                "succeeded": node["succeeded"],
                "failed": node["failed"],
                "cancelled": node["cancelled"],
                "mean_latency": node["mean_latency"],
                "mean_ttft": node["mean_ttft"],
                "generation": node["generation"],
                "lease": lease,
            }
            if self.distserve is not None and self.distserve.protocol == "lmdeploy":
                out[url]["links"] = [
                    link for link in self.distserve.links.status() if url in (link["prefill"], link["decode"])
                ]
                out[url]["preserved_sessions"] = sum(
                    1 for e in self.distserve.ledger.entries.values() if e.prefill == url
                )
        return out

    def _remove_quietly(self, url: str) -> None:
        with contextlib.suppress(NodeNotFound):
            self.remove(url)

    def _save(self) -> None:
        if self.settings.state_file:
            try:
                state_file.save(self.settings.state_file, [r.saved() for r in self.registrations.values()])
            except OSError as e:
                log.error("state file %s not written: %s", self.settings.state_file, e)

    async def _expire_leases(self) -> None:
        """A node whose lease ran out is drained; once its requests are done (or after another
        lease period) it is removed."""
        while True:
            await asyncio.sleep(LEASE_TICK)
            now = time.monotonic()
            in_flight = {n["url"]: n["in_flight"] for n in self.router.nodes()}
            for url, registration in list(self.registrations.items()):
                if registration.lease_expires is None or now < registration.lease_expires:
                    continue
                if self.state_of(url) != "draining":
                    log.warning("node %s: lease expired; draining it", url)
                    self.router.set_node_state(url, "draining")
                overdue = now - registration.lease_expires >= (registration.lease_ttl or 0)
                if in_flight.get(url, 0) == 0 or overdue:
                    self._remove_quietly(url)

"""The fleet: the nodes the proxy serves and everything kept about them besides the data
plane's table: how each registered (for LMDeploy-compatible status and the state file), its
lease, its health. Every way in (the CLI's --node, /nodes/*, the state file) goes through
here, so a node is checked, tracked and saved the same way whichever door it came through.

With a shared ``Membership`` (the workers of a group, or replicas sharing Redis), a change is
written there first and every process applies the membership's snapshots, its own changes
included: one path, whichever process made the change. Leases then live in the membership,
which drops an expired registration everywhere at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from . import _pdproxy, background, state_file
from .config import Settings
from .engine_scraper import EngineScraper
from .errors import InvalidNode, NodeNotFound, UpstreamError
from .group import Group
from .health import HealthChecker
from .membership import Entry, Membership, RegistryUnavailable
from .router import Router
from .tls import node_session
from .urls import check_node_url, parse_networks

log = logging.getLogger("pdproxy.fleet")

#: LMDeploy's EngineRole values, as its tooling reads and sends them.
ROLE_NUMBERS = {"hybrid": 1, "prefill": 2, "decode": 3}
#: How often leases are checked.
LEASE_TICK = 1.0
#: The largest cap on a node's requests in flight (the data plane counts in 32 bits).
MAX_CONCURRENCY = 2**32 - 1
#: Longest wait between attempts to register a configured node while the registry is down.
REGISTER_RETRY_MAX = 10.0


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

    @classmethod
    def from_entry(cls, entry: Entry) -> Registration:
        """A registration from a membership entry (the lease as it has left)."""
        known = {k: v for k, v in entry.items() if k in cls.__dataclass_fields__ and k != "lease_expires"}
        remaining = entry.get("lease_remaining")
        expires = time.monotonic() + remaining if isinstance(remaining, int | float) else None
        return cls(**known, lease_expires=expires)


class TerminateFailed(UpstreamError):
    """The node did not confirm its termination (it was removed all the same)."""

    code = "terminate_failed"


class Fleet:
    def __init__(self, router: Router, settings: Settings, membership: Membership | None = None) -> None:
        self.router = router
        self.settings = settings
        self.membership = membership
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
            ca_file=settings.node_ca_file,
        )
        #: Reads the engines' /metrics (where health checks run: in a worker group, the leader).
        self.engines = EngineScraper(
            router,
            interval=settings.engine_metrics_interval,
            timeout=settings.engine_metrics_timeout,
            concurrency=settings.engine_metrics_concurrency,
            max_bytes=settings.engine_metrics_max_bytes,
            api_key_of=self.api_key_of,
            ca_file=settings.node_ca_file,
        )
        self._session: aiohttp.ClientSession | None = None
        self._lease_task: asyncio.Task[None] | None = None
        #: The disaggregation flow, when serving with DistServe (for the management API).
        self.distserve: Any = None
        #: This worker's group, when serving with several workers (for the management API).
        self.group: Group | None = None
        #: Called with a node's URL once it is removed (links and sessions to clean up).
        self.on_removed: list[Callable[[str], None]] = []
        self._chores: set[asyncio.Task[None]] = set()

    async def start(self, check_health: bool = True) -> None:
        """Loads the saved and configured nodes and starts the background work; health checks
        only with ``check_health`` (in a worker group the leader starts them, ``start_health``)."""
        self._session = node_session(self.settings.node_ca_file, self.settings.admin_timeout)
        if check_health:
            await self.start_health()
        if self.membership is not None:
            await self.membership.start(self.apply)
        restore = self.settings.state_file and not self.settings.disable_cache_status
        saved = state_file.load(self.settings.state_file) if restore else []
        initial = [{k: v for k, v in e.items() if k in Registration.__dataclass_fields__} for e in saved]
        initial += [spec.registration() for spec in self.settings.node_specs()]
        for fields in initial:
            try:
                await self.add(**fields, discover=False)  # all asked at once, below
            except RegistryUnavailable:
                # Serve with what the registry last said, and register this node once it is back.
                self._background(self._register_when_available(fields), f"pdproxy-register {fields.get('url')}")
            except (InvalidNode, TypeError) as e:
                log.error("node %s not added: %s", fields.get("url"), e)
        # The models of nodes that declared none, before serving (they get no traffic until known).
        await self.router.discover()
        if self.membership is None:
            self._lease_task = background.start(self._expire_leases(), "pdproxy-leases")

    async def start_health(self) -> None:
        """Starts the health checks and the engines' readings (once; a worker that becomes its
        group's leader)."""
        if not self.health.running:
            await self.health.start()
        if not self.engines.running and self.settings.engine_metrics_interval > 0:
            await self.engines.start()

    async def aclose(self) -> None:
        await background.stop(self._lease_task)
        for task in list(self._chores):
            await background.stop(task)
        if self.membership is not None:
            await self.membership.aclose()
        await self.health.aclose()
        await self.engines.aclose()
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
        discover: bool = True,
    ) -> tuple[Registration, bool]:
        """Adds a node, or updates (and renews the lease of) a registered one. Returns its
        registration and whether it is new; a node without models is asked for them first
        (``discover``)."""
        address = await self._checked_address(url)
        if lease_ttl is not None and not lease_ttl > 0:
            raise InvalidNode(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        if max_concurrency is not None and not 0 <= max_concurrency <= MAX_CONCURRENCY:
            raise InvalidNode(
                f"max_concurrency must be between 0 (no cap) and {MAX_CONCURRENCY}, got {max_concurrency}"
            )
        if bootstrap_port is not None and not 0 < bootstrap_port < 65536:
            raise InvalidNode(f"bootstrap_port must be a port number, got {bootstrap_port}")
        normalized = _pdproxy.Router.normalize_url(url)
        expires = time.monotonic() + lease_ttl if lease_ttl is not None else None
        registration = Registration(
            normalized, models, role, speed, max_concurrency, api_key, lease_ttl, expires, bootstrap_port
        )
        # Refused here (InvalidNode), before any other process sees it.
        _pdproxy.Router.check_node(registration.url, registration.role, registration.speed, registration.api_key)
        created = normalized not in self.registrations
        if self.membership is not None:
            await self.membership.put(registration.saved())
        self._add_here(registration, address)
        self._save()
        if models is None and discover:
            # Answered with the node's models when it tells them at once (it has no traffic till then).
            await self.router.discover(normalized)
        return registration, created

    async def _checked_address(self, url: str) -> str:
        """The address ``url`` is reached at, once checked (see ``urls.check_node_url``)."""
        return await check_node_url(url, self._allowed, own_port=self.settings.port)

    def _add_here(self, registration: Registration, address: str) -> None:
        """Adds or updates the node in this process, reached at ``address`` (checked)."""
        r = registration
        created = r.url not in self.registrations
        self.router.add_node(
            r.url,
            r.models,
            role=r.role,
            speed=r.speed,
            max_concurrency=r.max_concurrency,
            api_key=r.api_key,
            bootstrap_port=r.bootstrap_port,
            address=address,
        )
        self.registrations[r.url] = r
        if not created and self.state_of(r.url) == "draining" and r.lease_ttl is not None:
            self.router.set_node_state(r.url, "healthy")  # a renewed lease ends the drain
        self.health.track(r.url, r.api_key)
        log.info("node %s %s (%s)", r.url, "added" if created else "updated", r.role)

    def _remove_here(self, url: str) -> str:
        """Removes the node from this process. Raises ``NodeNotFound``."""
        normalized = self.router.remove_node(url)
        for hook in self.on_removed:  # while its registration (its API key) is still known
            hook(normalized)
        self.registrations.pop(normalized, None)
        self.health.forget(normalized)
        log.info("node %s removed", normalized)
        return normalized

    async def apply(self, entries: list[Entry]) -> None:
        """Makes this process's nodes those of a membership snapshot."""
        wanted = {}
        for entry in entries:
            try:
                registration = Registration.from_entry(entry)
                registration.url = _pdproxy.Router.normalize_url(registration.url)
            except (TypeError, ValueError) as e:
                log.error("membership entry %r ignored: %s", entry.get("url"), e)
                continue
            wanted[registration.url] = registration
        for url in [u for u in self.registrations if u not in wanted]:
            with contextlib.suppress(NodeNotFound):
                self._remove_here(url)
        for url, registration in wanted.items():
            known = self.registrations.get(url)
            if known is not None and _same(known, registration):
                known.lease_expires = registration.lease_expires
                continue
            try:
                # Entries from a shared registry pass the same checks as any registration.
                address = await self._checked_address(url)
                self._add_here(registration, address)
            except (InvalidNode, ValueError) as e:
                log.error("membership entry %s not applied: %s", url, e)
        self.router.refresh_bindings()
        self._save()

    async def remove(self, url: str) -> str:
        """Removes a node everywhere. Raises ``NodeNotFound``."""
        normalized = self.lookup(url)
        if self.membership is not None:
            await self.membership.delete(normalized)
        with contextlib.suppress(NodeNotFound):  # a snapshot may have removed it meanwhile
            self._remove_here(normalized)
        self._save()
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
        await self.remove(normalized)
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
        health = self.health_summaries()
        for node in self.router.nodes():
            url = node["url"]
            registration = self.registrations.get(url)
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
                "health": health.get(url),
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
                "engine": {
                    **node["engine"],
                    "dialect": self.engines.dialects.get(url),
                    "last_error": self.engines.errors.get(url),
                },
                "address": node["address"],
            }
            if self.distserve is not None and self.distserve.protocol == "lmdeploy":
                out[url]["links"] = [
                    link for link in self.distserve.links.status() if url in (link["prefill"], link["decode"])
                ]
                out[url]["preserved_sessions"] = sum(
                    1 for e in self.distserve.ledger.entries.values() if e.prefill == url
                )
        return out

    def health_summaries(self) -> dict[str, dict[str, Any]]:
        """What the health checks know of each node: this process's, or in a worker group the
        leader's (as it last published them, `publish_health`)."""
        if self.health.running:
            return {url: h.summary() for url, h in self.health.nodes.items()}
        if self.group is not None:
            return {e["url"]: e["health"] for e in state_file.load(str(self.group.health_path)) if "health" in e}
        return {}

    def publish_health(self) -> None:
        """The leader's round: its health view, for the other workers' status."""
        assert self.group is not None
        summaries = [{"url": url, "health": h} for url, h in self.health_summaries().items()]
        state_file.save(str(self.group.health_path), summaries)

    def _remove_quietly(self, url: str) -> None:
        """Removes a node in the background (the health checker's verdict)."""

        async def remove() -> None:
            with contextlib.suppress(NodeNotFound, RegistryUnavailable):
                await self.remove(url)

        self._background(remove(), f"pdproxy-remove {url}")

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Runs ``work`` until it ends or the fleet closes."""
        task = background.start(work, name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _register_when_available(self, fields: dict[str, Any]) -> None:
        delay = 1.0
        while True:
            await asyncio.sleep(delay)
            try:
                await self.add(**fields)
            except RegistryUnavailable:
                delay = min(delay * 2, REGISTER_RETRY_MAX)
                continue
            except (InvalidNode, TypeError) as e:
                log.error("node %s not added: %s", fields.get("url"), e)
            return

    def _save(self) -> None:
        # In a worker group only the leader writes it.
        if self.settings.state_file and (self.group is None or self.group.leader):
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
                    with contextlib.suppress(NodeNotFound):
                        await self.remove(url)


def _same(a: Registration, b: Registration) -> bool:
    """The same registration, leases' countdowns aside."""
    return a.saved() == b.saved()

"""The supervisor: the control plane's parts in one process (router, fleet, worker group, PD
flow, tenants, metrics), their start and stop in order, the drain, the group
leader's chores and readiness. The ASGI app (``app.py``) only dispatches requests to them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdproxy import _background
from pdproxy.config.settings import Settings
from pdproxy.fleet.fleet import Fleet
from pdproxy.fleet.membership import Membership
from pdproxy.fleet.membership import from_url as membership_from_url
from pdproxy.fleet.membership.group_file import GroupFileMembership
from pdproxy.observability.metrics import registry_for
from pdproxy.pd import PdAdapter, make_adapter
from pdproxy.router import Router
from pdproxy.server.group import GROUP_ENV, Group
from pdproxy.server.tenants import TenantsFile, UsageSync

__all__ = ["Supervisor"]

log = logging.getLogger("pdproxy")

#: Allocations between two young-generation collections when serving (CPython's default: 700).
GC_THRESHOLD = 50_000


class Supervisor:
    """Owns what one process of the proxy runs. The router and the fleet are built in
    ``start``, inside the worker process, so that the data plane's threads start after any fork."""

    def __init__(self, settings: Settings, *, tune_gc: bool = False, exit_when_drained: bool = False) -> None:
        self.settings = settings
        #: Only when serving: an embedding process's garbage collector is not ours to tune.
        self.tune_gc = tune_gc
        #: Only when serving under `pdproxy serve --edge granian`: a finished drain ends the process.
        self.exit_when_drained = exit_when_drained
        self.router: Router | None = None
        self.fleet: Fleet | None = None
        #: The disaggregation flow, when serving with DistServe.
        self.pd: PdAdapter | None = None
        self.metrics: CollectorRegistry | None = None
        self.group: Group | None = None
        self.tenants: TenantsFile | None = None
        self.usage_sync: UsageSync | None = None
        #: The drain in progress; ``drained`` is set once it is over.
        self.draining = False
        self.drained = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self._group_task: asyncio.Task[None] | None = None
        self._health_watch: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self.router is not None and self.fleet is not None

    async def start(self) -> None:
        if self.tune_gc:
            # Per request the hot path allocates a few short-lived containers (futures, dicts);
            # with the default threshold the cycle collector runs every few hundred requests
            # and scans everything. Startup objects are frozen out of its reach instead.
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        self.metrics = registry_for(self)
        group_dir = os.environ.get(GROUP_ENV)
        self.group = Group(Path(group_dir)) if group_dir else None
        group = (self.group.table, self.group.index) if self.group else None
        # The fleet adds the configured nodes, so that they are checked and tracked like any other.
        self.router = Router(settings=self.settings.replace(nodes=()), group=group)
        await self.router.start()
        if self.settings.tenants.file:
            self.tenants = TenantsFile(self.router, self.settings.tenants.file)
            self.tenants.start()
            if self.settings.membership.registry:
                s = self.settings
                self.usage_sync = UsageSync(
                    self.router,
                    s.membership.registry,
                    s.tenants.sync_interval,
                    s.membership.namespace,
                    s.membership.timeout,
                )
                await self.usage_sync.start()
        self.fleet = Fleet(self.router, self.settings, self._membership())
        self.fleet.group = self.group
        if self.settings.pd.serving_strategy == "DistServe":
            # Before the fleet starts, so that it sees every node the fleet adds and removes.
            self.pd = make_adapter(self.router, self.settings, self.fleet, self.group.directory if self.group else None)
            await self.pd.start()
            self.fleet.pd = self.pd
            self.fleet.on_removed.append(self.pd.node_removed)
        await self.fleet.start(check_health=self.group is None)
        self._health_watch = _background.start(self._watch_health(), "pdproxy-health-watch")
        if self.group is not None:
            self._group_task = _background.start(
                self.group.run(on_lead=self._lead, leader_tick=self._leader_tick, signal_tick=self._group_signals),
                "pdproxy-group",
            )
        log.info("pdproxy routing to %d node(s); policies %s", len(self.router.views()), self.router.policies)

    async def stop(self) -> None:
        if self.usage_sync is not None:
            await self.usage_sync.aclose()
        if self.tenants is not None:
            await self.tenants.aclose()
        await _background.stop(self._health_watch)
        await _background.stop(self._group_task)
        if self.pd is not None:
            await self.pd.aclose()
        if self.fleet is not None:
            await self.fleet.aclose()
        if self.router is not None:
            await self.router.aclose()
        if self.group is not None:
            self.group.leave()

    def _membership(self) -> Membership | None:
        """Where node membership is shared: Redis (--registry), else the worker group's document."""
        if self.settings.membership.registry:
            return membership_from_url(self.settings.membership)
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
        if self.pd is not None:
            await self.pd.adopt_orphans()

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
            await asyncio.sleep(self.settings.health.interval)
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

    @property
    def in_flight(self) -> int:
        """Inference requests being served now, by the edge and by this app (one global count)."""
        return self.router.serving if self.router is not None else 0

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
            async with asyncio.timeout(self.settings.server.drain_timeout):
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
        return sum(n.in_flight for n in self.router.views())

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Ready when a request could be routed now: a healthy node; with DistServe, a healthy
        prefill node and a healthy decode node. Returns the verdict and what ``/ready`` says."""
        assert self.router is not None
        healthy = [n.role for n in self.router.views() if n.state == "healthy"]
        needed = ("prefill", "decode") if self.pd is not None else ("hybrid",)
        if self.pd is not None and self.settings.pd.dummy_prefill:
            needed = ("decode",)
        ready = all(role in healthy for role in needed) and not self.draining
        return ready, {
            "status": "ready" if ready else "not ready",
            "routable_nodes": len(healthy),
            "needs": list(needed),
        }

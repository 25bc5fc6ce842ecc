"""The fleet: how nodes come and go. What a node is lives in the data plane's node table
(``Router.node(url)``, one ``NodeRecord``); the fleet keeps only what is its own: when each
lease runs out, and the state file. Every way in (the CLI's --node, /nodes/*, the state file)
goes through here, so a node is checked, tracked and saved the same way whichever door it
came through.

With a shared ``Membership`` (the workers of a group, or replicas sharing Redis), a change is
written there first and every process applies the membership's snapshots, its own changes
included: one path, whichever process made the change. Leases then live in the membership,
which drops an expired registration everywhere at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NotRequired, TypedDict

import aiohttp

from pdproxy import _background, _pdproxy
from pdproxy._background import Work
from pdproxy._json_types import JsonValue
from pdproxy.config.settings import Settings
from pdproxy.errors import (
    ConfigError,
    InvalidNode,
    NodeNotFound,
    NodeUnresolvable,
    RegistryUnavailable,
    TerminateFailed,
)
from pdproxy.fleet import state_file
from pdproxy.fleet.engine_scraper import EngineScraper
from pdproxy.fleet.health import HealthChecker, HealthSummary
from pdproxy.fleet.membership import Entry, Membership
from pdproxy.fleet.node_record import NodeRecord, configured_nodes
from pdproxy.fleet.node_snapshot import EngineReport, engine_report
from pdproxy.fleet.node_sources import FoundBy, NodeSource, sources_for
from pdproxy.fleet.tls import node_session
from pdproxy.fleet.urls import parse_networks
from pdproxy.kv_events import chat_template, index_options
from pdproxy.kv_events.follower import KvEventFollower, KvEventsPlan
from pdproxy.pd import PdAdapter
from pdproxy.router import Router
from pdproxy.server.group import Group

if TYPE_CHECKING:
    from pdproxy._pdproxy import NodeInfo, NodeView
    from pdproxy.pd.links import LinkSummary

log = logging.getLogger("pdproxy.fleet")

#: LMDeploy's EngineRole values, as its tooling reads and sends them.
ROLE_NUMBERS = {"hybrid": 1, "prefill": 2, "decode": 3}
#: How often leases are checked.
LEASE_TICK = 1.0
#: Longest wait between attempts to register a configured node while the registry is down.
REGISTER_RETRY_MAX = 10.0


class EngineStatus(EngineReport):
    """A node's engine in ``/nodes/status``: the data plane's reading (``_pdproxy.EngineReading``),
    then the scraper's dialect and last error."""

    dialect: str | None
    last_error: str | None


class LeaseStatus(TypedDict):
    ttl: float | None
    expires_in: float


class NodeStatusRow(TypedDict):
    """One node in ``/nodes/status``, every key in the order it is sent: the record's shown
    fields (``NodeRecord.shown_fields``), LMDeploy's keys (role as its integer, models,
    unfinished, latency; speed is among the record's), then pdproxy's (health, counts, lease,
    engine, where it is reached and who found it); ``links`` and ``preserved_sessions`` only
    with a flow that keeps them (``PdAdapter.node_status``)."""

    speed: float | None
    max_concurrency: int | None
    bootstrap_port: int | None
    lease_ttl: float | None
    labels: dict[str, str]
    role: int
    models: list[str]
    unfinished: int
    latency: list[float]
    role_name: str
    state: str | None
    circuit: str
    health: HealthSummary | JsonValue
    in_flight: int
    requests: int
    succeeded: int
    failed: int
    client_errors: int
    cancelled: int
    mean_latency: float | None
    mean_ttft: float | None
    generation: int
    lease: LeaseStatus | None
    engine: EngineStatus
    address: str | None
    found_by: JsonValue
    kv_events: dict[str, object] | None
    replicas: ReplicaLoad | None
    links: NotRequired[list[LinkSummary]]
    preserved_sessions: NotRequired[int]


class ReplicaLoad(TypedDict):
    """The other replicas' load on a node, as they last said (``--replica-listen``)."""

    #: Replicas whose last datagram is fresh (the same for every node).
    peers: int
    #: Their requests here still waiting for their first byte.
    peer_unanswered: int
    #: The prefill they expect the node to still owe them.
    peer_prefill_ms_left: float
    #: Their requests here not yet ended (decoding, most of them).
    peer_in_flight: int


class Fleet:
    def __init__(self, router: Router, settings: Settings, membership: Membership | None = None) -> None:
        self.router = router
        self.settings = settings
        self.membership = membership
        #: When each leased node's lease runs out (monotonic seconds).
        self.leases: dict[str, float] = {}
        #: The nodes a node source found (Kubernetes, DNS), by URL: the source and where it
        #: found the node. They live in this process only: not saved, not shared, and removed
        #: by their source alone. A node added by hand is never one of them.
        self.found: dict[str, FoundBy] = {}
        #: Where nodes may be (the data plane resolves a node's host by them as it adds it).
        self.address_rules = _pdproxy.NodeAddressRules(
            [str(network) for network in parse_networks(settings.security.allow_node_cidrs)], settings.server.port
        )
        self.health = HealthChecker(
            router,
            settings.health,
            on_remove=self._remove_quietly,
            ca_file=settings.security.node_ca_file,
        )
        #: Reads the engines' /metrics (where health checks run: in a worker group, the leader).
        self.engines = EngineScraper(
            router,
            settings.engine_metrics,
            api_key_of=self.api_key_of,
            on_sleep=self.health.engine_asleep,
            ca_file=settings.security.node_ca_file,
        )
        #: Follows the engines' KV events into the data plane's index (``--kv-events``), in
        #: every worker: each has its own data plane.
        self.kv_events: KvEventFollower | None = None
        #: Shares this replica's load on the nodes with the other replicas (``--replica-listen``),
        #: where the health checks run: in a worker group the leader, whose node counters every
        #: worker reads.
        self.replica_share: _pdproxy.ReplicaShare | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lease_task: asyncio.Task[None] | None = None
        #: The disaggregation flow, when serving with DistServe (for the management API).
        self.pd: PdAdapter | None = None
        #: This worker's group, when serving with several workers (for the management API).
        self.group: Group | None = None
        #: Called with a node's URL once it is removed (links and sessions to clean up).
        self.on_removed: list[Callable[[str], None]] = []
        self._chores: set[asyncio.Task[None]] = set()
        #: Where nodes are found by themselves (Kubernetes, DNS); started with the fleet.
        self.sources: list[NodeSource] = []

    async def start(self, check_health: bool = True) -> None:
        """Loads the saved and configured nodes and starts the background work; health checks
        only with ``check_health`` (in a worker group the leader starts them, ``start_health``)."""
        self._session = node_session(self.settings.security.node_ca_file, self.settings.timeouts.admin)
        if check_health:
            await self.start_health()
        if self.settings.kv.events:
            await self._follow_kv_events()
        if self.membership is not None:
            await self.membership.start(self.apply)
        restore = self.settings.server.state_file and not self.settings.server.disable_cache_status
        records = []
        for entry in state_file.load(self.settings.server.state_file) if restore else []:
            try:
                records.append(NodeRecord.of(entry, f"state file {self.settings.server.state_file}: node"))
            except ConfigError as e:
                log.error("%s; not added", e)
        configured = configured_nodes(self.settings)
        for record in (*records, *configured):
            try:
                await self.add(record, discover=False)  # all asked at once, below
            except RegistryUnavailable:
                # Serve with what the registry last said, and register this node once it is back.
                self._background(self._register_when_available(record), f"pdproxy-register {record.url}")
            except NodeUnresolvable as e:
                # A name that may resolve later (a service still coming up): keep trying.
                log.warning("node %s not added yet: %s; trying again", record.url, e)
                self._background(self._register_when_available(record), f"pdproxy-register {record.url}")
            except InvalidNode as e:
                if record in configured:  # the operator's own setting: stop rather than serve without it
                    raise ConfigError(f"--node: {e.message}") from None
                log.error("node %s not added: %s", record.url, e)
        self.sources = sources_for(self.settings)
        for source in self.sources:
            await source.start(self.put_found, self.drop_found, self.owns_found)
        # The models of nodes that declared none, before serving (they get no traffic until known).
        await self.router.discover()
        if self.membership is None:
            self._lease_task = _background.start(self._expire_leases(), "pdproxy-leases")

    async def start_health(self) -> None:
        """Starts the health checks and the engines' readings (once; a worker that becomes its
        group's leader)."""
        if not self.health.running:
            await self.health.start()
        if not self.engines.running and self.settings.engine_metrics.interval > 0:
            await self.engines.start()
        replicas = self.settings.replicas
        if self.replica_share is None and replicas.listen:
            self.replica_share = _pdproxy.ReplicaShare(
                self.router.core, replicas.listen, list(replicas.peers), replicas.interval_ms
            )
            log.info("sharing load with replicas %s from %s", ", ".join(replicas.peers), self.replica_share.listen)

    def session(self) -> aiohttp.ClientSession:
        """The session calls to the nodes go through (once started)."""
        assert self._session is not None
        return self._session

    async def _follow_kv_events(self) -> None:
        settings = self.settings
        self.router.core.start_kv_index(
            chat_template(settings.kv.chat_template),
            settings.kv.index_max_blocks,
            **index_options(settings.kv.tokenizer),  # type: ignore[arg-type]
        )
        plan = KvEventsPlan(
            settings.kv.events,
            settings.kv.events_replay or None,
            settings.kv.events_ranks,
            settings.kv.events_topic,
        )
        self.kv_events = KvEventFollower(self.router.core, plan, session_of=self.session)
        await self.kv_events.start()

    async def aclose(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.aclose()
        if self.replica_share is not None:
            self.replica_share.close()
        for source in self.sources:
            await source.aclose()
        await _background.stop(self._lease_task)
        for task in list(self._chores):
            await _background.stop(task)
        if self.membership is not None:
            await self.membership.aclose()
        await self.health.aclose()
        await self.engines.aclose()
        if self._session is not None:
            await self._session.close()

    async def add(self, record: NodeRecord, discover: bool = True) -> tuple[NodeView, bool]:
        """Adds a node, or updates (and renews the lease of) a registered one. Returns its view
        and whether it is new; a node without models is asked for them first (``discover``).
        A node a source found becomes one added by hand.

        ``record`` may be unchecked (``NodeRecord.unchecked``): the data plane checks it as it
        adds it, in one call that parses its URL, checks every rule, resolves its host and
        checks the addresses (``_pdproxy.Router.add_node``). With a shared membership the
        record is checked first (one more call), since the membership is written before."""
        record = self._keyed(record)
        address = None
        if self.membership is not None:
            url, address = await asyncio.to_thread(self.address_rules.check, record)
            record = record.model_copy(update={"url": url})
            await self.membership.put(record.saved())
        expires = time.monotonic() + record.lease_ttl if record.lease_ttl is not None else None
        view, created = await self._add_here(record, address, expires)
        self.found.pop(view.url, None)
        self._save()
        if record.models is None and discover:
            # Answered with the node's models when it tells them at once (it has no traffic till then).
            view = await self.router.discover(view.url) or view
        return view, created

    async def _add_here(
        self, record: NodeRecord, address: str | None, lease_expires: float | None
    ) -> tuple[NodeView, bool]:
        """Adds or updates the node in this process, reached at ``address`` when it was checked
        already, else at the address its host resolves to, once the rules pass."""
        rules = self.address_rules if address is None else None
        view, created = await self.router.register(
            record, address=address, rules=rules, end_drain=lease_expires is not None
        )
        url = view.url
        if lease_expires is None:
            self.leases.pop(url, None)
        else:
            self.leases[url] = lease_expires  # a renewed lease ended a drain (`end_drain`)
        self.health.track(url)
        log.info("node %s %s (%s)", url, "added" if created else "updated", record.role)
        return view, created

    def _remove_here(self, url: str) -> str:
        """Removes the node from this process. Raises ``NodeNotFound``."""
        normalized = self.lookup(url)
        for hook in self.on_removed:  # while the node (its API key) is still known
            hook(normalized)
        self.router.remove_node(normalized)
        self.leases.pop(normalized, None)
        self.found.pop(normalized, None)
        self.health.forget(normalized)
        log.info("node %s removed", normalized)
        return normalized

    async def apply(self, entries: list[Entry]) -> None:
        """Makes this process's nodes those of a membership snapshot."""
        wanted: dict[str, tuple[NodeRecord, float | None]] = {}
        for entry in entries:
            remaining = entry.get("lease_remaining")
            try:
                record = NodeRecord.of({k: v for k, v in entry.items() if k != "lease_remaining"}, "membership entry")
            except ConfigError as e:
                log.error("%s; ignored", e)
                continue
            expires = time.monotonic() + remaining if isinstance(remaining, int | float) else None
            wanted[record.url] = (record, expires)
        for url in [n.url for n in self.router.views() if n.url not in wanted and n.url not in self.found]:
            with contextlib.suppress(NodeNotFound):
                self._remove_here(url)
        for url, (record, expires) in wanted.items():
            self.found.pop(url, None)  # registered by hand somewhere: the membership's now
            if self._record_of(url) == record:
                if expires is not None:
                    self.leases[url] = expires
                continue
            try:
                # Entries from a shared registry pass the same checks as any registration.
                await self._add_here(record, None, expires)
            except (InvalidNode, ValueError) as e:
                log.error("membership entry %s not applied: %s", url, e)
        self.router.refresh_bindings()
        self._save()

    def _keyed(self, record: NodeRecord) -> NodeRecord:
        """``record`` with the key every node without its own is sent (``--node-api-key``)."""
        if record.api_key is None and self.settings.security.node_api_key:
            return record.model_copy(update={"api_key": self.settings.security.node_api_key})
        return record

    def _record_of(self, url: str) -> NodeRecord | None:
        """The record of the registered node ``url`` (what it declared), if any."""
        try:
            return NodeRecord.of_node(self.router.node(url))
        except NodeNotFound:
            return None

    async def put_found(self, record: NodeRecord, found_by: FoundBy) -> bool:
        """Adds or updates a node a source found; returns whether it did. A node registered
        another way (by hand, or by another source) stays as it is."""
        record = self._keyed(record)
        if self.state_of(record.url) is not None and not self.owns_found(record.url, found_by.source):
            return False
        try:
            _, address = await asyncio.to_thread(self.address_rules.check, record)
        except InvalidNode as e:
            log.error("%s: node %s not added: %s", found_by.describe(), record.url, e)
            return False
        # The node may have been registered by hand while its address was checked.
        if self.state_of(record.url) is not None and record.url not in self.found:
            return False
        self.found[record.url] = found_by
        if self._record_of(record.url) != record:
            await self._add_here(record, address, None)  # without models: discovery asks it at once
        return True

    def drop_found(self, url: str, source: str) -> bool:
        """Removes a node ``source`` found (and no one has registered since); returns whether it did."""
        if not self.owns_found(url, source):
            return False
        with contextlib.suppress(NodeNotFound):
            self._remove_here(url)
        self.found.pop(url, None)  # also when the node had left the table already
        return True

    def owns_found(self, url: str, source: str) -> bool:
        """Whether the node ``url`` is in this process as one ``source`` found."""
        owner = self.found.get(url)
        return owner is not None and owner.source == source

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
        key = self.api_key_of(normalized)
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
        node = self._node(url)
        return None if node is None else node["api_key"]

    def bootstrap_port_of(self, url: str) -> int | None:
        node = self._node(url)
        return None if node is None else node["bootstrap_port"]

    def _node(self, url: str) -> NodeInfo | None:
        """The registered node ``url`` (``None`` when it is not registered)."""
        try:
            return self.router.node(url)
        except NodeNotFound:
            return None

    def lookup(self, url: str) -> str:
        """The normalised URL of a registered node. Raises ``NodeNotFound``."""
        return self.router.node(url)["url"]

    def state_of(self, url: str) -> str | None:
        node = self._node(url)
        return None if node is None else node["state"]

    def status(self) -> dict[str, NodeStatusRow]:
        """Every node, keyed by URL: LMDeploy's keys (role as its integer, models, unfinished,
        latency, speed) and pdproxy's (the record's fields shown, health, counts, lease, engine)."""
        health = self.health_summaries()
        kv_events = self.kv_events.statuses() if self.kv_events is not None else None
        return {view.url: self._row(view, health, kv_events) for view in self.router.core.views()}

    def node_status(self, view: NodeView) -> NodeStatusRow:
        """One node as ``status`` shows it, from its view (``add``'s answer)."""
        kv_events = self.kv_events.statuses() if self.kv_events is not None else None
        return self._row(view, self.health_summaries(), kv_events)

    def _row(
        self,
        view: NodeView,
        health: dict[str, HealthSummary | JsonValue],
        kv_events: dict[str, dict[str, object]] | None,
    ) -> NodeStatusRow:
        url = view.url
        expires = self.leases.get(url)
        row = NodeStatusRow(
            speed=view.speed,
            max_concurrency=view.max_concurrency,
            bootstrap_port=view.bootstrap_port,
            lease_ttl=view.lease_ttl,
            labels=view.labels,
            role=ROLE_NUMBERS[view.role],
            models=view.models,
            unfinished=view.in_flight,
            latency=view.recent_latencies,
            role_name=view.role,
            state=view.state,
            circuit=view.circuit,
            health=health.get(url),
            in_flight=view.in_flight,
            requests=view.requests,
            succeeded=view.succeeded,
            failed=view.failed,
            client_errors=view.client_errors,
            cancelled=view.cancelled,
            mean_latency=view.mean_latency,
            mean_ttft=view.mean_ttft,
            generation=view.generation,
            lease=None
            if expires is None
            else LeaseStatus(ttl=view.lease_ttl, expires_in=round(expires - time.monotonic(), 3)),
            engine=EngineStatus(
                **engine_report(view.engine),
                dialect=self.engines.dialects.get(url),
                last_error=self.engines.errors.get(url),
            ),
            address=view.address,
            found_by=found.shown() if (found := self.found.get(url)) is not None else None,
            kv_events=kv_events.get(url) if kv_events is not None else None,
            replicas=self._replica_load(view),
        )
        if self.pd is not None and (held := self.pd.node_status(url)) is not None:
            row["links"] = held["links"]
            row["preserved_sessions"] = held["preserved_sessions"]
        return row

    def _replica_load(self, view: NodeView) -> ReplicaLoad | None:
        if self.replica_share is None:
            return None
        return ReplicaLoad(
            peers=self.replica_share.stats()[3],
            peer_unanswered=view.peer_unanswered,
            peer_prefill_ms_left=round(view.peer_prefill_ms_left, 3),
            peer_in_flight=view.peer_in_flight,
        )

    def sources_status(self) -> dict[str, JsonValue]:
        """How each node source fares: whether it reaches where it looks, since when not, why."""
        return {source.name: source.state.shown(source.node_count()) for source in self.sources}

    def health_summaries(self) -> dict[str, HealthSummary | JsonValue]:
        """What the health checks know of each node: this process's, or in a worker group the
        leader's (as it last published them, `publish_health`)."""
        if self.health.running:
            return {url: h.summary() for url, h in self.health.nodes.items()}
        if self.group is not None:
            saved = state_file.load(str(self.group.health_path))
            return {str(e["url"]): e["health"] for e in saved if "health" in e}
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

    def _background(self, work: Work, name: str) -> None:
        """Runs ``work`` until it ends or the fleet closes."""
        task = _background.start(work, name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _register_when_available(self, record: NodeRecord) -> None:
        delay = 1.0
        while True:
            await asyncio.sleep(delay)
            try:
                await self.add(record)
            except (RegistryUnavailable, NodeUnresolvable):
                delay = min(delay * 2, REGISTER_RETRY_MAX)
                continue
            except InvalidNode as e:
                log.error("node %s not added: %s", record.url, e)
            return

    def _save(self) -> None:
        # In a worker group only the leader writes it.
        if self.settings.server.state_file and (self.group is None or self.group.leader):
            try:
                records = [self._record_of(n.url) for n in self.router.views() if n.url not in self.found]
                state_file.save(self.settings.server.state_file, [r.saved() for r in records if r is not None])
            except OSError as e:
                log.error("state file %s not written: %s", self.settings.server.state_file, e)

    async def _expire_leases(self) -> None:
        """A node whose lease ran out is drained; once its requests are done (or after another
        lease period) it is removed."""
        while True:
            await asyncio.sleep(LEASE_TICK)
            now = time.monotonic()
            for url, expires in list(self.leases.items()):
                if now < expires:
                    continue
                try:
                    node = self.router.node(url)
                except NodeNotFound:
                    self.leases.pop(url, None)
                    continue
                if node["state"] != "draining":
                    log.warning("node %s: lease expired; draining it", url)
                    self.router.set_node_state(url, "draining")
                overdue = now - expires >= (node["lease_ttl"] or 0)
                if node["in_flight"] == 0 or overdue:
                    with contextlib.suppress(NodeNotFound):
                        await self.remove(url)

"""Active and passive health checks.

Every node's ``/health`` is probed concurrently each ``interval`` seconds with a timeout. The
answer follows LMDeploy's shape: 200 ``{"status": "healthy"}`` serves; ``sleeping`` is kept
but not routed to; ``initializing`` is not routed to yet; 503 or ``unhealthy``, an error or
a timeout is a failure (an empty 200, as older LMDeploy versions send, is healthy).
An engine whose ``/metrics`` says it is asleep (vLLM's sleep mode, whose ``/health`` still
answers 200) is ``sleeping`` too, from that reading until one says it is awake (``engine_asleep``).
``fall`` consecutive failures take a node out of routing and ``rise`` successes bring it
back; requests that could not connect to a node count as failures too. A node that has not
answered a check yet gets no such benefit of the doubt: its first failure takes it out (an
unreachable new node is never shown healthy) and its first success brings it in. A failing
node is kept (optionally removed after ``remove_after`` seconds), never deleted on the spot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import aiohttp

from pdproxy import _background
from pdproxy.config.settings import HealthSettings
from pdproxy.errors import AnswerTooLarge, NodeNotFound
from pdproxy.fleet.node_answers import read_json
from pdproxy.fleet.tls import node_session
from pdproxy.router import Router

log = logging.getLogger("pdproxy.health")

#: States the checker sets; `draining` belongs to the operator and leases, so it is left alone.
CHECKED_STATES = frozenset({"healthy", "unhealthy", "sleeping", "initializing"})


class HealthSummary(TypedDict):
    """A node's health as ``/nodes/status`` shows it."""

    state: str
    consecutive_failures: int
    last_error: str | None
    #: Seconds since its last check.
    last_check_age: float | None


@dataclass
class NodeHealth:
    """What the checker knows of one node."""

    state: str = "healthy"
    successes: int = 0
    failures: int = 0
    last_error: str | None = None
    last_check: float | None = None
    unhealthy_since: float | None = None
    connect_failures_seen: int = 0
    #: It has answered a check once: from then on `fall` and `rise` apply.
    answered: bool = False
    #: What its last good /health answer said (healthy or sleeping).
    reported: str | None = None

    def summary(self) -> HealthSummary:
        return HealthSummary(
            state=self.state,
            consecutive_failures=self.failures,
            last_error=self.last_error,
            last_check_age=None if self.last_check is None else round(time.monotonic() - self.last_check, 3),
        )


class HealthChecker:
    def __init__(
        self,
        router: Router,
        settings: HealthSettings,
        *,
        on_remove: Callable[[str], None],
        ca_file: str = "",
    ) -> None:
        self._router = router
        self._interval = settings.interval
        self._timeout = settings.timeout
        self._ca_file = ca_file
        self._fall = settings.fall
        self._rise = settings.rise
        self._remove_after = settings.remove_after
        self._on_remove = on_remove
        self.nodes: dict[str, NodeHealth] = {}
        #: The nodes whose engine's metrics say it is asleep (see ``engine_asleep``).
        self._asleep: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        #: When the last round of checks ended (monotonic), for the staleness alarm.
        self.last_round: float | None = None

    @property
    def running(self) -> bool:
        """Whether this process checks (in a worker group, only the leader does)."""
        return self._session is not None

    def track(self, url: str) -> None:
        """Starts (or keeps) checking ``url``; a new node starts healthy and is checked at once."""
        health = self.nodes.setdefault(url, NodeHealth())
        if self._session is not None:
            asyncio.get_running_loop().create_task(self._check(url, health))

    def forget(self, url: str) -> None:
        self.nodes.pop(url, None)
        self._asleep.discard(url)

    def engine_asleep(self, url: str, asleep: bool) -> None:
        """What the node's engine metrics say of its sleep, at each reading: a healthy node that
        is asleep is ``sleeping`` at once (no traffic), and back to ``healthy`` once awake."""
        (self._asleep.add if asleep else self._asleep.discard)(url)
        health = self.nodes.get(url)
        if health is None:
            return
        if asleep and health.state == "healthy":
            self._set(url, health, "sleeping")
        elif not asleep and health.state == "sleeping" and health.reported == "healthy":
            self._set(url, health, "healthy")

    async def start(self) -> None:
        self._session = node_session(self._ca_file, self._timeout)
        self._task = _background.start(self._run(), "pdproxy-health")

    async def aclose(self) -> None:
        await _background.stop(self._task)
        if self._session is not None:
            await self._session.close()

    async def check_all(self) -> None:
        """One round: every node probed concurrently, passive failures counted. Each node's
        check stands alone: whatever one node answers, the others are checked."""
        passive = {n.url: n.connect_failures for n in self._router.views()}
        checks = []
        for url, health in list(self.nodes.items()):
            seen = passive.get(url)
            if seen is not None and seen > health.connect_failures_seen:
                health.connect_failures_seen = seen
                self._record(url, health, None, "requests could not connect")
            checks.append(self._check(url, health))
        for result in await asyncio.gather(*checks, return_exceptions=True):
            if isinstance(result, Exception):
                log.error("health check failed unexpectedly: %r", result)
        self.last_round = time.monotonic()

    def stale(self) -> float | None:
        """Seconds since the last round ended, when that is longer than three intervals (the
        checker has stopped or is stuck); ``None`` while checks keep up."""
        if self.last_round is None or self._session is None:
            return None
        age = time.monotonic() - self.last_round
        return age if age > 3 * self._interval + self._timeout else None

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # the checks must outlive any bug in one round
                log.exception("a round of health checks failed; the next one starts as planned")
            await asyncio.sleep(self._interval)

    async def _check(self, url: str, health: NodeHealth) -> None:
        assert self._session is not None
        try:
            key = self._router.node(url)["api_key"]
        except NodeNotFound:
            return  # removed meanwhile
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            async with self._session.get(f"{url}/health", headers=headers, allow_redirects=False) as response:
                payload = await read_json(response)
                status = response.status
        except AnswerTooLarge as e:
            self._record(url, health, None, f"/health: {e}")
            return
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self._record(url, health, None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        self._record(url, health, _engine_state(status, payload), f"/health answered {status}")

    def _record(self, url: str, health: NodeHealth, engine_state: str | None, error: str) -> None:
        if self.nodes.get(url) is not health:
            return  # removed meanwhile
        health.last_check = time.monotonic()
        if engine_state in ("healthy", "sleeping"):
            health.reported = engine_state
            if url in self._asleep:
                engine_state = "sleeping"  # its /health cannot tell, its metrics did
            health.failures = 0
            health.successes += 1
            health.last_error = None
            back = health.successes >= self._rise or not health.answered
            health.answered = True
            if engine_state == "sleeping" or health.state != "unhealthy" or back:
                self._set(url, health, engine_state)
            return
        if engine_state == "initializing":
            health.answered = True
            health.successes = 0
            health.last_error = "initializing"
            self._set(url, health, "initializing")
            return
        health.successes = 0
        health.failures += 1
        health.last_error = error
        if health.failures >= self._fall or not health.answered:
            self._set(url, health, "unhealthy")
        overdue = health.unhealthy_since is not None and time.monotonic() - health.unhealthy_since >= self._remove_after
        if health.state == "unhealthy" and self._remove_after > 0 and overdue:
            log.warning("node %s unhealthy for %.0f s: removing it", url, self._remove_after)
            self._on_remove(url)

    def _set(self, url: str, health: NodeHealth, state: str) -> None:
        if state == health.state:
            return
        try:
            current = self._router.node(url)["state"]
        except NodeNotFound:
            current = None
        if current is None or current not in CHECKED_STATES:
            health.state = state  # remember, but do not undo an operator's drain
            return
        log.info(
            "node %s: %s -> %s%s", url, health.state, state, f" ({health.last_error})" if health.last_error else ""
        )
        health.state = state
        health.unhealthy_since = time.monotonic() if state == "unhealthy" else None
        self._router.set_node_state(url, state)


def _engine_state(status: int, payload: object) -> str | None:
    """The engine's own word for its state; None for a failure."""
    reported = payload.get("status") if isinstance(payload, dict) else None
    if status == 200:
        return reported if reported in ("healthy", "sleeping") else "healthy"
    if reported == "initializing":
        return "initializing"
    return None

"""Reads every node's ``/metrics`` in the background and records what its engine reports in the
data plane's node table, where the engine-aware policies use it.

Off the request path and bounded: one round every ``interval`` seconds (every
``QUEUED_INTERVAL`` while some engine reports requests waiting: a queue is when routing needs
fresh figures most, and when they age fastest), at most ``concurrency`` nodes at once, each
answer within ``timeout`` and ``max_bytes``. A failed reading (an error, a status other than
200, an answer too large or without engine metrics) is counted on the node and its message
kept for the status page; the figures already recorded then age until the data plane stops
using them (``engine_metrics_max_age``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from pdproxy import _background
from pdproxy.config.settings import EngineMetricsSettings
from pdproxy.errors import NodeNotFound
from pdproxy.fleet.engine_report import EngineReading, parse
from pdproxy.fleet.tls import node_session
from pdproxy.router import Router

log = logging.getLogger("pdproxy.engines")

#: Seconds between rounds while an engine reports a queue (when ``interval`` is longer). On
#: bench/fleet.py's system_prompts, four pdproxy replicas starting on a cold fleet cleared the
#: backlog of its first seconds by t=13 s reading every 2 s, by t=7 s every 0.5 s, and by t=5 s
#: so (one run each); in two runs of the whole benchmark the backlog stayed all the same.
QUEUED_INTERVAL = 0.5


class EngineScraper:
    def __init__(
        self,
        router: Router,
        settings: EngineMetricsSettings,
        *,
        api_key_of: Callable[[str], str | None],
        on_sleep: Callable[[str, bool], None] = lambda url, asleep: None,
        ca_file: str = "",
    ) -> None:
        self._router = router
        self._interval = settings.interval
        self._timeout = settings.timeout
        self._ca_file = ca_file
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._max_bytes = settings.max_bytes
        self._api_key_of = api_key_of
        #: The last failure of each node whose last reading failed.
        self.errors: dict[str, str] = {}
        #: The dialect each node's engine speaks, as last read.
        self.dialects: dict[str, str] = {}
        #: Told each reading's word on the engine's sleep (the health checker keeps it).
        self._on_sleep = on_sleep
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        self._session = node_session(self._ca_file, self._timeout)
        self._task = _background.start(self._run(), "pdproxy-engine-metrics")

    async def aclose(self) -> None:
        await _background.stop(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()

    async def read_all(self) -> bool:
        """One round: every node read, at most ``concurrency`` at once. True when some engine
        reported requests waiting."""
        urls = [node.url for node in self._router.views()]
        queued = await asyncio.gather(*(self._read(url) for url in urls))
        for known in (self.errors, self.dialects):
            for url in set(known) - set(urls):
                del known[url]
        return any(queued)

    async def _run(self) -> None:
        while True:
            queued = await self.read_all()
            await asyncio.sleep(min(self._interval, QUEUED_INTERVAL) if queued else self._interval)

    async def _read(self, url: str) -> bool:
        """Reads one node; true when its engine reported requests waiting."""
        async with self._slots:
            try:
                # pdproxy's counts as the engine is asked: what it had there at most when the
                # engine counted, so that others' requests show (another replica's, a batch job).
                self._router.core.engine_reading_asked(url)
            except NodeNotFound:
                return False  # removed meanwhile
            try:
                reading = await self._fetch(url)
            except _Failed as e:
                self._failed(url, str(e))
                return False
        try:
            self._router.core.record_engine_report(
                url,
                reading.running,
                reading.waiting,
                reading.kv_usage,
                reading.prompt_tokens,
                reading.cached_tokens,
                reading.kv_capacity_tokens,
                reading.transferred_tokens,
            )
        except NodeNotFound:
            return False  # removed meanwhile
        self.errors.pop(url, None)
        self.dialects[url] = reading.dialect
        self._on_sleep(url, reading.asleep)
        return reading.waiting > 0

    async def _fetch(self, url: str) -> EngineReading:
        assert self._session is not None
        key = self._api_key_of(url)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            async with self._session.get(f"{url}/metrics", headers=headers, allow_redirects=False) as response:
                if response.status != 200:
                    raise _Failed(f"/metrics answered {response.status}")
                body = await self._read_body(response)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _Failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        if len(body) > self._max_bytes:
            raise _Failed(f"/metrics is larger than {self._max_bytes} bytes")
        reading = parse(body.decode(errors="replace"))
        if reading is None:
            raise _Failed("/metrics has no vLLM, SGLang or LMDeploy engine metrics")
        return reading

    async def _read_body(self, response: aiohttp.ClientResponse) -> bytes:
        """The answer, or as much of it as shows it is larger than ``max_bytes`` (one read may
        return less than asked for, so read until the end or past the limit)."""
        if response.content_length is not None and response.content_length > self._max_bytes:
            raise _Failed(f"/metrics is larger than {self._max_bytes} bytes")
        body = bytearray()
        while len(body) <= self._max_bytes:
            chunk = await response.content.read(self._max_bytes + 1 - len(body))
            if not chunk:
                break
            body += chunk
        return bytes(body)

    def _failed(self, url: str, message: str) -> None:
        try:
            self._router.core.record_engine_failure(url)
        except NodeNotFound:
            return
        if url not in self.errors:
            log.debug("node %s: engine metrics not read: %s", url, message)
        self.errors[url] = message


class _Failed(Exception):
    """A reading that failed, with what to show."""

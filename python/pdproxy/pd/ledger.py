"""The ledger of preserved prefill sessions.

Between its prefill answer and its decode's first token, a request's KV cache lives on the
prefill node and nobody but pdproxy knows it is still needed. The ledger holds it until decode
has consumed it; on any other ending (decode refused or failed before starting, link failure,
client gone, decode node removed, shutdown) pdproxy frees it on the prefill node with
``/distserve/free_cache``, exactly once, with bounded retries. Entries also expire after a TTL,
swept in the background, so nothing outlives a bug."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdproxy import background

log = logging.getLogger("pdproxy.pd")


@dataclass(eq=False)
class Preserved:
    id: int
    prefill: str
    session_id: int
    decode: str | None
    created: float
    state: str = "preserved"  # preserved -> consumed | freeing -> freed | lost


class SessionLedger:
    def __init__(self, *, ttl: float, free_timeout: float, free_attempts: int, api_key_of: Any) -> None:
        self.entries: dict[int, Preserved] = {}
        self._ids = itertools.count(1)
        self._ttl = ttl
        self._timeout = aiohttp.ClientTimeout(total=free_timeout)
        self._attempts = free_attempts
        self._api_key_of = api_key_of
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.freed = 0
        self.consumed = 0
        self.free_failures = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        self._task = background.start(self._sweep(), "pdproxy-pd-ledger")

    async def aclose(self) -> None:
        await background.stop(self._task)
        # Shutting down: what is still preserved is freed now, not left to leak.
        await asyncio.gather(*(self.free(e, "shutdown") for e in list(self.entries.values())))
        if self._session is not None:
            await self._session.close()

    def add(self, prefill: str, session_id: int, decode: str | None) -> Preserved:
        entry = Preserved(next(self._ids), prefill, session_id, decode, time.monotonic())
        self.entries[entry.id] = entry
        return entry

    def consume(self, entry: Preserved) -> None:
        """Decode has taken the session over: it frees it on the prefill node itself."""
        if entry.state == "preserved":
            entry.state = "consumed"
            self.consumed += 1
            self.entries.pop(entry.id, None)

    async def free(self, entry: Preserved, reason: str) -> None:
        """Frees the session on its prefill node, once, whatever the number of callers."""
        if entry.state != "preserved":
            return
        entry.state = "freeing"
        body = {"remote_engine_id": entry.prefill, "remote_session_id": entry.session_id}
        key = self._api_key_of(entry.prefill)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        for attempt in range(self._attempts):
            try:
                assert self._session is not None
                async with self._session.post(f"{entry.prefill}/distserve/free_cache", json=body, headers=headers) as r:
                    if r.status == 200:
                        entry.state = "freed"
                        self.freed += 1
                        log.info("freed prefill session %s on %s (%s)", entry.session_id, entry.prefill, reason)
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1 * 2**attempt)
        else:
            entry.state = "lost"
            self.free_failures += 1
            log.error("could not free prefill session %s on %s (%s)", entry.session_id, entry.prefill, reason)
        self.entries.pop(entry.id, None)

    def forget_prefill(self, url: str) -> None:
        """A removed prefill node's sessions went with it."""
        for entry in [e for e in self.entries.values() if e.prefill == url]:
            entry.state = "lost"
            self.entries.pop(entry.id, None)

    async def gc(self, older_than: float = 0.0) -> list[dict[str, Any]]:
        """Frees every entry older than ``older_than`` seconds; reports what it freed."""
        now = time.monotonic()
        stale = [e for e in self.entries.values() if now - e.created >= older_than and e.state == "preserved"]
        await asyncio.gather(*(self.free(e, "gc") for e in stale))
        return [{"prefill": e.prefill, "session_id": e.session_id, "state": e.state} for e in stale]

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "preserved": len(self.entries),
            "oldest_age": max((now - e.created for e in self.entries.values()), default=None),
            "consumed": self.consumed,
            "freed": self.freed,
            "free_failures": self.free_failures,
        }

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(self._ttl / 4, 0.05))
            await self.gc(older_than=self._ttl)

"""The ledger of preserved prefill sessions: the control plane's side.

Between its prefill answer and its decode's first token, a request's KV cache lives on the
prefill node and nobody but pdproxy knows it is still needed. The data plane keeps the ledger
(``DistServeCore``): it records each session, marks it consumed when decode takes it over, and
on any other ending (decode refused or failed before starting, link failure, client gone) frees
it on the prefill node with ``/distserve/free_cache``, exactly once, with bounded retries. What
this module adds is what needs time and the file system: the sweep of sessions that outlive
their TTL, the frees when a prefill node is removed or the proxy shuts down, the status, and in
a worker group the adoption of the sessions a dead worker journaled (each worker journals its
sessions, one small file each in the group's directory)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Literal, NamedTuple, TypedDict

from pdproxy import _background
from pdproxy._pdproxy import DistServeCore

from . import ApiKeyOf

log = logging.getLogger("pdproxy.pd")


#: How a free ended (``preserved``: the node could not be reached and the session is kept).
FreeState = Literal["freed", "lost", "consumed", "preserved"]


class Swept(NamedTuple):
    """A session the sweep freed, and how that ended."""

    prefill: str
    session_id: int
    state: FreeState


class LedgerStatus(TypedDict):
    """The ledger in ``/distserve/status``: sessions held now, the oldest one's age (seconds),
    and how the others ended."""

    preserved: int
    oldest_age: float | None
    consumed: int
    freed: int
    free_failures: int


class SessionLedger:
    def __init__(self, core: DistServeCore, *, ttl: float, api_key_of: ApiKeyOf, journal: Path | None = None) -> None:
        self._core = core
        self._api_key_of = api_key_of
        self._ttl = ttl
        #: In a worker group: this worker's journal directory (written by the data plane).
        self._journal = journal
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = _background.start(self._sweep(), "pdproxy-pd-ledger")

    async def aclose(self) -> None:
        await _background.stop(self._task)
        # Shutting down: what is still preserved is freed now, not left to leak.
        await self._free_all([entry for entry, _, _ in self._core.preserved()], "shutdown")
        if self._journal is not None:
            with contextlib.suppress(OSError):  # empty by now: every entry was freed or given up
                self._journal.rmdir()

    def add(self, prefill: str, session_id: int, decode: str | None) -> int:
        """Records a session preserved on ``prefill``; its id in the ledger."""
        return self._core.add(prefill, session_id, decode, self._api_key_of(prefill))

    def preserve(self, prefill: str, answer: bytes, decode: str) -> tuple[int, str]:
        """Records the session ``answer`` (a prefill's body) preserved on ``prefill``: its id,
        and the decode's ``migration_request`` (JSON)."""
        return self._core.preserve(prefill, answer, decode, self._api_key_of(prefill))

    def consume(self, entry: int) -> None:
        """Decode has taken the session over: it frees it on the prefill node itself."""
        self._core.consume(entry)

    async def free(self, entry: int, reason: str, keep_if_unreachable: bool = False) -> FreeState:
        """Frees the session on its prefill node, once, whatever the number of callers; when the
        node cannot be reached it is given up (``lost``), or with ``keep_if_unreachable`` kept,
        for the TTL sweep to try again."""
        what = self._core.describe(entry)
        try:
            outcome = await self._core.free(entry, keep_if_unreachable)
        except KeyError:
            return "consumed"  # it ended meanwhile
        if outcome == "freed":
            log.info("freed %s (%s)", what, reason)
        elif outcome == "preserved":
            log.warning("%s not freed yet (%s): the sweep tries again after %g s", what, reason, self._ttl)
        else:
            self._log_failure(reason)
        return outcome

    async def adopt(self, journal: Path) -> int:
        """Frees the sessions a dead worker journaled in ``journal``, then removes it; how many."""
        adopted = self._take_over(journal)
        await self._free_all(adopted, "its worker died")
        return len(adopted)

    def _take_over(self, journal: Path) -> list[int]:
        """Moves another journal's entries into this ledger (a few small files in memory)."""
        adopted = []
        for path in sorted(journal.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_text())
                adopted.append(self.add(str(record["prefill"]), int(record["session_id"]), record.get("decode")))
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            journal.rmdir()
        return adopted

    async def release_prefill(self, url: str) -> None:
        """A prefill node is being removed: the sessions preserved on it are freed while it can
        still be reached (its engine would keep their KV blocks until it restarts); those it
        cannot free now stay for the TTL sweep."""
        leaving = [entry for entry, _, _ in self._core.preserved(prefill=url)]
        await self._free_all(leaving, "its prefill node was removed", keep_if_unreachable=True)

    def held_on(self, prefill: str) -> int:
        """Sessions preserved on ``prefill`` now."""
        return len(self._core.preserved(prefill=prefill))

    async def gc(self, older_than: float = 0.0) -> list[Swept]:
        """Frees every session older than ``older_than`` seconds; each with how it ended."""
        stale = self._core.preserved(older_than)
        ended = await self._free_all([entry for entry, _, _ in stale], "gc")
        return [Swept(prefill, session_id, state) for (_, prefill, session_id), state in zip(stale, ended, strict=True)]

    def status(self) -> LedgerStatus:
        preserved, oldest_age, consumed, freed, free_failures = self._core.counts()
        return LedgerStatus(
            preserved=preserved, oldest_age=oldest_age, consumed=consumed, freed=freed, free_failures=free_failures
        )

    async def _free_all(self, entries: list[int], reason: str, keep_if_unreachable: bool = False) -> list[FreeState]:
        return list(await asyncio.gather(*(self.free(e, reason, keep_if_unreachable) for e in entries)))

    def _log_failure(self, reason: str) -> None:
        failure = self._core.take_last_failure()
        if failure is not None:
            log.error("%s (%s)", failure, reason)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(self._ttl / 4, 0.05))
            await self.gc(older_than=self._ttl)
            # Frees the data plane gave up on by itself (a request's ending) are logged here.
            self._log_failure("a request's ending")

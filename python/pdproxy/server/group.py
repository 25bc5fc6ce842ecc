"""A worker group: the processes of ``pdproxy serve --workers N`` on one machine.

``pdproxy serve`` creates the group's directory (in ``/dev/shm`` when there is one) before
granian starts the workers: the shared table of node counters (``table``, see the data
plane's ``shared.rs``), the membership document and its lock (``membership.group_file``), the
leader's lock and the prefill-decode link markers. Each worker maps the table and joins it.

One worker at a time is the leader: whoever holds the ``flock`` on ``leader.lock``. The kernel
releases it when that worker dies, and another takes over within ``LEAD_INTERVAL``. The leader
does what must happen once per group: health checks (their verdict lands in the shared table,
so every worker routes by it), lease expiry, handing back the permits of workers that died,
reusing retired node slots, and freeing the DistServe sessions that dead workers had preserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, TypedDict

from pdproxy import _pdproxy

__all__ = ["GROUP_ENV", "Group", "GroupSummary", "prepared"]

log = logging.getLogger("pdproxy.group")

#: How `pdproxy serve` tells its workers where the group's directory is.
GROUP_ENV = "_PDPROXY_GROUP_DIR"
#: Seconds between a worker's looks at the group (leadership, reclaiming, reuse of slots).
LEAD_INTERVAL = 1.0
#: Seconds between a worker's looks at the group-wide signals (drain, stale slot bindings).
SIGNAL_INTERVAL = 0.1
#: Workers a group may have: half the table's entries, so that replacements of dead workers
#: always find room before the leader reclaims the dead ones' entries.
MAX_WORKERS = _pdproxy.SharedTable.MAX_WORKERS // 2
#: A retired node slot is reused no sooner than this: far longer than any worker takes to see
#: the removal (SIGNAL_INTERVAL), so no worker still counts on it.
SLOT_REUSE_GRACE = 10.0


@contextlib.contextmanager
def prepared(workers: int) -> Iterator[Path | None]:
    """The group's directory for ``workers`` processes (None for one: nothing is shared),
    removed when the group ends."""
    if workers < 2:
        yield None
        return
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="pdproxy-group-", dir=base))
    try:
        _pdproxy.SharedTable.create(str(directory / "table"))
        (directory / "links").mkdir()
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class SlotUse(TypedDict):
    """Node slots of the shared table: bound to a node, retired (waiting for reuse), all."""

    bound: int
    retired: int
    total: int


class GroupSummary(TypedDict):
    """This worker's view of its group (``/debug/state``, ``/metrics``)."""

    #: This worker's index in the table, and its process.
    worker: int
    pid: int
    leader: bool
    #: Permits this worker holds now.
    held: int
    #: The pids of the attached workers.
    workers: list[int]
    slots: SlotUse


class Group:
    """This worker's membership of the group."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.table = _pdproxy.SharedTable.open(str(directory / "table"))
        self.pid = os.getpid()
        self.index = self.table.join(self.pid)
        self._leader_lock: IO[bytes] | None = None

    @property
    def health_path(self) -> Path:
        """Where the leader publishes its health checks' view."""
        return self.directory / "health.json"

    @property
    def leader(self) -> bool:
        return self._leader_lock is not None

    def try_to_lead(self) -> bool:
        """Takes the leadership if no live worker holds it; True when this worker leads."""
        if self._leader_lock is None:
            lock = open(self.directory / "leader.lock", "ab")  # noqa: SIM115 - held for the worker's life
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                return False
            self._leader_lock = lock
            log.info("worker %d (pid %d) leads the group", self.index, self.pid)
        return True

    def reclaim_dead_workers(self) -> int:
        """Hands back the permits of workers that have exited; returns how many."""
        returned = 0
        for index, pid in self.table.workers():
            if pid != self.pid and not alive(pid):
                handed_back = self.table.reclaim(index, pid)
                if handed_back is not None:
                    log.warning("worker pid %d exited; %d permit(s) it held were handed back", pid, handed_back)
                    returned += handed_back
        return returned

    def leave(self) -> None:
        """Detaches this worker (anything it still counted is handed back)."""
        self.table.reclaim(self.index, self.pid)
        if self._leader_lock is not None:
            self._leader_lock.close()
            self._leader_lock = None

    def summary(self) -> GroupSummary:
        bound, retired = self.table.slots_in_use()
        return GroupSummary(
            worker=self.index,
            pid=self.pid,
            leader=self.leader,
            held=self.table.held(self.index),
            workers=[pid for _, pid in self.table.workers()],
            slots=SlotUse(bound=bound, retired=retired, total=self.table.SLOTS),
        )

    async def run(
        self,
        *,
        on_lead: Callable[[], Awaitable[None]],
        leader_tick: Callable[[], Awaitable[None]],
        signal_tick: Callable[[], None],
    ) -> None:
        """This worker's part in the group, until cancelled: ``signal_tick`` every
        SIGNAL_INTERVAL; the leadership when it comes free (``on_lead`` once), then the
        leader's rounds (``leader_tick``)."""
        since_lead_check = LEAD_INTERVAL
        while True:
            signal_tick()
            since_lead_check += SIGNAL_INTERVAL
            if since_lead_check >= LEAD_INTERVAL:
                since_lead_check = 0.0
                try:
                    if not self.leader and self.try_to_lead():
                        await on_lead()
                    if self.leader:
                        self.reclaim_dead_workers()
                        self.table.recycle(SLOT_REUSE_GRACE)
                        await leader_tick()
                except Exception:
                    log.exception("the group's round failed; retrying in %.0f s", LEAD_INTERVAL)
            await asyncio.sleep(SIGNAL_INTERVAL)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True

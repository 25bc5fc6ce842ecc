"""Follows one engine rank's KV events: a ZMQ SUB socket on its publisher, the sequence numbers
checked, gaps filled from its replay socket, restarts noticed.

An engine numbers its batches from 0 and keeps the last few thousand for replay. A subscriber
joins as soon as it connects by asking the replay socket for all the engine keeps (an 8-byte
big-endian start sequence; the replies end with sequence -1): an engine that served before
pdproxy started, and is idle now, is then known warm without waiting for its next batch. Live
batches the join already replayed are skipped. Batches missed later (ZMQ drops at its
high-water mark, a reconnect) are asked for the same way. A gap that cannot be filled,
numbers that go back (the engine restarted and counts again) or the publisher's socket closing
(its engine exited, most often) make what the index holds for that rank untrustworthy: it is
dropped (``EventSink.forget``) and rebuilt from the events that follow.

The subscription is live while its socket is connected and its join done; the index falls
back to the approximate table for a rank that is not (``status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from .wire import Batch, WireError, decode_batch, message_parts

log = logging.getLogger("pdproxy.kv_events")

#: How long a replay may take to answer before the gap counts as unfillable.
REPLAY_TIMEOUT_S = 1.0
#: How long the join's replay may take: all an engine keeps (vLLM: 10,000 batches).
JOIN_TIMEOUT_S = 10.0
#: Batches asked of a replay socket at most, when joining on a live batch (an engine keeps 10,000).
JOIN_REPLAY = 10_000


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one data-parallel rank of a node publishes."""

    node: str
    rank: int
    events: str
    replay: str | None = None
    topic: str = ""


class EventSink(Protocol):
    def apply(self, endpoint: Endpoint, batch: Batch) -> None: ...

    def forget(self, endpoint: Endpoint, why: str) -> None: ...


@dataclass
class StreamStatus:
    """What ``/nodes/status`` shows of a subscription."""

    connected: bool = False
    #: Catching up with what the engine keeps (the replay asked for on connecting).
    joining: bool = False
    #: The next sequence number expected (None: none seen yet).
    next_seq: int | None = None
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    unfilled_gaps: int = 0
    restarts: int = 0
    bad_messages: int = 0
    last_batch_at: float | None = None
    #: Why the rank's entries were last dropped.
    last_forget: str | None = None

    @property
    def live(self) -> bool:
        # Joined: what the engine kept is in. (An engine that published nothing yet holds
        # nothing: an empty index is right for it.)
        return self.connected and not self.joining

    def as_dict(self) -> dict[str, object]:
        figures: dict[str, object] = {"live": self.live, **asdict(self)}
        del figures["last_batch_at"]  # shown as an age
        since = self.last_batch_at
        figures["seconds_since_batch"] = None if since is None else round(time.time() - since, 3)
        return figures


class Subscription:
    """One rank's events into ``sink``, until ``close``."""

    def __init__(self, endpoint: Endpoint, sink: EventSink, context: zmq.asyncio.Context) -> None:
        self.endpoint = endpoint
        self.sink = sink
        self.status = StreamStatus()
        self._context = context
        self._task: asyncio.Task[None] | None = None
        #: One at a time: a join's replay, or a live batch (and the replay of its gap).
        self._turn = asyncio.Lock()
        #: Where the join's replay ended: the next number, and the engine's time of the last
        #: batch. A live batch numbered below it and no later was published as the join replayed
        #: it; a later one is a restarted engine's (None: no join since the last live batch).
        self._joined: tuple[int, float] | None = None
        self._last_ts = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint.node}#{self.endpoint.rank}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint.events)
        watch = asyncio.create_task(self._watch(monitor))
        try:
            while True:
                frames = await sub.recv_multipart()
                async with self._turn:
                    await self._received(frames)
        finally:
            watch.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            finally:
                # Whatever the watch ended with: an open socket would hang the context's term.
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        joins: set[asyncio.Task[None]] = set()
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                self._connection_changed(event["event"], joins)
        finally:
            for join in joins:
                join.cancel()

    def _connection_changed(self, event: int, joins: set[asyncio.Task[None]]) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.status.connected = True
            if self.status.next_seq is None and self.endpoint.replay is not None:
                self.status.joining = True
                join = asyncio.create_task(self._join())
                joins.add(join)
                join.add_done_callback(joins.discard)
        elif event == zmq.EVENT_DISCONNECTED:
            # The publisher's socket closed: most often its engine exited, and its cache with
            # it. Known cold now, not when the health checks or the next batch say so; once
            # connected again, the stream joins afresh (the replay gives back what a mere
            # network break took).
            self.status.connected = False
            if self.status.next_seq is not None:
                self.status.next_seq = None
                self._joined = None
                self._forget("disconnected from the publisher")

    async def _join(self) -> None:
        """Everything the engine keeps, replayed before the live batches that follow."""
        try:
            async with self._turn:
                if self.status.next_seq is not None:
                    return  # a live batch joined first
                await self._replay(0, None, within_s=JOIN_TIMEOUT_S)
                if self.status.next_seq is not None:
                    self._joined = (self.status.next_seq, self._last_ts)
        finally:
            self.status.joining = False

    async def _received(self, frames: list[bytes]) -> None:
        try:
            parts = message_parts(frames)
            if parts is None:
                return
            seq, payload = parts
            batch = decode_batch(payload)
        except WireError as e:
            self._bad(e)
            return
        expected = self.status.next_seq
        if self._joined is not None:
            joined_to, joined_ts = self._joined
            if seq < joined_to and batch.ts <= joined_ts:
                return  # published while the join replayed it
            self._joined = None
        if expected is not None and seq < expected:
            # Numbers going back: a new engine process counting from 0 again.
            self.status.restarts += 1
            self._forget(f"sequence went back from {expected} to {seq}: the engine restarted")
            expected = None
        if expected is None:
            # Joining: first what the engine still keeps of its earlier batches.
            await self._replay(max(0, seq - JOIN_REPLAY), seq)
        elif seq > expected:
            self.status.gaps += 1
            if not await self._replay(expected, seq, fill=True):
                self.status.unfilled_gaps += 1
                self._forget(f"batches {expected}-{seq - 1} missed and not replayed")
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: Batch) -> None:
        self.sink.apply(self.endpoint, batch)
        self.status.next_seq = seq + 1
        self.status.batches += 1
        self.status.last_batch_at = time.time()
        self._last_ts = batch.ts

    def _forget(self, why: str) -> None:
        log.warning("KV events of %s rank %d: %s", self.endpoint.node, self.endpoint.rank, why)
        self.status.last_forget = why
        self.sink.forget(self.endpoint, why)

    def _bad(self, error: Exception) -> None:
        self.status.bad_messages += 1
        if self.status.bad_messages <= 3:
            log.warning("KV events of %s rank %d: %s", self.endpoint.node, self.endpoint.rank, error)

    async def _replay(
        self, start: int, end: int | None, *, fill: bool = False, within_s: float = REPLAY_TIMEOUT_S
    ) -> bool:
        """Applies batches ``start`` to ``end - 1`` (``None``: to the last kept) from the replay
        socket; False when it has not got them all (no replay socket, no answer in time, or the
        oldest ones gone). ``fill``: a gap, which batches missing at its start leave open; else
        (joining) whatever the engine still keeps will do."""
        if self.endpoint.replay is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint.replay)
        next_seq = start
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(within_s):
                while True:
                    frames = await dealer.recv_multipart()
                    # A DEALER receives what the ROUTER sent after the client's identity.
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    try:
                        parts = message_parts(frames)
                    except WireError as e:
                        self._bad(e)
                        continue
                    if parts is None:
                        break
                    seq, payload = parts
                    if seq < next_seq or (end is not None and seq >= end):
                        continue
                    if seq > next_seq and fill:
                        # The oldest ones are no longer kept: the rest cannot make them up.
                        return False
                    try:
                        batch = decode_batch(payload)
                    except WireError as e:
                        self._bad(e)
                        return False
                    self._apply(seq, batch)
                    self.status.replayed += 1
                    next_seq = seq + 1
        except TimeoutError:
            return False
        finally:
            dealer.close(linger=0)
        return end is None or next_seq == end

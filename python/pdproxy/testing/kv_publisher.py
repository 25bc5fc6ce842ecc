"""The simulated engine's KV events, published as vLLM and SGLang publish theirs: a ZMQ PUB
socket sending ``[topic, seq, batch]`` (the batch msgpack-encoded, see
``pdproxy.kv_events.wire``), a ROUTER socket replaying the batches it keeps from a requested
sequence number, then an end marker (sequence -1).

Events follow the simulated KV cache (``PagedKvCache.observer``): blocks filled, evicted,
flushed. A block's token ids are its text cut as the simulated tokenizer cuts it
(``TOKEN_BYTES`` bytes a token), each read as a little-endian integer, so that the token ids
give the text back (``token_bytes``). All the events of one turn of the event loop go in one
batch, as an engine sends one per scheduler step.

Knobs for the tests (``/mock/kv_events``): ``drop`` N batches from the PUB socket but keep
them for replay (a gap a subscriber fills), ``lose`` N (a gap it cannot), ``restart`` (the
sequence numbers count from 0 again and nothing is kept, as a new engine process).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from pdproxy.kv_events.wire import DIALECTS, Batch, Cleared, Event, Removed, Stored, encode_batch

from .batching import EngineModel
from .tokens import TOKEN_BYTES

#: Batches kept for replay (vLLM's and SGLang's default ``buffer_steps``).
BUFFER_STEPS = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def token_ids(content: bytes) -> list[int]:
    """The simulated tokenizer's ids of a block's text."""
    return [int.from_bytes(content[i : i + TOKEN_BYTES], "little") for i in range(0, len(content), TOKEN_BYTES)]


def token_bytes(token_id: int) -> bytes:
    """The text of one of the simulated tokenizer's ids."""
    return token_id.to_bytes(TOKEN_BYTES, "little")


def block_id(name: bytes) -> int:
    """A block's name (an 8-byte hash) as its 64-bit event hash."""
    return int.from_bytes(name[-8:], "big")


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        model: EngineModel,
        dialect: str = "vllm",
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown KV event dialect {dialect!r}: {', '.join(DIALECTS)}")
        self.block_tokens = model.kv_block_tokens
        #: Texts kept at most: those of blocks long gone go first.
        self._contents_limit = 4 * model.kv_blocks
        self.dialect = dialect
        #: One engine, no data-parallel ranks: its batches carry none, under no topic.
        self.rank: int | None = None
        self._topic = b""
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, endpoint)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._router, replay_endpoint)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=BUFFER_STEPS)
        self._seq = 0
        self._pending: list[Event] = []
        #: The text of each named block the cache may store (its events carry the token ids).
        self._contents: dict[bytes, bytes] = {}
        self._drop = 0
        self._lose = 0
        self.published = 0
        self._replayer: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None:
            self._replayer = asyncio.create_task(self._serve_replays())

    async def aclose(self) -> None:
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._context.term()

    def config(self) -> dict[str, object]:
        """Where it publishes, as SGLang's ``/server_info`` advertises its publisher."""
        return {
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self._topic.decode(),
            "dialect": self.dialect,
            "block_size": self.block_tokens,
        }

    # -- what the cache holds ---------------------------------------------------------------

    def name_blocks(self, names: Sequence[bytes], text: bytes) -> None:
        """The text of a sequence's named blocks (``names[i]`` is block ``i`` of ``text``)."""
        size = self.block_tokens * TOKEN_BYTES
        for i, name in enumerate(names):
            self._contents.setdefault(name, text[i * size : (i + 1) * size])
        while len(self._contents) > self._contents_limit:
            del self._contents[next(iter(self._contents))]

    def stored(self, blocks: Sequence[tuple[bytes, bytes | None]]) -> None:
        # One event per run of blocks that each extend the one before, as an engine sends them.
        run: list[bytes] = []
        parent: bytes | None = None
        for name, extends in blocks:
            if run and extends != run[-1]:
                self._store_run(run, parent)
                run = []
            if not run:
                parent = extends
            run.append(name)
        if run:
            self._store_run(run, parent)

    def _store_run(self, names: list[bytes], parent: bytes | None) -> None:
        tokens: list[int] = []
        for name in names:
            tokens += token_ids(self._contents.get(name, b"\0" * TOKEN_BYTES * self.block_tokens))
        hashes = tuple(block_id(n) for n in names)
        self._queue(Stored(hashes, None if parent is None else block_id(parent), tuple(tokens), self.block_tokens))

    def removed(self, blocks: Sequence[bytes]) -> None:
        for name in blocks:
            self._contents.pop(name, None)
        self._queue(Removed(tuple(block_id(n) for n in blocks)))

    def cleared(self) -> None:
        self._contents.clear()
        self._queue(Cleared())

    # -- knobs ------------------------------------------------------------------------------

    def drop(self, batches: int) -> None:
        """The next ``batches`` batches are kept for replay but not sent."""
        self._drop += batches

    def lose(self, batches: int) -> None:
        """The next ``batches`` batches are neither sent nor kept."""
        self._lose += batches

    def restart(self) -> None:
        """A new engine process: numbers from 0 again, nothing kept."""
        self._seq = 0
        self._buffer.clear()

    # -- sending ----------------------------------------------------------------------------

    def _queue(self, event: Event) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(event)

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        if not events:
            return
        seq = self._seq
        self._seq += 1
        if self._lose:
            self._lose -= 1
            return
        payload = encode_batch(Batch(time.time(), tuple(events), self.rank), dialect=self.dialect)
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            return
        self.published += 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart(self._reply(client, seq.to_bytes(8, "big"), payload))
            await self._router.send_multipart(self._reply(client, END_SEQ, b""))

    def _reply(self, client: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        # SGLang's replies carry no topic frame; vLLM's do.
        if self.dialect == "sglang":
            return [client, b"", seq, payload]
        return [client, b"", self._topic if payload else b"", seq, payload]


def _bind(socket: zmq.asyncio.Socket, endpoint: str) -> str:
    """Binds ``endpoint`` (port 0: any free one) and says where it is."""
    if endpoint.endswith(":0"):
        port = socket.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    socket.bind(endpoint)
    return endpoint

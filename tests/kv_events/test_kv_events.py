"""KV-cache events: their wire formats, and a subscription following a simulated engine's
publisher over real ZMQ sockets (gaps replayed, restarts noticed)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
import zmq.asyncio

from pdproxy.kv_events.subscriber import Endpoint, Subscription
from pdproxy.kv_events.wire import (
    DIALECTS,
    Batch,
    Cleared,
    Removed,
    Stored,
    WireError,
    block_hash,
    decode_batch,
    encode_batch,
)
from pdproxy.testing.kv_publisher import block_id, token_bytes
from pdproxy.testing.mock_engine import MockEngine
from pdproxy.testing.tokens import block_hashes, render_prompt
from servers import eventually

STORED = Stored((1, 2), 7, tuple(range(8)), 4)
BATCH = Batch(12.5, (STORED, Removed((3,)), Cleared()), rank=1)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_each_engines_encoding_decodes_to_the_same_events(dialect: str) -> None:
    assert decode_batch(encode_batch(BATCH, dialect=dialect)) == BATCH


def test_newer_vllm_sends_events_as_maps_with_sha256_hashes() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None, "token_ids": [5, 6],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}]],
        use_bin_type=True,
    )  # fmt: skip
    (event,) = decode_batch(payload).events
    assert event == Stored((int.from_bytes(digest[-8:], "big"),), None, (5, 6), 2)
    assert block_hash(-1) == (1 << 64) - 1, "SGLang's signed hashes wrap as vLLM's integer form does"


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]]),  # 3 tokens for one block of 2
        msgpack.packb([1.0, [["Teleported", [1]]]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": []}]]),
        msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]),
    ],
)
def test_what_is_not_an_event_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


class Mirror:
    """What a subscriber learns of an engine's cache: its blocks, each with its parent and text."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, bytes]] = {}
        self.forgotten: list[str] = []
        self.batches = 0

    def apply(self, endpoint: Endpoint, batch: Batch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, Stored):
                parent = event.parent
                for i, h in enumerate(event.block_hashes):
                    ids = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                    self.blocks[h] = (parent, b"".join(token_bytes(t) for t in ids))
                    parent = h
            elif isinstance(event, Removed):
                for h in event.block_hashes:
                    self.blocks.pop(h, None)
            else:
                self.blocks.clear()

    def forget(self, endpoint: Endpoint, why: str) -> None:
        self.forgotten.append(why)
        self.blocks.clear()

    def text_of(self, block: int) -> bytes:
        """The prompt text up to ``block``, from the blocks' own token ids."""
        parts = []
        at: int | None = block
        while at is not None:
            parent, text = self.blocks[at]
            parts.append(text)
            at = parent
        return b"".join(reversed(parts))


@pytest.fixture
async def engine() -> MockEngine:
    async with MockEngine(
        simulate=True, kv_blocks=64, kv_block_tokens=4, decode_step_ms=1.0, prefill_ms_per_token=0.0,
        kv_events="tcp://127.0.0.1:0", kv_events_replay="tcp://127.0.0.1:0",
    ) as engine:  # fmt: skip
        yield engine


@contextlib.asynccontextmanager
async def following(engine: MockEngine, context: zmq.asyncio.Context) -> AsyncIterator[tuple[Mirror, Subscription]]:
    """A subscriber mirroring ``engine``'s events, once connected; closed on the way out."""
    mirror = Mirror()
    subscription = follow(engine, mirror, context)
    try:
        await eventually(lambda: subscription.status.connected)
        yield mirror, subscription
    finally:
        await subscription.close()


def follow(engine: MockEngine, mirror: Mirror, context: zmq.asyncio.Context) -> Subscription:
    config = engine.state.kv_events.config()  # type: ignore[union-attr]
    endpoint = Endpoint(engine.url, 0, config["endpoint"], config["replay_endpoint"])  # type: ignore[arg-type]
    subscription = Subscription(endpoint, mirror, context)
    subscription.start()
    return subscription


async def chat(engine: MockEngine, text: str) -> dict[str, object]:
    body = {"model": engine.settings.model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with aiohttp.ClientSession() as client, client.post(engine.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        return body


def cached_names(engine: MockEngine) -> set[int]:
    cache = engine.state.batcher.cache  # type: ignore[union-attr]
    return {block_id(b) for b in [*cache._held, *cache._evictable] if not b.startswith(b"flushed")}


@pytest.fixture
async def context() -> zmq.asyncio.Context:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_a_subscriber_mirrors_the_engines_cache_and_reads_its_prompts_back(
    engine: MockEngine, context: zmq.asyncio.Context
) -> None:
    async with following(engine, context) as (mirror, subscription):
        bodies = [await chat(engine, f"question {i}: " + "words " * (5 + 7 * i)) for i in range(12)]
        await eventually(lambda: set(mirror.blocks) == cached_names(engine))
        assert engine.state.batcher.cache.evicted > 0, "a cache this small evicts: removals are followed too"  # type: ignore[union-attr]
        # A block still cached gives its prompt back, from the token ids of its chain.
        body = bodies[-1]
        prompt = render_prompt(body)
        last = block_id(block_hashes(prompt, 4)[-1])
        assert mirror.text_of(last) == prompt.encode()[: len(mirror.text_of(last))]
        assert len(mirror.text_of(last)) == len(prompt.encode()) // 16 * 16
        assert subscription.status.gaps == 0
        assert not mirror.forgotten


async def test_a_gap_is_replayed_and_a_lost_one_drops_what_was_known(
    engine: MockEngine, context: zmq.asyncio.Context
) -> None:
    async with following(engine, context) as (mirror, subscription):
        await chat(engine, "first " * 10)
        await eventually(lambda: mirror.batches > 0)
        async with aiohttp.ClientSession() as client:
            await client.post(engine.url + "/mock/kv_events", json={"drop": 2})
            await chat(engine, "second " * 10)
            await chat(engine, "third " * 10)
            await chat(engine, "fourth " * 10)
            await eventually(lambda: set(mirror.blocks) == cached_names(engine))
            assert subscription.status.gaps == 1
            assert subscription.status.replayed == 2
            assert not mirror.forgotten

            await client.post(engine.url + "/mock/kv_events", json={"lose": 1})
            await chat(engine, "fifth " * 10)
            await chat(engine, "sixth " * 10)
            await eventually(lambda: subscription.status.unfilled_gaps == 1)
            assert "not replayed" in mirror.forgotten[-1]
            # Known again from the next events on, and only what they say.
            assert set(mirror.blocks) <= cached_names(engine)


async def test_numbers_that_go_back_are_a_restarted_engine(engine: MockEngine, context: zmq.asyncio.Context) -> None:
    async with following(engine, context) as (mirror, subscription):
        for i in range(3):
            await chat(engine, f"turn {i} " * 10)
        await eventually(lambda: subscription.status.next_seq is not None and subscription.status.next_seq >= 2)
        async with aiohttp.ClientSession() as client:
            await client.post(engine.url + "/mock/kv_events", json={"restart": True})
        await chat(engine, "after the restart " * 10)
        await eventually(lambda: subscription.status.restarts == 1)
        assert "restarted" in mirror.forgotten[-1]


async def test_a_publisher_gone_is_forgotten_at_once(context: zmq.asyncio.Context) -> None:
    mirror = Mirror()
    async with MockEngine(
        simulate=True, kv_blocks=64, kv_block_tokens=4, decode_step_ms=1.0, prefill_ms_per_token=0.0,
        kv_events="tcp://127.0.0.1:0", kv_events_replay="tcp://127.0.0.1:0",
    ) as engine:  # fmt: skip
        subscription = follow(engine, mirror, context)
        await eventually(lambda: subscription.status.connected)
        await chat(engine, "held until the engine exits " * 8)
        await eventually(lambda: bool(mirror.blocks))
    try:
        # The engine exited (its cache with it): no batch will say so.
        await eventually(lambda: not subscription.status.connected)
        assert mirror.forgotten == ["disconnected from the publisher"]
        assert not mirror.blocks
        assert subscription.status.next_seq is None, "a publisher back is joined afresh"
    finally:
        await subscription.close()


async def test_a_late_subscriber_learns_what_the_engine_kept(engine: MockEngine, context: zmq.asyncio.Context) -> None:
    for i in range(4):
        await chat(engine, f"before anyone listened {i} " * 8)
    async with following(engine, context) as (mirror, subscription):
        await chat(engine, "now someone listens " * 8)
        await eventually(lambda: set(mirror.blocks) == cached_names(engine))
        assert subscription.status.replayed > 0
        assert not mirror.forgotten


async def test_an_idle_engine_is_known_warm_on_joining(engine: MockEngine, context: zmq.asyncio.Context) -> None:
    for i in range(4):
        await chat(engine, f"served before pdproxy started {i} " * 8)
    async with following(engine, context) as (mirror, subscription):
        # No batch comes now: what the engine kept is asked for as the subscription connects.
        await eventually(lambda: subscription.status.live)
        assert mirror.blocks
        assert set(mirror.blocks) == cached_names(engine)
        joined = subscription.status.next_seq
        assert joined is not None
        assert subscription.status.replayed == joined
        # The batches that follow are applied once, and nothing counts as a restart.
        await chat(engine, "and then someone asks " * 8)
        await eventually(lambda: set(mirror.blocks) == cached_names(engine))
        assert subscription.status.batches == subscription.status.replayed + subscription.status.next_seq - joined
        assert subscription.status.restarts == 0
        assert subscription.status.gaps == 0
        assert not mirror.forgotten


async def test_a_restart_right_after_joining_is_not_taken_for_replayed_batches(
    engine: MockEngine, context: zmq.asyncio.Context
) -> None:
    for i in range(3):
        await chat(engine, f"before the join {i} " * 8)
    async with following(engine, context) as (mirror, subscription):
        await eventually(lambda: subscription.status.live)
        assert subscription.status.replayed > 0
        # Numbered from 0 again with the socket kept (as bench/fleet_engines.py's reset does):
        # below the join's end, but published after it.
        async with aiohttp.ClientSession() as client:
            await client.post(engine.url + "/mock/kv_events", json={"restart": True})
        await chat(engine, "after the restart " * 8)
        await eventually(lambda: subscription.status.restarts == 1)
        assert "restarted" in mirror.forgotten[-1]
        # Known again from the restarted engine's events on, and only what they say (the
        # restart counts before its first batch applies: a replay of what came before is asked
        # for in between).
        await eventually(lambda: mirror.blocks, "the restarted engine's first batch applied")
        assert set(mirror.blocks) <= cached_names(engine)

"""The mock engine's continuous batching, as its gauges show it: a request counts as waiting
only once a step could not admit it, as vLLM's and SGLang's schedulers count theirs."""

from __future__ import annotations

import asyncio

from pdproxy.testing.batching import ContinuousBatcher, EngineModel


def model(max_batch: int) -> EngineModel:
    # A step that prefills 100 tokens takes 200 ms: long enough to submit another inside it.
    return EngineModel(
        kv_blocks=64,
        kv_block_tokens=16,
        max_batch=max_batch,
        max_step_tokens=512,
        prefill_ms_per_token=2.0,
        decode_step_ms=1.0,
        decode_step_ms_per_seq=0.0,
    )


async def test_a_request_come_during_a_step_is_not_waiting_until_a_step_leaves_it_out() -> None:
    batcher = ContinuousBatcher(model(max_batch=4))
    try:
        first = batcher.submit([], [], prompt_tokens=100, output_tokens=2)
        await asyncio.sleep(0.05)  # the first step, prefilling it, runs
        second = batcher.submit([], [], prompt_tokens=100, output_tokens=2)
        assert len(batcher.waiting) == 1
        assert batcher.queued == 0, "the next step admits it: no wait for a place"
        await asyncio.wait_for(second.progress.wait(), 2)
        assert second.admitted
        assert batcher.queued == 0
        await asyncio.wait_for(first.progress.wait(), 2)
    finally:
        await batcher.aclose()


async def test_a_request_a_full_batch_leaves_out_is_waiting() -> None:
    batcher = ContinuousBatcher(model(max_batch=1))
    try:
        batcher.submit([], [], prompt_tokens=100, output_tokens=200)  # decodes for 200 ms after
        await asyncio.sleep(0.05)
        second = batcher.submit([], [], prompt_tokens=100, output_tokens=2)

        async def left_out() -> None:
            while batcher.queued != 1:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(left_out(), 2)
        assert not second.admitted, "the batch of one is full"
    finally:
        await batcher.aclose()

"""Continuous batching, simulated in time with asyncio sleeps (no busy work: a whole fleet of
simulated engines runs on one core).

Requests wait in a FIFO queue until the batch has room (``max_batch``) and the KV cache can
hold their prompt and answer beside the running ones (``kv_cache``); the head of the queue
waits for room rather than be overtaken, as vLLM's and LMDeploy's schedulers do. Admission
looks up the prompt's blocks in the prefix cache: only the uncached tokens (at least one)
are prefilled. Each step of the engine prefills up to ``max_step_tokens`` prompt tokens
(chunked prefill) and decodes one token for every request past its prefill; it lasts

    decode_step_ms + decode_step_ms_per_seq * decoding requests + prefill_ms_per_token * prefilled tokens

so a long uncached prompt delays its own first token and, while it is prefilled, every
other request's next token. A request's first token comes at the end of the step that
finishes its prefill.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from dataclasses import dataclass, field

from .kv_cache import PagedKvCache

#: Lateness of a step's wake-up (seconds) that the next step makes up.
CATCH_UP = 0.005


@dataclass(frozen=True)
class EngineModel:
    """What a simulated engine's time is made of."""

    kv_blocks: int
    kv_block_tokens: int
    max_batch: int
    max_step_tokens: int
    prefill_ms_per_token: float
    decode_step_ms: float
    decode_step_ms_per_seq: float

    def step_ms(self, decoding: int, prefilled: int) -> float:
        return self.decode_step_ms + self.decode_step_ms_per_seq * decoding + self.prefill_ms_per_token * prefilled


class PromptTooLong(Exception):
    """The prompt and answer need more KV blocks than the whole cache has."""


@dataclass(eq=False)
class SimRequest:
    """One request inside the simulated engine."""

    #: The named blocks of the prompt, and of the answer once complete (``completed``).
    prompt_blocks: list[bytes]
    completed_blocks: list[bytes]
    prompt_tokens: int
    output_tokens: int
    #: Blocks the request holds besides its named prompt blocks.
    private_blocks: int = 0
    cached_tokens: int = 0
    #: Prompt tokens still to prefill (known once admitted).
    to_prefill: int = 0
    #: Uncached prompt tokens when it arrived (the oracle's estimate while it waits).
    uncached_on_arrival: int = 0
    #: KV blocks it would take beside those running requests held when it arrived (the
    #: oracle's estimate while it waits), and those its admission took (given back as it ends).
    blocks_on_arrival: int = 0
    added_blocks: int = 0
    produced: int = 0
    admitted: bool = False
    finished: bool = False
    cancelled: bool = False
    error: Exception | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def next_tokens(self) -> int:
        """Waits until the engine made progress; how many tokens exist now (raises the
        request's error, if it failed)."""
        await self.progress.wait()
        self.progress.clear()
        if self.error is not None:
            raise self.error
        return self.produced


@dataclass
class EngineCounters:
    """Cumulative figures the engines export as Prometheus counters."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    #: The cache hit rate of the last step that admitted requests (SGLang's gauge).
    last_hit_rate: float = 0.0
    #: Seconds the steps ran late beyond what the next step makes up (a machine too busy to
    #: keep the simulated time: it should stay near zero).
    late_s: float = 0.0


class ContinuousBatcher:
    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self.cache = PagedKvCache(model.kv_blocks)
        self.waiting: collections.deque[SimRequest] = collections.deque()
        #: The requests the last step could not admit: what the engines' gauges of waiting
        #: requests say (vLLM's and SGLang's schedulers set theirs after a step's admissions).
        #: A request that came since, which the next step admits, is not in it.
        self.queued = 0
        self.running: list[SimRequest] = []
        self.counters = EngineCounters()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock = 0.0

    def submit(
        self, prompt_blocks: list[bytes], answer_blocks: list[bytes], prompt_tokens: int, output_tokens: int
    ) -> SimRequest:
        """Queues a request: ``prompt_blocks`` are the named blocks of its prompt,
        ``answer_blocks`` those its answer completes."""
        block = self.model.kv_block_tokens
        total_blocks = math.ceil((prompt_tokens + output_tokens) / block)
        request = SimRequest(
            prompt_blocks=prompt_blocks,
            completed_blocks=answer_blocks,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            private_blocks=max(0, total_blocks - len(prompt_blocks)),
        )
        if total_blocks > self.model.kv_blocks:
            request.error = PromptTooLong(
                f"the request needs {total_blocks} KV blocks; the engine has {self.model.kv_blocks}"
            )
            request.progress.set()
            return request
        request.uncached_on_arrival = self._uncached(request, self.cache.cached_prefix(prompt_blocks))
        request.blocks_on_arrival = total_blocks - self.cache.held(prompt_blocks)
        self.waiting.append(request)
        self._ensure_running()
        self._wake.set()
        return request

    def cancel(self, request: SimRequest) -> None:
        """The client went away: the request leaves the queue or the batch at the next step."""
        if not request.finished:
            request.cancelled = True
            self._wake.set()

    def reset(self) -> None:
        """Forgets every cached block and zeroes the counters (between benchmark runs)."""
        self.cache.clear()
        self.counters = EngineCounters()

    def flush(self) -> None:
        """Empties the prefix cache, as vLLM's ``POST /reset_prefix_cache`` does: no later prompt
        finds anything cached before. Running requests go on with the KV they hold (their
        prompts and answers are not kept once they finish); the counters go on counting."""
        renamed = self.cache.flush()
        for request in self.running:
            request.prompt_blocks = [renamed.get(block, block) for block in request.prompt_blocks]
            request.completed_blocks = []
        for request in self.waiting:
            request.uncached_on_arrival = self._uncached(request, 0)
            request.blocks_on_arrival = len(request.prompt_blocks) + request.private_blocks

    def restart(self) -> None:
        """What a restarted engine shows from outside, without the downtime: its prefix cache
        empty and its cumulative counters (``/metrics``) back to zero. Requests in flight finish
        as they would have; how late the simulation ran (``late_s``) is not the engine's figure
        and is kept."""
        self.flush()
        self.counters = EngineCounters(late_s=self.counters.late_s)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the oracle's view ------------------------------------------------------------------

    def uncached_tokens(self, prompt_blocks: list[bytes], prompt_tokens: int) -> int:
        """Tokens of this prompt the engine would prefill, were it to arrive now."""
        return max(1, prompt_tokens - self.cache.cached_prefix(prompt_blocks) * self.model.kv_block_tokens)

    def estimate_ttft(self, prompt_blocks: list[bytes], prompt_tokens: int, output_tokens: int = 0) -> float:
        """Seconds until the first token of a request with this prompt (and answer, for the KV
        blocks it needs), were it to arrive now: the wait for a place in the batch and for room
        in the KV cache, then the prefill ahead of it and its own."""
        model = self.model
        own = self.uncached_tokens(prompt_blocks, prompt_tokens)
        ahead = sum(r.to_prefill for r in self.running) + sum(r.uncached_on_arrival for r in self.waiting)
        decoding = sum(1 for r in self.running if r.to_prefill == 0)
        step = model.step_ms(decoding, 0)
        queue = len(self.running) + len(self.waiting) - model.max_batch
        slot_steps = 0
        if queue >= 0 and self.running:
            # Slots free up as running requests finish: the (queue+1)-th to finish frees ours.
            left = sorted(r.output_tokens - r.produced for r in self.running)
            rounds, k = divmod(queue, len(left))
            slot_steps = left[k] + rounds * left[-1]
        blocks = math.ceil((prompt_tokens + output_tokens) / model.kv_block_tokens) - self.cache.held(prompt_blocks)
        prefill = ahead + own
        steps = math.ceil(prefill / model.max_step_tokens)
        wait = max(slot_steps, self._kv_wait_steps(blocks))
        return (wait * step + steps * step + prefill * model.prefill_ms_per_token) / 1000

    def _kv_wait_steps(self, blocks: int) -> int:
        """Decode steps until the KV cache has room for ``blocks`` more beside the requests
        waiting ahead, as the running ones finish (those with the fewest tokens left first) and
        give back what they took: long contexts fill the cache before the batch is full."""
        need = blocks + sum(r.blocks_on_arrival for r in self.waiting)
        free = self.cache.total - self.cache.used
        if need <= free:
            return 0
        ending = sorted((r.output_tokens - r.produced, r.added_blocks) for r in self.running)
        for left, given_back in ending:
            free += given_back
            if need <= free:
                return left
        return ending[-1][0] if ending else 0

    # -- the engine -------------------------------------------------------------------------

    def _uncached(self, request: SimRequest, matched_blocks: int) -> int:
        return max(1, request.prompt_tokens - matched_blocks * self.model.kv_block_tokens)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mock-engine-batcher")

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self.waiting):
            self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        for request in [r for r in self.running if r.cancelled]:
            self._leave(request, complete=False)

    def _admit(self) -> None:
        admitted = hits = prompt = 0
        while self.waiting and len(self.running) < self.model.max_batch:
            request = self.waiting[0]
            used = self.cache.used
            matched = self.cache.allocate(request.prompt_blocks, request.private_blocks)
            if matched is None:
                if not self.running:  # never fits beside itself: cannot happen once sized by submit
                    self.waiting.popleft()
                    request.error = PromptTooLong("the request does not fit in the KV cache")
                    request.progress.set()
                    continue
                break
            self.waiting.popleft()
            request.added_blocks = self.cache.used - used
            request.admitted = True
            request.to_prefill = self._uncached(request, matched)
            request.cached_tokens = request.prompt_tokens - request.to_prefill
            self.running.append(request)
            admitted += 1
            hits += request.cached_tokens
            prompt += request.prompt_tokens
        if admitted:
            self.counters.prompt_tokens += prompt
            self.counters.cached_tokens += hits
            self.counters.last_hit_rate = hits / prompt

    def _leave(self, request: SimRequest, complete: bool) -> None:
        self.running.remove(request)
        completed = request.completed_blocks if complete else []
        self.cache.release(request.prompt_blocks, request.private_blocks, completed)
        request.finished = True
        if complete:
            self.counters.finished += 1
        request.progress.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        ends: float | None = None  # when the previous step ended (None: the engine was idle)
        while True:
            self._drop_cancelled()
            self._admit()
            self.queued = len(self.waiting)
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                ends = None
                continue
            budget = self.model.max_step_tokens
            prefill: list[tuple[SimRequest, int]] = []
            for request in self.running:
                if request.to_prefill and budget:
                    take = min(request.to_prefill, budget)
                    prefill.append((request, take))
                    budget -= take
            decoding = [r for r in self.running if not r.to_prefill]
            step = self.model.step_ms(len(decoding), self.model.max_step_tokens - budget) / 1000
            # Steps follow each other on a schedule: a wake-up a little late (a busy machine)
            # is made up at the next step instead of slowing the engine down.
            now = loop.time()
            if ends is not None and now - ends > CATCH_UP:
                self.counters.late_s += now - ends - CATCH_UP
            ends = (now if ends is None else max(ends, now - CATCH_UP)) + step
            await asyncio.sleep(ends - now)
            for request, take in prefill:
                request.to_prefill -= take
                if not request.to_prefill and not request.cancelled:
                    self._produce(request)
            for request in decoding:
                if not request.cancelled:
                    self._produce(request)

    def _produce(self, request: SimRequest) -> None:
        if request.produced < request.output_tokens:
            request.produced += 1
            self.counters.generation_tokens += 1
        if request.produced >= request.output_tokens:
            self._leave(request, complete=True)
        else:
            request.progress.set()

"""The fleet benchmark's workloads: what real fleets see, as deterministic traces (one seed).

- ``multi_turn``: chats whose history grows turn by turn. Conversations arrive at random
  (Poisson); each shares one short system prompt, opens with a long message (a pasted document)
  and goes on with short ones; every turn's prompt is the whole conversation so far, its answers
  included, sent a think time after the previous answer arrived.
- ``system_prompts``: many users sharing a few long system prompts, popular ones far more than
  others (Zipf), each asking one short question of their own.
- ``no_reuse``: prompts that share nothing.

A trace is a list of conversations (one turn for the last two). Its nominal capacity, the rate
that would keep every engine saturated if each prompt block were computed only once in the whole
fleet (``ideal_capacity``), sets the arrival rates: a load of 80% arrives at 0.8 of it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from pdproxy.testing.batching import EngineModel
from pdproxy.testing.generation import generate, prompt_text
from pdproxy.testing.tokens import TOKEN_BYTES, block_hashes, count_tokens, render_prompt

_VOCABULARY = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu amber birch cedar dune ember fjord grove harbor "
    "island jungle karst lagoon meadow nectar orchard prairie quartz river summit tundra upland valley willow"
).split()


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of filler text."""
    words: list[str] = []
    size = 0
    while size < tokens * TOKEN_BYTES:
        word = rng.choice(_VOCABULARY)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


#: The simulated engines' time model is the mock engine's own (``--simulate`` options).
EngineShape = EngineModel


def engine_options(shape: EngineShape) -> dict[str, float | int]:
    """``shape`` as the mock engine's ``--engine`` JSON takes it."""
    return dataclasses.asdict(shape)


def decode_ms_per_token(shape: EngineShape) -> float:
    """A full batch's step, shared by its requests."""
    return (shape.decode_step_ms + shape.decode_step_ms_per_seq * shape.max_batch) / shape.max_batch


@dataclass
class Conversation:
    """One user's requests: ``turns`` user messages, each sent ``think`` seconds after the answer
    to the one before (the first at ``start``)."""

    start: float
    system: str
    turns: list[str]
    think: list[float]
    max_tokens: int

    def messages(self, answers: list[str]) -> list[dict[str, str]]:
        """The next turn's messages, given the answers so far."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i, answer in enumerate(answers):
            out += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answer}]
        out.append({"role": "user", "content": self.turns[len(answers)]})
        return out

    def body(self, model: str, answers: list[str], stream: bool = True) -> dict[str, object]:
        return {
            "model": model,
            "messages": self.messages(answers),
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": stream,
            "stream_options": {"include_usage": True},
        }


@dataclass
class Trace:
    workload: str
    #: Seconds over which the conversations arrive.
    duration: float
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    #: Requests per conversation.
    turns: int
    max_tokens: int

    def trace(self, rate: float, duration: float, seed: int) -> Trace:
        """Conversations arriving over ``duration`` seconds so that requests come at ``rate``
        per second."""
        rng = random.Random(f"{self.name}:{seed}")
        trace = Trace(self.name, duration)
        start = 0.0
        while True:
            start += rng.expovariate(rate / self.turns)
            if start >= duration:
                return trace
            trace.conversations.append(self._conversation(rng, start))

    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        raise NotImplementedError


class MultiTurn(Workload):
    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        turns = [text(rng, 256)] + [text(rng, rng.randint(32, 96)) for _ in range(self.turns - 1)]
        think = [rng.uniform(0.2, 0.8) for _ in range(self.turns)]
        return Conversation(start, SHARED_SYSTEM, turns, think, self.max_tokens)


class SystemPrompts(Workload):
    prompts = 32
    prompt_tokens = 2048
    zipf = 1.1

    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        weights = [1 / (k + 1) ** self.zipf for k in range(self.prompts)]
        k = rng.choices(range(self.prompts), weights)[0]
        return Conversation(start, SYSTEM_PROMPTS[k], [text(rng, rng.randint(32, 96))], [0.0], self.max_tokens)


class NoReuse(Workload):
    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        return Conversation(start, "", [text(rng, rng.randint(256, 512))], [0.0], self.max_tokens)


SHARED_SYSTEM = text(random.Random("shared-system"), 256)
SYSTEM_PROMPTS = [text(random.Random(f"system-{k}"), SystemPrompts.prompt_tokens) for k in range(SystemPrompts.prompts)]

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        MultiTurn("multi_turn", "multi-turn chats, history growing turn by turn", turns=6, max_tokens=32),
        SystemPrompts("system_prompts", "users sharing 32 long system prompts (Zipf 1.1)", turns=1, max_tokens=32),
        NoReuse("no_reuse", "prompts with no reuse", turns=1, max_tokens=32),
    )
}
PREFIX_HEAVY = ("multi_turn", "system_prompts")


def ideal_uncached_tokens(trace: Trace, block_tokens: int) -> float:
    """Mean tokens per request to prefill if the whole fleet were one engine with an endless
    cache: each prompt block computed once (answers are the engines' deterministic ones)."""
    seen: set[bytes] = set()
    total = requests = 0
    for conversation in sorted(trace.conversations, key=lambda c: c.start):
        answers: list[str] = []
        for _ in conversation.turns:
            body = conversation.body("m", answers, stream=False)
            prompt = render_prompt(body)
            full_blocks = len(prompt.encode()) // (block_tokens * TOKEN_BYTES)
            hashes = block_hashes(prompt, block_tokens)[:full_blocks]
            cached = 0
            for block in hashes:
                if block not in seen:
                    break
                cached += 1
            seen.update(hashes)
            total += max(1, count_tokens(prompt) - cached * block_tokens)
            requests += 1
            tokens, _ = generate(prompt_text(body), conversation.max_tokens, ignore_eos=True)
            answers.append("".join(tokens))
    return total / max(1, requests)


def ideal_capacity(workload: Workload, shape: EngineShape, engines: int, seed: int) -> float:
    """Requests per second the fleet serves at most on this workload: every engine busy with full
    batches, each request prefilling only what no request before it computed."""
    sample = workload.trace(rate=20.0, duration=60.0, seed=seed)
    uncached = ideal_uncached_tokens(sample, shape.kv_block_tokens)
    per_request_ms = uncached * shape.prefill_ms_per_token + workload.max_tokens * decode_ms_per_token(shape)
    return engines * 1000 / per_request_ms


def stats(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of ``values`` (nearest rank)."""
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "mean": sum(ordered) / len(ordered)}

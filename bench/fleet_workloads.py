"""The fleet benchmark's workloads: what real fleets see, as deterministic traces (one seed).

- ``multi_turn``: chats whose history grows turn by turn. Conversations arrive at random
  (Poisson); each shares one short system prompt, opens with a long message (a pasted document)
  and goes on with short ones; every turn's prompt is the whole conversation so far, its answers
  included, sent a think time after the previous answer arrived.
- ``system_prompts``: many users sharing a few long system prompts, popular ones far more than
  others (Zipf), each asking one short question of their own.
- ``no_reuse``: prompts that share nothing.
- ``hot_prefix``: one long system prompt in 60% of the requests, too popular for one engine to
  serve alone, and a long tail behind it: the other 40% spread over 256 other system prompts
  (Zipf), more than every engine can hold at once. One short question each.
- ``agent_sessions``: an agent working through a task: a system prompt (a short preamble all
  sessions share, then a long context of the session's own) and the task, then turn after turn
  a tool result of a few hundred to a thousand tokens and a short answer, a moment apart (the
  tool running); the context grows to about 12k tokens, so that what an engine holds of a
  prompt runs far past its first few KiB. Runs twice as long as the others, so that sessions
  reach their long contexts inside the measured window.
- ``unequal_engines``: ``system_prompts``' traffic on a fleet whose last two engines are twice as
  slow (prefill and decode steps): where a request goes must weigh an engine's speed.
- ``bursts``: ``system_prompts``' prompts arriving in bursts at the same mean rate: three times
  the mean rate for one second in every four, a third of it in between.
- ``evict_restart``: ``hot_prefix``' traffic, whose long tail keeps every engine's cache
  evicting, and one engine restarted inside the measured window: what a router believes an
  engine holds goes wrong both ways (it was evicted; it was lost), which the engines' own KV
  events (``--kv-events``) tell and a router's guess does not.
- ``flush_restart``: ``system_prompts``' traffic; inside the measured window one engine's prefix
  cache is flushed (as vLLM's ``POST /reset_prefix_cache`` does) and, later, another engine is
  restarted (its cache empty and its ``/metrics`` counters back to zero): an engine that lost its
  cache must get its share of the traffic back.

A workload declares its fleet (``Workload.fleet``: each engine's shape; most use ``FLEET``, eight
equal engines) and the events on its engines during a run (``Workload.events``). A trace is a
list of conversations (one turn for the single-question workloads) and the times of those
events. Its nominal capacity, the rate that would keep every engine saturated if each prompt
block were computed only once in the whole fleet (``ideal_capacity``), bounds the search for the
fleet's capacity, which sets the arrival rates: a load of 80% arrives at 0.8 of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Iterator
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

#: Each engine: a KV cache of 32768 tokens (16 of the 32 long system prompts, or the histories of
#: a few dozen conversations beside a full batch), 16 requests at once, prefill at 0.2 ms per
#: uncached token (a 2048-token prompt takes 0.4 s), decode steps of 10 ms plus 0.5 ms per
#: request in the batch; 1024 prompt tokens per step (chunked prefill).
SHAPE = EngineShape(
    kv_blocks=2048,
    kv_block_tokens=16,
    max_batch=16,
    max_step_tokens=1024,
    prefill_ms_per_token=0.2,
    decode_step_ms=10.0,
    decode_step_ms_per_seq=0.5,
)


def slowed(shape: EngineShape, factor: float) -> EngineShape:
    """``shape`` ``factor`` times slower: its prefill per token and its decode steps."""
    return dataclasses.replace(
        shape,
        prefill_ms_per_token=shape.prefill_ms_per_token * factor,
        decode_step_ms=shape.decode_step_ms * factor,
        decode_step_ms_per_seq=shape.decode_step_ms_per_seq * factor,
    )


#: The fleet most workloads run on: eight equal engines.
FLEET = (SHAPE,) * 8
#: Eight engines, the last two twice as slow.
UNEQUAL_FLEET = (SHAPE,) * 6 + (slowed(SHAPE, 2.0),) * 2


def engine_options(shape: EngineShape) -> dict[str, float | int]:
    """``shape`` as the mock engine's ``--engine`` JSON takes it."""
    return dataclasses.asdict(shape)


def decode_ms_per_token(shape: EngineShape, batch: float | None = None) -> float:
    """A step of ``batch`` requests (a full batch by default), shared by them."""
    batch = shape.max_batch if batch is None else batch
    return (shape.decode_step_ms + shape.decode_step_ms_per_seq * batch) / batch


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


#: What can happen to an engine during a run: its prefix cache emptied (``flush``), or that and
#: its cumulative counters back to zero (``restart``); see ``fleet_engines.py``.
EVENT_KINDS = ("flush", "restart")


@dataclass(frozen=True)
class Event:
    """``kind`` done to engine ``engine`` (its index in the fleet) ``at`` seconds into the run."""

    at: float
    kind: str
    engine: int


@dataclass
class Trace:
    workload: str
    #: Seconds over which the conversations arrive.
    duration: float
    conversations: list[Conversation] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


@dataclass(frozen=True)
class Bursts:
    """On/off arrivals: ``factor`` times the mean rate for ``on`` seconds at the start of every
    ``period``, and the rate that keeps the mean in between."""

    period: float
    on: float
    factor: float

    def __post_init__(self) -> None:
        if not 0 < self.on < self.period or self.factor * self.on > self.period:
            raise ValueError(f"bursts of {self.factor}x for {self.on} s in {self.period} s cannot keep the mean")

    def rate(self, at: float, mean: float) -> float:
        if at % self.period < self.on:
            return mean * self.factor
        return mean * (self.period - self.factor * self.on) / (self.period - self.on)

    def next_arrival(self, rng: random.Random, after: float, mean: float) -> float:
        """The next arrival after ``after`` (a Poisson process of that rate over time, thinned
        from one at the bursts' rate)."""
        peak = mean * self.factor
        at = after
        while True:
            at += rng.expovariate(peak)
            if rng.random() * peak <= self.rate(at, mean):
                return at


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    #: Requests per conversation.
    turns: int
    max_tokens: int
    #: The engines it runs on, one shape each.
    fleet: tuple[EngineShape, ...] = FLEET
    #: Done to the engines during a run: (fraction of the arrivals' window, kind, engine).
    events: tuple[tuple[float, str, int], ...] = ()
    #: Conversations arrive in bursts; None: at random (Poisson).
    bursts: Bursts | None = None
    #: Its runs, their warm-up and the capacity probes last this many times the usual: long
    #: sessions need that to reach their long contexts inside the measured window.
    stretch: float = 1.0

    def __post_init__(self) -> None:
        for fraction, kind, engine in self.events:
            if kind not in EVENT_KINDS or not 0 <= engine < len(self.fleet) or not 0 < fraction < 1:
                raise ValueError(f"{self.name}: no {kind} of engine {engine} at {fraction:.0%} of a run")

    def trace(self, rate: float, duration: float, seed: int) -> Trace:
        """Conversations arriving over ``duration`` seconds so that requests come at ``rate``
        per second."""
        rng = random.Random(f"{self.name}:{seed}")
        trace = Trace(self.name, duration, events=[Event(f * duration, k, e) for f, k, e in self.events])
        start = 0.0
        while True:
            if self.bursts is None:
                start += rng.expovariate(rate / self.turns)
            else:
                start = self.bursts.next_arrival(rng, start, rate / self.turns)
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


def _zipf(count: int, s: float) -> list[float]:
    return [1 / (k + 1) ** s for k in range(count)]


class SystemPrompts(Workload):
    prompts = 32
    prompt_tokens = 2048
    zipf = 1.1

    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        k = rng.choices(range(self.prompts), _zipf(self.prompts, self.zipf))[0]
        return Conversation(start, SYSTEM_PROMPTS[k], [text(rng, rng.randint(32, 96))], [0.0], self.max_tokens)


class NoReuse(Workload):
    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        return Conversation(start, "", [text(rng, rng.randint(256, 512))], [0.0], self.max_tokens)


class HotPrefix(Workload):
    #: The share of requests behind the hot prompt, and its length.
    hot_share = 0.6
    hot_tokens = 2048
    #: The tail: this many other prompts of this length, chosen by Zipf.
    tail = 256
    tail_tokens = 1024
    zipf = 1.0

    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        if rng.random() < self.hot_share:
            system = hot_prompt()
        else:
            system = tail_prompts()[rng.choices(range(self.tail), _zipf(self.tail, self.zipf))[0]]
        return Conversation(start, system, [text(rng, rng.randint(32, 96))], [0.0], self.max_tokens)


class AgentSessions(Workload):
    """The system prompt is a short preamble every session shares (the agent's instructions)
    and a long context of the session's own (its repository, its documents): were all of it
    shared, the greedy oracle, and any router that follows cached prefixes, would start every
    session on the engines that hold it until their queues cost more than its prefill, and the
    sessions, held there by their growing histories, would overload them (the fleet's capacity,
    measured through the oracle, would be a fraction of what it serves). Tool results are sent
    as user messages: a ``tool`` message needs the id of a tool call the answers never make (and
    routers that parse messages would refuse it)."""

    shared_tokens = 256
    context_tokens = 1792
    task_tokens = 512
    tool_result_tokens = (200, 1000)
    #: The tool's running time between an answer and the next turn (seconds).
    think = (0.1, 0.5)

    def _conversation(self, rng: random.Random, start: float) -> Conversation:
        results = [text(rng, rng.randint(*self.tool_result_tokens)) for _ in range(self.turns - 1)]
        think = [rng.uniform(*self.think) for _ in range(self.turns)]
        system = f"{agent_prompt()} {text(rng, self.context_tokens)}"
        return Conversation(start, system, [text(rng, self.task_tokens), *results], think, self.max_tokens)


SHARED_SYSTEM = text(random.Random("shared-system"), 256)
SYSTEM_PROMPTS = [text(random.Random(f"system-{k}"), SystemPrompts.prompt_tokens) for k in range(SystemPrompts.prompts)]


@functools.cache
def hot_prompt() -> str:
    return text(random.Random("hot-system"), HotPrefix.hot_tokens)


@functools.cache
def tail_prompts() -> list[str]:
    return [text(random.Random(f"tail-system-{k}"), HotPrefix.tail_tokens) for k in range(HotPrefix.tail)]


@functools.cache
def agent_prompt() -> str:
    return text(random.Random("agent-system"), AgentSessions.shared_tokens)


_PROMPTS_TITLE = "32 long system prompts (Zipf 1.1)"
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        MultiTurn("multi_turn", "multi-turn chats, history growing turn by turn", turns=6, max_tokens=32),
        SystemPrompts("system_prompts", "users sharing 32 long system prompts (Zipf 1.1)", turns=1, max_tokens=32),
        NoReuse("no_reuse", "prompts with no reuse", turns=1, max_tokens=32),
        HotPrefix("hot_prefix", "one system prompt in 60% of requests, 256 others (Zipf 1.0)", turns=1, max_tokens=32),
        AgentSessions(
            "agent_sessions", "agent sessions, context growing to ~12k tokens", turns=16, max_tokens=32, stretch=2.0
        ),
        SystemPrompts(
            "unequal_engines",
            f"{_PROMPTS_TITLE}, 2 of 8 engines 2x slower",
            turns=1,
            max_tokens=32,
            fleet=UNEQUAL_FLEET,
        ),
        SystemPrompts(
            "bursts",
            f"{_PROMPTS_TITLE} in bursts (3x the mean rate 1 s in 4)",
            turns=1,
            max_tokens=32,
            bursts=Bursts(period=4.0, on=1.0, factor=3.0),
        ),
        HotPrefix(
            "evict_restart",
            "hot_prefix's traffic (caches evicting all the time), engine 2 restarted at 50%",
            turns=1,
            max_tokens=32,
            events=((0.5, "restart", 2),),
        ),
        SystemPrompts(
            "flush_restart",
            f"{_PROMPTS_TITLE}, engine 0 flushed at 40% of the run, engine 3 restarted at 60%",
            turns=1,
            max_tokens=32,
            events=((0.4, "flush", 0), (0.6, "restart", 3)),
        ),
    )
}


def _requests(trace: Trace, block_tokens: int) -> Iterator[tuple[int, list[bytes], int]]:
    """Every request of ``trace``, conversation by conversation in order of their starts: its
    conversation's index, the hashes of its prompt's full blocks and its prompt's tokens
    (answers are the engines' deterministic ones)."""
    for index, conversation in enumerate(sorted(trace.conversations, key=lambda c: c.start)):
        answers: list[str] = []
        for _ in conversation.turns:
            body = conversation.body("m", answers, stream=False)
            prompt = render_prompt(body)
            full_blocks = len(prompt.encode()) // (block_tokens * TOKEN_BYTES)
            yield index, block_hashes(prompt, block_tokens)[:full_blocks], count_tokens(prompt)
            tokens, _ = generate(prompt_text(body), conversation.max_tokens, ignore_eos=True)
            answers.append("".join(tokens))


@dataclass(frozen=True)
class IdealLoad:
    #: Mean tokens per request to prefill if the whole fleet were one engine with an endless
    #: cache: each prompt block computed once.
    uncached_tokens: float
    #: Mean tokens per request (prompt and answer) a KV cache holds for it alone, beside the
    #: blocks it shares with other conversations: what bounds a batch of long contexts.
    private_tokens: float


def ideal_load(trace: Trace, block_tokens: int, max_tokens: int) -> IdealLoad:
    seen: set[bytes] = set()
    conversations: dict[bytes, set[int]] = {}
    requests: list[tuple[list[bytes], int]] = []
    uncached = 0
    for index, hashes, tokens in _requests(trace, block_tokens):
        cached = 0
        for block in hashes:
            if block not in seen:
                break
            cached += 1
        seen.update(hashes)
        for block in hashes:
            conversations.setdefault(block, set()).add(index)
        uncached += max(1, tokens - cached * block_tokens)
        requests.append((hashes, tokens))
    private = 0
    for hashes, tokens in requests:
        shared = sum(1 for block in hashes if len(conversations[block]) > 1)
        private += tokens + max_tokens - shared * block_tokens
    count = max(1, len(requests))
    return IdealLoad(uncached / count, private / count)


def ideal_capacity(workload: Workload, seed: int) -> float:
    """Requests per second its fleet serves at most on this workload: every engine busy with
    batches as full as its KV cache allows (16 requests, fewer when each holds a long context of
    its own), each request prefilling only what no request before it computed; the engines'
    rates added up."""
    sample = workload.trace(rate=20.0, duration=60.0, seed=seed)
    load = ideal_load(sample, workload.fleet[0].kv_block_tokens, workload.max_tokens)
    total = 0.0
    for shape in workload.fleet:
        batch = min(shape.max_batch, max(1.0, shape.kv_blocks * shape.kv_block_tokens / load.private_tokens))
        per_request_ms = load.uncached_tokens * shape.prefill_ms_per_token + workload.max_tokens * decode_ms_per_token(
            shape, batch
        )
        total += 1000 / per_request_ms
    return total


def stats(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of ``values`` (nearest rank)."""
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "mean": sum(ordered) / len(ordered)}

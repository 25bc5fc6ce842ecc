"""How far below round robin any router can bring the TTFT p99 of `bench/fleet.py`'s `no_reuse`
workload: a discrete-event model of its eight simulated engines (the step rule of
`pdproxy.testing.batching`, in simulated time, so it runs in seconds and without the machine's
noise), fed the same kind of trace, and routed by policies that see the engines' exact state.

    python bench/no_reuse_bound.py            # seeds 1-3
    python bench/no_reuse_bound.py --seeds 6

Prompts that share nothing leave a router only one lever: where each one's prefill waits for
another's. Round robin spaces each engine's arrivals by eight gaps; the policies here:

- ``least requests``: the engine with the fewest requests in flight (ties at random);
- ``greedy exact``: the engine where this request's first token comes soonest, from the engine's
  exact state (the oracle of bench/fleet.py does this);
- ``scored's pricing``: `scored`'s cost for a prompt no engine holds, as pdproxy prices it (a
  prefill clock per node that each request sent there pushes on by a fixed part and its own
  prefill; the requests still waiting for their first token; its tie rule);
- ``exact bound``: an engine with no prefill pending if there is one (the one sent to least
  recently), else the one whose pending prefill ends first, from the exact state: what a router
  that saw inside the engines could do.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet_workloads import FLEET, WORKLOADS

SHAPE = FLEET[0]
ENGINES = len(FLEET)
#: 80% of the capacity bench/fleet.py measured for no_reuse (README, Fleet).
RATE = 0.8 * 67.9
#: As bench/fleet.py runs no_reuse at 80%: 15 s of arrivals three times over, 4 s not measured.
DURATION_S, WARMUP_S = 45.0, 4.0
PROMPT_TOKENS = (256, 512)
OUTPUT_TOKENS = WORKLOADS["no_reuse"].max_tokens


@dataclass(eq=False)
class Request:
    sent_ms: float
    tokens: int
    to_prefill: int
    produced: int = 0
    ttft_ms: float | None = None


@dataclass(eq=False)
class Engine:
    index: int
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    #: The step in progress: when it ends, and the prompt tokens it prefills for whom.
    step_ends_ms: float | None = None
    step_prefill: list[tuple[Request, int]] = field(default_factory=list)
    last_sent_ms: float = -1.0
    #: scored's prefill clock (ms) as pdproxy keeps it.
    clock_ms: float = 0.0

    def unanswered(self) -> int:
        return sum(1 for r in self.waiting + self.running if r.ttft_ms is None)

    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def prefill_ends_ms(self, now_ms: float) -> float:
        """When the prefill pending here ends: the step in progress, then what it left."""
        left = sum(r.to_prefill for r in self.waiting + self.running) - sum(t for _, t in self.step_prefill)
        return (self.step_ends_ms or now_ms) + SHAPE.prefill_ms_per_token * left


Policy = Callable[[list[Engine], Request, float], Engine]


def round_robin() -> Policy:
    turn = itertools.count()
    return lambda engines, _request, _now: engines[next(turn) % len(engines)]


def least_requests(rng: random.Random) -> Policy:
    return lambda engines, _request, _now: min(engines, key=lambda e: (e.in_flight(), rng.random()))


def greedy_exact(rng: random.Random) -> Policy:
    def first_token_ms(engine: Engine, request: Request, now_ms: float) -> float:
        decoding = sum(1 for r in engine.running if not r.to_prefill)
        own = SHAPE.decode_step_ms + SHAPE.decode_step_ms_per_seq * decoding
        return engine.prefill_ends_ms(now_ms) + own + SHAPE.prefill_ms_per_token * request.tokens

    return lambda engines, request, now: min(engines, key=lambda e: (first_token_ms(e, request, now), rng.random()))


def scored_pricing(fixed_ms: float = 20.0, prefix: float = 2.0, tie_share: float = 0.02) -> Policy:
    def pick(engines: list[Engine], request: Request, now_ms: float) -> Engine:
        own = SHAPE.prefill_ms_per_token * request.tokens
        costs = []
        for engine in engines:
            behind = engine.unanswered()
            if not behind:  # the last one's first byte sets the clock to now
                engine.clock_ms = min(engine.clock_ms, now_ms)
            costs.append(max(0.0, engine.clock_ms - now_ms) + own * (1 + prefix * (1 + behind)))
        best = min(costs)
        tied = [e for e, c in zip(engines, costs, strict=True) if c <= best + max(best * tie_share, 1.0)]
        chosen = min(tied, key=lambda e: (e.in_flight(), e.last_sent_ms))
        chosen.clock_ms = max(chosen.clock_ms, now_ms) + fixed_ms + own
        return chosen

    return pick


def exact_bound() -> Policy:
    def pick(engines: list[Engine], _request: Request, now_ms: float) -> Engine:
        idle = [e for e in engines if not e.unanswered()]
        if idle:
            return min(idle, key=lambda e: e.last_sent_ms)
        return min(engines, key=lambda e: e.prefill_ends_ms(now_ms))

    return pick


def simulate(policy: Policy, seed: int) -> list[float]:
    """The measured requests' TTFTs (ms) with arrivals of ``seed`` routed by ``policy``."""
    rng = random.Random(f"no-reuse-bound:{seed}")
    engines = [Engine(i) for i in range(ENGINES)]
    events: list[tuple[float, int, int, int]] = []  # (ms, order, engine or -1 for an arrival, tokens)
    order = itertools.count()
    t = 0.0
    while (t := t + rng.expovariate(RATE)) < DURATION_S:
        heapq.heappush(events, (t * 1000, next(order), -1, rng.randint(*PROMPT_TOKENS)))
    served: list[Request] = []

    def start_step(engine: Engine, now_ms: float) -> None:
        while engine.waiting and len(engine.running) < SHAPE.max_batch:
            engine.running.append(engine.waiting.pop(0))
        engine.step_prefill = []
        if not engine.running:
            engine.step_ends_ms = None
            return
        budget = SHAPE.max_step_tokens
        for r in engine.running:
            if r.to_prefill and budget:
                take = min(r.to_prefill, budget)
                engine.step_prefill.append((r, take))
                budget -= take
        decoding = sum(1 for r in engine.running if not r.to_prefill)
        prefilled = SHAPE.max_step_tokens - budget
        ms = SHAPE.decode_step_ms + SHAPE.decode_step_ms_per_seq * decoding + SHAPE.prefill_ms_per_token * prefilled
        engine.step_ends_ms = now_ms + ms
        heapq.heappush(events, (engine.step_ends_ms, next(order), engine.index, 0))

    while events:
        now, _, index, tokens = heapq.heappop(events)
        if index < 0:
            request = Request(now, tokens, tokens)
            engine = policy(engines, request, now)
            engine.last_sent_ms = now
            engine.waiting.append(request)
            if engine.step_ends_ms is None:
                start_step(engine, now)
            continue
        engine = engines[index]
        decoding = [r for r in engine.running if not r.to_prefill]
        for r, take in engine.step_prefill:
            r.to_prefill -= take
            if not r.to_prefill:
                r.ttft_ms, r.produced = now - r.sent_ms, 1
        for r in decoding:
            r.produced += 1
        for r in [r for r in engine.running if r.produced >= OUTPUT_TOKENS]:
            engine.running.remove(r)
            served.append(r)
        start_step(engine, now)
    return [r.ttft_ms for r in served if r.ttft_ms is not None and r.sent_ms >= WARMUP_S * 1000]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="traces to run, seeds 1..N")
    args = parser.parse_args()
    seeds = range(1, args.seeds + 1)
    policies: dict[str, Callable[[int], Policy]] = {
        "round robin": lambda _seed: round_robin(),
        "least requests": lambda seed: least_requests(random.Random(seed)),
        "greedy exact": lambda seed: greedy_exact(random.Random(seed)),
        "scored's pricing": lambda _seed: scored_pricing(),
        "exact bound": lambda _seed: exact_bound(),
    }
    print(f"no_reuse at {RATE:.1f} req/s on {ENGINES} engines, {DURATION_S:.0f} s of arrivals; TTFT p99 ms per seed\n")
    print("| policy | " + " | ".join(f"seed {s}" for s in seeds) + " | against round robin |")
    print("|---|" + "---|" * len(seeds) + "---|")
    reference: list[float] = []
    for name, make in policies.items():
        figures = [p99(simulate(make(seed), seed)) for seed in seeds]
        reference = reference or figures
        ratios = [f / r for f, r in zip(figures, reference, strict=True)]
        print(f"| {name} | " + " | ".join(f"{f:.0f}" for f in figures) + f" | {min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
    main()

"""Fleet benchmark: how fast a fleet of engines answers through each router, on the workloads
real fleets see (see ``fleet_workloads``), with open-loop arrivals at fractions of its capacity.

    python bench/fleet.py                  # every workload at 50%, 80% and 95% load, every router
    python bench/fleet.py --quick          # 80% load only, shorter runs
    python bench/fleet.py --repeat 3       # each cell three times (seeds 1, 2, 3): medians and spread
    python bench/fleet.py --write-readme   # also refresh bench/README.md's verdicts (tables: bench/results)

Simulated engines (``pdproxy mock-engine --simulate``: paged KV cache with prefix reuse,
continuous batching; ``fleet_engines.py``) run in one process, as the workload's fleet declares
them (eight equal engines, or some slower). For each workload and load, every router plays the
same trace against freshly emptied engines: pdproxy with each of its policies, sglang-router and
vllm-router with their cache-aware policy, LMDeploy's proxy with its default, round robin, and
the oracle, which knows every engine's exact cache and queue. The trace's events (an engine's
cache flushed, an engine restarted) are fired at their times, whichever the router. Per run:
time to first token, end-to-end latency, throughput and the share of prompt tokens the engines
found in their caches (from each answer's ``usage``), over the requests sent after the warm-up.
With ``--repeat N`` each cell runs N times on traces of consecutive seeds: the tables give the
medians and the range of TTFT p99, the verdicts (issue 35's targets at 80% load) whether each
comparison holds beyond that run-to-run spread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import peers
from fleet_client import EVENT_WINDOW, Outcome, Played
from fleet_client import run as play
from fleet_workloads import WORKLOADS, EngineShape, Trace, Workload, engine_options, ideal_capacity, stats
from pdproxy.testing.ports import free_port_range, free_udp_port

MODEL = "fleet-model"
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"

#: A run is noisy when the simulated engines fell this far behind their schedule (seconds, the
#: most of any engine) or the client sent its requests this late (p99, seconds): the machine was
#: too busy (other work) for the simulated time to hold. A noisy run is done again (--retries).
LATE_LIMIT = 0.5
LAG_LIMIT = 0.1

#: The capacity of the fleet on a workload: the highest arrival rate at which the oracle keeps
#: the time to first token under this at the 90th percentile (found by bisection).
CAPACITY_TTFT_P90 = 1.0


@dataclass(frozen=True)
class Router:
    name: str
    kind: str  # pdproxy, peer, oracle
    policy: str = ""
    peer: str = ""
    #: pdproxy: routes by the engines' KV events (``--kv-events``), not its prefix table alone.
    kv_events: bool = False
    #: pdproxy: replicas in front of the same engines, requests sent to each in turn (each knows
    #: only the traffic it routes, and the engines' events).
    replicas: int = 1
    #: pdproxy replicas: each tells the others its load on every engine (``--replica-listen``,
    #: ``--replica-peer``).
    shared: bool = False
    #: pdproxy replicas: every request through the first, the others idle beside it (what
    #: running N replicas costs one host, apart from what each knows).
    lead: bool = False

    @property
    def is_pdproxy(self) -> bool:
        return self.kind == "pdproxy"


ROUTERS = {
    r.name: r
    for r in (
        Router("pdproxy scored", "pdproxy", "scored"),
        Router("pdproxy scored kv-events", "pdproxy", "scored", kv_events=True),
        Router("pdproxy least_engine_load", "pdproxy", "least_engine_load"),
        Router("pdproxy min_cache_usage", "pdproxy", "min_cache_usage"),
        Router("pdproxy prefix", "pdproxy", "prefix"),
        Router("pdproxy min_expected_latency", "pdproxy", "min_expected_latency"),
        Router("sglang-router cache_aware", "peer", "cache_aware", "sglang"),
        Router("vllm-router cache_aware", "peer", "cache_aware", "vllm"),
        Router("lmdeploy-proxy min_expected_latency", "peer", "", "lmdeploy"),
        Router("round robin", "pdproxy", "round_robin"),
        Router("oracle", "oracle"),
    )
}
DEFAULT_ROUTERS = [name for name in ROUTERS if name not in ("pdproxy min_expected_latency", "pdproxy scored kv-events")]
#: In every table, whatever --routers says: what every other figure is read against.
REFERENCES = ("round robin", "oracle")
#: The router issue 35's targets are about, and the peers it must beat.
SCORED = "pdproxy scored"
PEERS = tuple(name for name, r in ROUTERS.items() if r.kind == "peer")
#: Issue 35's targets, at this load: TTFT p99 no worse than round robin's and any peer's, at most
#: this many times the oracle's; cache hit rate within this of the oracle's.
TARGET_LOAD = 0.8
ORACLE_FACTOR = 1.5
HIT_RATE_MARGIN = 0.03


@dataclass
class Fleet:
    engines: list[str]
    oracle: str
    pid: int

    def post(self, path: str) -> Any:
        request = urllib.request.Request(self.oracle + path, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.oracle + "/fleet/stats", timeout=10) as r:
            return dict(json.loads(r.read()))

    def engines_late(self) -> float:
        """How far the most delayed engine fell behind its schedule since the last reset (s)."""
        return max(float(s["simulation"]["late_s"]) for s in self.stats().values())


@contextlib.contextmanager
def fleet(shapes: tuple[EngineShape, ...], dialects: str, kv_events: bool = False) -> Iterator[Fleet]:
    """The engines of ``shapes`` (one each) and the oracle, in one process; ``kv_events``: the
    engines publish their KV events."""
    count = len(shapes)
    first = free_port_range(count + 1)
    oracle_port = first + count
    engines = json.dumps([engine_options(shape) for shape in shapes])
    args = [sys.executable, str(HERE / "fleet_engines.py"), "--port", str(first), "--count", str(count)]
    args += ["--oracle-port", str(oracle_port), "--model", MODEL, "--engine", engines, "--dialects", dialects]
    args += ["--kv-events"] if kv_events else []
    oracle = f"http://127.0.0.1:{oracle_port}"
    # The oracle answers once every engine serves.
    with harness.service("fleet", args, oracle + "/health", oracle) as svc:
        yield Fleet([f"http://127.0.0.1:{first + i}" for i in range(count)], oracle, svc.proc.pid)


def routes_taken(fleet_: Fleet) -> list[dict[str, object]]:
    """Which engine took each conversation's turns, from the engines' own records of the
    requests they received (their last few hundred each): a conversation is named by its first
    two messages, a turn by how many messages came before it."""
    routes: list[dict[str, object]] = []
    for index, engine in enumerate(fleet_.engines):
        with urllib.request.urlopen(engine + "/mock/requests", timeout=10) as r:
            records = json.loads(r.read())
        for record in records:
            messages = (record.get("body") or {}).get("messages") or []
            head = json.dumps(messages[:2], sort_keys=True).encode()
            conversation = hashlib.sha1(head).hexdigest()[:12]
            routes.append({"engine": index, "conversation": conversation, "turn": len(messages) // 2})
    return routes


@contextlib.contextmanager
def router(spec: Router, fleet_: Fleet, installed: dict[str, peers.Peer]) -> Iterator[tuple[list[str], list[int]]]:
    """The router running in front of the fleet (pdproxy: its replicas); yields its base URLs
    and processes (none: the oracle, which runs in the engines' process)."""
    if spec.kind == "oracle":
        yield [fleet_.oracle], []
    elif spec.kind == "pdproxy":
        extra = ("--policy", spec.policy)
        if spec.kv_events:
            extra += ("--kv-events", "auto", "--kv-tokenizer", "mock")
        sharing = replica_sharing(spec.replicas) if spec.shared else [()] * spec.replicas
        with contextlib.ExitStack() as stack:
            services = [
                stack.enter_context(harness.pdproxy(fleet_.engines, MODEL, extra=extra + share)) for share in sharing
            ]
            if spec.kv_events:
                for svc in services:
                    wait_kv_events_live(svc.url, len(fleet_.engines))
            urls = [s.url for s in services]
            yield urls[:1] if spec.lead else urls, [s.proc.pid for s in services]
    else:
        with installed[spec.peer].start(fleet_.engines, MODEL, spec.policy or None) as svc:
            yield [svc.url], [svc.proc.pid]


def replica_sharing(replicas: int) -> list[tuple[str, ...]]:
    """Each replica's flags to share its load with the others: its own UDP port to listen on,
    and the others' as its peers."""
    ports = [free_udp_port() for _ in range(replicas)]
    listen = [f"127.0.0.1:{port}" for port in ports]
    return [
        ("--replica-listen", mine, *(flag for peer in listen if peer != mine for flag in ("--replica-peer", peer)))
        for mine in listen
    ]


def cpu_seconds(name: str, pids: list[int]) -> float:
    """The CPU seconds used so far by the processes ``pids`` watched as ``name``: the client is
    this process alone (the engines and the routers are its children)."""
    return sum(harness.cpu_seconds(pid, descendants=name != "client") for pid in pids)


def nodes_statuses(urls: list[str]) -> list[dict[str, Any]]:
    """Each pdproxy replica's ``/nodes/status`` (what it learnt of the engines), for ``--dump``."""
    statuses = []
    for url in urls:
        with urllib.request.urlopen(url + "/nodes/status", timeout=5) as r:
            statuses.append(json.loads(r.read()))
    return statuses


#: How far off a price counts as off, in `priced_off` (seconds).
PRICED_OFF_S = 0.03


def priced_off(statuses: list[dict[str, Any]]) -> dict[str, float]:
    """Of the first tokens pdproxy priced (every node, every replica, the whole run), the shares
    that came more than ``PRICED_OFF_S`` before and after their price (`first_token_lateness`)."""
    early = late = total = 0
    for status in statuses:
        for node in status.values():
            h = node["engine"]["learnt"]["first_token_lateness"]
            bounds = h["bounds"]
            if PRICED_OFF_S not in bounds or -PRICED_OFF_S not in bounds:
                raise ValueError(f"the lateness buckets {bounds} do not split at ±{PRICED_OFF_S} s")
            # Bucket i holds the values above bounds[i - 1], up to bounds[i].
            for lower, upper, count in zip([-math.inf, *bounds], [*bounds, math.inf], h["counts"], strict=True):
                total += count
                early += count if upper <= -PRICED_OFF_S else 0
                late += count if lower >= PRICED_OFF_S else 0
    return {"early": early / total if total else 0.0, "late": late / total if total else 0.0, "priced": total}


def wait_kv_events_live(url: str, nodes: int, timeout: float = 30.0) -> None:
    """Until pdproxy at ``url`` follows the KV events of all ``nodes`` live."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/nodes/status", timeout=5) as r:
            status = json.loads(r.read())
        if sum(bool((n.get("kv_events") or {}).get("live")) for n in status.values()) >= nodes:
            return
        time.sleep(0.2)
    raise RuntimeError(f"pdproxy at {url} does not follow the engines' KV events")


def summarize(outcomes: list[Outcome], warmup: float, window: float) -> dict[str, Any]:
    measured = [o for o in outcomes if warmup <= o.due < window]
    ok = [o for o in measured if o.ok and o.ttft is not None and o.e2e is not None]
    prompt = sum(o.prompt_tokens or 0 for o in ok)
    cached = sum(o.cached_tokens or 0 for o in ok)
    ends = [o.sent + (o.e2e or 0) for o in ok]
    span = (max(ends) - warmup) if ends else float("nan")
    lags = [o.sent - o.due for o in measured]
    return {
        "requests": len(measured),
        "errors": len(measured) - len(ok),
        "ttft_s": stats([o.ttft for o in ok if o.ttft is not None]),
        "e2e_s": stats([o.e2e for o in ok if o.e2e is not None]),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "tokens_per_s": sum(o.tokens for o in ok) / span if span > 0 else 0.0,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "send_lag_s": stats(lags),
    }


def _share(requests: list[int], engine: int) -> float:
    total = sum(requests)
    return requests[engine] / total if total else math.nan


def event_figures(played: Played, received: list[int]) -> list[dict[str, Any]]:
    """For each event of the run: the engine's share of the requests the fleet received before
    it (from the start), in the ``EVENT_WINDOW`` seconds after it and from it to the end
    (``received``: each engine's count at the end), and the fleet's TTFT over the requests sent
    in those seconds."""
    out = []
    for fired in played.fired:
        event = fired.event
        figures: dict[str, Any] = {"kind": event.kind, "engine": event.engine, "at_s": round(fired.sent, 3)}
        if fired.error:
            figures["error"] = fired.error
        if fired.requests is not None:
            since = [n - before for n, before in zip(received, fired.requests, strict=True)]
            figures["share_before"] = _share(fired.requests, event.engine)
            figures["share_rest"] = _share(since, event.engine)
            if fired.requests_later is not None:
                window = [n - before for n, before in zip(fired.requests_later, fired.requests, strict=True)]
                figures["share_next"] = _share(window, event.engine)
        soon = [o for o in played.outcomes if fired.sent <= o.sent < fired.sent + EVENT_WINDOW]
        figures["ttft_next_s"] = stats([o.ttft for o in soon if o.ok and o.ttft is not None])
        out.append(figures)
    return out


def run_one(
    spec: Router, fleet_: Fleet, installed: dict[str, peers.Peer], trace: Trace, args: argparse.Namespace
) -> dict[str, Any]:
    # The fleet is reset before the router starts, so that no router reads the engines as the
    # run before left them (the first reading would show every engine restarted, its figures
    # from another run).
    fleet_.post("/fleet/reset")
    with router(spec, fleet_, installed) as (urls, pids):
        started = time.monotonic()
        watched = {"engines": [fleet_.pid], "client": [os.getpid()], **({"router": pids} if pids else {})}
        before = {name: cpu_seconds(name, ps) for name, ps in watched.items()}
        played = asyncio.run(play(urls, MODEL, trace, trace.duration, args.drain, control=fleet_.oracle))
        elapsed = time.monotonic() - started
        cpu = {name: cpu_seconds(name, ps) - before[name] for name, ps in watched.items()}
        statuses = nodes_statuses(urls) if spec.kind == "pdproxy" else []
    result = summarize(played.outcomes, warmup(trace.workload, args), trace.duration)
    if statuses:
        result["priced_off"] = priced_off(statuses)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        stem = f"{trace.workload}-{spec.name.replace(' ', '_')}"
        runs = [p for p in args.dump.glob(stem + "-*.jsonl") if not p.name.endswith(".engines.jsonl")]
        where = args.dump / f"{stem}-{len(runs) + 1}.jsonl"
        where.write_text("".join(json.dumps(dataclasses.asdict(o)) + "\n" for o in played.outcomes))
        where.with_suffix(".engines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in routes_taken(fleet_)))
        if statuses:
            where.with_suffix(".status.json").write_text(json.dumps(statuses, indent=1))
    result["cpu_cores"] = {name: round(seconds / elapsed, 3) for name, seconds in cpu.items()}
    engine = fleet_.stats()
    sims = [s["simulation"] for s in engine.values()]
    prompt = sum(s["prompt_tokens"] for s in sims)
    # From the engines' counters: a restarted engine's count only since its restart.
    result["engine_cache_hit_rate"] = sum(s["cached_tokens"] for s in sims) / prompt if prompt else 0.0
    # Requests each engine received (not its counters, which a restart zeroes).
    result["engine_requests"] = [int(s["requests"]) for s in engine.values()]
    result["engine_late_s"] = max(float(s["late_s"]) for s in sims)
    if played.fired:
        result["events"] = event_figures(played, result["engine_requests"])
    result["run_seconds"] = elapsed
    return result


def find_capacity(fleet_: Fleet, workload: Workload, args: argparse.Namespace) -> float:
    """The highest rate (requests per second) at which the oracle keeps TTFT p90 under
    ``CAPACITY_TTFT_P90``: bisection between 10% and 100% of the ideal capacity (every prompt
    block computed once in the whole fleet, every batch as full as the KV cache allows)."""
    ideal = ideal_capacity(workload, args.seed)
    low, high = 0.1 * ideal, ideal
    duration = args.probe_duration * workload.stretch
    for _ in range(args.probes):
        rate = (low + high) / 2
        trace = workload.trace(rate, duration, args.seed + 1000)
        for attempt in range(args.retries + 1):
            fleet_.post("/fleet/reset")
            played = play(fleet_.oracle, MODEL, trace, duration, args.drain, control=fleet_.oracle)
            outcomes = asyncio.run(played).outcomes
            measured = summarize(outcomes, duration / 4, duration)
            measured["engine_late_s"] = fleet_.engines_late()
            if not noisy(measured):
                break
            harness.say(f"  capacity probe {rate:.1f} req/s: noisy" + (", again" if attempt < args.retries else ""))
            time.sleep(10)
        p90 = measured["ttft_s"]["p90"]
        harness.say(f"  capacity probe {rate:.1f} req/s: oracle TTFT p90 {_ms(p90)} ms")
        if measured["errors"] == 0 and p90 <= CAPACITY_TTFT_P90:
            low = rate
        else:
            high = rate
    return low


def noisy(result: dict[str, Any]) -> bool:
    return bool(result["engine_late_s"] > LATE_LIMIT or result["send_lag_s"]["p99"] > LAG_LIMIT)


#: The cell whose target is a close margin on a p99 (within 5% of the best load-only policy) and
#: how much longer its runs are: a 15 s run puts about eight requests above its p99, which moves
#: a router's p99 by 6% from one run to the next on the same trace.
CLOSE_TARGET = ("no_reuse", 0.8)
CLOSE_TARGET_RUNS = 3


def run_duration(workload: str, load: float, args: argparse.Namespace) -> float:
    """Seconds of arrivals for the runs of ``workload`` at ``load``."""
    longer = (workload, load) == CLOSE_TARGET and not args.quick
    return args.duration * WORKLOADS[workload].stretch * (CLOSE_TARGET_RUNS if longer else 1)


def warmup(workload: str, args: argparse.Namespace) -> float:
    """The first seconds of a run of ``workload`` not measured."""
    return float(args.warmup * WORKLOADS[workload].stretch)


def run_steady(
    spec: Router, fleet_: Fleet, installed: dict[str, peers.Peer], trace: Trace, args: argparse.Namespace
) -> dict[str, Any]:
    """``run_one``, again (after a pause) while the machine was too busy for the run to count."""
    for attempt in range(args.retries + 1):
        result = run_one(spec, fleet_, installed, trace, args)
        result["attempts"] = attempt + 1
        result["noisy"] = noisy(result)
        if not result["noisy"]:
            break
        harness.say(
            f"  {spec.name}: noisy run (engines {result['engine_late_s']:.2f} s late, send lag p99 "
            f"{_ms(result['send_lag_s']['p99'])} ms)" + (", again" if attempt < args.retries else ", kept and marked")
        )
        time.sleep(10)
    return result


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0%}"


def _range(values: list[float]) -> list[float]:
    numbers = [v for v in values if v == v]
    return [min(numbers), max(numbers)] if numbers else [math.nan, math.nan]


def _median(values: list[Any]) -> Any:
    """The median of runs' figures, leaf by leaf: numbers (NaN left out), dicts key by key, lists
    of one length item by item; anything else, or a figure all runs agree on, is the first run's."""
    first = values[0]
    if all(isinstance(v, dict) for v in values):
        return {key: _median([v[key] for v in values if key in v]) for key in first}
    if all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_median(list(items)) for items in zip(*values, strict=True)]
    if all(v == first for v in values):
        return first
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        numbers = [v for v in values if v == v]
        return statistics.median(numbers) if numbers else math.nan
    return first


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A table's row from a cell's runs: the median of every figure; the range of TTFT p99 and of
    the cache hit rate; the errors and noisy runs of all the runs; and every run as it was."""
    row: dict[str, Any] = _median(runs)
    row["errors"] = sum(r["errors"] for r in runs)
    row["noisy"] = sum(1 for r in runs if r.get("noisy"))
    row["spread"] = {
        "ttft_p99_s": _range([r["ttft_s"]["p99"] for r in runs]),
        "cache_hit_rate": _range([r["cache_hit_rate"] for r in runs]),
    }
    row["runs"] = runs
    return row


def _p99(row: dict[str, Any]) -> str:
    """TTFT p99 in ms, with its range over the runs when there were several: "415 (380-460)"."""
    low, high = row["spread"]["ttft_p99_s"]
    median = _ms(row["ttft_s"]["p99"])
    return median if len(row["runs"]) < 2 else f"{median} ({_ms(low)}-{_ms(high)})"


def _hit_rate(row: dict[str, Any]) -> str:
    low, high = row["spread"]["cache_hit_rate"]
    median = f"{row['cache_hit_rate']:.1%}"
    return median if len(row["runs"]) < 2 else f"{median} ({low * 100:.1f}-{high:.1%})"


def _event_headers(events: list[dict[str, Any]]) -> list[str]:
    shares = [f"engine {e['engine']}'s share {EVENT_WINDOW:.0f} s after its {e['kind']} (before)" for e in events]
    return [*shares, f"TTFT p99 ms {EVENT_WINDOW:.0f} s after each event"] if events else []


def _event_cells(row: dict[str, Any]) -> list[str]:
    events = row.get("events") or []
    shares = [f"{_pct(e.get('share_next'))} ({_pct(e.get('share_before'))})" for e in events]
    return [*shares, " / ".join(_ms(e["ttft_next_s"]["p99"]) for e in events)] if events else []


def table(workload: str, load: float, capacity: float, rows: dict[str, dict[str, Any]]) -> list[str]:
    runs = max((len(r["runs"]) for r in rows.values()), default=1)
    events: list[dict[str, Any]] = next((r["events"] for r in rows.values() if r.get("events")), [])
    extra = _event_headers(events)
    p99 = "TTFT p99 ms" + (f" (range of {runs} runs)" if runs > 1 else "")
    lines = [
        f"#### {WORKLOADS[workload].title}, {load:.0%} load "
        f"({load * capacity:.1f} req/s of a capacity of {capacity:.1f})",
        "",
        f"| router | TTFT p50 ms | {p99} | end-to-end p50 ms | end-to-end p99 ms | req/s | tokens/s "
        f"| cache hit rate | errors |{''.join(f' {h} |' for h in extra)}",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for name, r in rows.items():
        mark = "" if not r["noisy"] else " (noisy)" if runs == 1 else f" (noisy {r['noisy']} of {len(r['runs'])})"
        lines.append(
            f"| {name}{mark} | {_ms(r['ttft_s']['p50'])} | {_p99(r)} | {_ms(r['e2e_s']['p50'])} "
            f"| {_ms(r['e2e_s']['p99'])} | {r['throughput_rps']:.1f} | {r['tokens_per_s']:.0f} "
            f"| {_hit_rate(r)} | {r['errors']} |{''.join(f' {c} |' for c in _event_cells(r))}"
        )
    return lines


@dataclass(frozen=True)
class Comparison:
    """A target held on the medians of two routers' runs, and run by run (runs of one seed, the
    same trace, paired)."""

    met: bool
    runs_met: int
    runs: int
    #: Whether every run of one router is on the same side of the target as the medians (None: one run).
    beyond_spread: bool | None

    def spread_cell(self) -> str:
        if self.beyond_spread is None:
            return "- (one run)"
        return f"{'yes' if self.beyond_spread else 'no'} (met in {self.runs_met} of {self.runs} runs)"


def _by_seed(row: dict[str, Any], figure: str) -> dict[int, float]:
    return {int(r.get("seed", i)): _figure(r, figure) for i, r in enumerate(row["runs"])}


def _figure(run: dict[str, Any], figure: str) -> float:
    return float(run["ttft_s"]["p99"] if figure == "ttft_p99" else run["cache_hit_rate"])


def compare(mine: dict[str, Any], theirs: dict[str, Any], figure: str, factor: float, margin: float) -> Comparison:
    """``mine``'s figure at most ``factor`` times ``theirs`` (TTFT p99), or at least ``theirs``
    less ``margin`` (cache hit rate)."""
    a, b = _by_seed(mine, figure), _by_seed(theirs, figure)

    def holds(x: float, y: float) -> bool:
        return x <= factor * y if figure == "ttft_p99" else x >= y - margin

    met = holds(statistics.median(a.values()), statistics.median(b.values()))
    seeds = sorted(a.keys() & b.keys())
    runs_met = sum(1 for seed in seeds if holds(a[seed], b[seed]))
    beyond: bool | None = None
    if len(a) > 1 or len(b) > 1:
        # Met beyond the spread: even mine's worst run against theirs' best; missed beyond the
        # spread: even mine's best against theirs' worst.
        lower = figure == "ttft_p99"
        worst, best = (max, min) if lower else (min, max)
        x, y = (worst(a.values()), best(b.values())) if met else (best(a.values()), worst(b.values()))
        beyond = holds(x, y) == met
    return Comparison(met, runs_met, len(seeds), beyond)


@dataclass(frozen=True)
class Verdict:
    """One target held on one workload."""

    workload: str
    target: str
    figures: str
    result: Comparison

    def row(self) -> str:
        met = "yes" if self.result.met else "no"
        return f"| {self.workload} | {self.target} | {self.figures} | {met} | {self.result.spread_cell()} |"


def _target(
    workload: str, target: str, mine: dict[str, Any], theirs: dict[str, Any], figure: str, factor: float = 1.0
) -> Verdict:
    """``mine`` (pdproxy scored's row) held against ``theirs``."""
    result = compare(mine, theirs, figure, factor, HIT_RATE_MARGIN)
    if figure == "ttft_p99":
        ratio = mine["ttft_s"]["p99"] / theirs["ttft_s"]["p99"]
        figures = f"{_p99(mine)} against {_p99(theirs)} ms ({ratio:.2f}x)"
    else:
        points = (mine["cache_hit_rate"] - theirs["cache_hit_rate"]) * 100
        figures = f"{_hit_rate(mine)} against {_hit_rate(theirs)} ({points:+.1f} points)"
    return Verdict(workload, target, figures, result)


def verdicts(results: dict[str, dict[str, dict[str, Any]]], workloads: list[str]) -> list[Verdict]:
    """Issue 35's targets at 80% load, on every workload: `pdproxy scored`'s TTFT p99 no worse
    than round robin's, at most 1.5x the oracle's, no worse than any peer router's; its cache hit
    rate within 3 points of the oracle's. Each judged on the medians of the runs, and said
    whether it holds beyond their spread (every run of one router on the same side of the
    target as the medians) and in how many of the runs (paired by seed)."""
    lines: list[Verdict] = []
    for workload in workloads:
        rows = results.get(f"{workload}@{TARGET_LOAD}", {})
        mine = rows.get(SCORED)
        if mine is None:
            continue
        if "round robin" in rows:
            lines.append(_target(workload, "TTFT p99 <= round robin's", mine, rows["round robin"], "ttft_p99"))
        if "oracle" in rows:
            oracle = rows["oracle"]
            target = f"TTFT p99 <= {ORACLE_FACTOR}x the oracle's"
            lines.append(_target(workload, target, mine, oracle, "ttft_p99", ORACLE_FACTOR))
            target = f"cache hit rate within {HIT_RATE_MARGIN * 100:.0f} points of the oracle's"
            lines.append(_target(workload, target, mine, oracle, "hit_rate"))
        for peer in PEERS:
            if peer in rows:
                lines.append(_target(workload, f"TTFT p99 <= {peer}'s", mine, rows[peer], "ttft_p99"))
    return lines


def verdicts_table(judged: list[Verdict]) -> list[str]:
    header = ["| workload | target | figures | met | beyond the run-to-run spread |", "|---|---|---|---|---|"]
    return header + [v.row() for v in judged]


def verdicts_in_short(judged: list[Verdict]) -> list[str]:
    """How many targets are met (and beyond the spread), and the ones that are not."""
    met = [v for v in judged if v.result.met]
    spread = f"{sum(1 for v in met if v.result.beyond_spread)} beyond the run-to-run spread"
    out = [f"Targets at {TARGET_LOAD:.0%} load: {len(met)} of {len(judged)} met, {spread}."]
    missed = [v for v in judged if not v.result.met]
    if missed:
        out += ["", "| workload | target missed | figures |", "|---|---|---|"]
        out += [f"| {v.workload} | {v.target} | {v.figures} |" for v in missed]
    return out


def charts(results: dict[str, dict[str, dict[str, Any]]], out_dir: Path) -> list[Path]:
    """One PNG per workload: TTFT p99 per router at each load (matplotlib, if installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for workload in WORKLOADS:
        cells = {key: rows for key, rows in results.items() if key.startswith(workload + "@")}
        if not cells:
            continue
        names = list(next(iter(cells.values())))
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        for ax, (label, key) in zip(axes, (("TTFT p99, ms", "ttft_s"), ("TTFT p50, ms", "ttft_s")), strict=True):
            q = "p99" if "p99" in label else "p50"
            width = 0.8 / max(1, len(cells))
            for k, (cell_key, rows) in enumerate(sorted(cells.items())):
                values = [rows[n][key][q] * 1000 if n in rows else 0 for n in names]
                positions = [i + k * width for i in range(len(names))]
                ax.bar(positions, values, width, label=f"{float(cell_key.split('@')[1]):.0%}")
            ax.set_xticks([i + width * (len(cells) - 1) / 2 for i in range(len(names))])
            ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=7)
            ax.set_yscale("log")
            ax.set_title(label, fontsize=10)
            ax.legend(fontsize=7, title="load", title_fontsize=7)
            ax.spines[["top", "right"]].set_visible(False)
        fig.suptitle(WORKLOADS[workload].title, fontsize=10)
        fig.tight_layout()
        path = out_dir / f"fleet-{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def update_readme(markdown: str) -> None:
    text = README.read_text()
    start, end = "<!-- fleet:start -->", "<!-- fleet:end -->"
    if start in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        text = head + start + "\n" + markdown + "\n" + end + tail
    else:
        text += f"\n## Fleet: routing quality\n\n{start}\n{markdown}\n{end}\n"
    README.write_text(text)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="80%% load only and shorter runs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of the nominal capacity")
    parser.add_argument(
        "--routers",
        default=",".join(DEFAULT_ROUTERS),
        help="comma-separated (or ;-separated, for policies with weights): "
        + ", ".join(ROUTERS)
        + ", or 'pdproxy POLICY' for any policy; "
        + " and ".join(REFERENCES)
        + " are always run (but with --no-references)",
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals per run (default 15, quick 10)"
    )
    parser.add_argument("--warmup", type=float, default=None, help="first seconds not measured (default 4, quick 3)")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds to wait for answers after the arrivals")
    parser.add_argument("--seed", type=int, default=1, help="the traces' seed (the first, with --repeat)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each cell, on traces of seeds SEED, SEED+1, ...: medians, spread"
    )
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="leave out " + " and ".join(REFERENCES) + " (to compare pdproxy's own variants in half the time)",
    )
    parser.add_argument("--retries", type=int, default=2, help="times a noisy run (machine too busy) is done again")
    parser.add_argument("--probes", type=int, default=5, help="bisection steps to find each workload's capacity")
    parser.add_argument("--probe-duration", type=float, default=10.0, help="seconds of arrivals per probe")
    parser.add_argument(
        "--capacity", action="append", default=[], help="WORKLOAD=REQ/S: skip the search for that workload"
    )
    parser.add_argument("--dialects", default="vllm,sglang,lmdeploy", help="engines' metrics dialects, in turn")
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the engines publish their KV events, and 'pdproxy scored kv-events' follows them",
    )
    parser.add_argument(
        "--dump", type=Path, default=None, help="a folder for each run's requests (JSON lines), to look into one"
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="refresh the fleet section of bench/README.md (the verdicts; the tables to a dated file in bench/results)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "fleet.json", help="where the results go (charts beside it)"
    )
    args = parser.parse_args()
    if args.quick:
        args.loads = "0.8"
    args.duration = args.duration or (10.0 if args.quick else 15.0)
    args.warmup = args.warmup if args.warmup is not None else (3.0 if args.quick else 4.0)
    unknown = [w for w in args.workloads.split(",") if w and w not in WORKLOADS]
    if unknown or args.repeat < 1:
        parser.error(f"unknown workload(s) {', '.join(unknown)}" if unknown else "--repeat must be at least 1")
    return args


def choose_routers(names: str, references: bool = True) -> list[Router]:
    """The routers named (any other "pdproxy POLICY" is pdproxy with that policy, weights too:
    "pdproxy scored:queue=0.5", following the engines' KV events: "pdproxy scored:queue=0.5
    kv-events"; a pdproxy router's name ending in " xN" is N replicas of it: "pdproxy scored
    kv-events x4", and in " xN shared" N replicas telling each other their load on the engines:
    "pdproxy scored kv-events x4 shared"; with " lead" after, every request goes through the
    first of them), the references added where missing (``references``)."""
    listed = [n for n in names.split(";" if ";" in names else ",") if n]
    listed += [n for n in REFERENCES if n not in listed and references]
    return [router_named(n) for n in listed]


def router_named(name: str) -> Router:
    base, replicas, shared, lead = name, 1, False, False
    if match := re.fullmatch(r"(pdproxy .+) x(\d+)( shared)?( lead)?", name):
        base, replicas, shared, lead = match[1], int(match[2]), bool(match[3]), bool(match[4])
    spec = ROUTERS.get(base)
    if spec is None:
        policy = base.removeprefix("pdproxy ")
        spec = Router(base, "pdproxy", policy.removesuffix(" kv-events"), kv_events=policy.endswith(" kv-events"))
    return dataclasses.replace(spec, name=name, replicas=replicas, shared=shared, lead=lead) if replicas != 1 else spec


def check_events(workload: str, args: argparse.Namespace) -> None:
    """Says when a workload's events would fall outside the measured window."""
    for fraction, kind, engine in WORKLOADS[workload].events:
        at = fraction * args.duration
        if not args.warmup <= at < args.duration:
            harness.say(f"{workload}: the {kind} of engine {engine} at {at:.1f} s is outside the measured window")


def measure_cell(
    workload: str,
    load: float,
    capacity: float,
    routers: list[Router],
    fleet_: Fleet,
    installed: dict[str, peers.Peer],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Every router on ``workload`` at ``load``, ``--repeat`` times (each time a trace of the next
    seed, every router on it in turn); one row per router."""
    rate = capacity * load
    runs: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in routers}
    for repeat in range(args.repeat):
        seed = args.seed + repeat
        trace = WORKLOADS[workload].trace(rate, run_duration(workload, load, args), seed)
        harness.say(f"{workload} at {load:.0%}: {rate:.1f} req/s, {trace.requests} requests, seed {seed}")
        for spec in routers:
            if spec.name not in runs:
                continue
            try:
                r = run_steady(spec, fleet_, installed, trace, args)
            except (peers.PeerError, RuntimeError, OSError) as e:
                harness.say(f"{spec.name} left out: {e}")
                del runs[spec.name]
                continue
            r["seed"] = seed
            runs[spec.name].append(r)
            harness.say(
                f"  {spec.name:38} TTFT p50 {_ms(r['ttft_s']['p50']):>6} p99 {_ms(r['ttft_s']['p99']):>6} ms, "
                f"e2e p99 {_ms(r['e2e_s']['p99']):>6} ms, hit {r['cache_hit_rate']:.0%}, "
                f"{r['throughput_rps']:.1f} req/s, errors {r['errors']}, "
                f"lag p99 {_ms(r['send_lag_s']['p99'])} ms, "
                f"late {r['engine_late_s']:.2f} s, cores {r['cpu_cores']}"
                + (
                    f", priced >{PRICED_OFF_S * 1e3:.0f} ms off: {r['priced_off']['early']:.1%} early, "
                    f"{r['priced_off']['late']:.1%} late"
                    if r.get("priced_off", {}).get("priced")
                    else ""
                )
                + "".join(
                    f", engine {e['engine']} {_pct(e.get('share_before'))} -> {_pct(e.get('share_next'))} "
                    f"after its {e['kind']}"
                    for e in r.get("events", [])
                )
            )
    return {name: aggregate(rs) for name, rs in runs.items() if rs}


def by_fleet(workloads: list[str]) -> dict[tuple[EngineShape, ...], list[str]]:
    """The workloads grouped by the fleet they run on (one fleet started for each group)."""
    groups: dict[tuple[EngineShape, ...], list[str]] = {}
    for workload in workloads:
        groups.setdefault(WORKLOADS[workload].fleet, []).append(workload)
    return groups


def headline(args: argparse.Namespace, workloads: list[str], loads: list[float], minutes: float) -> str:
    command = ("python bench/fleet.py " + " ".join(sys.argv[1:])).strip()
    longer = not args.quick and CLOSE_TARGET[0] in workloads and CLOSE_TARGET[1] in loads
    line = (
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores, "
        f"{platform.platform()}, in {minutes:.1f} min: `{command}`. {args.duration:.0f} s of arrivals per run"
        + (f" ({CLOSE_TARGET_RUNS}x that for {CLOSE_TARGET[0]} at {CLOSE_TARGET[1]:.0%}, see below)" if longer else "")
        + f", the first {args.warmup:.0f} s not measured."
    )
    stretched = [f"{w} {WORKLOADS[w].stretch:g}x" for w in workloads if WORKLOADS[w].stretch != 1]
    if stretched:
        line += f" Longer runs and warm-up for the long sessions of {', '.join(stretched)}."
    if args.repeat > 1:
        line += (
            f" Each cell run {args.repeat} times, on traces of seeds {args.seed}-{args.seed + args.repeat - 1}: "
            "the medians, and the range of TTFT p99 and of the cache hit rate in brackets; errors of all the runs."
        )
    return line


def main() -> None:
    args = arguments()
    workloads = [w for w in args.workloads.split(",") if w]
    loads = [float(x) for x in args.loads.split(",") if x]
    routers = choose_routers(args.routers, references=not args.no_references)
    # The engines publish their events when a router follows them, and the router that does runs.
    if args.kv_events and not any(r.kv_events for r in routers):
        routers.insert(1, ROUTERS["pdproxy scored kv-events"])
    args.kv_events = any(r.kv_events for r in routers)
    ready = peers.prepare(sorted({r.peer for r in routers if r.peer}))
    installed = {name: peer for name, peer in peers.PEERS.items() if peer in ready}
    routers = [r for r in routers if not r.peer or r.peer in installed]
    began = time.monotonic()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    given = {k: float(v) for k, v in (c.split("=", 1) for c in args.capacity)}
    capacities: dict[str, float] = {}
    for shapes, group in by_fleet(workloads).items():
        harness.say(f"a fleet of {len(shapes)} engines ({len(set(shapes))} shapes) for {', '.join(group)}")
        with fleet(shapes, args.dialects, args.kv_events) as fleet_:
            for workload in group:
                check_events(workload, args)
                if workload in given:
                    capacities[workload] = given[workload]
                else:
                    harness.say(f"{workload}: finding the capacity")
                    capacities[workload] = find_capacity(fleet_, WORKLOADS[workload], args)
                harness.say(f"{workload}: capacity {capacities[workload]:.1f} req/s")
                for load in loads:
                    cell = measure_cell(workload, load, capacities[workload], routers, fleet_, installed, args)
                    results[f"{workload}@{load}"] = cell
    elapsed = time.monotonic() - began
    markdown = [headline(args, workloads, loads, elapsed / 60), ""]
    for workload in workloads:
        for load in loads:
            if f"{workload}@{load}" in results:
                markdown += [*table(workload, load, capacities[workload], results[f"{workload}@{load}"]), ""]
    judged = verdicts(results, workloads)
    targets = [f"#### Against the targets ({TARGET_LOAD:.0%} load)", "", *verdicts_table(judged), ""]
    markdown += targets
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "fleets": {w: [engine_options(shape) for shape in WORKLOADS[w].fleet] for w in workloads},
        "capacities": capacities,
        "args": vars(args),
        "results": results,
        "minutes": elapsed / 60,
    }
    args.out.write_text(json.dumps(out, indent=1, default=str))
    pictures = charts(results, args.out.parent)
    markdown += [f"![{p.stem}]({os.path.relpath(p, HERE)})" for p in pictures]
    text = "\n".join(markdown)
    print(text)
    if args.write_readme:
        # The tables go to a dated file; the README keeps the verdicts and the charts.
        tables = RESULTS / time.strftime("%Y-%m-%d-%H%M-fleet.md", time.gmtime())
        tables.write_text(f"# Fleet benchmark\n\n{text}\n")
        link = f"The tables of every cell and every verdict: [{tables.name}]({os.path.relpath(tables, HERE)})."
        update_readme("\n".join([markdown[0], "", link, "", *verdicts_in_short(judged)]))


if __name__ == "__main__":
    main()

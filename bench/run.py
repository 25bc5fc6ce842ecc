"""pdproxy benchmarks: one command starts mock engines and proxies side by side and prints
one table per scenario, with ratios measured in the same run.

    python bench/run.py                      # every scenario, 10 s each
    python bench/run.py S1 S4 --duration 5   # some scenarios
    python bench/run.py --write-readme       # also make it the run bench/README.md shows
    python bench/run.py --from-json bench/results/latest.json --write-readme   # a saved run, nothing run
    python bench/run.py --peers none         # only direct and pdproxy
    python bench/run.py --repeat 1           # one run per target instead of the median of three
    python bench/run.py --baseline DIR       # beside another build of pdproxy (DIR/pdproxy/...)
    python bench/run.py --wait-quiet 14000   # start each scenario on a quiet stretch of a shared machine

Targets: `direct` (the load generator talks to the mock engines itself: the physical limit),
`pdproxy` (`pdproxy serve --edge-threads 1`: the Rust edge, see `PDPROXY_TARGETS`; in S1-S4 also
`pdproxy-default-threads`, one edge thread per core), `pdproxy-granian` (`pdproxy serve --edge granian`:
the Python app under granian, one worker, as before the edge) and the peers: `lmdeploy-proxy` (LMDeploy's
`lmdeploy serve proxy`), `sglang-router` and `vllm-router` (Rust routers), each installed on first
use into its own virtual environment under bench/.peers, and `nginx` (Debian's package); and
`floor`, hyper passing requests through (bench/loadgen/src/bin/floor.rs), for calibration. Every
target (PD: every setup) is up at once and their runs take turns, ``--repeat`` rounds (S4: the
targets take turns of 250 ms within each run); a table row is the median run.

Every run writes its tables to bench/results/latest.md and its figures to latest.json (not kept in
git: they are this machine's last run). With
``--write-readme`` it becomes the run bench/README.md shows: there, pdproxy beside the peers and
the Rust edge's targets judged on the run (``render_readme``); every table in results/run.md
(figures: run.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import charts
import harness
import peers

MODEL = "bench-model"
#: pdproxy as measured: each target name, and how it serves. The Rust edge runs one thread: on
#: two cores shared with the load generator and the engines, a second edge thread (the default,
#: one per core, for a proxy with a machine to itself) only adds context switches; S1-S4 show
#: the default too (`pdproxy-default-threads`).
PDPROXY_TARGETS = {"pdproxy": ("--edge", "rust", "--edge-threads", "1"), "pdproxy-granian": ("--edge", "granian")}
#: Measured in S1-S4 beside the targets above.
DEFAULT_THREADS = {"pdproxy-default-threads": ("--edge", "rust")}
#: pdproxy's policy in S1-S4: the routers' (peers.SGLANG_POLICY, nginx's upstream), so the tables
#: compare proxies and not policies (what `scored`, the default, costs: bench/features.py).
SCENARIO_POLICY = peers.SGLANG_POLICY
#: The name of another build of pdproxy run beside this one (``--baseline``).
BASELINE = "pdproxy-baseline"
CHAT = "/v1/chat/completions"
RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"


def chat(stream: bool, tokens: int, prompt_tokens: int = 0) -> dict:
    """A chat request for ``tokens`` tokens; ``prompt_tokens``: a long prompt of about that many
    tokens (4 bytes each) instead of two words."""
    content = "benchmark prompt" if prompt_tokens <= 0 else ("long prompt " * prompt_tokens)[: 4 * prompt_tokens]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass(frozen=True)
class Median:
    """Runs a load ``times`` times and keeps the median run by one measure: the whole run, so a row's
    figures always come from one and the same run."""

    times: int
    label: str  # the measure, as the table names it
    measure: Callable[[harness.LoadResult], float]

    def __call__(
        self, urls: list[str], body: dict, connections: int, duration: float, watch: dict[str, int]
    ) -> harness.LoadResult:
        return self.pick([harness.run_load(urls, body, connections, duration, watch) for _ in range(self.times)])

    def pick(self, runs: list[harness.LoadResult]) -> harness.LoadResult:
        """The median of ``runs``, which keeps the measure of every run."""
        median = sorted(runs, key=self.measure)[len(runs) // 2]
        median.runs = [self.measure(r) for r in runs]
        return median

    def describe(self, results: dict[str, harness.LoadResult]) -> str:
        if self.times == 1:
            return ""
        runs = "; ".join(f"{name} {' / '.join(map(_figure, r.runs))}" for name, r in results.items())
        return f"Each row is the median of {self.times} runs by {self.label}. All runs: {runs}."


def _figure(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def by_rps(times: int) -> Median:
    return Median(times, "req/s", lambda r: r.load["rps"])


@dataclass
class Scenario:
    name: str
    title: str
    body: dict
    connections: int
    engines: int = 2
    token_delay_ms: float = 0.0
    render: Callable[[dict[str, harness.LoadResult]], list[str]] = field(default=lambda r: [])
    # The measure the median run is chosen on.
    median_label: str = "req/s"
    median_of: Callable[[harness.LoadResult], float] = field(default=lambda r: r.load["rps"])
    # Seconds: targets take turns this long within one run (rather than run after run), for
    # latencies a few tens of µs apart, which drift between runs on a shared machine by more.
    interleave: float | None = None

    def median(self, times: int) -> Median:
        return Median(times, self.median_label, self.median_of)


def _ms(result: harness.LoadResult, key: str, q: str) -> float:
    return float(result.load[key][q]) if result.load.get(key) else float("nan")


def _cpu_us(result: harness.LoadResult, per: str) -> float:
    count = result.load["requests"] if per == "request" else result.load["events"]
    return result.cpu_s.get("proxy", float("nan")) / max(count, 1) * 1e6


def render_s1(results: dict[str, harness.LoadResult]) -> list[str]:
    direct = results["direct"].load["rps"]
    rows = [
        "| target | req/s | % of direct | p50 ms | p99 ms | proxy CPU µs/req | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        cpu = "" if name == "direct" else f"{_cpu_us(r, 'request'):.0f}"
        rows.append(
            f"| {name} | {r.load['rps']:.0f} | {100 * r.load['rps'] / direct:.0f}% | "
            f"{_ms(r, 'latency_ms', 'p50'):.2f} | {_ms(r, 'latency_ms', 'p99'):.2f} | {cpu} | {r.load['errors']} |"
        )
    return rows


def render_s2(results: dict[str, harness.LoadResult]) -> list[str]:
    direct = results["direct"].load["events_per_s"]
    rows = ["| target | events/s | % of direct | req/s | proxy CPU µs/event | errors |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        cpu = "" if name == "direct" else f"{_cpu_us(r, 'event'):.1f}"
        rows.append(
            f"| {name} | {r.load['events_per_s']:.0f} | {100 * r.load['events_per_s'] / direct:.0f}% | "
            f"{r.load['rps']:.0f} | {cpu} | {r.load['errors']} |"
        )
    return rows


def render_s3(results: dict[str, harness.LoadResult]) -> list[str]:
    d = results["direct"]
    rows = [
        "| target | events/s | % of direct | gap p50 ms | gap p99 ms | added gap p99 ms | TTFT p99 ms | "
        "proxy CPU µs/event | proxy RSS MB | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        proxy = name != "direct"
        added = f"{_ms(r, 'gap_ms', 'p99') - _ms(d, 'gap_ms', 'p99'):+.2f}" if proxy else ""
        cpu = f"{_cpu_us(r, 'event'):.1f}" if proxy else ""
        rss = f"{r.rss_bytes.get('proxy', 0) / 1e6:.0f}" if proxy else ""
        share = 100 * r.load["events_per_s"] / d.load["events_per_s"]
        rows.append(
            f"| {name} | {r.load['events_per_s']:.0f} | {share:.1f}% | {_ms(r, 'gap_ms', 'p50'):.2f} | "
            f"{_ms(r, 'gap_ms', 'p99'):.2f} | {added} | {_ms(r, 'ttft_ms', 'p99'):.1f} | {cpu} | {rss} | "
            f"{r.load['errors']} |"
        )
    return rows


def render_s4(results: dict[str, harness.LoadResult]) -> list[str]:
    rows = [
        "| target | p50 ms | p99 ms | added p50 µs | added p99 µs | proxy CPU µs/req |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        added = r.load.get("added_latency_ms")
        a50, a99 = (f"{added['p50'] * 1000:+.0f}", f"{added['p99'] * 1000:+.0f}") if added else ("", "")
        cpu = f"{_cpu_us(r, 'request'):.0f}" if added else ""
        rows.append(
            f"| {name} | {_ms(r, 'latency_ms', 'p50'):.3f} | {_ms(r, 'latency_ms', 'p99'):.3f} | "
            f"{a50} | {a99} | {cpu} |"
        )
    return rows


def added_to_direct(run: dict[str, harness.LoadResult]) -> dict[str, harness.LoadResult]:
    """Each target's latency above `direct`'s in the same interleaved run, as ``added_latency_ms``."""
    direct = run["direct"]
    for name, r in run.items():
        if name != "direct":
            r.load["added_latency_ms"] = {
                q: _ms(r, "latency_ms", q) - _ms(direct, "latency_ms", q) for q in ("p50", "p99")
            }
    return run


def render_mock(results: dict[str, harness.LoadResult]) -> list[str]:
    rows = [
        "| load | req/s | events/s | mock CPU (cores) | mock CPU µs/req | mock CPU µs/event |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        cpu = r.cpu_s["mock"]
        dur = r.load["duration_s"]
        per_event = f"{cpu / max(r.load['events'], 1) * 1e6:.1f}" if r.load["events"] else ""
        rows.append(
            f"| {name} | {r.load['rps']:.0f} | {r.load['events_per_s']:.0f} | {cpu / dur:.2f} | "
            f"{cpu / max(r.load['requests'], 1) * 1e6:.0f} | {per_event} |"
        )
    return rows


def render_pd(results: dict[str, harness.LoadResult], late: bool = False) -> list[str]:
    """The PD table; ``late``: with the open-loop runs' sends the schedule could not keep."""
    hybrid = results["pdproxy hybrid"]
    rows = [
        "| target and protocol | req/s | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | added TTFT p99 ms "
        "| proxy CPU µs/req | errors |" + (" late sends |" if late else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if late else ""),
    ]
    for name, r in results.items():
        pd = r is not hybrid
        a50 = f"{_ms(r, 'ttft_ms', 'p50') - _ms(hybrid, 'ttft_ms', 'p50'):+.2f}" if pd else ""
        a99 = f"{_ms(r, 'ttft_ms', 'p99') - _ms(hybrid, 'ttft_ms', 'p99'):+.2f}" if pd else ""
        rows.append(
            f"| {name} | {r.load['rps']:.0f} | {_ms(r, 'ttft_ms', 'p50'):.2f} | {_ms(r, 'ttft_ms', 'p99'):.2f} | "
            f"{a50} | {a99} | {_cpu_us(r, 'request'):.0f} | {r.load['errors']} |"
            + (f" {r.load.get('late', 0)} |" if late else "")
        )
    return rows


PD_TITLE = "PD: one prefill and one decode engine, 256 streams, 32 tokens at 10 ms/token"
#: The open-loop part of the PD scenario: every setup offered the same arrivals, a rate each of
#: them keeps up with (LMDeploy's proxy serves about 200 req/s closed loop), so first-token times
#: compare at one load, not at whatever throughput each setup reached (a faster proxy loads the
#: engines, which share the machine, more).
PD_RATE = 120.0
PD_RATE_TITLE = f"PD at a fixed rate: the same engines and setups, {PD_RATE:.0f} requests per second arriving"
PD_PROTOCOLS = ("lmdeploy", "sglang", "vllm")


def pd_median(times: int) -> Median:
    return Median(times, "TTFT p50 ms", lambda r: _ms(r, "ttft_ms", "p50"))


def run_pd(
    duration: float, repeat: int, others: list[peers.Peer], baseline: str | None = None
) -> tuple[dict[str, harness.LoadResult], dict[str, harness.LoadResult]]:
    """The same load through pdproxy with one hybrid engine (the baseline), then disaggregated
    between a prefill and a decode engine in each PD protocol, through pdproxy and through the
    peers that speak that protocol: what disaggregation adds to the first token, and at what cost.

    Every setup is up at once, each with engines of its own (so no one inherits another's KV
    state), and each round runs each setup once, as in S1-S4: a slow spell of a shared machine
    falls on every setup alike rather than on the one whose runs happened to be under way.
    ``baseline``: another build of pdproxy, run in each protocol beside this one. Returns the
    closed-loop runs, then those at ``PD_RATE`` (each round runs each setup both ways)."""
    body, connections, delay = chat(True, 32), 256, 10.0
    median = pd_median(repeat)
    with contextlib.ExitStack() as up:
        # name -> (the URL the load goes to, the processes whose CPU counts)
        setups: dict[str, tuple[str, dict[str, int]]] = {}
        harness.say(f"{PD_TITLE}: starting pdproxy with one hybrid engine")
        (engine,) = up.enter_context(harness.mock_engines(1, MODEL, delay))
        proxy = up.enter_context(harness.pdproxy([engine.url], MODEL, PDPROXY_TARGETS["pdproxy"]))
        setups["pdproxy hybrid"] = (proxy.url + CHAT, {"proxy": proxy.proc.pid, "mock": engine.proc.pid})
        for protocol in PD_PROTOCOLS:
            ours = [*PDPROXY_TARGETS, *([BASELINE] if baseline else [])]
            speakers: list[str | peers.Peer] = [*ours, *(p for p in others if p.pd_protocol == protocol)]
            for speaker in speakers:
                name = f"{speaker if isinstance(speaker, str) else speaker.name} {protocol}"
                harness.say(f"{PD_TITLE}: starting {name} with a prefill and a decode engine")
                with contextlib.ExitStack() as setup:
                    prefill, decode = setup.enter_context(
                        harness.mock_engines(2, MODEL, delay, roles=["prefill", "decode"])
                    )
                    try:
                        proxy = setup.enter_context(_pd_proxy(speaker, protocol, prefill.url, decode.url, baseline))
                    except Exception as e:
                        if isinstance(speaker, str):
                            raise
                        harness.say(f"PD: leaving out {name}: {e}")
                        continue
                    watch = {"proxy": proxy.proc.pid, "prefill": prefill.proc.pid, "decode": decode.proc.pid}
                    setups[name] = (proxy.url + CHAT, watch)
                    up.enter_context(setup.pop_all())
        runs: dict[str, list[harness.LoadResult]] = {name: [] for name in setups}
        paced: dict[str, list[harness.LoadResult]] = {name: [] for name in setups}
        for round_ in range(repeat):
            for name, (url, watch) in setups.items():
                harness.say(f"{PD_TITLE}: {name}, run {round_ + 1} of {repeat}")
                runs[name].append(harness.run_load([url], body, connections, duration, watch))
                harness.say(f"{PD_RATE_TITLE}: {name}, run {round_ + 1} of {repeat}")
                paced[name].append(harness.run_load([url], body, connections, duration, watch, rate=PD_RATE))
        return {name: median.pick(r) for name, r in runs.items()}, {name: median.pick(r) for name, r in paced.items()}


def _pd_proxy(
    speaker: str | peers.Peer, protocol: str, prefill: str, decode: str, baseline: str | None
) -> AbstractContextManager[harness.Service]:
    if not isinstance(speaker, str):
        return speaker.start_pd(prefill, decode, MODEL)
    build = baseline if speaker == BASELINE else None
    how = PDPROXY_TARGETS["pdproxy" if build else speaker]
    extra = (*how, "--serving-strategy", "DistServe", "--pd-protocol", protocol)
    return harness.pdproxy([], MODEL, extra, {prefill: "prefill", decode: "decode"}, build=build)


MANAGEMENT_TITLE = "Management calls through each pdproxy edge (one client, idle proxy, two engines)"
MANAGEMENT_PATHS = ("/nodes/status", "/metrics")


def run_management(duration: float, baseline: str | None = None) -> dict[str, dict[str, list[float]]]:
    """Latency of the management API as an operator sees it: sequential calls on one keep-alive
    connection, for about ``duration`` seconds per path and target (``baseline``: beside
    another build of pdproxy, with the Rust edge)."""
    results: dict[str, dict[str, list[float]]] = {}
    targets = {name: (how, None) for name, how in PDPROXY_TARGETS.items()}
    if baseline:
        targets[BASELINE] = (PDPROXY_TARGETS["pdproxy"], baseline)
    with harness.mock_engines(2, MODEL) as engines:
        for name, (how, build) in targets.items():
            with harness.pdproxy([e.url for e in engines], MODEL, how, build=build) as proxy:
                harness.say(f"{MANAGEMENT_TITLE}: {name}")
                results[name] = {p: harness.sequential_latency(proxy.url, p, duration) for p in MANAGEMENT_PATHS}
    return results


def render_management(results: dict[str, dict[str, list[float]]]) -> list[str]:
    rows = ["| target | " + " | ".join(f"{p} p50 ms | {p} p99 ms" for p in MANAGEMENT_PATHS) + " |"]
    rows.append("|---|" + "---|---|" * len(MANAGEMENT_PATHS))
    for name, by_path in results.items():
        cells = []
        for path in MANAGEMENT_PATHS:
            samples = sorted(by_path[path])
            cells += [f"{samples[len(samples) // 2] * 1e3:.2f}", f"{samples[int(len(samples) * 0.99)] * 1e3:.2f}"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


SCENARIOS = {
    "S1": Scenario("S1", "S1: non-stream chat, 64 connections", chat(False, 16), 64, render=render_s1),
    "S2": Scenario(
        "S2",
        "S2: stream, 64 events per response without delay, 64 connections",
        chat(True, 62),
        64,
        render=render_s2,
        median_label="events/s",
        median_of=lambda r: r.load["events_per_s"],
    ),
    "S3": Scenario(
        "S3",
        "S3: 512 concurrent streams, 100 tokens at 20 ms/token",
        chat(True, 100),
        512,
        token_delay_ms=20.0,
        render=render_s3,
        median_label="gap p99 ms",
        median_of=lambda r: _ms(r, "gap_ms", "p99"),
    ),
    "S4": Scenario(
        "S4",
        "S4: one connection, non-stream, one engine",
        chat(False, 16),
        1,
        # One engine: every target sends every request where `direct` does (see bench/README.md).
        engines=1,
        render=render_s4,
        median_label="p50 ms added to direct's in the same run (direct: its p50 ms)",
        median_of=lambda r: r.load.get("added_latency_ms", r.load["latency_ms"])["p50"],
        interleave=0.25,
    ),
}


def run_scenario(
    s: Scenario, duration: float, others: list[peers.Peer], repeat: int, baseline: str | None = None
) -> dict[str, harness.LoadResult]:
    """Every target of the scenario, its runs taking turns: all targets are up at once and each
    round runs each of them once, so that a burst of noise on a shared machine falls on every
    target alike rather than on the one whose runs happened to be under way."""
    harness.say(f"{s.title}: starting {s.engines} mock engine(s) and every target")
    median = s.median(repeat)
    with harness.mock_engines(s.engines, MODEL, s.token_delay_ms) as engines, contextlib.ExitStack() as up:
        mocks = {f"mock-{i}": e.proc.pid for i, e in enumerate(engines)}
        urls = [e.url for e in engines]
        # name -> (the URLs the load goes to, the processes whose CPU and memory count)
        targets: dict[str, tuple[list[str], dict[str, int]]] = {"direct": ([u + CHAT for u in urls], mocks)}
        floor = up.enter_context(harness.floor(urls))
        targets["floor"] = ([floor.url + CHAT], {"proxy": floor.proc.pid, **mocks})
        for name, how in {**PDPROXY_TARGETS, **DEFAULT_THREADS}.items():
            proxy = up.enter_context(harness.pdproxy(urls, MODEL, (*how, "--policy", SCENARIO_POLICY)))
            targets[name] = ([proxy.url + CHAT], {"proxy": proxy.proc.pid, **mocks})
        if baseline:
            how = (*PDPROXY_TARGETS["pdproxy"], "--policy", SCENARIO_POLICY)
            proxy = up.enter_context(harness.pdproxy(urls, MODEL, how, build=baseline))
            targets[BASELINE] = ([proxy.url + CHAT], {"proxy": proxy.proc.pid, **mocks})
        for peer in others:
            try:
                proxy = up.enter_context(peer.start(urls, MODEL))
            except Exception as e:  # a peer that fails is left out of this table, not the whole run
                harness.say(f"{s.name}: leaving out {peer.name}: {e}")
                continue
            targets[peer.name] = ([proxy.url + CHAT], {"proxy": proxy.proc.pid, **mocks})
        runs: dict[str, list[harness.LoadResult]] = {name: [] for name in targets}
        if s.interleave is not None:
            each = {name: (urls[0], watch) for name, (urls, watch) in targets.items()}
            for round_ in range(repeat):
                harness.say(f"{s.name}: every target in turn, run {round_ + 1} of {repeat}, {duration:.0f} s each")
                run = harness.run_interleaved(each, s.body, duration * len(each), s.interleave)
                for name, result in added_to_direct(run).items():
                    runs[name].append(result)
            return {name: median.pick(r) for name, r in runs.items()}
        for round_ in range(repeat):
            for name, (target, watch) in targets.items():
                if name not in runs:
                    continue
                harness.say(f"{s.name}: {name}, run {round_ + 1} of {repeat}, {duration:.0f} s")
                try:
                    runs[name].append(harness.run_load(target, s.body, s.connections, duration, watch))
                except Exception as e:
                    harness.say(f"{s.name}: leaving out {name}: {e}")
                    del runs[name]
    return {name: median.pick(r) for name, r in runs.items()}


def run_mock_capacity(duration: float, repeat: int) -> dict[str, harness.LoadResult]:
    harness.say("mock engine capacity: one process, 64 connections")
    results = {}
    run_load = by_rps(repeat)
    with harness.mock_engines(1, MODEL) as (engine,):
        url = engine.url + "/v1/chat/completions"
        watch = {"mock": engine.proc.pid}
        results["non-stream, 16 tokens"] = run_load([url], chat(False, 16), 64, duration, watch)
        results["stream, 64 events"] = run_load([url], chat(True, 62), 64, duration, watch)
    return results


POLICY_TITLE = "Routing policy: S1's load (64 connections, two engines) with short and long prompts"
#: pdproxy's policies compared in the policy scenario (the first the reference), and their flags:
#: `scored` alone, and with the KV index following the engines' events (--kv-events).
POLICIES = {
    "round_robin": ("--policy", "round_robin"),
    "scored": ("--policy", "scored"),
    "scored, kv index": ("--policy", "scored", "--kv-events", "auto", "--kv-tokenizer", "mock"),
}
REFERENCE_POLICY = next(iter(POLICIES))
#: The prompts of the policy scenario: S1's two words, and a long one (tokens of 4 bytes).
POLICY_PROMPTS = {"short": 0, "2k tokens": 2048}
#: The policy scenario's engines simulate a KV cache and publish its events (the index then
#: holds the repeated prompt, and matches all of it), with steps short enough that the proxy,
#: not the engines, is what the load measures.
POLICY_ENGINE = (
    *("--simulate", "--max-batch", "64", "--prefill-ms-per-token", "0", "--decode-step-ms", "0.5"),
    *("--decode-step-ms-per-seq", "0", "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"),
)


def run_policy(duration: float, repeat: int) -> dict[str, harness.LoadResult]:
    """What a routing policy costs the proxy per request: S1's load through pdproxy with each of
    ``POLICIES``, every setup up at once and taking turns, the same prompt repeated (so `scored`
    finds it cached and does its whole work: hashing every block, matching, learning; and the
    KV index renders it and matches every block)."""
    run_load = by_rps(repeat)
    with harness.mock_engines(2, MODEL, options=POLICY_ENGINE) as engines, contextlib.ExitStack() as up:
        mocks = {f"mock-{i}": e.proc.pid for i, e in enumerate(engines)}
        urls = [e.url for e in engines]
        proxies = {}
        for policy, flags in POLICIES.items():
            how = (*PDPROXY_TARGETS["pdproxy"], *flags)
            proxies[policy] = up.enter_context(harness.pdproxy(urls, MODEL, how))
        runs: dict[str, list[harness.LoadResult]] = {}
        for round_ in range(repeat):
            for prompt, tokens in POLICY_PROMPTS.items():
                for policy, proxy in proxies.items():
                    name = f"{policy}, {prompt} prompt"
                    harness.say(f"{POLICY_TITLE}: {name}, run {round_ + 1} of {repeat}")
                    watch = {"proxy": proxy.proc.pid, **mocks}
                    load = harness.run_load([proxy.url + CHAT], chat(False, 16, tokens), 64, duration, watch)
                    runs.setdefault(name, []).append(load)
        check_index_used(proxies["scored, kv index"].url)
    return {name: run_load.pick(r) for name, r in runs.items()}


def check_index_used(proxy: str) -> None:
    """The KV index's row measures the index only if it priced the candidates: its /metrics say."""
    with urllib.request.urlopen(proxy + "/metrics", timeout=5) as response:
        text = response.read().decode()
    priced = {
        source: float(value)
        for source, value in re.findall(r'^pdproxy_kv_index_priced_total\{source="(\w+)"\} (\S+)$', text, re.M)
    }
    index, table = priced.get("index", 0), priced.get("table", 0)
    harness.say(f"{POLICY_TITLE}: the KV index priced {index:.0f} candidates, the table {table:.0f}")
    if not index:
        raise SystemExit("the KV index priced no candidate: its row would measure scored alone")


def render_policy(results: dict[str, harness.LoadResult]) -> list[str]:
    rows = [
        f"| policy and prompt | req/s | p99 ms | proxy CPU µs/req | vs {REFERENCE_POLICY} | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        prompt = name.rsplit(", ", 1)[1]
        reference = _cpu_us(results[f"{REFERENCE_POLICY}, {prompt}"], "request")
        cpu = _cpu_us(r, "request")
        rows.append(
            f"| {name} | {r.load['rps']:.0f} | {_ms(r, 'latency_ms', 'p99'):.2f} | {cpu:.0f} | "
            f"{cpu / reference:.2f}x | {r.load['errors']} |"
        )
    return rows


def as_json(results: dict[str, harness.LoadResult]) -> dict[str, dict]:
    return {k: {"load": v.load, "cpu_s": v.cpu_s, "rss_bytes": v.rss_bytes, "runs": v.runs} for k, v in results.items()}


def from_json(saved: dict[str, dict]) -> dict[str, harness.LoadResult]:
    """Results as ``as_json`` saved them."""
    return {name: harness.LoadResult(**result) for name, result in saved.items()}


MOCK_TITLE = "Mock engine capacity (one process, 64 connections, direct)"
#: Where the run's JSON keeps the PD scenario's runs at ``PD_RATE``, beside its closed-loop ones.
PD_RATE_KEY = "PD at a fixed rate"


def title_of(name: str) -> str:
    titles = {"PD": PD_TITLE, "policy": POLICY_TITLE, "mock": MOCK_TITLE, "management": MANAGEMENT_TITLE}
    return titles[name] if name in titles else SCENARIOS[name].title


def render_section(name: str, raw: dict[str, dict], chart: Path | None = None) -> str:
    """One scenario's tables, from every scenario's results as the run's JSON keeps them (``raw``);
    ``chart``: its picture, beside the tables in bench/results/."""
    if name == "management":
        return "\n".join([f"### {MANAGEMENT_TITLE}", "", *render_management(raw[name])])
    results = from_json(raw[name])
    times = max(len(next(iter(results.values())).runs), 1)
    after: list[str] = []  # rows that follow the median's description
    if name == "PD":
        paced = from_json(raw[PD_RATE_KEY])
        rows, median = render_pd(results), pd_median(times)
        after = ["", f"#### {PD_RATE_TITLE}", "", *render_pd(paced, late=True), "", median.describe(paced)]
    elif name == "policy":
        rows, median = render_policy(results), by_rps(times)
    elif name == "mock":
        rows, median = render_mock(results), by_rps(times)
    else:
        scenario = SCENARIOS[name]
        rows, median = scenario.render(results), scenario.median(times)
    if median.describe(results):
        rows = [*rows, "", median.describe(results)]
    rows = [*rows, *after]
    if chart is not None:
        rows = [*rows, "", f"![{name}]({chart.name})"]
    return "\n".join([f"### {title_of(name)}", "", *rows])


def headline(summary: dict) -> str:
    """Which run: when, where, the command and the peers' versions."""
    command = summary.get("command")
    how = "command not recorded" if command is None else f"`python bench/run.py{' ' if command else ''}{command}`"
    line = f"Run {summary['run']} on {summary['machine']}; {how}."
    if summary["peers"]:
        line += " Peers: " + "; ".join(f"{n} {p['version']} ({p['how']})" for n, p in summary["peers"].items()) + "."
    return line


def render_run(summary: dict) -> str:
    """Every table of a run saved by this script (results/latest.json), as it printed them."""
    raw = summary["results"]
    return "\n\n".join([headline(summary), *(render_section(name, raw) for name in raw if name != PD_RATE_KEY)])


#: The columns of the README's summary, when the run has them (every target: results/run.md).
SUMMARY_COLUMNS = ("pdproxy", "floor", "nginx", "sglang-router", "vllm-router", "lmdeploy-proxy")
PROTOCOL_NAMES = {"lmdeploy": "LMDeploy's", "sglang": "SGLang's", "vllm": "vLLM's"}


def _summary_cells(name: str, results: dict[str, harness.LoadResult]) -> tuple[str, dict[str, str]] | None:
    """One scenario's row of the summary: its label and each column's cell."""
    cells: dict[str, str] = {}
    if name in ("S1", "S2"):
        per = "request" if name == "S1" else "event"
        for target, r in results.items():
            rate = r.load["rps"] if name == "S1" else r.load["events_per_s"]
            cpu = _cpu_us(r, per)
            cells[target] = f"{rate:.0f} ({cpu:.0f} µs)" if name == "S1" else f"{rate:.0f} ({cpu:.1f} µs)"
        label = "S1 req/s (proxy CPU per request)" if name == "S1" else "S2 events/s (proxy CPU per event)"
        return label, cells
    if name == "S3":
        d = results["direct"]
        for target, r in results.items():
            share = 100 * r.load["events_per_s"] / d.load["events_per_s"]
            added = _ms(r, "gap_ms", "p99") - _ms(d, "gap_ms", "p99")
            rss = r.rss_bytes.get("proxy", 0) / 1e6
            cells[target] = f"{share:.1f}%, {added:+.2f} ms, {rss:.0f} MB"
        return "S3 % of direct's events/s, added gap p99, proxy RSS", cells
    if name == "S4":
        for target, r in results.items():
            if added := r.load.get("added_latency_ms"):
                cells[target] = f"{added['p50'] * 1000:+.0f} µs"
        return "S4 added p50", cells
    return None


def _added_ttft(results: dict[str, harness.LoadResult], setup: str) -> float | None:
    """A PD setup's TTFT p50 above the hybrid engine's, in ms."""
    if setup not in results or "pdproxy hybrid" not in results:
        return None
    return _ms(results[setup], "ttft_ms", "p50") - _ms(results["pdproxy hybrid"], "ttft_ms", "p50")


def render_summary(loaded: dict[str, dict[str, harness.LoadResult]]) -> list[str]:
    """pdproxy beside the peers, one row per scenario, every figure as the full tables print it."""
    # A column per target the run has, in S1-S4 by its name, in PD as "NAME PROTOCOL".
    present = {name.split(" ")[0] for results in loaded.values() for name in results}
    columns = [c for c in SUMMARY_COLUMNS if c in present]
    rows = ["| scenario | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name in SCENARIOS:
        if name in loaded and (row := _summary_cells(name, loaded[name])):
            label, cells = row
            rows.append(f"| {label} | " + " | ".join(cells.get(c, "") for c in columns) + " |")
    if "PD" in loaded:
        closed, paced = loaded["PD"], loaded.get(PD_RATE_KEY, {})
        for protocol, spoken in PROTOCOL_NAMES.items():
            cells = {}
            for column in columns:
                a, b = _added_ttft(closed, f"{column} {protocol}"), _added_ttft(paced, f"{column} {protocol}")
                if a is not None:
                    cells[column] = f"{a:+.2f}" + (f" / {b:+.2f}" if b is not None else "") + " ms"
            label = f"PD in {spoken} protocol: added TTFT p50, closed loop / at {PD_RATE:.0f} req/s"
            rows.append(f"| {label} | " + " | ".join(cells.get(c, "") for c in columns) + " |")
    return rows


def _p50_ms(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e3


def render_targets(
    loaded: dict[str, dict[str, harness.LoadResult]], management: dict[str, dict[str, list[float]]] | None
) -> list[str]:
    """The Rust edge's targets (issue 13), each judged on the run's figures (those the full tables print)."""
    rows = ["| target | figures | met |", "|---|---|---|"]

    def row(what: str, figures: str, met: bool) -> None:
        rows.append(f"| {what} | {figures} | {'yes' if met else 'no'} |")

    s1, s2, s3, s4 = (loaded.get(name, {}) for name in ("S1", "S2", "S3", "S4"))
    if p := s1.get("pdproxy"):
        cpu = _cpu_us(p, "request")
        row("S1 proxy CPU per request <= 40 µs", f"{cpu:.0f} µs", cpu <= 40)
        if g := s1.get("sglang-router"):
            ratio = p.load["rps"] / g.load["rps"]
            row(
                "S1 req/s >= 1.5x sglang-router's",
                f"{p.load['rps']:.0f} against {g.load['rps']:.0f}: {ratio:.2f}x",
                ratio >= 1.5,
            )
    if p := s2.get("pdproxy"):
        cpu = _cpu_us(p, "event")
        row("S2 proxy CPU per event <= 3.5 µs", f"{cpu:.1f} µs", cpu <= 3.5)
    if (p := s3.get("pdproxy")) and (d := s3.get("direct")):
        share = 100 * p.load["events_per_s"] / d.load["events_per_s"]
        row("S3 events/s 100% of direct's", f"{share:.1f}%", share >= 99.95)
        added = _ms(p, "gap_ms", "p99") - _ms(d, "gap_ms", "p99")
        if n := s3.get("nginx"):
            theirs = _ms(n, "gap_ms", "p99") - _ms(d, "gap_ms", "p99")
            row("S3 added gap p99 <= nginx's + 1 ms", f"{added:+.2f} against {theirs:+.2f} ms", added <= theirs + 1)
        if g := s3.get("sglang-router"):
            ours, theirs = _cpu_us(p, "event"), _cpu_us(g, "event")
            ratio = ours / theirs
            row(
                "S3 proxy CPU per event <= 0.8x sglang-router's",
                f"{ours:.1f} against {theirs:.1f} µs: {ratio:.2f}x",
                ratio <= 0.8,
            )
        rss = p.rss_bytes.get("proxy", 0) / 1e6
        row("S3 proxy RSS <= 100 MB", f"{rss:.0f} MB", rss <= 100)
    if (p := s4.get("pdproxy")) and (added := p.load.get("added_latency_ms")):
        row("S4 added p50 <= 60 µs", f"{added['p50'] * 1000:+.0f} µs", added["p50"] * 1000 <= 60)
    for protocol, peer in (("vllm", "vllm-router"), ("sglang", "sglang-router")):
        figures, verdicts = [], []
        for results in (loaded.get("PD", {}), loaded.get(PD_RATE_KEY, {})):
            ours, theirs = _added_ttft(results, f"pdproxy {protocol}"), _added_ttft(results, f"{peer} {protocol}")
            if ours is not None and theirs is not None:
                figures.append(f"{ours:+.2f} against {theirs:+.2f} ms")
                verdicts.append("yes" if ours <= theirs else "no")
        if len(figures) == 2:
            what = f"PD in {PROTOCOL_NAMES[protocol]} protocol: added TTFT p50 <= {peer}'s"
            what += f", closed loop / at {PD_RATE:.0f} req/s"
            rows.append(f"| {what} | {' / '.join(figures)} | {' / '.join(verdicts)} |")
    if management and {"pdproxy", "pdproxy-granian"} <= management.keys():
        figures, met = [], True
        for path in MANAGEMENT_PATHS:
            ours, theirs = _p50_ms(management["pdproxy"][path]), _p50_ms(management["pdproxy-granian"][path])
            figures.append(f"{path} {ours:.2f} against {theirs:.2f} ms")
            met = met and ours <= theirs + 1
        row("management p50 through the Rust edge within 1 ms of the granian edge's", ", ".join(figures), met)
    return rows if len(rows) > 2 else []


def render_readme(summary: dict) -> str:
    """The README's section: which run, pdproxy beside the peers, the targets, and where the rest is."""
    raw = summary["results"]
    loaded = {name: from_json(results) for name, results in raw.items() if name != "management"}
    lines = [headline(summary), "", *render_summary(loaded)]
    if targets := render_targets(loaded, raw.get("management")):
        lines += ["", "Against the targets of the Rust edge (issue 13), in this run:", "", *targets]
    lines += [
        "",
        "Every table of this run, each target's runs, the granian edge, two edge threads, the routing policy, "
        "management calls and the mock engine's capacity: [results/run.md](results/run.md) "
        "(raw: [results/run.json](results/run.json)).",
    ]
    return "\n".join(lines)


def publish(summary: dict, markdown: str) -> None:
    """Makes ``summary`` the run bench/README.md shows: its tables in results/run.md (raw:
    results/run.json), its summary and targets in the README's results section."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "run.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "run.md").write_text(markdown + "\n")
    update_readme(render_readme(summary))


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def update_readme(markdown: str) -> None:
    text = README.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    block = f"{start}\n{markdown}\n{end}"
    text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    README.write_text(text)


#: How long `--wait-quiet` probes before it gives up, and the pause between probes.
QUIET_PATIENCE_S = 3 * 3600
QUIET_PAUSE_S = 60


def wait_quiet(rps: float, give_up: float) -> bool:
    """Waits until two probes in a row (S1's load sent directly to two engines, 3 s each) reach
    ``rps`` req/s: a shared machine's neighbours slow every process here alike, and the CPU per
    request or event is an absolute target. False when the machine is still busy at ``give_up``
    (a time.monotonic() value)."""
    s1 = SCENARIOS["S1"]
    with harness.mock_engines(s1.engines, MODEL) as engines:
        urls = [e.url + CHAT for e in engines]
        watch = {f"mock-{i}": e.proc.pid for i, e in enumerate(engines)}
        while True:
            probes = [harness.run_load(urls, s1.body, s1.connections, 3.0, watch, warmup=0.5) for _ in range(2)]
            measured = [p.load["rps"] for p in probes]
            shown = " / ".join(f"{r:.0f}" for r in measured)
            harness.say(f"quiet probe: direct S1 {shown} req/s (waiting for {rps:.0f})")
            if min(measured) >= rps:
                return True
            if time.monotonic() > give_up:
                return False
            time.sleep(QUIET_PAUSE_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)}, PD, policy, management, mock (default: all)"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (after 1 s warm-up)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per target; a row is the median run (default: %(default)s)"
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="make this run the one bench/README.md shows: its summary and targets there, its tables in "
        "bench/results/run.md (raw: run.json)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="run nothing: print the tables of a run saved by this script (bench/results/latest.json); with "
        "--write-readme, make it the run bench/README.md shows",
    )
    parser.add_argument(
        "--peers",
        default=",".join(peers.PEERS),
        help=f"peer proxies to run beside pdproxy, comma-separated: {', '.join(peers.PEERS)}, or none "
        "(default: %(default)s); installed into bench/.peers on first use",
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="a directory holding another build of pdproxy as DIR/pdproxy (say, a copy of the installed "
        "package made before a change): it runs beside pdproxy (in S1-S4, PD and management), with its "
        "flags, as pdproxy-baseline",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        metavar="RPS",
        help="start each scenario only once S1's load sent directly to two engines reaches RPS req/s in two "
        "probes in a row (a shared machine's quiet stretch); the run's command line says the threshold",
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        markdown = render_run(saved)
        print(markdown)
        if args.write_readme:
            publish(saved, markdown)
        return
    chosen = args.scenarios or [*SCENARIOS, "PD", "policy", "management", "mock"]
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        wanted = peers.parse(args.peers) if set(chosen) - {"mock", "management", "policy"} else []
    except ValueError as e:
        parser.error(str(e))
    harness.build_loadgen()
    others = peers.prepare(wanted)
    give_up = time.monotonic() + QUIET_PATIENCE_S

    def quiet_start() -> None:
        # Before every scenario, not only the first: quiet stretches of a shared machine are often
        # shorter than a whole run.
        if args.wait_quiet and not wait_quiet(args.wait_quiet, give_up):
            sys.exit(f"the machine stayed below {args.wait_quiet:.0f} req/s for {QUIET_PATIENCE_S // 3600} hours")

    quiet_start()
    raw: dict[str, dict] = {}
    summary = {
        "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "command": " ".join(sys.argv[1:]),
        "peers": {p.name: {"version": p.version(), "how": p.note} for p in others},
        "results": raw,
    }
    sections = [headline(summary)]
    for i, name in enumerate(chosen):
        if i:
            quiet_start()
        chart = None
        if name == "management":
            raw[name] = run_management(args.duration, args.baseline)
        elif name == "PD":
            results, paced = run_pd(args.duration, args.repeat, others, args.baseline)
            raw[PD_RATE_KEY] = as_json(paced)
        elif name == "policy":
            results = run_policy(args.duration, args.repeat)
        elif name == "mock":
            results = run_mock_capacity(args.duration, args.repeat)
        else:
            results = run_scenario(SCENARIOS[name], args.duration, others, args.repeat, args.baseline)
        if name != "management":
            raw[name] = as_json(results)
            RESULTS.mkdir(exist_ok=True)
            chart = charts.render(name, title_of(name), results, RESULTS)
        section = render_section(name, raw, chart)
        print(section + "\n", flush=True)
        sections.append(section)
    markdown = "\n\n".join(sections)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "latest.md").write_text(markdown + "\n")
    if args.write_readme:
        publish(summary, markdown)


if __name__ == "__main__":
    main()

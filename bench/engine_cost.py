"""What a proxy costs the engines behind it, apart from its own CPU: S1's load (non-stream chat, 64
connections, two mock engines) sent directly, directly with the five headers pdproxy adds for a node
(`x-request-id`, `X-Forwarded-For/Host/Proto`, `x-pdproxy-via`), through the floor proxy as
bench/run.py runs it (each client connection paired with one node's connection), through the floor
proxy routing each request to the next node (as pdproxy and the routers do in S1-S4), the same with
pdproxy's headers sent by the client (a pass-through that hands the engines what pdproxy hands them:
about the most req/s pdproxy could reach), and through pdproxy; the runs take turns. The measure is
the engines' CPU per request: they are Python servers, as LMDeploy's, vLLM's and SGLang's
api_servers are.

    python bench/engine_cost.py                 # 3 s per run, median of 9
    python bench/engine_cost.py --duration 5 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from run import CHAT, MODEL, PDPROXY_TARGETS, SCENARIO_POLICY, chat

#: What pdproxy's Rust edge adds to a client's request that carries none of these itself
#: (values as long as the ones it sends; see rust/src/edge/request.rs and rust/src/loops.rs).
ADDED = (
    "x-request-id:3202c96b42f547a3a8c8feb2631cb9bf",
    "x-forwarded-for:127.0.0.1",
    "x-forwarded-host:127.0.0.1:36595",
    "x-forwarded-proto:http",
    "x-pdproxy-via:pdproxy-bf98fbdb928ce010",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--repeat", type=int, default=9, help="runs per target; a row is the median")
    args = parser.parse_args()
    body = chat(False, 16)
    with harness.mock_engines(2, MODEL) as engines, contextlib.ExitStack() as up:
        urls = [e.url for e in engines]
        mocks = {f"mock-{i}": e.proc.pid for i, e in enumerate(engines)}
        pinned = up.enter_context(harness.floor(urls))
        per_request = up.enter_context(harness.floor(urls, per_request=True))
        how = (*PDPROXY_TARGETS["pdproxy"], "--policy", SCENARIO_POLICY)
        pdproxy = up.enter_context(harness.pdproxy(urls, MODEL, how))
        # name -> (where the load goes, the headers it adds, the proxy's pid)
        targets: dict[str, tuple[list[str], tuple[str, ...], int | None]] = {
            "direct": ([u + CHAT for u in urls], (), None),
            "direct, with pdproxy's headers": ([u + CHAT for u in urls], ADDED, None),
            "floor, connections paired": ([pinned.url + CHAT], (), pinned.proc.pid),
            "floor, each request to the next node": ([per_request.url + CHAT], (), per_request.proc.pid),
            "floor, each request to the next node, pdproxy's headers": (
                [per_request.url + CHAT],
                ADDED,
                per_request.proc.pid,
            ),
            "pdproxy": ([pdproxy.url + CHAT], (), pdproxy.proc.pid),
        }
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in targets}
        for round_ in range(args.repeat):
            harness.say(f"engine cost: round {round_ + 1} of {args.repeat}")
            for name, (target, headers, proxy) in targets.items():
                watch = {**mocks, **({"proxy": proxy} if proxy else {})}
                result = harness.run_load(target, body, 64, args.duration, watch, headers=headers)
                served = result.load["rps"] * args.duration
                engines_us = sum(result.cpu_s[m] for m in mocks) / served * 1e6
                proxy_us = result.cpu_s["proxy"] / served * 1e6 if proxy else 0.0
                runs[name].append((result.load["rps"], engines_us, proxy_us))
    print("| target | req/s | engines' CPU µs/request | proxy CPU µs/request |")
    print("|---|---|---|---|")
    for name, rows in runs.items():
        rps, engines_us, proxy_us = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"| {name} | {rps:.0f} | {engines_us:.1f} | {f'{proxy_us:.1f}' if proxy_us else ''} |")
    print()
    print(f"Medians of {args.repeat} runs each. Engines' CPU µs/request, all runs:")
    for name, rows in runs.items():
        print(f"- {name}: " + " / ".join(f"{r[1]:.0f}" for r in rows))


if __name__ == "__main__":
    main()

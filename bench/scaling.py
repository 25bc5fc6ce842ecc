"""How pdproxy's cost grows with the work: proxy CPU per request and per event, and RSS, as
concurrent streams grow (64 to 4096), as the number of nodes grows (2 to 128) and with 1, 2
and 4 worker processes (`--workers`).

    python bench/scaling.py                     # every sweep, 8 s per point
    python bench/scaling.py --duration 4
    python bench/scaling.py --sweeps workers    # one sweep: streams, nodes or workers
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from pdproxy.testing import mock_engine_command
from pdproxy.testing.ports import free_port_range
from run import CHAT, MODEL, chat

STREAMS = (64, 256, 1024, 4096)
NODES = (2, 16, 128)
WORKERS = (1, 2, 4)


@contextlib.contextmanager
def engines_in_one_process(count: int) -> Iterator[list[str]]:
    """``count`` mock engines served by one process (so 128 nodes cost one process)."""
    port = free_port_range(count)
    args = mock_engine_command(port, MODEL, "--count", str(count))
    url = f"http://127.0.0.1:{port}"
    with harness.service(f"{count} engines", args, url + "/health", url):
        yield [f"http://127.0.0.1:{port + i}" for i in range(count)]


def per(result: harness.LoadResult, what: str) -> float:
    return result.cpu_s["proxy"] / max(result.load[what], 1) * 1e6


def stream_sweep(duration: float) -> list[str]:
    rows = [
        "| streams | events/s | gap p99 ms | proxy CPU µs/event | proxy CPU µs/request | proxy RSS MB | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    with (
        harness.mock_engines(2, MODEL, token_delay_ms=20.0) as engines,
        harness.pdproxy([e.url for e in engines], MODEL) as proxy,
    ):
        for streams in STREAMS:
            harness.say(f"scaling: {streams} streams of 50 tokens at 20 ms/token for {duration:.0f} s")
            r = harness.run_load([proxy.url + CHAT], chat(True, 50), streams, duration, {"proxy": proxy.proc.pid})
            gap = r.load["gap_ms"]["p99"] if r.load.get("gap_ms") else float("nan")
            rows.append(
                f"| {streams} | {r.load['events_per_s']:.0f} | {gap:.1f} | {per(r, 'events'):.1f} | "
                f"{per(r, 'requests'):.0f} | {r.rss_bytes['proxy'] / 1e6:.0f} | {r.load['errors']} |"
            )
    return rows


def node_sweep(duration: float) -> list[str]:
    rows = ["| nodes | req/s | proxy CPU µs/request | proxy RSS MB | errors |", "|---|---|---|---|---|"]
    for count in NODES:
        with engines_in_one_process(count) as urls, harness.pdproxy(urls, MODEL) as proxy:
            harness.say(f"scaling: {count} nodes, non-stream, 64 connections for {duration:.0f} s")
            r = harness.run_load([proxy.url + CHAT], chat(False, 16), 64, duration, {"proxy": proxy.proc.pid})
            rows.append(
                f"| {count} | {r.load['rps']:.0f} | {per(r, 'requests'):.0f} | {r.rss_bytes['proxy'] / 1e6:.0f} | "
                f"{r.load['errors']} |"
            )
    return rows


def worker_sweep(duration: float) -> list[str]:
    """Non-stream requests and stream events through 1, 2 and 4 workers on the same engines
    (CPU counted over the whole process tree: granian's main process and every worker)."""
    rows = [
        "| workers | req/s | proxy CPU µs/request | events/s | proxy CPU µs/event | proxy RSS MB | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    with harness.mock_engines(2, MODEL) as engines:
        urls = [e.url for e in engines]
        for workers in WORKERS:
            with harness.pdproxy(urls, MODEL, ("--edge", "granian", "--workers", str(workers))) as proxy:
                watch = {"proxy": proxy.proc.pid}
                harness.say(f"scaling: {workers} worker(s), non-stream then stream, 64 connections, {duration:.0f} s")
                plain = harness.run_load([proxy.url + CHAT], chat(False, 16), 64, duration, watch)
                stream = harness.run_load([proxy.url + CHAT], chat(True, 64), 64, duration, watch)
            errors = plain.load["errors"] + stream.load["errors"]
            rows.append(
                f"| {workers} | {plain.load['rps']:.0f} | {per(plain, 'requests'):.0f} | "
                f"{stream.load['events_per_s']:.0f} | {per(stream, 'events'):.1f} | "
                f"{max(plain.rss_bytes['proxy'], stream.rss_bytes['proxy']) / 1e6:.0f} | {errors} |"
            )
    return rows


SWEEPS = {
    "streams": ("Concurrent streams (two engines, 50 tokens at 20 ms/token)", stream_sweep),
    "nodes": ("Nodes (one process of mock engines, non-stream, 64 connections)", node_sweep),
    "workers": ("Workers (two engines, 64 connections: non-stream, then streams of 64 events)", worker_sweep),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help="comma-separated: " + ", ".join(SWEEPS))
    args = parser.parse_args()
    chosen = [name.strip() for name in args.sweeps.split(",") if name.strip()]
    if unknown := [name for name in chosen if name not in SWEEPS]:
        parser.error(f"unknown sweep(s): {', '.join(unknown)}")
    harness.build_loadgen()
    for name in chosen:
        title, sweep = SWEEPS[name]
        print(f"### {title}\n")
        print("\n".join(sweep(args.duration)) + "\n", flush=True)


if __name__ == "__main__":
    main()

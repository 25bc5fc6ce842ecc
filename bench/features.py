"""What tenant limits, tracing and the routing policy cost on the hot path: S1 (non-stream
requests) and S2 (streamed events) through the Rust edge, plain (the default policy, `scored`)
and with each feature on, or with `round_robin` (the policy of S1-S4 in bench/run.py), side by side.

    python bench/features.py                 # 10 s per run, median of 3
    python bench/features.py --duration 5 --repeat 1

`tenants`: every request carries a tenant's key whose limits are all set (requests and tokens
per minute, requests at once, a daily budget) but never reached, so each request takes and
settles a pass and its answer's usage is read. `tracing`: every request is traced (sampler
always_on) and its spans exported over OTLP/HTTP to a local receiver that discards them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from run import CHAT, MODEL, Median, _cpu_us, by_rps, chat

KEY = "bench-tenant-key"
TENANTS = f"""
[tenants.bench]
keys = ["{KEY}"]
rpm = 1000000000
tpm = 1000000000000
concurrency = 100000
daily_tokens = 1000000000000000
"""


@contextmanager
def otlp_sink() -> Iterator[str]:
    """An OTLP/HTTP receiver that reads and discards what it is sent."""

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()


def variants(workdir: Path, sink: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each variant: the proxy's extra arguments, and the load's headers."""
    tenants = workdir / "tenants.toml"
    tenants.write_text(TENANTS)
    key = (f"authorization:Bearer {KEY}",)
    limits = ("--tenants-file", str(tenants))
    tracing = ("--otlp-endpoint", sink, "--trace-sampler", "always_on")
    return {
        "plain": ((), ()),
        "round_robin": (("--policy", "round_robin"), ()),
        "tenants": (limits, key),
        "tracing": (tracing, ()),
        "tenants+tracing": ((*limits, *tracing), key),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    harness.build_loadgen()
    s1 = by_rps(args.repeat)
    s2 = Median(args.repeat, "events/s", lambda r: r.load["events_per_s"])
    loads = [("S1", chat(False, 16), s1, "request"), ("S2", chat(True, 62), s2, "event")]
    rows = [
        "| variant | S1 req/s | S1 proxy CPU µs/req | S2 events/s | S2 proxy CPU µs/event |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp, otlp_sink() as sink, harness.mock_engines(2, MODEL) as engines:
        mocks = {f"mock-{i}": e.proc.pid for i, e in enumerate(engines)}
        urls = [e.url for e in engines]
        measured: dict[str, dict[str, Any]] = {}
        for name, (extra, headers) in variants(Path(tmp), sink).items():
            key = KEY if headers else None
            with harness.pdproxy(urls, MODEL, extra, key=key) as proxy:
                for scenario, body, median, per in loads:
                    harness.say(f"{scenario}: {name} for {args.duration:.0f} s")
                    watch = {"proxy": proxy.proc.pid, **mocks}
                    results = [
                        harness.run_load([proxy.url + CHAT], body, 64, args.duration, watch, headers=headers)
                        for _ in range(median.times)
                    ]
                    chosen = sorted(results, key=median.measure)[len(results) // 2]
                    assert chosen.load["errors"] == 0, f"{name} {scenario}: {chosen.load['errors']} errors"
                    measured.setdefault(name, {})[scenario] = (chosen, _cpu_us(chosen, per))
        base = measured["plain"]
        for name, by_scenario in measured.items():
            s1_result, s1_cpu = by_scenario["S1"]
            s2_result, s2_cpu = by_scenario["S2"]
            rows.append(
                f"| {name} | {s1_result.load['rps']:.0f} | {s1_cpu:.1f} ({s1_cpu / base['S1'][1]:.2f}x) | "
                f"{s2_result.load['events_per_s']:.0f} | {s2_cpu:.2f} ({s2_cpu / base['S2'][1]:.2f}x) |"
            )
    print("\n".join(rows))


if __name__ == "__main__":
    main()

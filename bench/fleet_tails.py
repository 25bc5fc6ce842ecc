"""Which requests make a fleet run's TTFT tail: reads the requests `bench/fleet.py --dump DIR`
kept of each run and splits them by turn (a conversation's first turn is a fresh prompt, its
later turns follow a held one).

    python bench/fleet.py --workloads multi_turn --kv-events --dump /tmp/dump ...
    python bench/fleet_tails.py /tmp/dump --warmup 12 --window 40

For each run: the first and later turns' TTFT p90 and p99, how many first turns are among the
slowest 2% of all requests, and how often a slow first turn (its slowest 10%) had another
first turn sent within 5 ms, against how often any first turn did: two fresh prompts routed
at once to the same engine slow each other, so a share well above the base rate says the
router sent them together (routers deciding at once on the same figures). Then, for each router
run more than once, the same over all its runs' requests pooled: a p99 of one 40 s run rests on
some 30 requests, and moves 10% between runs of the same trace.
"""

from __future__ import annotations

import argparse
import json
import math
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Any

#: Two first turns sent this close (seconds) count as sent together.
TOGETHER_S = 0.005


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.floor(q * len(ordered)))] if ordered else math.nan


def measured(path: Path, warmup: float, window: float) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    ok = [r for r in rows if r["error"] is None and r["ttft"] is not None]
    return [r for r in ok if r["sent"] >= warmup and r["due"] < window]


def sent_together(first: list[dict[str, Any]], chosen: list[dict[str, Any]]) -> tuple[int, int]:
    """How many of ``chosen`` first turns had another first turn sent within `TOGETHER_S`, of how many."""
    times = sorted(r["sent"] for r in first)
    together = sum(
        bisect_right(times, r["sent"] + TOGETHER_S) - bisect_left(times, r["sent"] - TOGETHER_S) > 1 for r in chosen
    )
    return together, len(chosen)


def describe(name: str, runs: list[list[dict[str, Any]]]) -> str:
    """One row for the requests of ``runs`` (one run, or several pooled: their percentiles over
    all their requests, steadier than any one run's)."""
    rows = [r for run in runs for r in run]
    first = [r for r in rows if r["turn"] == 0]
    later = [r for r in rows if r["turn"] > 0]
    slowest = sorted(rows, key=lambda r: r["ttft"])[-max(1, len(rows) // 50) :]
    slow_together, all_together = (0, 0), (0, 0)
    # Sent together is told within each run (their clocks are their own).
    for run in runs:
        run_first = [r for r in run if r["turn"] == 0]
        cut = percentile([r["ttft"] for r in run_first], 0.9)
        slow = sent_together(run_first, [r for r in run_first if r["ttft"] >= cut])
        every = sent_together(run_first, run_first)
        slow_together = (slow_together[0] + slow[0], slow_together[1] + slow[1])
        all_together = (all_together[0] + every[0], all_together[1] + every[1])

    def ms(values: list[dict[str, Any]], q: float) -> str:
        return f"{percentile([r['ttft'] for r in values], q) * 1000:.0f}"

    def share(counts: tuple[int, int]) -> str:
        return f"{counts[0] / counts[1]:.2f}" if counts[1] else "-"

    return (
        f"| {name} | {ms(rows, 0.99)} | {ms(first, 0.9)} / {ms(first, 0.99)} "
        f"| {ms(later, 0.9)} / {ms(later, 0.99)} "
        f"| {sum(r['turn'] == 0 for r in slowest)} of {len(slowest)} "
        f"| {share(slow_together)} against {share(all_together)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, help="the folder given to bench/fleet.py --dump")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds not measured (bench/fleet.py's --warmup)")
    parser.add_argument("--window", type=float, default=15.0, help="seconds of arrivals (bench/fleet.py's --duration)")
    args = parser.parse_args()
    print(
        "| run | TTFT p99 ms | first turns p90 / p99 | later turns p90 / p99 | first turns among the slowest 2% "
        f"| slow first turns sent within {TOGETHER_S * 1000:.0f} ms of another, against all first turns |"
    )
    print("|---|---|---|---|---|---|")
    by_router: dict[str, list[list[dict[str, Any]]]] = {}

    # Runs in the order they were made (NAME-1, NAME-2, ..., NAME-10).
    def order(path: Path) -> tuple[str, int]:
        name, _, number = path.stem.rpartition("-")
        return (name, int(number)) if number.isdigit() else (path.stem, 0)

    for path in sorted(args.dump.glob("*.jsonl"), key=order):
        if not path.name.endswith(".engines.jsonl"):
            run = measured(path, args.warmup, args.window)
            print(describe(path.stem, [run]))
            by_router.setdefault(path.stem.rsplit("-", 1)[0], []).append(run)
    for router, runs in by_router.items():
        if len(runs) > 1:
            print(describe(f"{router}, {len(runs)} runs pooled", runs))


if __name__ == "__main__":
    main()

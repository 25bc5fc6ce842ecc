"""bench/fleet_tails.py on a dump made by hand: it must find the first turns that make the tail
and tell that they were sent together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers import REPO

TAILS = REPO / "bench" / "fleet_tails.py"


def outcome(turn: int, sent: float, ttft: float) -> dict[str, object]:
    """One request as bench/fleet.py --dump writes it."""
    return {
        "conversation": 0,
        "turn": turn,
        "due": sent,
        "sent": sent,
        "ttft": ttft,
        "e2e": ttft + 0.5,
        "tokens": 8,
        "prompt_tokens": 100,
        "cached_tokens": 0,
        "error": None,
    }


def tails(dump: Path) -> list[str]:
    """The lines bench/fleet_tails.py prints for ``dump`` (40 s runs, the first 12 s not measured)."""
    done = subprocess.run(
        [sys.executable, str(TAILS), str(dump), "--warmup", "12", "--window", "40"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


def test_slow_first_turns_sent_together_are_told_apart(tmp_path: Path) -> None:
    rows = [outcome(0, 13.0 + i, 0.08) for i in range(18)]
    # Two first turns sent 2 ms apart, both slow: the pair a router sent to one engine.
    rows += [outcome(0, 13.5, 0.3), outcome(0, 13.502, 0.3)]
    rows += [outcome(1, 13.25 + i * 0.2, 0.05) for i in range(100)]
    # Before the warm-up's end, and failed: not measured.
    rows += [outcome(0, 5.0, 9.0), {**outcome(0, 20.0, 9.0), "error": "ClientError"}]
    (tmp_path / "multi_turn-some_router-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "multi_turn-some_router-1.engines.jsonl").write_text('{"engine": 0}\n')
    lines = tails(tmp_path)
    assert len(lines) == 3, lines  # a header, its rule, one run (not the engines' file)
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells == ["multi_turn-some_router-1", "300", "300 / 300", "50 / 50", "2 of 2", "1.00 against 0.10"]


def test_runs_of_one_router_are_pooled(tmp_path: Path) -> None:
    def run(slow_apart: float) -> list[dict[str, object]]:
        rows = [outcome(0, 13.0 + i, 0.08) for i in range(18)]
        rows += [outcome(0, 13.5, 0.3), outcome(0, 13.5 + slow_apart, 0.3)]
        return rows + [outcome(1, 13.25 + i * 0.2, 0.05) for i in range(100)]

    # The same router twice: its slow pair sent together in the first run, 1 s apart in the second.
    for number, apart in ((1, 0.002), (2, 1.0)):
        path = tmp_path / f"multi_turn-some_router-{number}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in run(apart)))
    lines = tails(tmp_path)
    assert len(lines) == 5, lines  # a header, its rule, two runs, their pool
    cells = [cell.strip() for cell in lines[4].strip("|").split("|")]
    assert cells == [
        "multi_turn-some_router, 2 runs pooled",
        "300",
        "300 / 300",
        "50 / 50",
        "4 of 4",
        "0.50 against 0.05",
    ]

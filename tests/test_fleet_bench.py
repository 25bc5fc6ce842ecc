"""bench/fleet.py in a short run: eight simulated engines behind the oracle and behind round
robin, on the shared-system-prompts workload. The oracle, which sees every engine's cache and
queue, must answer first and find more in the caches; if the simulation stopped simulating
(caches, queues), the two would tie and this fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FLEET = Path(__file__).resolve().parent.parent / "bench" / "fleet.py"


@pytest.mark.timeout(120)
def test_the_oracle_answers_first_in_a_short_fleet_run(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    command = [sys.executable, str(FLEET), "--workloads", "system_prompts", "--loads", "0.8"]
    # A fixed capacity (no search), 6 s of arrivals, no second attempts: well under a minute.
    command += ["--routers", "oracle,round robin", "--capacity", "system_prompts=60", "--duration", "6"]
    command += ["--warmup", "2", "--retries", "0", "--drain", "20", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]["system_prompts@0.8"]
    oracle, rr = rows["oracle"], rows["round robin"]
    for row in (oracle, rr):
        assert row["errors"] == 0, row
        assert row["requests"] > 100, row
    assert oracle["ttft_s"]["p50"] < rr["ttft_s"]["p50"], (oracle["ttft_s"], rr["ttft_s"])
    assert oracle["ttft_s"]["mean"] < rr["ttft_s"]["mean"], (oracle["ttft_s"], rr["ttft_s"])
    # The engines' own count of cached prompt tokens agrees with what the answers said.
    assert oracle["cache_hit_rate"] > rr["cache_hit_rate"] > 0
    assert oracle["engine_cache_hit_rate"] > rr["engine_cache_hit_rate"] > 0

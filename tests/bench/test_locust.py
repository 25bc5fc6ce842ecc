"""bench/locustfile.py in a short headless locust run against `pdproxy serve`: the token
metrics appear and nothing fails."""

from __future__ import annotations

import asyncio
import csv
import os
import subprocess
import sys
from pathlib import Path

from pdproxy.testing import MockEngine
from servers import REPO, pdproxy_serve

LOCUSTFILE = REPO / "bench" / "locustfile.py"


async def test_locust_records_token_metrics(tmp_path: Path) -> None:
    async with MockEngine(model="m") as engine, pdproxy_serve(tmp_path, "--node", f"{engine.url},model=m") as proxy:
        command = [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "4s",
            "--host",
            proxy.url,
            "--csv",
            str(tmp_path / "run"),
            "--only-summary",
        ]
        env = {**os.environ, "LOAD_MAX_TOKENS": "8", "LOAD_STREAM": "0.5"}
        # locust blocks (and monkeypatches its own process), so it runs beside this loop.
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader((tmp_path / "run_stats.csv").read_text().splitlines())}
    for metric in ("time_to_first_token", "inter_token_latency", "tokens_per_second"):
        assert int(rows[("METRIC", metric)]["Request Count"]) > 0, metric
    for name in ("/v1/chat/completions (stream)", "/v1/chat/completions (non-stream)"):
        assert int(rows[("POST", name)]["Request Count"]) > 0
        assert int(rows[("POST", name)]["Failure Count"]) == 0

"""`--metrics-port` (the peers' `--prometheus-port`): /metrics on a listener of its own, behind
the same key rules as on the serving port, and nothing else there."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from servers import free_port, pdproxy_serve

pytestmark = pytest.mark.usefixtures("edge")


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(model="m") as engine:
        yield engine


async def test_metrics_on_their_own_port_and_nothing_else(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    async with pdproxy_serve(tmp_path, "--node", engine.url, "--prometheus-port", str(port)) as proxy:
        metrics = f"http://127.0.0.1:{port}/metrics"
        async with http.get(metrics) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/plain")
            text = await r.text()
        assert "pdproxy_build_info" in text
        assert engine.url in text, "the same exposition as the serving port's"
        async with http.head(metrics) as r:
            assert r.status == 200
        for path in ("/nodes/status", "/v1/models", "/health"):
            async with http.get(f"http://127.0.0.1:{port}{path}") as r:
                assert r.status == 404, path
                assert (await r.json())["error"]["code"] == "not_found"
        async with http.post(metrics, json={}) as r:
            assert r.status in (404, 405)
        async with http.get(proxy.url + "/metrics") as r:
            assert r.status == 200, "still served on the serving port"


async def test_the_metrics_port_keeps_the_admin_key(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    keys = tmp_path / "admin-keys"
    keys.write_text("admin-secret\n")
    flags = ("--node", engine.url, "--metrics-port", str(port), "--admin-keys-file", str(keys))
    async with pdproxy_serve(tmp_path, *flags):
        metrics = f"http://127.0.0.1:{port}/metrics"
        async with http.get(metrics) as r:
            assert r.status == 401
            assert (await r.json())["error"]["message"]
        async with http.get(metrics, headers={"authorization": "Bearer admin-secret"}) as r:
            assert r.status == 200


def test_a_taken_metrics_port_stops_the_start_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pdproxy", "serve", "--port", str(free_port()), "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0, "a taken port is refused, as the serving port's is"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"--metrics-port: cannot listen on 127.0.0.1:{port}" in lines[0]

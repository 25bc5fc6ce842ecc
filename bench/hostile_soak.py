"""Hostile soak: normal traffic beside hostile nodes and hostile clients, for a bounded time.

Two `pdproxy serve` (Rust edge) run side by side:
- a Hybrid one: two mock engines serve the normal model; beside them a node that answers 413
  before reading a large body and resets the connection (model `big`), and one that reads each
  request and drops the connection without an answer (model `drop`);
- a DistServe one (vLLM's protocol): a mock prefill and decode pair serve the normal model; a node
  that answers every prefill with an endless body serves the model `endless`.

Normal clients send streaming and non-streaming chat requests to both; hostile clients send 4 MiB
bodies to `big`, requests to `drop` and `endless`, and bodies with `"n": 1000000000000`, and hold
2,000 idle connections open on the Hybrid proxy all along. What must hold:
- every normal request completes (200, its whole answer): 0 lost;
- no circuit of a normal node opens, and no normal node counts a failure;
- each hostile request gets its proper answer: 413 relayed; 502 from the node that drops requests,
  or 503 once its circuit is open (the hostile node's own circuit opening is right); 502 for the
  endless prefill answer; 400 for `n`. The node that drops requests receives each request that
  reached it exactly once (every one it received was answered 502: none replayed);
- each proxy's RSS, measured after a warm-up (4,000 normal requests, which fill its bounded
  tables: the prefix table is sized 1,024 here) and again once the load has ended, is back within
  10% of its start.

    python bench/hostile_soak.py                  # 120 s
    python bench/hostile_soak.py --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from pdproxy.testing.hostile_clients import idle_connections
from pdproxy.testing.raw_node import RawNode, answer_early, endless_answer, read_and_drop
from soak import MODEL, chat_request

#: Idle connections a hostile client holds open on the Hybrid proxy.
IDLE_CONNECTIONS = 2000
#: The body a hostile client sends to the node that refuses large ones.
BIG_PROMPT = "x" * (4 << 20)
#: What each hostile request may get.
EXPECTED = {"big": {413}, "drop": {502, 503}, "endless": {502, 503}, "n": {400}}
#: The prefix table's size for the soak, small enough for the warm-up to fill it (its default
#: 65,536 entries would grow all through the soak, one a normal request, by design).
TABLES = ("--prefix-cache-entries", "1024")
HYBRID_FLAGS = ("--policy", "least_requests", *TABLES)
#: Normal requests before the RSS is first read, across both proxies.
WARM_UP = 4000
#: Seconds the proxies get, once the load has ended, before their RSS is read again.
SETTLE = 5.0
#: The most a proxy's RSS may stay above its start once the soak has ended.
RSS_TOLERANCE = 0.10


def post_json(url: str, payload: object) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    urllib.request.urlopen(request, timeout=5).close()


def register(proxy: str, node: str, models: list[str], role: int) -> None:
    post_json(proxy + "/nodes/add", {"url": node, "status": {"models": models, "role": role}})


def node_states(proxy: str) -> dict[str, Any]:
    with urllib.request.urlopen(proxy + "/nodes/status", timeout=5) as r:
        return dict(json.loads(r.read()))


def complete(status: int, raw: bytes, stream: bool) -> bool:
    if status != 200:
        return False
    if stream:
        return raw.endswith(b"data: [DONE]\n\n")
    try:
        return bool(json.loads(raw).get("choices"))
    except ValueError:
        return False


async def normal(http: aiohttp.ClientSession, proxy: str, rng: random.Random, counts: collections.Counter[str]) -> None:
    body = chat_request(rng)
    stream = bool(body["stream"])
    try:
        async with asyncio.timeout(30), http.post(proxy + "/v1/chat/completions", json=body) as r:
            raw = await r.read()
            counts["normal:completed" if complete(r.status, raw, stream) else f"normal:lost:{r.status}"] += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        counts[f"normal:lost:{type(e).__name__}"] += 1


async def hostile(http: aiohttp.ClientSession, proxy: str, kind: str, counts: collections.Counter[str]) -> None:
    content = BIG_PROMPT if kind == "big" else "hi"
    body: dict[str, Any] = {"model": MODEL if kind == "n" else kind, "messages": [{"role": "user", "content": content}]}
    if kind == "n":
        body["n"] = 10**12
    try:
        async with asyncio.timeout(30), http.post(proxy + "/v1/chat/completions", json=body) as r:
            await r.read()
            outcome = f"as-expected-{r.status}" if r.status in EXPECTED[kind] else f"unexpected-{r.status}"
    except (TimeoutError, aiohttp.ClientError) as e:
        outcome = f"unexpected-{type(e).__name__}"
    counts[f"hostile:{kind}:{outcome}"] += 1


async def soak(hybrid: str, pd: str, duration: float, concurrency: int, seed: int) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + duration

    async def normal_client(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < end:
                await normal(http, hybrid if n % 2 else pd, rng, counts)

    async def hostile_client(proxy: str, kind: str) -> None:
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < end:
                await hostile(http, proxy, kind, counts)
                await asyncio.sleep(0.05)

    kinds = [(hybrid, "big"), (hybrid, "drop"), (hybrid, "n"), (pd, "endless"), (pd, "n")]
    await asyncio.gather(
        *(normal_client(n) for n in range(concurrency)), *(hostile_client(proxy, kind) for proxy, kind in kinds)
    )
    return counts


def report(
    counts: collections.Counter[str], rss: dict[str, tuple[int, int, int]], nodes: dict[str, Any], args: Any
) -> tuple[str, bool]:
    lost = sum(v for k, v in counts.items() if k.startswith("normal:lost"))
    unexpected = sum(v for k, v in counts.items() if "unexpected" in k)
    opened = [url for url, n in nodes["normal"].items() if n["circuit"] != "closed" or n["failed"]]
    replayed = nodes["drop_received"] != counts["hostile:drop:as-expected-502"]
    grown = {name: (after - start) / start for name, (start, _, after) in rss.items()}
    lines = [
        f"Hostile soak: {args.duration:.0f} s, {args.concurrency} normal clients, 5 hostile clients and "
        f"{IDLE_CONNECTIONS} idle connections; `python bench/hostile_soak.py --duration {args.duration:.0f}"
        f" --concurrency {args.concurrency}`",
        "",
        "| outcome | requests |",
        "|---|---|",
        *(f"| {key} | {counts[key]} |" for key in sorted(counts)),
        "",
        "| proxy | RSS after warm-up | peak | after the soak | change |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {start / 1e6:.0f} MB | {peak / 1e6:.0f} MB | {after / 1e6:.0f} MB | {grown[name]:+.1%} |"
            for name, (start, peak, after) in rss.items()
        ),
        "",
        f"Normal nodes with an open circuit or a failure: {opened or 'none'}. The node that drops requests "
        f"received {nodes['drop_received']} (each once: {not replayed}).",
        f"**{lost} normal requests lost**, {unexpected} hostile requests answered otherwise than expected.",
    ]
    ok = not lost and not unexpected and not opened and not replayed and all(g <= RSS_TOLERANCE for g in grown.values())
    return "\n".join(lines), ok


async def run(args: argparse.Namespace) -> tuple[str, bool]:
    async with (
        RawNode(answer_early(linger=False), model="big") as big,
        RawNode(read_and_drop, model="drop") as drop,
        RawNode(endless_answer, model="endless") as endless,
    ):
        with (
            harness.mock_engines(2, MODEL, token_delay_ms=5.0) as hybrids,
            harness.mock_engines(0, MODEL, token_delay_ms=5.0, roles=["prefill", "decode"]) as (prefill, decode),
            # The endless prefill node's partner: a decode node for its model (never reached).
            harness.mock_engines(0, "endless", roles=["decode"]) as (endless_decode,),
            harness.pdproxy([], MODEL, HYBRID_FLAGS, {e.url: "hybrid" for e in hybrids}) as a,
            harness.pdproxy(
                [],
                MODEL,
                ("--serving-strategy", "DistServe", "--pd-protocol", "vllm", *TABLES),
                {prefill.url: "prefill", decode.url: "decode"},
            ) as b,
        ):
            # From a thread: the raw nodes answer on this loop, which must keep running meanwhile.
            await asyncio.to_thread(register, a.url, big.url, ["big"], 1)
            await asyncio.to_thread(register, a.url, drop.url, ["drop"], 1)
            await asyncio.to_thread(register, b.url, endless.url, ["endless"], 2)
            await asyncio.to_thread(register, b.url, endless_decode.url, ["endless"], 3)
            proxies = {"hybrid": a, "disaggregated (vLLM)": b}
            # Warm-up: what a proxy holds for good once it has served (pools, buffers, and its
            # bounded tables filled: each normal prompt is new, a prefix-table entry each).
            warm: collections.Counter[str] = collections.Counter()
            async with aiohttp.ClientSession() as http:
                rng = random.Random(0)

                async def warm_up(proxy: str) -> None:
                    for _ in range(WARM_UP // 8):
                        await normal(http, proxy, rng, warm)

                await asyncio.gather(*(warm_up(p.url) for p in (a, b) for _ in range(4)))
            await asyncio.sleep(SETTLE)
            start = {name: harness.rss_bytes(p.proc.pid) for name, p in proxies.items()}
            peak = dict(start)

            async def sample() -> None:
                while True:
                    for name, p in proxies.items():
                        peak[name] = max(peak[name], harness.rss_bytes(p.proc.pid))
                    await asyncio.sleep(1)

            harness.say(f"soaking {a.url} and {b.url} for {args.duration:.0f} s; RSS {start}")
            idle = idle_connections(int(a.url.rsplit(":", 1)[1]), IDLE_CONNECTIONS)
            sampler = asyncio.create_task(sample())
            try:
                counts = await soak(a.url, b.url, args.duration, args.concurrency, args.seed)
            finally:
                for s in idle:
                    s.close()
                sampler.cancel()
            await asyncio.sleep(SETTLE)
            rss = {name: (start[name], peak[name], harness.rss_bytes(p.proc.pid)) for name, p in proxies.items()}
            states = {**node_states(a.url), **node_states(b.url)}
            normal_nodes = [e.url for e in hybrids] + [prefill.url, decode.url]
            nodes = {"normal": {url: states[url] for url in normal_nodes}, "drop_received": len(drop.received)}
    counts.update({f"warm-up:{k}": v for k, v in warm.items()})
    return report(counts, rss, nodes, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=16, help="normal clients, half on each proxy")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    text, ok = asyncio.run(run(args))
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

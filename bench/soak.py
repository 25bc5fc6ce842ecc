"""Soak: mixed streaming and non-streaming load with random faults, client disconnects and
node churn (every ``--churn`` seconds one engine is removed through /nodes/remove and added
back a few seconds later) against several mock engines through `pdproxy serve`, for a bounded
time. One of the engines misbehaves throughout: its /health answer is not UTF-8 and its
/v1/models answer is 64 MB; and some requests meet a node that stalls in the middle of its
answer or never ends it. Every request must
end either completed or with a correct error (an OpenAI error body, or a terminal error event
in a stream): anything else counts as lost. Memory and descriptors are sampled throughout.

    python bench/soak.py                 # 120 s
    python bench/soak.py --duration 600 --concurrency 64
    python bench/soak.py --workers 2     # a worker group (memory and descriptors summed over it)

After the load, every node's in-flight count must be back to zero: a leaked count fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
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

MODEL = "soak-model"
#: Faults injected into a fraction of requests, through the mock engine's header.
FAULTS = [
    "status=503",
    "status=500",
    "drop_after=2",
    "token_delay_ms=40",
    "ttft_ms=200",
    "status=429",
    "stall_body",  # non-streaming answers: half sent, then silence (the proxy's idle timeout ends it)
    "endless",  # an answer that never ends: the client stops reading after a while
]
#: The proxy's idle timeout in the soak, so that stalled answers end within it.
STREAM_IDLE_TIMEOUT = 2.0
#: How long a client reads an endless answer before it gives up on it.
ENDLESS_READ = 0.5


def classify(status: int, raw: bytes, stream: bool) -> str:
    if status == 200:
        if not stream:
            try:
                return "completed" if json.loads(raw).get("choices") else "lost:bad-json"
            except ValueError:
                return "lost:bad-json"
        if raw.endswith(b"data: [DONE]\n\n"):
            return "completed"
        last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        return "error:stream-terminal-event" if last.startswith(b'data: {"error"') else "lost:truncated-stream"
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"lost:bad-error-{status}"
    return f"error:{status}:{code}"


def chat_request(rng: random.Random, model: str = MODEL) -> dict[str, object]:
    """A soak's chat request: a new prompt, a few tokens, streamed six times in ten."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
        "max_tokens": rng.randint(4, 24),
        "stream": rng.random() < 0.6,
    }


async def one(http: aiohttp.ClientSession, url: str, rng: random.Random, counts: collections.Counter[str]) -> None:
    body = chat_request(rng)
    stream = bool(body["stream"])
    headers = {}
    if rng.random() < 0.25:
        fault = rng.choice(FAULTS)
        headers["x-mock-fault"] = fault
        counts[f"fault:{fault}"] += 1
    cancel_after = rng.uniform(0.005, 0.2) if rng.random() < 0.1 else None
    if headers.get("x-mock-fault") == "endless":
        cancel_after = ENDLESS_READ
    try:
        async with asyncio.timeout(cancel_after or 30):
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                raw = await r.read()
                counts[classify(r.status, raw, stream)] += 1
    except TimeoutError:
        counts["client-cancelled" if cancel_after else "lost:hang"] += 1
    except aiohttp.ClientError as e:
        counts[f"lost:transport-{type(e).__name__}"] += 1


#: Seconds a churned node stays out before it is added back.
CHURN_GAP = 3.0


async def soak(
    url: str, proxy_pid: int, duration: float, concurrency: int, seed: int, nodes: list[str], churn: float
) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    samples: list[tuple[float, int, int]] = []
    end = time.monotonic() + duration
    started = time.monotonic()

    async def churner() -> None:
        """Removes one node, then adds it back, in turn, while requests run."""
        async with aiohttp.ClientSession() as http:
            turn = 0
            while churn > 0 and time.monotonic() + churn + CHURN_GAP < end:
                await asyncio.sleep(churn)
                node = nodes[turn % len(nodes)]
                turn += 1
                async with http.post(url + "/nodes/remove", json={"url": node}) as r:
                    counts[f"churn:remove:{r.status}"] += 1
                await asyncio.sleep(CHURN_GAP)
                registration = {"url": node, "status": {"models": [MODEL]}}
                async with http.post(url + "/nodes/add", json=registration) as r:
                    counts[f"churn:add:{r.status}"] += 1

    async def worker(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < end:
                await one(http, url, rng, counts)
                counts["sent"] += 1

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic() - started, harness.rss_bytes(proxy_pid), open_fds(proxy_pid)))
            harness.say(f"{samples[-1][0]:5.0f} s: {counts['sent']} requests, RSS {samples[-1][1] / 1e6:.0f} MB")
            await asyncio.sleep(max(1.0, duration / 30))

    await asyncio.gather(sampler(), churner(), *(worker(n) for n in range(concurrency)))
    samples.append((time.monotonic() - started, harness.rss_bytes(proxy_pid), open_fds(proxy_pid)))
    return {"counts": dict(counts), "samples": samples}


def misbehave(engine: str) -> None:
    """Makes an engine answer /health with bytes that are not UTF-8 and /v1/models with 64 MB."""
    knobs = json.dumps({"health_body": "garbage", "models_body": "huge"}).encode()
    request = urllib.request.Request(
        engine + "/mock/config", data=knobs, headers={"content-type": "application/json"}, method="POST"
    )
    urllib.request.urlopen(request, timeout=5).close()


def open_fds(pid: int) -> int:
    total = 0
    for p in harness.process_tree(pid):
        with contextlib.suppress(OSError):
            total += len(list(Path(f"/proc/{p}/fd").iterdir()))
    return total


def slope_mb_per_min(samples: list[tuple[float, int, int]]) -> float:
    """Least-squares slope of RSS over time, in MB per minute (after the first fifth: warm-up)."""
    points = samples[len(samples) // 5 :]
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _, _ in points) / n
    mean_r = sum(r for _, r, _ in points) / n
    var = sum((t - mean_t) ** 2 for t, _, _ in points)
    cov = sum((t - mean_t) * (r - mean_r) for t, r, _ in points)
    return cov / var * 60 / 1e6 if var else 0.0


def settled_in_flight(url: str, timeout: float = 10.0) -> int:
    """Requests the proxy still counts in flight once the load is over (0 unless a count leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url + "/nodes/status", timeout=5) as r:
            in_flight = sum(n["in_flight"] for n in json.loads(r.read()).values())
        if in_flight == 0 or time.monotonic() > deadline:
            return int(in_flight)
        time.sleep(0.1)


def report(result: dict[str, Any], duration: float, concurrency: int, workers: int, churn: float) -> str:
    counts = result["counts"]
    samples = result["samples"]
    lost = {k: v for k, v in counts.items() if k.startswith("lost")}
    group = f", {workers} workers" if workers > 1 else ""
    command = f"--duration {duration:.0f} --concurrency {concurrency} --churn {churn:g}"
    command += f" --workers {workers}" if workers > 1 else ""
    lines = [
        f"Soak: {duration:.0f} s, {concurrency} concurrent clients, 3 mock engines (one misbehaving){group}, "
        f"{counts.get('sent', 0)} requests; `python bench/soak.py {command}`",
        "",
        "| outcome | requests |",
        "|---|---|",
    ]
    for key in sorted(k for k in counts if not k.startswith(("fault", "churn")) and k != "sent"):
        lines.append(f"| {key} | {counts[key]} |")
    churned = {k.removeprefix("churn:"): v for k, v in sorted(counts.items()) if k.startswith("churn")}
    lines += [
        "",
        "Node churn (management call: answers): " + (", ".join(f"{k} x{v}" for k, v in churned.items()) or "none"),
    ]
    lines += ["", "| faults injected | requests |", "|---|---|"]
    lines += [f"| {k.removeprefix('fault:')} | {v} |" for k, v in sorted(counts.items()) if k.startswith("fault")]
    (_, rss0, fd0), (_, rss1, fd1) = samples[0], samples[-1]
    lines += [
        "",
        f"Proxy RSS {rss0 / 1e6:.0f} MB at start, {rss1 / 1e6:.0f} MB at the end (slope after warm-up "
        f"{slope_mb_per_min(samples):+.2f} MB/min); open descriptors {fd0} -> {fd1}.",
        f"In flight after the load: {result['in_flight_after']}.",
        f"**{sum(lost.values())} requests lost**" + (f": {lost}" if lost else "."),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="pdproxy worker processes (--edge granian)")
    parser.add_argument("--edge", choices=("rust", "granian"), default="rust", help="pdproxy's edge")
    parser.add_argument("--churn", type=float, default=30.0, help="seconds between node removals (0: none)")
    args = parser.parse_args()
    with harness.mock_engines(3, MODEL, token_delay_ms=5.0) as engines:
        misbehave(engines[-1].url)
        edge = "granian" if args.workers > 1 else args.edge
        extra = (
            *("--policy", "least_requests", "--health-interval", "1", "--edge", edge, "--workers", str(args.workers)),
            *("--stream-idle-timeout", str(STREAM_IDLE_TIMEOUT)),
        )
        # Registered with their model (as LMDeploy engines register): the misbehaving one's
        # /v1/models cannot be read, so its declared model is what it serves.
        roles = {e.url: "hybrid" for e in engines}
        with harness.pdproxy([], MODEL, extra, roles) as proxy:
            harness.say(f"soaking {proxy.url} for {args.duration:.0f} s with {args.concurrency} clients")
            nodes = [e.url for e in engines]
            result = asyncio.run(
                soak(proxy.url, proxy.proc.pid, args.duration, args.concurrency, args.seed, nodes, args.churn)
            )
            result["in_flight_after"] = settled_in_flight(proxy.url)
    text = report(result, args.duration, args.concurrency, args.workers, args.churn)
    print(text)
    name = "soak.json" if args.workers == 1 else f"soak-{args.workers}-workers.json"
    (Path(__file__).resolve().parent / "results" / name).write_text(json.dumps(result, indent=1))
    refused = any(k.startswith("churn:") and not k.endswith((":200", ":201")) for k in result["counts"])
    if any(k.startswith("lost") for k in result["counts"]) or result["in_flight_after"] or refused:
        sys.exit(1)


if __name__ == "__main__":
    main()

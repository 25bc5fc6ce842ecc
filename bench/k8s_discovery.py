"""Kubernetes discovery at fleet scale: 1,000 pods in the fake API server (pdproxy.testing.fake_kube)
watched by one `pdproxy serve`, with and without churn.

What it reports:
- the watch's cost: pdproxy's CPU while 10 pods change per second (readiness flips, annotation
  changes, pods re-created at a new address), beside its CPU over as long a window without
  changes (health checks and the rest), as a share of one core;
- pdproxy's RSS once the 1,000 nodes are in, after one round of churn and after a second one
  (memory must not keep growing once the churn stops);
- how long a pod takes to become a node once Ready, and to stop being one once deleted (as
  `/health` counts the source's nodes), over 20 of each.

The pods' addresses are 127.0.x.y on a port nothing listens on: their health checks fail at once
and cost little, and no request is sent to them.

    python bench/k8s_discovery.py                 # 30 s windows
    python bench/k8s_discovery.py --window 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from pdproxy.testing.fake_kube import FakeKubeApi

NS = "fleet"
PODS = 1000
CHANGES_PER_SECOND = 10
#: Nothing listens there: health checks are refused at once.
PORT = 9
SAMPLES = 20


def pod_ip(index: int, generation: int = 0) -> str:
    return f"127.{1 + generation % 200}.{index // 250}.{1 + index % 250}"


def add(api: FakeKubeApi, index: int, generation: int = 0, ready: bool = True) -> None:
    api.add_pod(
        NS,
        f"vllm-{index}",
        ip=pod_ip(index, generation),
        phase="Running",
        ready=ready,
        labels={"app": "vllm"},
        annotations={"pdproxy.io/models": "m"},
        ports=[{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
    )


def found_nodes(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return int(json.loads(r.read())["discovery"]["kubernetes"]["nodes"])


async def until_nodes(url: str, count: int, within: float) -> float:
    """Seconds until the source counts ``count`` nodes (at most ``within``)."""
    started = time.monotonic()
    while await asyncio.to_thread(found_nodes, url) != count:
        if time.monotonic() - started > within:
            raise TimeoutError(f"the source never counted {count} nodes")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def churn(api: FakeKubeApi, seconds: float, rng: random.Random, generations: dict[int, int]) -> int:
    """10 changes a second for ``seconds``: a readiness flip, an annotation, a pod re-created."""
    changes = 0
    start = time.monotonic()
    while (now := time.monotonic()) < start + seconds:
        # On a fixed beat: the changes' own time does not slow the rate down.
        await asyncio.sleep(max(0.0, start + changes / CHANGES_PER_SECOND - now))
        index = rng.randrange(PODS)
        kind = rng.random()
        if kind < 0.4:
            pod = next(p for p in api.pods(NS) if p["metadata"]["name"] == f"vllm-{index}")
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
            api.update_pod(NS, f"vllm-{index}", ready=not ready)
        elif kind < 0.8:
            api.update_pod(NS, f"vllm-{index}", annotations={"pdproxy.io/models": "m", "pdproxy.io/speed": str(kind)})
        else:
            api.delete_pod(NS, f"vllm-{index}")
            generations[index] = generations.get(index, 0) + 1
            add(api, index, generations[index])
        changes += 1
    # Every pod Ready again, so that the next window starts from the same fleet.
    for pod in api.pods(NS):
        if not any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"]):
            api.update_pod(NS, pod["metadata"]["name"], ready=True)
    return changes


async def run(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    async with FakeKubeApi(bookmark_interval=5.0) as api:
        for index in range(PODS):
            add(api, index)
        with tempfile.TemporaryDirectory() as work:
            config = Path(work) / "kubeconfig"
            config.write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                        "users": [{"name": "pdproxy", "user": {"token": api.token}}],
                        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "pdproxy"}}],
                        "current-context": "fake",
                    }
                )
            )
            port = harness.free_port()
            url = f"http://127.0.0.1:{port}"
            command = [
                sys.executable,
                *("-m", "pdproxy", "serve", "--port", str(port), "--log-level", "warning"),
                *("--k8s-selector", "app=vllm", "--k8s-namespace", NS, "--k8s-kubeconfig", str(config)),
                *("--health-interval", "30"),
            ]
            # Started from a thread: the fake API server answers on this loop meanwhile.
            service = harness.service("pdproxy", command, url + "/health", url)
            proxy = await asyncio.to_thread(service.__enter__)
            try:
                pid = proxy.proc.pid
                took = await until_nodes(url, PODS, 60)
                harness.say(f"{PODS} nodes in {took:.1f} s; settling")
                await asyncio.sleep(10)
                rss_start = harness.rss_bytes(pid)

                cpu = harness.cpu_seconds(pid)
                await asyncio.sleep(args.window)
                idle_share = (harness.cpu_seconds(pid) - cpu) / args.window

                generations: dict[int, int] = {}
                cpu = harness.cpu_seconds(pid)
                started = time.monotonic()
                changes = await churn(api, args.window, rng, generations)
                churn_share = (harness.cpu_seconds(pid) - cpu) / (time.monotonic() - started)
                await until_nodes(url, PODS, 30)
                await asyncio.sleep(15)
                rss_one = harness.rss_bytes(pid)
                await churn(api, args.window, rng, generations)
                await until_nodes(url, PODS, 30)
                await asyncio.sleep(15)
                rss_two = harness.rss_bytes(pid)

                ready, deleted = [], []
                for index in rng.sample(range(PODS), SAMPLES):
                    name = f"vllm-{index}"
                    api.update_pod(NS, name, ready=False)
                    await until_nodes(url, PODS - 1, 10)
                    api.update_pod(NS, name, ready=True)
                    ready.append(await until_nodes(url, PODS, 10))
                    api.delete_pod(NS, name)
                    deleted.append(await until_nodes(url, PODS - 1, 10))
                    generations[index] = generations.get(index, 0) + 1
                    add(api, index, generations[index])
                    await until_nodes(url, PODS, 10)
            finally:
                await asyncio.to_thread(service.__exit__, None, None, None)
    watch = churn_share - idle_share
    lines = [
        f"Kubernetes discovery: {PODS} pods, {CHANGES_PER_SECOND} changes/s, {args.window:.0f} s windows; "
        f"`python bench/k8s_discovery.py --window {args.window:.0f}`",
        "",
        "| measure | value |",
        "|---|---|",
        f"| pdproxy CPU without changes | {idle_share:.1%} of a core |",
        f"| pdproxy CPU with {changes} changes in {args.window:.0f} s | {churn_share:.1%} of a core |",
        f"| the watch's cost (the difference) | **{watch:.1%} of a core** |",
        f"| RSS with {PODS} nodes | {rss_start / 1e6:.1f} MB |",
        f"| RSS after one round of churn | {rss_one / 1e6:.1f} MB ({(rss_one - rss_start) / rss_start:+.1%}) |",
        f"| RSS after a second round | {rss_two / 1e6:.1f} MB ({(rss_two - rss_one) / rss_one:+.1%} on the first) |",
        f"| pod Ready to node, median / max of {SAMPLES} | {statistics.median(ready) * 1e3:.0f} / "
        f"{max(ready) * 1e3:.0f} ms |",
        f"| pod deleted to node gone, median / max of {SAMPLES} | {statistics.median(deleted) * 1e3:.0f} / "
        f"{max(deleted) * 1e3:.0f} ms |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=30.0, help="seconds of each measuring window")
    parser.add_argument("--seed", type=int, default=1)
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()

"""Benchmark plumbing: processes, CPU and memory accounting, the load generator."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pdproxy.testing import mock_engine_command
from pdproxy.testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = ROOT / "target" / "release" / "pdproxy-loadgen"
FLOOR = ROOT / "target" / "release" / "pdproxy-floor"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
K = TypeVar("K", bound=Hashable)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)


# A benchmark ended with `kill PID` unwinds like Ctrl-C, so every `with` block here ends the
# engines, proxies and load generators it started instead of leaving them running.
signal.signal(signal.SIGTERM, _exit_on_sigterm)


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def build_loadgen() -> None:
    say("building the load generator and the floor proxy (cargo build --release -p pdproxy-loadgen)")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pdproxy-loadgen"], cwd=ROOT, check=True)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU of ``pid`` and (``descendants``) its descendants."""
    total = 0
    for p in process_tree(pid) if descendants else [pid]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE_SIZE
    return total


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    url: str


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s")


@contextlib.contextmanager
def service(
    name: str,
    args: list[str],
    ready_url: str,
    base_url: str,
    *,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout: float = 30.0,
) -> Iterator[Service]:
    """Runs ``args`` until the block ends; its output goes to ``log`` (to tell why a peer failed) or nowhere."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("wb")) if log else subprocess.DEVNULL
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(ready_url, proc, timeout)
            yield Service(name, proc, base_url)
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ends a process this harness started: SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def mock_engines(
    count: int,
    model: str,
    token_delay_ms: float = 0.0,
    roles: list[str] | None = None,
    options: tuple[str, ...] = (),
) -> Iterator[list[Service]]:
    """``count`` hybrid mock engines, or one per entry of ``roles``; ``options``: further
    ``mock-engine`` flags."""
    with contextlib.ExitStack() as stack:
        engines = []
        for i, role in enumerate(roles or ["hybrid"] * count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = mock_engine_command(port, model, "--role", role, "--token-delay-ms", str(token_delay_ms), *options)
            engines.append(stack.enter_context(service(f"{role}-{i}", args, url + "/health", url)))
        yield engines


ROLE_NUMBERS = {"hybrid": 1, "prefill": 2, "decode": 3}


@contextlib.contextmanager
def floor(nodes: list[str], per_request: bool = False) -> Iterator[Service]:
    """The floor proxy (bench/loadgen/src/bin/floor.rs): hyper passing requests through, nothing
    else; each client connection paired with one node's connection, or (``per_request``) each
    request sent to the next node."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(FLOOR), "--port", str(port), *(["--per-request"] if per_request else [])]
    for node in nodes:
        args += ["--upstream", node.removeprefix("http://")]
    with service("floor", args, url + "/health", url) as svc:
        yield svc


def build_env(build: str | None) -> dict[str, str] | None:
    """The environment that makes `python -m pdproxy` run the build of the package held in the
    directory ``build`` (DIR/pdproxy/...) instead of the installed one; ``None``: as it is."""
    return {**os.environ, "PYTHONPATH": build} if build else None


@contextlib.contextmanager
def pdproxy(
    nodes: list[str],
    model: str,
    extra: tuple[str, ...] = (),
    roles: dict[str, str] | None = None,
    key: str | None = None,
    build: str | None = None,
) -> Iterator[Service]:
    """`pdproxy serve` routing to ``nodes``; with ``roles`` (url -> role) the nodes are
    registered through /nodes/add as LMDeploy engines do, instead of --node. ``key``: the
    inference key its model list needs. ``build``: a directory holding another build of the
    `pdproxy` package, served instead of the installed one."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "pdproxy", "serve", "--port", str(port), "--log-level", "warning", *extra]
    for node in nodes if roles is None else []:
        args += ["--node", node]
    with service("pdproxy", args, url + "/health", url, env=build_env(build)) as svc:
        for node, role in (roles or {}).items():
            registration = {"url": node, "status": {"models": [model], "role": ROLE_NUMBERS[role]}}
            request = urllib.request.Request(
                url + "/nodes/add", data=json.dumps(registration).encode(), headers={"content-type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=5).close()
        # Wait for model discovery so every request is routed by model from the start.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            auth = {"authorization": f"Bearer {key}"} if key else {}
            with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=auth), timeout=1) as r:
                if model in r.read().decode():
                    break
            time.sleep(0.1)
        yield svc


def sequential_latency(url: str, path: str, duration: float) -> list[float]:
    """Seconds per ``GET path``, one call after the other on one keep-alive connection."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    samples: list[float] = []
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline or len(samples) < 100:
            started = time.perf_counter()
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            samples.append(time.perf_counter() - started)
            if response.status != 200:
                raise RuntimeError(f"GET {path}: {response.status}")
    finally:
        connection.close()
    return samples


@dataclass
class LoadResult:
    load: dict
    cpu_s: dict[str, float]
    rss_bytes: dict[str, int]
    # When the result is the median of repeated runs: the measure it was chosen on, for every run.
    runs: list[float] = field(default_factory=list)


def run_load(
    urls: list[str],
    body: dict,
    connections: int,
    duration: float,
    watch: dict[str, int],
    warmup: float = 1.0,
    headers: tuple[str, ...] = (),
    rate: float | None = None,
) -> LoadResult:
    """Runs the load generator (``headers``: ``NAME:VALUE`` on every request; ``rate``: requests
    per second arriving on a schedule, open loop, instead of back to back on each connection);
    measures CPU and RSS of the ``watch`` processes (name -> pid) over the measurement window."""
    args = ["--connections", str(connections), *(["--rate", str(rate)] if rate else [])]
    for header in headers:
        args += ["--header", header]
    out, cpu, rss = _loadgen(urls, body, args, duration, warmup, watch)
    return LoadResult(out, cpu, rss)


def run_interleaved(
    targets: dict[str, tuple[str, dict[str, int]]], body: dict, duration: float, turn: float, warmup: float = 1.0
) -> dict[str, LoadResult]:
    """One client sends requests one at a time, back to back, to each target in turn for ``turn``
    seconds (targets: name -> (URL, the processes to watch, name -> pid)): every target is
    measured over the same stretch of time, so a shared machine's drift falls on all of them
    alike. CPU is each process's over the whole window."""
    urls = [url for url, _ in targets.values()]
    watch = {(name, role): pid for name, (_, pids) in targets.items() for role, pid in pids.items()}
    out, cpu, rss = _loadgen(urls, body, ["--interleave", str(turn * 1000)], duration, warmup, watch)
    return {
        name: LoadResult(
            load,
            {role: cpu[(name, role)] for role in pids},
            {role: rss[(name, role)] for role in pids},
        )
        for (name, (_, pids)), load in zip(targets.items(), out["interleaved"], strict=True)
    }


def _loadgen(
    urls: list[str], body: dict, extra: list[str], duration: float, warmup: float, watch: dict[K, int]
) -> tuple[dict, dict[K, float], dict[K, int]]:
    """The load generator's JSON output, and the CPU seconds and RSS of each watched process over
    the measurement window."""
    args = [str(LOADGEN), "--duration", str(duration), "--warmup", str(warmup), "--body", json.dumps(body), *extra]
    for url in urls:
        args += ["--url", url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    time.sleep(warmup)
    before = {key: cpu_seconds(pid) for key, pid in watch.items()}
    time.sleep(duration * 0.9)
    rss = {key: rss_bytes(pid) for key, pid in watch.items()}
    time.sleep(duration * 0.1)
    after = {key: cpu_seconds(pid) for key, pid in watch.items()}
    out, _ = proc.communicate(timeout=duration + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed with {proc.returncode}")
    return json.loads(out), {key: after[key] - before[key] for key in watch}, rss

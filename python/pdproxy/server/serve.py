"""`pdproxy serve`: run the proxy under granian (ASGI, uvloop, HTTP/1.1)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from granian import Granian
from granian.constants import HTTPModes, Interfaces, Loops
from granian.log import LOGGING_CONFIG, LogLevels

from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError
from pdproxy.fleet import tls
from pdproxy.fleet.node_record import configured_nodes
from pdproxy.fleet.node_sources.selectors import SELECTORS
from pdproxy.observability.tracing import TraceIdFilter
from pdproxy.server import edge, group
from pdproxy.server.app import MAIN_PID_ENV, SETTINGS_ENV

#: Mock engines started by --demo: how many, and how long to wait for them.
DEMO_ENGINES = 2
DEMO_STARTUP_TIMEOUT = 20.0
DEMO_TOKEN_DELAY_MS = 20.0
#: Seconds before granian replaces a worker that died.
RESPAWN_INTERVAL = 1.0


def serve(settings: Settings) -> int:
    """Serves until drained (SIGTERM, Ctrl-C or ``POST /drain``); returns the exit status."""
    tls.check_files(settings)  # before anything listens
    _warn_if_open(settings)
    edge.raise_open_file_limit()
    if settings.server.edge == "rust":
        listener = edge.bind(settings)  # first: a taken port fails before anything starts
        _refuse_taken_port(settings, serving=False)
        with _demo_engines(settings) as demo_nodes:
            if demo_nodes:
                settings = settings.replace(nodes=(*settings.routing.nodes, *demo_nodes))
            _print_banner(settings, f"Rust edge, {edge.threads(settings)} thread(s)")
            return edge.serve(settings, listener, _logging_config(settings.server.log_level, behind_edge=True))
    _refuse_taken_port(settings)
    with _demo_engines(settings) as demo_nodes, group.prepared(settings.server.workers) as group_dir:
        if demo_nodes:
            settings = settings.replace(nodes=(*settings.routing.nodes, *demo_nodes))
        os.environ[SETTINGS_ENV] = settings.to_json()
        os.environ[MAIN_PID_ENV] = str(os.getpid())
        if group_dir is not None:
            os.environ[group.GROUP_ENV] = str(group_dir)
        _print_banner(settings, f"granian, {settings.server.workers} worker(s)")
        Granian(
            target="pdproxy.server.app:app_from_environment",
            factory=True,
            address=settings.server.host,
            port=settings.server.port,
            interface=Interfaces.ASGI,
            workers=settings.server.workers,
            loop=Loops.uvloop,
            http=HTTPModes.http1,
            log_level=LogLevels(settings.server.log_level.lower()),
            log_dictconfig=_logging_config(settings.server.log_level),
            log_access=False,
            backlog=2048,
            # SIGTERM drains: granian stops accepting and lets requests in flight finish, this long at most.
            workers_kill_timeout=max(1, round(settings.server.drain_timeout)),
            # A worker that dies is replaced; the group's leader hands back the permits it held.
            respawn_failed_workers=True,
            respawn_interval=RESPAWN_INTERVAL,
            # HTTPS with the same certificate as the Rust edge would serve (``--ssl``).
            ssl_cert=Path(settings.security.ssl_certfile) if settings.security.ssl else None,
            ssl_key=Path(settings.security.ssl_keyfile) if settings.security.ssl else None,
        ).serve()
    return 0


def _warn_if_open(settings: Settings) -> None:
    """Says it loudly when anyone on the network may manage the fleet."""
    loopback = settings.server.host in ("localhost", "::1") or settings.server.host.startswith("127.")
    if loopback or settings.security.admin_keys or settings.security.api_keys:
        return
    print(
        f"pdproxy: WARNING: listening on {settings.server.host} without --admin-keys: anyone who can reach port "
        f"{settings.server.port} can add, remove and terminate nodes and drain this proxy. Set --admin-keys (or "
        "--admin-keys-file), or listen on 127.0.0.1.",
        file=sys.stderr,
    )


def _refuse_taken_port(settings: Settings, serving: bool = True) -> None:
    """granian shares its port with any other listener that asks (SO_REUSEPORT), so a second
    proxy would quietly take half the traffic: a port that is taken is refused here instead (the
    metrics port's too, whose listener shares it among a group's workers; ``serving``: the
    serving port as well, which the Rust edge binds itself)."""
    if serving:
        _refuse_taken(settings.server.host, settings.server.port, "")
    if settings.observability.metrics_port:
        _refuse_taken(
            settings.observability.metrics_host or settings.server.host,
            settings.observability.metrics_port,
            "--metrics-port: ",
        )


def _refuse_taken(host: str, port: int, flag: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{flag}cannot listen on {host}:{port}: {e.strerror}") from None


def _logging_config(level: str, behind_edge: bool = False) -> dict[str, object]:
    """granian's logging setup plus pdproxy's logger, so both print the same way."""
    # granian's `dictConfig` document: nested dicts its own code leaves untyped.
    config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)
    # pdproxy's own handler, so lines logged while serving a traced request carry its trace id.
    config["filters"] = {**config.get("filters", {}), "trace_id": {"()": TraceIdFilter}}
    config["handlers"]["pdproxy"] = {**config["handlers"]["console"], "filters": ["trace_id"]}
    config["loggers"]["pdproxy"] = {"handlers": ["pdproxy"], "level": level.upper(), "propagate": False}
    if not behind_edge:
        return config
    config["filters"] = {**config.get("filters", {}), "no_embed_notice": {"()": _NoEmbedNotice}}
    config["loggers"]["_granian"].setdefault("filters", []).append("no_embed_notice")
    return config


class _NoEmbedNotice:
    """Drops granian's warning that its embedded server (our control plane's) is experimental."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Embedded server is experimental" not in record.getMessage()


def _print_banner(settings: Settings, how: str) -> None:
    base = f"{'https' if settings.security.ssl else 'http'}://{settings.server.host}:{settings.server.port}"
    nodes = [record.url for record in configured_nodes(settings)]  # never a node's key
    selectors = (getattr(settings.discovery, name) for name, _ in SELECTORS)
    nodes += [f"pods {selector!r}" for selector in selectors if selector] + [
        f"dns {n}" for n in settings.discovery.node_dns
    ]
    if not nodes:
        print("pdproxy: no nodes yet; pass --node URL (or --demo to try it with mock engines)", file=sys.stderr)
    print(f"pdproxy: serving on {base} ({how}) -> {', '.join(nodes) or 'no nodes'}", file=sys.stderr)
    if settings.server.demo:
        body = json.dumps(
            {"model": settings.server.demo_model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        print(
            f"pdproxy: try  curl -N {base}/v1/chat/completions -H 'content-type: application/json' -d '{body}'",
            file=sys.stderr,
        )


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"demo mock engine at {url} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            if response.status == 200:
                return
        time.sleep(0.1)
    raise ConfigError(f"demo mock engine at {url} did not become healthy in {DEMO_STARTUP_TIMEOUT:.0f}s")


@contextlib.contextmanager
def _demo_engines(settings: Settings) -> Iterator[list[str]]:
    """With --demo, runs mock engines next to the proxy for its lifetime."""
    if not settings.server.demo:
        yield []
        return
    from pdproxy.testing import mock_engine_command  # the mock engine's stack only loads for a demo
    from pdproxy.testing.ports import free_port

    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for _ in range(DEMO_ENGINES):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            print(f"pdproxy: starting demo mock engine {url} (model {settings.server.demo_model})", file=sys.stderr)
            cmd = mock_engine_command(port, settings.server.demo_model, "--token-delay-ms", str(DEMO_TOKEN_DELAY_MS))
            procs.append(subprocess.Popen(cmd))
            urls.append(url)
        deadline = time.monotonic() + DEMO_STARTUP_TIMEOUT
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc, deadline)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()

"""The Rust edge and its control plane, in one process.

The edge (the data plane's HTTP server, on every core) owns the public address and serves
inference requests without Python. Everything else goes to the control plane: the ASGI app,
served by granian on a Unix socket in a directory only this user can read. This module starts
both, beats the control plane's heartbeat, and stops them in order: a drain (SIGTERM, SIGINT
or ``POST /drain``) lets requests in flight finish, then the edge closes, then the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import uvloop
from granian.constants import HTTPModes, Interfaces
from granian.log import LogLevels
from granian.server.embed import Server as EmbeddedServer

from pdproxy import _pdproxy
from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError
from pdproxy.server.app import ProxyApp

log = logging.getLogger("pdproxy")

#: Pending connections the listener queues (bursts of new clients wait instead of being dropped).
BACKLOG = 2048
#: How often the control plane tells the edge it is alive, and after how long without a beat
#: the edge answers for it (503) instead of waiting on it.
HEARTBEAT_INTERVAL = 0.5
CONTROL_STALE_AFTER = 10.0
#: Seconds the control plane's server may take to come up, and connections to close at exit.
CONTROL_STARTUP_TIMEOUT = 10.0
CLOSE_GRACE = 2.0


def bind(settings: Settings) -> _pdproxy.EdgeListener:
    """The public listener, bound now: a taken port fails before anything starts."""
    return _pdproxy.EdgeListener(settings.server.host, settings.server.port, BACKLOG)


def threads(settings: Settings) -> int:
    """The edge's threads: one per core unless set."""
    return settings.server.edge_threads or os.cpu_count() or 1


#: Descriptors kept aside from the client connections' share: logs, sockets of the control plane.
RESERVED_FILES = 64
#: The soft limit a hard limit of "unlimited" is raised to (the kernel caps it at nr_open).
UNLIMITED_FILES = 1 << 20


def raise_open_file_limit() -> int:
    """Raises the soft limit on open files to the hard one, as servers do (nginx's
    ``worker_rlimit_nofile``): the usual soft limit of 1,024 is a few hundred streams, each of
    which holds a client's and a node's connection. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a limit this process may not raise stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def max_connections(settings: Settings) -> int:
    """The cap on client connections: the setting, or half the open-file limit less a reserve,
    so that every client connection may hold a connection to its node as well."""
    if settings.limits.max_connections:
        return settings.limits.max_connections
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        limit = UNLIMITED_FILES
    return max((limit - RESERVED_FILES) // 2, 1)


def serve(settings: Settings, listener: _pdproxy.EdgeListener, logging_config: dict[str, object]) -> int:
    """Serves until drained; returns the exit status."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_supervise(settings, listener, logging_config))


async def _supervise(settings: Settings, listener: _pdproxy.EdgeListener, logging_config: dict[str, object]) -> int:
    app = ProxyApp(settings, tune_gc=True, behind_edge=True)
    workdir = Path(tempfile.mkdtemp(prefix="pdproxy-"))  # mode 0700: the control plane is private
    socket_path = workdir / "control.sock"
    control = EmbeddedServer(
        target=app,
        uds=socket_path,
        interface=Interfaces.ASGINL,  # the app's lifespan is run here, not by granian
        http=HTTPModes.http1,
        # granian's notices about its private socket are noise here; its warnings and errors are not.
        log_level=max(LogLevels(settings.server.log_level.lower()), LogLevels.warning, key=_severity),
        log_dictconfig=logging_config,
        log_access=False,
    )
    control_task: asyncio.Task[None] | None = None
    edge: _pdproxy.Edge | None = None
    status = 0
    try:
        await app.startup()
        control_task = asyncio.create_task(control.serve())
        await _until_listening(socket_path, control_task)
        assert app.supervisor.router is not None
        edge = _pdproxy.Edge(
            app.supervisor.router.core,
            listener,
            settings,
            threads(settings),
            max_connections(settings),
            str(socket_path),
            CONTROL_STALE_AFTER,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, app.supervisor.drain)
        loop.add_signal_handler(signal.SIGHUP, app.supervisor.reload_tenants)
        heartbeat = asyncio.create_task(_beat(edge.heartbeat))
        drained = asyncio.create_task(app.supervisor.drained.wait())
        done, _ = await asyncio.wait({drained, control_task}, return_when=asyncio.FIRST_COMPLETED)
        if drained not in done:
            log.error("the control plane stopped unexpectedly: finishing the requests in flight, then exiting")
            status = 1
            app.supervisor.drain()
            await drained
        heartbeat.cancel()
    finally:
        if edge is not None:
            still_open = edge.shutdown()
            if still_open:
                log.info("%d client connection(s) were still open at exit", still_open)
        control.stop()  # type: ignore[no-untyped-call]  # granian's embedded server is untyped
        if control_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(control_task, CLOSE_GRACE)
        await app.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    return status


def _severity(level: LogLevels) -> int:
    return logging.getLevelName(level.value.upper())  # type: ignore[no-any-return]


async def _until_listening(socket_path: Path, server: asyncio.Task[None]) -> None:
    """Waits for granian to listen on the control plane's socket."""
    async with asyncio.timeout(CONTROL_STARTUP_TIMEOUT):
        while not socket_path.exists():  # noqa: ASYNC240 (a stat of a local path, not I/O worth a thread)
            if server.done():
                raise ConfigError(f"the control plane did not start: {server.exception()!r}")
            await asyncio.sleep(0.01)


async def _beat(heartbeat: Callable[[], None]) -> None:
    while True:
        heartbeat()
        await asyncio.sleep(HEARTBEAT_INTERVAL)

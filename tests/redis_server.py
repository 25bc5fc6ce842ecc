"""A real redis-server (Debian's) on a free loopback port, for the registry tests: no data on
disk, stopped by its PID, and restartable on the same port to play a Redis that lost its data."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from servers import free_port, stop_process

REDIS_SERVER = shutil.which("redis-server")
READY_TIMEOUT = 10.0


def ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis answers PING on 127.0.0.1:port (inline command, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("the registry tests need Debian's redis-server (apt-get install redis-server)")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Starts an empty server on this port and waits until it answers PING."""
        assert self.proc is None, "already running"
        self.starts += 1
        options = f"--port {self.port} --bind 127.0.0.1 --appendonly no --daemonize no --dir {self.workdir}"
        with open(self.workdir / f"redis-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, *options.split(), "--save", ""],  # nothing saved: a restart comes back empty
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{self.log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stops the server by its PID; the port stops answering before this returns."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc)

    def restart_empty(self) -> None:
        """A Redis that restarted and lost its data: same port, nothing saved (--save '')."""
        self.stop()
        self.start()

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("redis-*.log")))


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()

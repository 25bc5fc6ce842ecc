"""What a hostile client does to a proxy, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["idle_connections"]


def idle_connections(port: int, count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` connections to ``host:port`` that never send a byte (the caller closes them)."""
    opened = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # connecting in the background is the point
            s.connect((host, port))
        opened.append(s)
    return opened

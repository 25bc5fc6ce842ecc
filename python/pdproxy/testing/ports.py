"""A free TCP port, for the processes pdproxy starts itself (the demo's mock engines, the test
and benchmark tools' servers)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (the kernel's pick; it may be taken again
    before it is used, which a caller binding it at once can live with)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port

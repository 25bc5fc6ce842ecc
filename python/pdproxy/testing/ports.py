"""Free TCP ports, for the processes pdproxy starts itself (the demo's mock engines, the test
and benchmark tools' servers).

A port is chosen here and bound later by another process, so two things can take it in
between: another process picking the same port (the kernel hands a freed port out again), and
an outgoing connection using it as its local port. Ports are therefore taken below the kernel's
ephemeral range (which outgoing connections never use), each process walking a slice of its
own (pytest-xdist workers by their number, other processes by their pid) from a random start
(a worker's children share its slice)."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_range", "free_udp_port"]

#: The lowest port handed out; below it sit well-known services.
LOWEST_PORT = 12_000
#: Linux's default start of the ephemeral range, where it cannot be read.
EPHEMERAL_LOW = 32_768
#: Slices the ports below the ephemeral range are cut into; one per process.
SLICES = 32
#: Where Linux keeps its ephemeral range ("32768\t60999" by default).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

#: The next offset into this process's slice; random at first so that processes sharing a
#: slice start apart.
_next_offset: int | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing uses at ``host`` now."""
    return free_port_range(1, host)


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A port free at ``host`` for TCP (``free_port``) and for UDP both: a replica listens for
    its peers' datagrams on it (``--replica-listen``)."""
    while True:
        port = free_port(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports nothing uses at ``host`` now, from this
    process's slice (from anywhere below the ephemeral range when ``count`` is large)."""
    global _next_offset
    below = _ephemeral_low() - LOWEST_PORT
    size = below // SLICES
    start = LOWEST_PORT + _slice_key() % SLICES * size
    if count > size // 4:
        start, size = LOWEST_PORT, below
    if _next_offset is None:
        _next_offset = random.randrange(size)
    for _ in range(size):
        first = start + _next_offset % (size - count + 1)
        _next_offset += count
        if all(_bindable(host, first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports at {host}")


def _ephemeral_low() -> int:
    try:
        return max(int(EPHEMERAL_RANGE.read_text().split()[0]), LOWEST_PORT + 64 * SLICES)
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def _slice_key() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else os.getpid()


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEADDR the bind also fails while connections linger on the port.
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True

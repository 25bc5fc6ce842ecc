"""The test tools' free ports: below the kernel's ephemeral range (which outgoing connections
take from), and apart for each pytest-xdist worker, so that a port chosen by one process is not
bound by another before the process it was chosen for binds it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pdproxy.testing.ports import EPHEMERAL_RANGE, free_port, free_port_range

PICK = "from pdproxy.testing.ports import free_port; print(*(free_port() for _ in range(50)))"


def ports_of_worker(worker: str) -> set[int]:
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker}
    out = subprocess.run([sys.executable, "-c", PICK], env=env, capture_output=True, text=True, check=True)
    return {int(p) for p in out.stdout.split()}


def test_ports_sit_below_the_ephemeral_range_and_are_free() -> None:
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    port = free_port()
    assert port < ephemeral_low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it


def test_each_worker_picks_from_its_own_slice() -> None:
    gw0, gw1 = ports_of_worker("gw0"), ports_of_worker("gw1")
    assert len(gw0) == len(gw1) == 50, "no port twice in one process"
    assert max(gw0) < min(gw1) or max(gw1) < min(gw0), "the two workers' ports do not interleave"


def test_a_range_is_consecutive_and_free() -> None:
    first = free_port_range(5)
    sockets = [socket.socket() for _ in range(5)]
    try:
        for i, s in enumerate(sockets):
            s.bind(("127.0.0.1", first + i))
    finally:
        for s in sockets:
            s.close()

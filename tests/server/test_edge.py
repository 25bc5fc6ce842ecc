"""The Rust edge: what it answers itself (a body too large even for a client that writes it all
first), owning its port, draining on SIGTERM, and a control plane that cannot answer (a clear
503, never a hang), on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

import pdproxy
from pdproxy import _pdproxy
from pdproxy.errors import ProxyOverloaded
from pdproxy.testing import MockEngine, MockSettings
from servers import chat_body, eventually, pdproxy_serve, stop_process


def write_all_then_read(url: str, head: bytes, body: bytes, timeout: float = 10.0) -> bytes:
    """A client that writes its whole request before it reads a byte of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer


def test_a_body_too_large_is_answered_to_a_client_that_writes_it_all_first(tmp_path: Path) -> None:
    with pdproxy_serve(tmp_path, "--edge", "rust", "--max-body-size", "1000") as proxy:
        body = b"x" * (4 << 20)  # far beyond the socket buffers: the edge must read it to answer
        declared = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
        )
        answer = write_all_then_read(proxy.url, declared, body)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
        # Without a declared length: the limit is found while reading.
        chunked = b"".join(b"%x\r\n%s\r\n" % (65536, b"y" * 65536) for _ in range(32)) + b"0\r\n\r\n"
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        answer = write_all_then_read(proxy.url, head, chunked)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("edge", ["rust", "granian"])
def test_a_taken_port_is_refused(tmp_path: Path, edge: str) -> None:
    with pdproxy_serve(tmp_path, "--edge", edge) as first:
        port = first.url.rsplit(":", 1)[1]
        second = subprocess.run(
            [sys.executable, "-m", "pdproxy", "serve", "--edge", edge, "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr
        assert "in use" in second.stderr
        assert first.proc.poll() is None, "the first proxy still serves"


async def test_sigterm_drains_streams_then_exits_cleanly(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m", token_delay_ms=50)) as engine:
        node = f"{engine.url},model=m"
        async with pdproxy_serve(tmp_path, "--edge", "rust", "--node", node, "--drain-timeout", "10") as proxy:
            body = chat_body("m", stream=True, max_tokens=10, ignore_eos=True)
            async with http.post(proxy.url + "/v1/chat/completions", json=body) as stream:
                assert (await stream.content.readline()).startswith(b"data: ")
                proxy.proc.send_signal(signal.SIGTERM)

                async def draining() -> bool:  # readiness is withdrawn as the drain starts
                    async with http.get(proxy.url + "/ready") as r:
                        return r.status == 503

                await eventually(draining, "the drain to start")
                async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                    assert (r.status, r.headers["x-pdproxy-error"]) == (503, "draining")
                rest = await stream.read()
            assert rest.endswith(b"data: [DONE]\n\n"), "the stream in flight finished"
            returncode = await asyncio.get_running_loop().run_in_executor(None, proxy.proc.wait, 15)
            assert returncode == 0
            assert "Traceback" not in proxy.log()


@contextlib.contextmanager
def silent_control_plane(path: Path) -> Iterator[None]:
    """A control plane that accepts connections and never answers."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@contextlib.asynccontextmanager
async def edge_with(control_socket: Path, stale_after: float, **settings: object) -> AsyncIterator[tuple[str, object]]:
    """A Rust edge in this process with a router of one mock engine, its control plane at
    ``control_socket``; yields the edge's URL and the edge."""
    async with MockEngine(model="m") as engine:
        config = pdproxy.Settings(first_byte_timeout=2.0, **settings)  # type: ignore[arg-type]
        router = pdproxy.Router(settings=config)
        router.add_node(engine.url, ["m"], verify=False)
        listener = _pdproxy.EdgeListener("127.0.0.1", 0, 128)
        edge = _pdproxy.Edge(router.core, listener, config, 1, 256, str(control_socket), stale_after)
        try:
            yield f"http://127.0.0.1:{listener.port}", edge
        finally:
            await asyncio.get_running_loop().run_in_executor(None, edge.shutdown)
            await router.aclose()


async def test_a_control_plane_that_is_gone_gets_a_clear_503(http: aiohttp.ClientSession) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with edge_with(Path(workdir) / "nobody.sock", stale_after=10.0) as (url, _edge):
            started = time.monotonic()
            async with http.get(url + "/nodes/status") as r:
                assert r.status == 503
                assert r.headers["x-pdproxy-error"] == "control_plane_unavailable"
                assert (await r.json())["error"]["code"] == "control_plane_unavailable"
            assert time.monotonic() - started < 1.0
            # Inference does not need the control plane.
            async with http.post(url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status == 200


async def test_a_control_plane_that_stopped_answering_gets_a_503_not_a_hang(http: aiohttp.ClientSession) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "control.sock"
        with silent_control_plane(path):
            async with edge_with(path, stale_after=0.5) as (url, edge):
                # Beating: the edge waits for the control plane, up to its time limit.
                edge.heartbeat()  # type: ignore[attr-defined]
                started = time.monotonic()
                async with http.get(url + "/health") as r:
                    assert r.status == 503
                assert 1.5 < time.monotonic() - started < 5, "bounded by first_byte_timeout"
                # No beat for longer than stale_after: answered at once. A fixed wait, as the
                # staleness is time itself: nothing but the clock marks the control plane stale.
                await asyncio.sleep(0.7)
                started = time.monotonic()
                async with http.get(url + "/metrics") as r:
                    assert r.status == 503
                    assert "not responding" in (await r.json())["error"]["message"]
                assert time.monotonic() - started < 0.5


async def test_the_edge_counts_in_the_global_gate_with_the_control_plane(http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m", ttft_ms=300)) as engine:
        with tempfile.TemporaryDirectory() as workdir:
            config = pdproxy.Settings(max_requests=1)
            router = pdproxy.Router(settings=config)
            router.add_node(engine.url, ["m"], verify=False)
            listener = _pdproxy.EdgeListener("127.0.0.1", 0, 128)
            edge = _pdproxy.Edge(router.core, listener, config, 1, 256, str(Path(workdir) / "x.sock"), 10.0)
            url = f"http://127.0.0.1:{listener.port}"
            try:
                slow = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=chat_body("m")))
                await eventually(lambda: router.serving > 0, "the edge's request in the gate")
                with pytest.raises(ProxyOverloaded):
                    router.enter_request()  # the control plane's side sees the edge's request
                async with await slow as r:
                    assert r.status == 200
                assert router.serving == 0
            finally:
                await asyncio.get_running_loop().run_in_executor(None, edge.shutdown)
                await router.aclose()


def test_the_control_socket_is_private(tmp_path: Path) -> None:
    with pdproxy_serve(tmp_path, "--edge", "rust") as proxy:
        sockets = [
            p for p in Path(tempfile.gettempdir()).glob("pdproxy-*/control.sock") if _owned_by(p, proxy.proc.pid)
        ]
        assert sockets, "the control plane listens on a socket in a pdproxy-* directory"
        assert os.stat(sockets[0].parent).st_mode & 0o077 == 0, "only its owner can enter the directory"
        stop_process(proxy.proc)
        assert not sockets[0].parent.exists(), "removed at exit"


def _owned_by(path: Path, pid: int) -> bool:
    """Whether process ``pid`` has the Unix socket at ``path`` open (as a listener)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[-1] == str(path):
                socket_inode = fields[6]
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) == f"socket:[{socket_inode}]":
                            return True
    return False

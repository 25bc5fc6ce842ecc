"""The prefill-decode link pool (LMDeploy DistServe).

A link (P, D) is connected by one handshake, strictly in LMDeploy's order: ``engine_info(P)``,
``engine_info(D)``, ``p2p_initialize(P)``, ``p2p_initialize(D)``, ``p2p_connect(P)``,
``p2p_connect(D)``, with the transport LMDeploy's proxy flags choose (``--migration-protocol``,
``--link-type``, ``--disable-gdr``: the same integers and fields its proxy sends). Requests that
find a link unconnected share one handshake (single flight) and wait for it with a timeout; a
failed handshake is retried with backoff, a bounded number of times. Warm-up connects every
pair with bounded concurrency and, since it joins the handshakes already in flight, repeating it
never piles up work. Removing a node drops its links on both sides.

In a worker group the pool is the group's: a handshake runs under a lock file per pair and
leaves a marker once connected, so each pair is connected once for all workers, and dropped
once (by whichever worker removes the marker)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import aiohttp

from pdproxy._json_types import JsonObject, JsonValue, loads
from pdproxy.config.settings import PdSettings
from pdproxy.errors import HandshakeError, LinkFailed
from pdproxy.fleet.tls import node_session

log = logging.getLogger("pdproxy.pd")

STATUS_SUCCESS = 1
#: LMDeploy's integer enums (MigrationProtocol, RDMALinkType), as its proxy sends them.
PROTOCOLS = {"TCP": 1, "RDMA": 2, "NVLINK": 3}
LINK_TYPES = {"IB": 1, "RoCE": 2}


class RdmaConfig(TypedDict):
    """LMDeploy's ``DistServeRDMAConfig``."""

    with_gdr: bool
    link_type: int


class TransportFields(TypedDict):
    """The transport fields of LMDeploy's ``p2p_initialize`` body (its enums as integers)."""

    protocol: int
    tcp_config: None
    rdma_config: RdmaConfig
    nvlink_config: None


class LinkSummary(TypedDict):
    """One prefill-decode link, as ``/distserve/status`` shows it."""

    prefill: str
    decode: str
    #: connecting, connected or failed.
    state: str
    last_error: str | None
    handshake_seconds: float | None
    attempts: int


class WarmupAnswer(TypedDict):
    """``POST /distserve/connection_warmup``: every pair's link, and how many are connected."""

    links: list[LinkSummary]
    connected: int


@dataclass(frozen=True)
class Transport:
    """How the engines of a link move KV (``lmdeploy serve proxy --migration-protocol
    --link-type --disable-gdr``), in the fields of LMDeploy's ``PDConnectionMessage``."""

    protocol: str = "RDMA"
    link_type: str = "RoCE"
    with_gdr: bool = True

    @property
    def protocol_number(self) -> int:
        return PROTOCOLS[self.protocol]

    def init_fields(self) -> TransportFields:
        """What ``p2p_initialize`` carries besides the engines: LMDeploy's proxy always sends its
        RDMA settings (for NVLINK too) and no TCP or NVLink settings."""
        return TransportFields(
            protocol=self.protocol_number,
            tcp_config=None,
            rdma_config=RdmaConfig(with_gdr=self.with_gdr, link_type=LINK_TYPES[self.link_type]),
            nvlink_config=None,
        )


@dataclass
class Link:
    prefill: str
    decode: str
    state: str = "connecting"  # connecting -> connected | failed
    last_error: str | None = None
    handshake_seconds: float | None = None
    attempts: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def summary(self) -> LinkSummary:
        return LinkSummary(
            prefill=self.prefill,
            decode=self.decode,
            state=self.state,
            last_error=self.last_error,
            handshake_seconds=self.handshake_seconds,
            attempts=self.attempts,
        )


def parse_engine_info(payload: JsonValue) -> JsonObject:
    """LMDeploy double-encodes engine_info (a JSON string holding JSON); accept that and a
    plain object."""
    if isinstance(payload, str):
        payload = loads(payload)
    if not isinstance(payload, dict) or "tp_size" not in payload:
        raise ValueError("engine_info is not an object with tp_size")
    return payload


class LinkPool:
    def __init__(
        self,
        settings: PdSettings,
        *,
        api_key_of: Callable[[str], str | None],
        transport: Transport,
        group_dir: Path | None = None,
        ca_file: str = "",
    ) -> None:
        self.links: dict[tuple[str, str], Link] = {}
        self.transport = transport
        #: In a worker group: where the pairs' lock files and connected markers live.
        self._shared = group_dir / "links" if group_dir is not None else None
        self._timeout = settings.link_timeout
        self._ca_file = ca_file
        self._attempts = settings.link_attempts
        self._backoff = settings.link_backoff
        self._wait_timeout = settings.link_wait_timeout
        self._api_key_of = api_key_of
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = node_session(self._ca_file, self._timeout)

    async def aclose(self) -> None:
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
        if self._session is not None:
            await self._session.close()

    async def ensure(self, prefill: str, decode: str) -> None:
        """Returns once (prefill, decode) is connected; raises ``LinkFailed`` otherwise."""
        link = self.links.get((prefill, decode))
        if link is not None and link.state == "connected":
            return
        if link is None or link.task is None or link.task.done():
            link = link or Link(prefill, decode)
            self.links[(prefill, decode)] = link
            link.state = "connecting"
            link.task = asyncio.get_running_loop().create_task(self._connect(link))
        try:
            # Shielded: a waiter that gives up must not cancel the handshake others share.
            await asyncio.wait_for(asyncio.shield(link.task), self._wait_timeout)
        except TimeoutError:
            raise LinkFailed(f"the prefill-decode link was not ready within {self._wait_timeout:g}s") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request itself was cancelled
            # The handshake was cancelled under us: a node of the pair was removed.
            raise LinkFailed("the prefill-decode link was dropped (a node was removed)") from None
        if link.state != "connected":
            raise LinkFailed(f"the prefill and decode nodes could not be connected: {link.last_error}")

    async def warmup(self, prefills: Iterable[str], decodes: Iterable[str], concurrency: int) -> WarmupAnswer:
        limit = asyncio.Semaphore(concurrency)
        pairs = [(p, d) for p in prefills for d in decodes]

        async def one(p: str, d: str) -> None:
            async with limit:
                with contextlib.suppress(LinkFailed):
                    await self.ensure(p, d)

        await asyncio.gather(*(one(p, d) for p, d in pairs))
        states = [self.links[pair].summary() for pair in pairs if pair in self.links]
        return WarmupAnswer(links=states, connected=sum(1 for s in states if s["state"] == "connected"))

    async def drop(self, url: str, api_key: str | None = None) -> None:
        """Forgets every link of ``url`` and drops them on both nodes (best effort); ``api_key``
        is ``url``'s own, given by the caller since the node may be unregistered already."""
        gone = [link for key, link in list(self.links.items()) if url in key]
        for link in gone:
            self.links.pop((link.prefill, link.decode), None)
            if link.task is not None and not link.task.done():
                link.task.cancel()
        if self._shared is not None:
            gone = self._unmark(url)  # the group's links, dropped by this worker only if it unmarks them
        calls = []
        for link in gone:
            for local, remote in ((link.prefill, link.decode), (link.decode, link.prefill)):
                body = {"engine_id": local, "remote_engine_id": remote}
                calls.append(self._post(local, "p2p_drop_connect", body, api_key if local == url else None))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.info("p2p_drop_connect failed: %s", outcome)

    def status(self) -> list[LinkSummary]:
        return [link.summary() for link in self.links.values()]

    async def _connect(self, link: Link) -> None:
        if self._shared is None:
            await self._connect_here(link)
            return
        marker = self._marker(link.prefill, link.decode)
        async with _file_lock(marker.with_suffix(".lock")):
            if marker.exists():
                link.state = "connected"  # another worker of the group connected it
                link.last_error = None
                return
            await self._connect_here(link)
            if link.state == "connected":
                marker.write_text(json.dumps({"prefill": link.prefill, "decode": link.decode}))

    def _marker(self, prefill: str, decode: str) -> Path:
        assert self._shared is not None
        return self._shared / (hashlib.sha256(f"{prefill} {decode}".encode()).hexdigest()[:32] + ".connected")

    def _unmark(self, url: str) -> list[Link]:
        """Removes the group's markers of the links of ``url``; the links this call unmarked."""
        assert self._shared is not None
        unmarked = []
        for marker in self._shared.glob("*.connected"):
            try:
                pair = json.loads(marker.read_text())
                if url not in (pair["prefill"], pair["decode"]):
                    continue
                marker.unlink()
            except (OSError, ValueError, KeyError):
                continue  # another worker unmarked it first, or it is being written
            unmarked.append(Link(pair["prefill"], pair["decode"]))
        return unmarked

    async def _connect_here(self, link: Link) -> None:
        for attempt in range(self._attempts):
            link.attempts += 1
            started = time.monotonic()
            try:
                await self._handshake(link.prefill, link.decode)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, HandshakeError) as e:
                link.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.warning("link %s -> %s: handshake failed (%s)", link.prefill, link.decode, link.last_error)
                if attempt + 1 < self._attempts:
                    await asyncio.sleep(self._backoff * 2**attempt)
                continue
            link.state = "connected"
            link.last_error = None
            link.handshake_seconds = round(time.monotonic() - started, 6)
            log.info("link %s -> %s connected in %.3f s", link.prefill, link.decode, link.handshake_seconds)
            return
        link.state = "failed"

    async def _handshake(self, prefill: str, decode: str) -> None:
        p_info = parse_engine_info(await self._get(prefill, "engine_info"))
        d_info = parse_engine_info(await self._get(decode, "engine_info"))
        if p_info.get("tp_size") != d_info.get("tp_size"):
            raise HandshakeError(f"tp_size differs: prefill {p_info.get('tp_size')}, decode {d_info.get('tp_size')}")
        p_init = await self._post(prefill, "p2p_initialize", self._init_body(prefill, p_info, decode, d_info))
        d_init = await self._post(decode, "p2p_initialize", self._init_body(decode, d_info, prefill, p_info))
        for name, answer in (("prefill", p_init), ("decode", d_init)):
            if answer.get("status") != STATUS_SUCCESS:
                raise HandshakeError(f"p2p_initialize on the {name} node answered status {answer.get('status')}")
        for local, peer, peer_init in ((prefill, decode, d_init), (decode, prefill, p_init)):
            connect = {
                "protocol": self.transport.protocol_number,
                "remote_engine_id": peer,
                "remote_engine_endpoint_info": peer_init["engine_endpoint_info"],
                "remote_kvtransfer_endpoint_info": peer_init["kvtransfer_endpoint_info"],
            }
            answer = await self._post(local, "p2p_connect", connect)
            if answer.get("status") != STATUS_SUCCESS:
                raise HandshakeError(f"p2p_connect on {local} answered status {answer.get('status')}")

    def _init_body(self, local: str, local_info: JsonObject, remote: str, remote_info: JsonObject) -> dict[str, object]:
        return {
            "local_engine_id": local,
            "local_engine_config": local_info,
            "remote_engine_id": remote,
            "remote_engine_config": remote_info,
            "rank": None,
            **self.transport.init_fields(),
        }

    def _headers(self, url: str, api_key: str | None = None) -> dict[str, str]:
        key = self._api_key_of(url) or api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _get(self, url: str, endpoint: str) -> JsonValue:
        assert self._session is not None
        async with self._session.get(f"{url}/distserve/{endpoint}", headers=self._headers(url)) as r:
            if r.status != 200:
                raise HandshakeError(f"{endpoint} on {url} answered {r.status}")
            answer: JsonValue = await r.json(content_type=None)
        return answer

    async def _post(
        self, url: str, endpoint: str, body: Mapping[str, object], api_key: str | None = None
    ) -> JsonObject:
        assert self._session is not None
        headers = self._headers(url, api_key)
        async with self._session.post(f"{url}/distserve/{endpoint}", json=body, headers=headers) as r:
            if r.status != 200:
                raise HandshakeError(f"{endpoint} on {url} answered {r.status}")
            answer: JsonValue = await r.json(content_type=None)
        if not isinstance(answer, dict):
            raise HandshakeError(f"{endpoint} on {url} did not answer an object")
        return answer


@contextlib.asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive lock shared by the group's workers, waited for without blocking the loop."""
    with open(path, "a") as f:  # noqa: ASYNC230 - a lock file on a memory-backed file system
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

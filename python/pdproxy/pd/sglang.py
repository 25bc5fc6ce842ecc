"""SGLang's PD disaggregation: one body, with ``bootstrap_host`` (the prefill node's host),
``bootstrap_port`` (its bootstrap server, from registration or its ``/server_info``) and a
fresh random ``bootstrap_room``, sent to the prefill and the decode node at once (the prefill
waits for the decode to join the room, so sending them one after the other would deadlock).
The decode answer is relayed; the prefill answer is drained. If either leg fails first, the
other is cancelled at once. Batched requests get arrays, one room per item."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable
from typing import TypedDict
from urllib.parse import urlsplit

import aiohttp

from pdproxy import _pdproxy
from pdproxy._pdproxy import Response
from pdproxy._pdproxy import Router as CoreRouter
from pdproxy.config import Settings
from pdproxy.errors import PrefillFailed, UpstreamError
from pdproxy.router import Router
from pdproxy.tls import node_session
from pdproxy.tracing import end_on_answer, leg

from .relay import PdRequest, read_all, relay, send_raw

log = logging.getLogger("pdproxy.pd")

PD_PATHS = frozenset(_pdproxy.PD_PATHS["sglang"])


def batch_size(body: bytes) -> int | None:
    """Items in a batched request (an array prompt or text, or chat with n > 1); None if single."""
    n = Router.inspect(body)["n"] or 1
    if n > 1:
        return n
    for key in ("prompt", "text", "input_ids"):
        raw = CoreRouter.member(body, key)
        if raw is not None and raw.lstrip().startswith("["):
            items = json.loads(raw)
            # A list of token ids is one prompt; a list of prompts is a batch.
            if items and not all(isinstance(i, int) for i in items):
                return len(items)
    return None


class SglangStatus(TypedDict):
    protocol: str
    #: Prefill nodes' bootstrap ports learnt from their ``/server_info`` (None: it named none).
    bootstrap_ports: dict[str, int | None]
    #: Prefill answers still being read after their decode started.
    draining_prefills: int


class SglangPD:
    protocol = "sglang"
    paths = PD_PATHS

    def __init__(self, router: Router, settings: Settings, bootstrap_port_of: Callable[[str], int | None]) -> None:
        self.router = router
        self.settings = settings
        self._declared_port = bootstrap_port_of
        self._ports: dict[str, int | None] = {}
        self._drains: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = node_session(self.settings.node_ca_file, self.settings.pd_link_timeout)

    async def aclose(self) -> None:
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def node_removed(self, url: str) -> None:
        self._ports.pop(url, None)

    def status(self) -> SglangStatus:
        return SglangStatus(protocol=self.protocol, bootstrap_ports=self._ports, draining_prefills=len(self._drains))

    async def bootstrap_port(self, url: str) -> int | None:
        """The prefill node's bootstrap port: declared at registration, else from its
        ``/server_info`` (``disaggregation_bootstrap_port``), else null (the decode node then
        assumes its own)."""
        declared = self._declared_port(url)
        if declared is not None:
            return int(declared)
        if url not in self._ports:
            self._ports[url] = await self._probe_port(url)
        return self._ports[url]

    async def _probe_port(self, url: str) -> int | None:
        assert self._session is not None
        for endpoint in ("/server_info", "/get_server_info"):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self._session.get(url + endpoint, allow_redirects=False) as r:
                    if r.status == 200:
                        port = (await r.json(content_type=None)).get("disaggregation_bootstrap_port")
                        return port if isinstance(port, int) else None
        return None

    async def handle(self, request: PdRequest) -> None:
        path, body, headers, send, echo = request.path, request.body, request.headers, request.send, request.echo
        trace, tenant = request.trace, request.tenant
        model = Router.inspect(body)["model"]
        prefill = self.router.select(model, role="prefill")
        decode = self.router.select(model, role="decode")
        host = (urlsplit(prefill).hostname or "").strip("[]")
        port = await self.bootstrap_port(prefill)
        items = batch_size(body)
        rooms: int | list[int] = (
            random.getrandbits(63) if items is None else [random.getrandbits(63) for _ in range(items)]
        )
        fields = {
            "bootstrap_host": host if items is None else [host] * items,
            "bootstrap_port": port if items is None else [port] * items,
            "bootstrap_room": rooms,
        }
        both = Router.patch(body, fields)
        prefill_span, decode_span = leg(trace, "pdproxy.prefill"), leg(trace, "pdproxy.decode")
        prefill_leg = self.router.forward(
            path, both, headers, role="prefill", node=prefill, trace=prefill_span, tenant=tenant
        )
        decode_leg = self.router.forward(
            path, both, headers, role="decode", node=decode, trace=decode_span, tenant=tenant
        )
        end_on_answer(prefill_span, prefill_leg)
        end_on_answer(decode_span, decode_leg)
        try:
            answer = await self._decode_answer(prefill_leg, decode_leg)
        except BaseException:
            prefill_leg.cancel()
            decode_leg.cancel()
            raise
        if isinstance(answer, tuple):  # the prefill failed first: its answer, decode cancelled
            failed, raw = answer
            await send_raw(send, failed, raw, echo)
            return
        self._drain(prefill_leg)
        try:
            await relay(answer, send, echo, self.settings)
        finally:
            answer.close()

    async def _decode_answer(
        self, prefill_leg: asyncio.Future[Response], decode_leg: asyncio.Future[Response]
    ) -> Response | tuple[Response, bytes]:
        """Decode's head, unless the prefill failed first (then its 4xx answer, or an error)."""
        done, _ = await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_leg in done and decode_leg not in done:
            error = prefill_leg.exception()
            if error is not None or prefill_leg.result().status != 200:
                decode_leg.cancel()
                if error is not None:
                    raise PrefillFailed(f"the prefill node failed: {error}") from error
                failed = prefill_leg.result()
                raw = await read_all(failed, self.settings)
                if 400 <= failed.status < 500:
                    return failed, raw
                raise PrefillFailed(f"the prefill node answered {failed.status}")
        response = await decode_leg
        if response.status != 200:
            prefill_leg.cancel()
            if prefill_leg.done() and not prefill_leg.cancelled() and prefill_leg.exception() is None:
                prefill_leg.result().close()
        return response

    def _drain(self, prefill_leg: asyncio.Future[Response]) -> None:
        """Reads the prefill's answer to its end in the background (it carries nothing the
        client needs, but leaving it unread would hold the node)."""

        async def drain() -> None:
            try:
                response = await prefill_leg
                await read_all(response, self.settings)
                if response.status != 200:
                    log.warning("prefill leg answered %d after decode started", response.status)
                response.close()
            except (UpstreamError, asyncio.CancelledError):
                pass

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

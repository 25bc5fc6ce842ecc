"""vLLM's and SGLang's disaggregation as their engines speak it, for the mock engine.

vLLM: a prefill asked for ``do_remote_decode`` keeps its KV and answers top-level
``kv_transfer_params`` (only when it stopped at ``max_tokens``); a decode given valid params
reads the KV (here: an HTTP stand-in for the NIXL read, which also frees it on the prefill),
otherwise it silently recomputes the prompt, which the mock counts so tests can see it.

SGLang: prefill and decode get the same body with ``bootstrap_host/port/room``; the prefill
waits in the room until the decode joins (through the prefill's bootstrap address), then
"transfers" and answers; the decode waits for the transfer, then generates.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TypedDict

from pdproxy._json_types import JsonObject, JsonValue

#: Fields a decode needs to take vLLM's remote path.
VLLM_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def check_vllm_prefill_shape(body: JsonObject, raw_had_max_completion: bool) -> list[str]:
    errors = []
    params = body.get("kv_transfer_params")
    if not (isinstance(params, dict) and params.get("do_remote_decode") is True):
        errors.append("vllm prefill lacks kv_transfer_params.do_remote_decode")
    if body.get("max_tokens") != 1:
        errors.append("vllm prefill max_tokens is not 1")
    if raw_had_max_completion and body.get("max_completion_tokens") != 1:
        errors.append("vllm prefill max_completion_tokens is not 1")
    if body.get("stream"):
        errors.append("vllm prefill is streamed")
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        if name in body:
            errors.append(f"vllm prefill carries {name}")
    return errors


def vllm_remote_path(params: JsonValue) -> bool:
    """True when a decode takes the remote path (as vLLM's scheduler decides)."""
    return (
        isinstance(params, dict)
        and params.get("do_remote_prefill") is True
        and bool(params.get("remote_block_ids"))
        and all(params.get(name) is not None for name in VLLM_REQUIRED)
    )


class RendezvousReport(TypedDict):
    """SGLang's rooms in ``/mock/ledger``: those still open, those a proxy used twice, and counts."""

    open_rooms: list[int]
    reused_rooms: list[int]
    transferred: int
    timeouts: int


@dataclass
class Room:
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    transferred: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rendezvous:
    """SGLang bootstrap rooms of one prefill engine."""

    rooms: dict[int, Room] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    reused: list[int] = field(default_factory=list)
    transferred: int = 0
    timeouts: int = 0

    def room(self, room: int) -> Room:
        return self.rooms.setdefault(room, Room())

    async def prefill(self, rooms: list[int], wait: float) -> bool:
        """The prefill's side: wait for every room's decode, then transfer."""
        for r in rooms:
            if r in self.seen:
                self.reused.append(r)
            self.seen.add(r)
        try:
            async with asyncio.timeout(wait):
                for r in rooms:
                    await self.room(r).joined.wait()
        except TimeoutError:
            self.timeouts += 1
            return False
        for r in rooms:
            self.room(r).transferred.set()
            self.transferred += 1
        return True

    async def join(self, room: int, wait: float) -> bool:
        """The decode's side (through the bootstrap address): join, wait for the transfer."""
        entry = self.room(room)
        entry.joined.set()
        try:
            async with asyncio.timeout(wait):
                await entry.transferred.wait()
        except TimeoutError:
            return False
        finally:
            if entry.transferred.is_set():
                self.rooms.pop(room, None)
        return True

    def report(self) -> RendezvousReport:
        return RendezvousReport(
            open_rooms=sorted(self.rooms),
            reused_rooms=self.reused,
            transferred=self.transferred,
            timeouts=self.timeouts,
        )

"""LMDeploy DistServe as an api_server speaks it: the ``/distserve/*`` endpoints (with their
quirks: ``engine_info`` double-encoded, integer enums, ``p2p_initialize`` before
``p2p_connect``, ``free_cache`` always answering SUCCESS), prefill sessions whose KV stays
preserved until freed, and decode that migrates them.

The mock is stricter than a real engine so that proxy bugs show: every preserved session is
tracked in a ledger, a migration whose handle does not match what prefill produced is
refused, frees of unknown or already freed sessions are counted, and the handshake order per
peer is logged. The side channel a real decode uses to free the prefill's session (ZMQ) is an
HTTP call here (``/mock/migrate``), so that engines in separate processes work the same.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import TypedDict

from pdproxy._json_types import JsonObject, JsonValue

#: LMDeploy's integer enums (they start at 1): MigrationProtocol, RDMALinkType, the status.
PROTOCOLS = {1: "TCP", 2: "RDMA", 3: "NVLINK"}
LINK_TYPES = {1: "IB", 2: "RoCE"}
STATUS_SUCCESS = 1
#: Formats of the prefill answer's handle, as LMDeploy versions produced it.
ID_FORMATS = ("legacy", "cache_session_id", "chat", "completions")


class LedgerReport(TypedDict):
    """What ``/mock/ledger`` tells of the sessions: those still held, who freed the others, and
    everything that went wrong."""

    live: list[int]
    #: By session id (as text, a JSON key): ``proxy`` or ``decode``.
    freed: dict[str, str | None]
    double_frees: list[int]
    unknown_frees: list[int]
    migration_errors: list[str]
    shape_errors: list[str]


class RdmaSettings(TypedDict):
    with_gdr: bool
    #: RDMALinkType by name: IB or RoCE.
    link_type: str


class Transport(TypedDict):
    """The transport a ``p2p_initialize`` asked for, by name."""

    #: TCP, RDMA or NVLINK.
    protocol: str
    rdma: RdmaSettings | None
    nvlink: JsonValue


@dataclass
class Session:
    id: int
    blocks: list[int]
    token_id: int
    state: str = "preserved"  # preserved -> freed
    freed_by: str | None = None


@dataclass
class KvLedger:
    """This engine's preserved prefill sessions and every free it was asked for."""

    block_size: int
    sessions: dict[int, Session] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    blocks: itertools.count[int] = field(default_factory=itertools.count)
    double_frees: list[int] = field(default_factory=list)
    unknown_frees: list[int] = field(default_factory=list)
    migration_errors: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)

    def preserve(self, prompt_tokens: int, token_id: int) -> Session:
        count = max(1, math.ceil(prompt_tokens / self.block_size))
        session = Session(next(self.ids), [next(self.blocks) for _ in range(count)], token_id)
        self.sessions[session.id] = session
        return session

    def free(self, session_id: int, by: str) -> None:
        session = self.sessions.get(session_id)
        if session is None:
            self.unknown_frees.append(session_id)
        elif session.state == "freed":
            self.double_frees.append(session_id)
        else:
            session.state, session.freed_by = "freed", by

    def migrate(self, session_id: int, blocks: list[JsonValue], token_id: int, by: str) -> str | None:
        """Decode reads the session and frees it; returns what was wrong, if anything."""
        session = self.sessions.get(session_id)
        if session is None:
            error = f"session {session_id} is not known"
        elif session.state != "preserved":
            error = f"session {session_id} is {session.state}"
        elif blocks != session.blocks:
            error = f"blocks {blocks} are not session {session_id}'s {session.blocks}"
        elif token_id != session.token_id:
            error = f"token {token_id} is not session {session_id}'s {session.token_id}"
        else:
            self.free(session_id, by)
            return None
        self.migration_errors.append(error)
        return error

    def read(self, session_id: int, blocks: list[JsonValue], by: str) -> str | None:
        """A vLLM decode reads the KV (no token check: vLLM recomputes nothing from it) and
        notifies the prefill, which frees it."""
        session = self.sessions.get(session_id)
        if session is None or session.state != "preserved":
            error = f"request {session_id} holds no KV"
        elif blocks != session.blocks:
            error = f"blocks {blocks} are not request {session_id}'s {session.blocks}"
        else:
            self.free(session_id, by)
            return None
        self.migration_errors.append(error)
        return error

    def report(self) -> LedgerReport:
        return LedgerReport(
            live=[s.id for s in self.sessions.values() if s.state == "preserved"],
            freed={str(s.id): s.freed_by for s in self.sessions.values() if s.state == "freed"},
            double_frees=self.double_frees,
            unknown_frees=self.unknown_frees,
            migration_errors=self.migration_errors,
            shape_errors=self.shape_errors,
        )


@dataclass
class Links:
    """P2P links to peers, keyed by the peer's engine id (its URL, exactly as given)."""

    initialized: set[str] = field(default_factory=set)
    connected: set[str] = field(default_factory=set)
    #: Per peer, the transport its p2p_initialize asked for: protocol and RDMA settings, by name.
    transport: dict[str, Transport] = field(default_factory=dict)
    #: (operation, peer, monotonic time): engines in one process can be ordered together.
    log: list[tuple[str, str, float]] = field(default_factory=list)

    def record(self, operation: str, peer: str) -> None:
        self.log.append((operation, peer, time.monotonic()))


def engine_info(tp_size: int, block_size: int) -> str:
    """What ``/distserve/engine_info`` returns: LMDeploy encodes it twice (a JSON string)."""
    info = {
        "tp_size": tp_size,
        "ep_size": 1,
        "dp_size": 1,
        "pp_size": None,
        "dp_rank": 0,
        "block_size": block_size,
        "num_cpu_blocks": 0,
        "num_gpu_blocks": 4096,
    }
    return json.dumps(json.dumps(info))


def check_transport(body: JsonObject) -> tuple[Transport | None, str | None]:
    """The transport of a ``p2p_initialize`` as LMDeploy's ``DistServeInitRequest`` validates it
    (its enums as integers, ``rdma_config`` an object of ``with_gdr`` and ``link_type`` or null);
    ``(transport by name, None)`` or ``(None, what is wrong)``."""
    protocol = body.get("protocol")
    if not isinstance(protocol, int) or isinstance(protocol, bool) or protocol not in PROTOCOLS:
        return None, f"protocol {protocol!r} is not one of LMDeploy's MigrationProtocol values {sorted(PROTOCOLS)}"
    rdma = body.get("rdma_config")
    transport = Transport(protocol=PROTOCOLS[protocol], rdma=None, nvlink=body.get("nvlink_config"))
    if rdma is not None:
        if not isinstance(rdma, dict) or set(rdma) - {"with_gdr", "link_type"}:
            return None, f"rdma_config {rdma!r} is not a DistServeRDMAConfig"
        with_gdr, link_type = rdma.get("with_gdr", True), rdma.get("link_type", 2)
        if (
            not isinstance(with_gdr, bool)
            or not isinstance(link_type, int)
            or isinstance(link_type, bool)
            or link_type not in LINK_TYPES
        ):
            return None, f"rdma_config {rdma!r}: with_gdr must be a boolean, link_type one of {sorted(LINK_TYPES)}"
        transport["rdma"] = RdmaSettings(with_gdr=with_gdr, link_type=LINK_TYPES[link_type])
    if PROTOCOLS[protocol] == "RDMA" and transport["rdma"] is None:
        return None, "an RDMA link needs rdma_config"
    return transport, None


def check_prefill_shape(body: JsonObject, chat: bool) -> list[str]:
    """What a proxy got wrong in a prefill request, per LMDeploy's flow."""
    errors = []
    if body.get("max_tokens") != 1:
        errors.append("prefill max_tokens is not 1")
    if chat and body.get("max_completion_tokens") not in (None, 1):
        errors.append("prefill max_completion_tokens is not 1")
    if body.get("stream"):
        errors.append("prefill is streamed")
    if body.get("with_cache") is not True or body.get("preserve_cache") is not True:
        errors.append("prefill lacks with_cache/preserve_cache")
    return errors


def check_decode_shape(body: JsonObject) -> list[str]:
    errors = []
    if "with_cache" in body or "preserve_cache" in body:
        errors.append("decode carries with_cache/preserve_cache")
    migration = body.get("migration_request")
    if not isinstance(migration, dict):
        return [*errors, "decode has no migration_request object"]
    protocol = migration.get("protocol")
    if not isinstance(protocol, int) or isinstance(protocol, bool) or protocol not in PROTOCOLS:
        errors.append("migration_request.protocol is not one of LMDeploy's MigrationProtocol integers")
    for name, kind in (("remote_engine_id", str), ("remote_session_id", int), ("remote_token_id", int)):
        if not isinstance(migration.get(name), kind) or isinstance(migration.get(name), bool):
            errors.append(f"migration_request.{name} is not a {kind.__name__}")
    if not isinstance(migration.get("remote_block_ids"), list):
        errors.append("migration_request.remote_block_ids is not a list")
    return errors


def prefill_id(id_format: str, session: Session, body: JsonObject, chat: bool, default: str) -> dict[str, str | int]:
    """The handle fields of a prefill answer in the chosen LMDeploy version's format."""
    if id_format == "legacy":
        return {"id": str(session.id)}
    if id_format == "cache_session_id":
        return {"id": default, "cache_session_id": session.id}
    if id_format == "chat":
        return {"id": f"chatcmpl-{session.id:08x}"} if chat else {"id": str(body.get("session_id", -1))}
    return {"id": str(body.get("session_id", -1))}

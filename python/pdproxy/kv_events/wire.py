"""The engines' KV-cache events as they come over ZMQ, decoded into one shape.

vLLM and SGLang publish the same event family: a batch per scheduler step, msgpack-encoded
``[ts, events]`` or ``[ts, events, data_parallel_rank]``, each event a ``BlockStored`` (the
hashes of blocks just filled, their parent's hash, their token ids), a ``BlockRemoved`` or an
``AllBlocksCleared``. The event's own encoding differs: SGLang and vLLM up to 0.10 send it as
an array whose first item names it (``["BlockStored", hashes, parent, tokens, size, lora]``),
newer vLLM as a map with a ``type`` key. Block hashes are 64-bit integers (SGLang, and vLLM
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) or bytes (vLLM's default: its sha256 digests);
both become the same ``int`` here, the low 64 bits, as vLLM's own integer form takes them.

Blocks kept in another medium than the engine's GPU (``CPU``, ``STORAGE``: offloading tiers)
are not where a prefill finds its prefix, so their events are kept apart (``medium``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

#: The medium of the blocks a prefill reuses; events that name none are about it.
GPU = "GPU"
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """A message that is not a KV event batch in either engine's format."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks just filled, in order, each extending the one before (the first extends
    ``parent``); ``token_ids`` holds ``block_size`` tokens for each block."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: str | int | None = None
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block dropped (a cache reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    #: The data-parallel rank that sent it, when it says.
    rank: int | None = None


def block_hash(value: object) -> int:
    """An engine's block hash as an unsigned 64-bit integer."""
    if isinstance(value, bytes):
        if not value:
            raise WireError("an empty block hash")
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    raise WireError(f"a block hash must be bytes or an integer, not {type(value).__name__}")


def decode_batch(payload: bytes) -> Batch:
    """One published batch (the last frame of a message)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise WireError("a batch is [ts, events] or [ts, events, rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("a batch is [ts, events] or [ts, events, rank]")
    if rank is not None and not isinstance(rank, int):
        raise WireError("a batch's rank must be an integer")
    return Batch(float(ts), tuple(decode_event(e) for e in events), rank)


def decode_event(raw: object) -> Event:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return _from_fields(raw[0], dict(zip(_FIELDS.get(raw[0], ()), raw[1:], strict=False)))
    if isinstance(raw, Mapping) and isinstance(raw.get("type"), str):
        return _from_fields(raw["type"], raw)
    raise WireError("an event is a tagged array or a map with a type")


#: The fields of the array form, in order (later ones, left out when at their defaults, are
#: not needed here).
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _from_fields(tag: str, fields: Mapping[str, object]) -> Event:
    medium = fields.get("medium") or GPU
    if not isinstance(medium, str):
        raise WireError("an event's medium must be a string")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"))
        tokens = fields.get("token_ids")
        size = fields.get("block_size")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WireError("BlockStored needs its token ids")
        if not isinstance(size, int) or size < 1 or len(tokens) != size * len(hashes):
            raise WireError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
        parent = fields.get("parent_block_hash")
        lora = fields.get("lora_name") or fields.get("lora_id")
        return Stored(
            hashes,
            None if parent is None else block_hash(parent),
            tuple(tokens),
            size,
            lora if isinstance(lora, str | int) else None,
            medium,
        )
    if tag == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes")), medium)
    if tag == "AllBlocksCleared":
        return Cleared()
    raise WireError(f"an unknown event {tag!r}")


def _hashes(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw:
        raise WireError("an event needs its block hashes")
    return tuple(block_hash(h) for h in raw)


def encode_batch(batch: Batch, *, dialect: str = "vllm") -> bytes:
    """``batch`` as an engine sends it: ``vllm`` (events as maps, block hashes as 8 bytes),
    ``vllm-array`` (vLLM up to 0.10: tagged arrays) or ``sglang`` (tagged arrays, integer
    hashes, no medium). The mock engine publishes with it; decoding it gives ``batch`` back."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown KV event dialect {dialect!r}: {', '.join(DIALECTS)}")
    events = [_encode_event(e, dialect) for e in batch.events]
    raw: list[object] = [batch.ts, events] if batch.rank is None else [batch.ts, events, batch.rank]
    packed: bytes = msgpack.packb(raw, use_bin_type=True)
    return packed


DIALECTS = ("vllm", "vllm-array", "sglang")


def _encode_event(event: Event, dialect: str) -> object:
    def hash_out(h: int) -> object:
        return h.to_bytes(8, "big") if dialect != "sglang" else h

    if isinstance(event, Stored):
        fields: dict[str, object] = {
            "block_hashes": [hash_out(h) for h in event.block_hashes],
            "parent_block_hash": None if event.parent is None else hash_out(event.parent),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora if isinstance(event.lora, int) else None,
            "medium": event.medium,
            "lora_name": event.lora if isinstance(event.lora, str) else None,
        }
        tag = "BlockStored"
    elif isinstance(event, Removed):
        fields = {"block_hashes": [hash_out(h) for h in event.block_hashes], "medium": event.medium}
        tag = "BlockRemoved"
    else:
        fields, tag = {}, "AllBlocksCleared"
    if dialect == "vllm":
        return {"type": tag, **fields}
    order = _FIELDS[tag][: 5 if dialect == "sglang" and tag == "BlockStored" else None]
    if dialect == "sglang" and tag == "BlockRemoved":
        order = order[:1]
    return [tag, *(fields[name] for name in order)]


def message_parts(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """The sequence number and payload of a published message: ``[topic, seq, payload]``
    (vLLM, SGLang's PUB socket), or ``[seq, payload]`` (SGLang's replies to a replay);
    ``None`` for the end-of-replay marker (sequence -1)."""
    if len(frames) == 3:
        seq_bytes, payload = frames[1], frames[2]
    elif len(frames) == 2:
        seq_bytes, payload = frames[0], frames[1]
    else:
        raise WireError(f"a KV event message has 2 or 3 frames, not {len(frames)}")
    if len(seq_bytes) != 8:
        raise WireError("a sequence number is 8 bytes")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    return None if seq < 0 else (seq, payload)

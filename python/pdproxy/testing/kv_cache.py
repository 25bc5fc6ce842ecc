"""A paged KV cache with prefix reuse and LRU eviction, as vLLM's block manager (and SGLang's
radix cache, at block granularity) keep it.

The cache has ``total`` blocks. A sequence holds one block per ``block_tokens`` of its prompt
and answer. Full prompt blocks are named by the hash of the prefix they end (see
``tokens.block_hashes``), so two sequences that share a prefix share its blocks. When no
sequence holds a named block any more it stays cached, evictable, until its space is needed:
the least recently released goes first, a sequence's deepest blocks before its first ones.

Flushing the cache (``flush``, as vLLM's ``POST /reset_prefix_cache`` and SGLang's
``POST /flush_cache`` do) drops every block kept for reuse; blocks running sequences hold stay
theirs, renamed so that no later prompt finds them and dropped once released.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheObserver(Protocol):
    """Told what the cache keeps, as an engine's KV events tell it (see ``kv_events``)."""

    def stored(self, blocks: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Blocks newly filled, in order, each with the block it extends."""

    def removed(self, blocks: Sequence[bytes]) -> None: ...

    def cleared(self) -> None: ...


class PagedKvCache:
    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a KV cache needs at least one block, got {total}")
        self.total = total
        #: Named blocks held by running sequences, and by how many.
        self._held: dict[bytes, int] = {}
        #: Named blocks no sequence holds: reusable until evicted, least recently released first.
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        #: Unnamed blocks held by running sequences (partial blocks, room for the answer).
        self._private = 0
        #: Blocks evicted since the start.
        self.evicted = 0
        #: Held blocks a flush renamed: dropped, not kept for reuse, once no sequence holds them.
        self._detached: set[bytes] = set()
        self._flushes = 0
        self.observer: CacheObserver | None = None

    @property
    def used(self) -> int:
        """Blocks held by running sequences (what the engines report as KV-cache usage)."""
        return len(self._held) + self._private

    @property
    def cached(self) -> int:
        """Blocks kept for reuse that no sequence holds."""
        return len(self._evictable)

    def usage(self) -> float:
        return self.used / self.total

    def contains(self, block: bytes) -> bool:
        return block in self._held or block in self._evictable

    def held(self, hashes: Sequence[bytes]) -> int:
        """How many of these blocks running sequences hold (another sequence shares them without
        taking room)."""
        return sum(1 for block in hashes if block in self._held)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt are in the cache now (nothing changes)."""
        for n, block in enumerate(hashes):
            if not self.contains(block):
                return n
        return len(hashes)

    def allocate(self, hashes: Sequence[bytes], private: int) -> int | None:
        """Takes a sequence's blocks: its named prompt blocks (reused where cached) and
        ``private`` more. Returns how many leading blocks were already cached, or None (and
        nothing changes) when they do not fit beside the blocks running sequences hold."""
        matched = self.cached_prefix(hashes)
        reused = sum(1 for block in hashes if block in self._evictable)
        fresh = sum(1 for block in hashes if not self.contains(block))
        room = self.total - self.used - reused
        if fresh + private > room:
            return None
        stored: list[tuple[bytes, bytes | None]] = []
        for i, block in enumerate(hashes):
            if block in self._evictable:
                del self._evictable[block]
                self._held[block] = 1
            else:
                if block not in self._held:
                    stored.append((block, hashes[i - 1] if i else None))
                self._held[block] = self._held.get(block, 0) + 1
        self._private += private
        evicted = []
        while self.used + len(self._evictable) > self.total:
            evicted.append(self._evictable.popitem(last=False)[0])
            self.evicted += 1
        if self.observer is not None:
            if evicted:
                self.observer.removed(evicted)
            if stored:
                self.observer.stored(stored)
        return matched

    def release(self, hashes: Sequence[bytes], private: int, completed: Sequence[bytes] = ()) -> None:
        """Gives back a sequence's blocks. ``completed`` names the blocks its answer filled
        (they were private until now): they stay cached too, so that the next turn of a
        conversation finds its whole history."""
        stored: list[tuple[bytes, bytes | None]] = []
        for i in reversed(range(len(completed))):
            if private == 0:
                break
            block = completed[i]
            private -= 1
            self._private -= 1
            if not self.contains(block):
                self._evictable[block] = None
                stored.append((block, completed[i - 1] if i else (hashes[-1] if hashes else None)))
        if stored and self.observer is not None:
            self.observer.stored(stored[::-1])
        self._private -= private
        for block in reversed(hashes):
            holders = self._held.get(block, 0) - 1
            if holders > 0:
                self._held[block] = holders
            elif holders == 0:
                del self._held[block]
                if block in self._detached:
                    self._detached.discard(block)
                else:
                    self._evictable[block] = None

    def clear(self) -> None:
        """Drops every cached block (held ones stay, and stay found)."""
        dropped = list(self._evictable)
        self._evictable.clear()
        if dropped and self.observer is not None:
            self.observer.removed(dropped)

    def flush(self) -> dict[bytes, bytes]:
        """Empties the prefix cache: no later prompt finds any block there now. The blocks
        running sequences hold stay allocated under new names, dropped once released (a real
        engine's running requests keep their KV; it is not found again). Returns the new name of
        each renamed block, for its holders to release it by."""
        self._evictable.clear()
        self._flushes += 1
        tag = b"flushed-%d:" % self._flushes
        renamed = {block: tag + block for block in self._held if block not in self._detached}
        self._held = {renamed.get(block, block): holders for block, holders in self._held.items()}
        self._detached.update(renamed.values())
        if self.observer is not None:
            self.observer.cleared()
        return renamed

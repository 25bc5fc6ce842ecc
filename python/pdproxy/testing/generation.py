"""Deterministic text generation for the mock engine: the same prompt always gives the
same tokens, so tests can compare what the proxy delivered with what the engine sent."""

from __future__ import annotations

import hashlib
import random
from typing import Any

_WORDS = tuple(
    "the quick brown fox jumps over a lazy dog while seven bright stars watch from far away and every "
    "token travels through the proxy exactly once before it reaches its reader so nothing is lost "
    "nothing is repeated and the stream ends cleanly with done".split(" ")
)

#: Token counts of natural (unlimited) answers fall in this range.
NATURAL_LENGTH = (8, 32)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a chat or completions request as one string."""
    if "messages" in body:
        parts = []
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "\n".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt)
    return str(prompt)


def token_id(token: str) -> int:
    """The id of a generated token (its place in the vocabulary)."""
    return _WORDS.index(token.strip())


def count_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


def generate(prompt: str, max_tokens: int | None, ignore_eos: bool = False) -> tuple[list[str], str]:
    """The answer's tokens and its finish reason (``stop`` or ``length``).

    With ``ignore_eos`` (as vLLM, SGLang and LMDeploy accept it) the answer runs to
    ``max_tokens`` whatever its natural length.
    """
    seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    natural = rng.randint(*NATURAL_LENGTH)
    if max_tokens is None:
        length = natural
    elif ignore_eos:
        length = max_tokens
    else:
        length = min(natural, max_tokens)
    tokens = [" " + rng.choice(_WORDS) for _ in range(length)]
    # `length`: cut by max_tokens before the answer's natural end (or with the end ignored).
    stopped_by_limit = max_tokens is not None and (ignore_eos or length < natural)
    return tokens, "length" if stopped_by_limit else "stop"

"""Deterministic text generation for the mock engine: the same prompt always gives the
same tokens, so tests can compare what the proxy delivered with what the engine sent."""

from __future__ import annotations

import hashlib
import random

from pdproxy._json_types import JsonObject, JsonValue

_WORDS = tuple(
    "the quick brown fox jumps over a lazy dog while seven bright stars watch from far away and every "
    "token travels through the proxy exactly once before it reaches its reader so nothing is lost "
    "nothing is repeated and the stream ends cleanly with done".split(" ")
)

#: Token counts of natural (unlimited) answers fall in this range.
NATURAL_LENGTH = (8, 32)


def prompt_text(body: JsonObject) -> str:
    """The prompt of a chat or completions request as one string."""
    if "messages" in body:
        parts = []
        for message in _items(body["messages"]):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(content_texts(content))
        return "\n".join(parts)
    return completion_prompt(body)


def completion_prompt(body: JsonObject) -> str:
    """A completions request's ``prompt`` as one string: several prompts (texts, or token ids
    separated by spaces) one per line."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "\n".join(" ".join(map(str, p)) if isinstance(p, list) else str(p) for p in prompt)
    return str(prompt)


def content_texts(content: list[JsonValue]) -> list[str]:
    """The texts of a message's content parts (OpenAI's ``[{"type": "text", "text": ...}]``)."""
    texts = (part.get("text", "") for part in content if isinstance(part, dict))
    return [text for text in texts if isinstance(text, str)]


def _items(value: JsonValue) -> list[JsonValue]:
    return value if isinstance(value, list) else []


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

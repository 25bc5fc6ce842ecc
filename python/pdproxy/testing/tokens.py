"""The simulated engine's tokenizer and chat template: deterministic, cheap, and prefix-stable.

A token is ``TOKEN_BYTES`` bytes of the rendered prompt (real BPE tokenizers average about four
bytes per token of English text). Cutting at fixed byte offsets keeps the property prefix
caching relies on: a text that extends another tokenizes as the other's tokens followed by
more, so a conversation's next turn shares every full KV block of the previous one.
"""

from __future__ import annotations

import hashlib

from pdproxy._json_types import JsonObject

from .generation import completion_prompt, content_texts

#: Bytes of text per token.
TOKEN_BYTES = 4


def render_prompt(body: JsonObject) -> str:
    """The text the engine computes KV for: chat messages through a template (each message as
    ``<|role|>content<|end|>``, then the assistant's turn opened), or the completions prompt.
    The answer to a chat request extends its prompt, and the next turn's prompt (the answer
    then ``<|end|>`` and the new message) extends the answer."""
    if "messages" in body:
        parts = []
        messages = body["messages"]
        for message in messages if isinstance(messages, list) else []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(content_texts(content))
            parts.append(f"<|{message.get('role', 'user')}|>{content if isinstance(content, str) else ''}<|end|>")
        return "".join(parts) + "<|assistant|>"
    return completion_prompt(body)


def count_tokens(text: str) -> int:
    """Tokens of ``text`` (at least one)."""
    return max(1, -(-len(text.encode()) // TOKEN_BYTES))


def block_hashes(text: str, block_tokens: int) -> list[bytes]:
    """One hash per full KV block of ``text``, each chaining the one before, so that a hash
    names the whole prefix up to its block (as vLLM's and SGLang's prefix caches key blocks)."""
    data = text.encode()
    size = block_tokens * TOKEN_BYTES
    hashes = []
    previous = b""
    for start in range(0, len(data) - size + 1, size):
        previous = hashlib.blake2b(previous + data[start : start + size], digest_size=8).digest()
        hashes.append(previous)
    return hashes

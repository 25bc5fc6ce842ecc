"""The engines' KV-cache events (vLLM, SGLang): decoded (``wire``), followed per engine rank
(``subscriber``), fed to the data plane's KV index (``follower``), whose block token ids are
read with the model's vocabulary (``vocabulary``) and chat prompts rendered as the engines
render them (``chat_template``)."""

from __future__ import annotations

import json

from pdproxy.errors import ConfigError

from .vocabulary import load_vocabulary

__all__ = ["chat_template", "index_options"]

#: The mock engine's token ids: four bytes of text each (``pdproxy.testing.tokens``).
MOCK_TOKEN_BYTES = 4

_TEMPLATES: dict[str, tuple[str, str, str, str, str]] = {
    "role-tags": ("", "<|", "|>", "<|end|>", "<|assistant|>"),
    "chatml": ("", "<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
}


def chat_template(spec: str) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """``--kv-chat-template``: a known name, or a JSON list of the five parts."""
    parts: object = _TEMPLATES.get(spec)
    if parts is None:
        try:
            parts = json.loads(spec)
        except ValueError:
            parts = None
    if not (isinstance(parts, list | tuple) and len(parts) == 5 and all(isinstance(p, str) for p in parts)):
        names = ", ".join(_TEMPLATES)
        raise ConfigError(f"--kv-chat-template must be one of {names} or a JSON list of five strings, got {spec!r}")
    start, before, after, end, generation = (p.encode() for p in parts)
    return start, before, after, end, generation


def index_options(tokenizer: str) -> dict[str, object]:
    """How the index reads token ids: ``--kv-tokenizer``'s vocabulary, or the mock engine's."""
    if tokenizer == "mock":
        return {"token_width": MOCK_TOKEN_BYTES}
    return {"vocabulary": load_vocabulary(tokenizer)}

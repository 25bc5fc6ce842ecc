"""Each token id's bytes, from a model's ``tokenizer.json`` (Hugging Face ``tokenizers``' file,
which vLLM and SGLang load): what the KV index decodes the engines' block token ids with.

Byte-level vocabularies (GPT-2's scheme: Llama 3, Qwen, Mistral's newer tokenizers) spell each
byte as one printable character; SentencePiece ones (``Metaspace``) spell a space ``▁`` and
unknown bytes ``<0xNN>``. Added tokens (``<|im_start|>``...) are their text, as a chat template
writes them. Tokens the tokenizer adds on its own (a beginning-of-sequence token from its
post-processor) are in no prompt's text: they decode to nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from pdproxy.errors import ConfigError

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: character to byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def load_vocabulary(path: str | Path) -> list[bytes]:
    """Each id's bytes (ids nothing names: none), from ``path`` (a ``tokenizer.json``, or the
    model directory holding one)."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the tokenizer {file}: {e}") from None
    return vocabulary_of(spec)


def vocabulary_of(spec: object) -> list[bytes]:
    vocab = _field(_field(spec, "model"), "vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = {str(_items(entry)[0]): i for i, entry in enumerate(vocab) if _items(entry)}
    elif isinstance(vocab, dict):
        pieces = {str(piece): _int(i) for piece, i in vocab.items()}
    else:
        raise ConfigError("the tokenizer has no vocabulary (model.vocab)")
    decode = _piece_decoder(spec)
    added = {
        _int(_field(t, "id")): str(_field(t, "content"))
        for t in _items(_field(spec, "added_tokens"))
        if _field(t, "id") is not None
    }
    size = max([*pieces.values(), *added.keys(), -1]) + 1
    table = [b""] * size
    for piece, i in pieces.items():
        table[i] = decode(piece)
    for i, content in added.items():
        table[i] = content.encode()
    for i in _added_by_post_processor(spec):
        if 0 <= i < size:
            table[i] = b""
    return table


def _piece_decoder(spec: object) -> Callable[[str], bytes]:
    kinds = _decoder_kinds(_field(spec, "decoder"))
    pre = json.dumps(_field(spec, "pre_tokenizer") or {})
    if "ByteLevel" in kinds or '"ByteLevel"' in pre:
        alphabet = byte_level_alphabet()

        def byte_level(piece: str) -> bytes:
            try:
                return bytes(alphabet[c] for c in piece)
            except KeyError:
                return piece.encode()

        return byte_level

    def sentencepiece(piece: str) -> bytes:
        byte = _BYTE_PIECE.match(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    return sentencepiece


def _decoder_kinds(decoder: object) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    kinds = {str(decoder.get("type"))}
    for inner in _items(decoder.get("decoders")):
        kinds |= _decoder_kinds(inner)
    return kinds


def _added_by_post_processor(spec: object) -> set[int]:
    """The ids a ``TemplateProcessing`` post-processor puts around a text on its own."""
    processor = _field(spec, "post_processor")
    processors = _items(_field(processor, "processors")) or [processor]
    out: set[int] = set()
    for p in processors:
        if _field(p, "type") != "TemplateProcessing":
            continue
        tokens = _field(p, "special_tokens")
        for token in tokens.values() if isinstance(tokens, dict) else ():
            out.update(_int(i) for i in _items(_field(token, "ids")))
    return out


# The file is JSON of a foreign shape: these read it without trusting it.


def _field(node: object, name: str) -> object:
    return node.get(name) if isinstance(node, dict) else None


def _items(node: object) -> list[object]:
    return node if isinstance(node, list) else []


def _int(value: object) -> int:
    if isinstance(value, int):
        return value
    raise ConfigError(f"the tokenizer names a token id {value!r} that is not an integer")

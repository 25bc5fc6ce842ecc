"""A tiny Llama for the real-engine tier, made here since no weights can be downloaded: its config
(hidden 256, 2 layers, 4 heads) and a byte-level BPE tokenizer trained on generated text, with a
chat template. vLLM serves it with `--load-format dummy` (random weights: the text is noise, the
protocol is real).

    python scripts/tiny_model.py DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

VOCAB = 4096
#: Words the tokenizer learns from, in generated sentences.
WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not have "
    "model request token stream prefill decode cache node proxy answer question user system "
    "hello world test fleet engine server client route time fast slow one two three four five"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|begin|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(20000), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    config.save_pretrained(out)
    print(f"tiny model in {out}: vocab {len(fast)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Tokenizers: load a checkpoint's `tokenizer.json`, and build a tiny byte-level BPE for the
tiny test checkpoints (a real `tokenizers` model, so that text prompts work end to end)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .errors import CheckpointError

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, MASK_TOKEN)
# the ids a tiny tokenizer's training text had no merges for
RESERVED_TOKEN = "<|reserved_{}|>"

# ChatML, as Qwen checkpoints use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of
tokens and the target model verifies them in one forward pass; accepted tokens are kept,
the first rejected one is replaced by the target's own choice, and the step repeats.
def greedy(logits):
    return int(logits.argmax())
for i in range(10):
    print(i, i * i, "hello world")
Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer: 8.
User: Can you explain what a key-value cache is? Assistant: It stores the keys and values
of earlier positions so that each new token attends to them without recomputing.
"""


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` tokens trained on `texts` (deterministic for
    the same texts). The special tokens come last, after the learned vocabulary, as in Qwen
    tokenizers. Texts too short to learn that many merges leave the vocabulary short: the
    rest is filled with reserved tokens (`<|reserved_N|>`, special, never produced from
    text) before the special tokens, as Qwen and Llama reserve their unused ids."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise CheckpointError(
            f"tokenizer vocab_size {vocab_size} too small: a byte-level BPE needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    short = vocab_size - len(SPECIAL_TOKENS) - tok.get_vocab_size()
    tok.add_special_tokens([RESERVED_TOKEN.format(i) for i in range(short)] + list(SPECIAL_TOKENS))
    return tok


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a fixed built-in text: deterministic, no download."""
    return train_byte_level_bpe([_TRAINING_TEXT] * 4, vocab_size)


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir}: no tokenizer.json; pass token ids (--prompt-ids) instead of text"
        )
    return Tokenizer.from_file(str(path))

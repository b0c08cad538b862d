"""Tokenizers: load a checkpoint's `tokenizer.json`, and build a tiny byte-level BPE for the
tiny test checkpoints (a real `tokenizers` model, so that text prompts work end to end)."""

from __future__ import annotations

import json
import re
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
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot read
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read ({reason})") from None


def _byte_level_bytes() -> dict[str, int]:
    """A byte-level BPE's vocabulary spells each byte as one printable character (the
    printable Latin-1 bytes as themselves, the others as 256, 257, ... in byte order);
    this maps each such character back to its byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: b for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = 256 + extra
    return {chr(c): b for b, c in spelled.items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _word_boundary(decoder) -> str | None:
    """The character a SentencePiece vocabulary writes for a space ("\u2581"), when the
    decoder turns it back into one (a Metaspace decoder, or a Replace in a Sequence)."""
    try:  # the decoder's own JSON, as tokenizer.json holds it
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):  # no decoder, or one that does not say
        return None
    steps = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    for step in steps:
        if step.get("type") == "Metaspace":
            return step.get("replacement")
        if step.get("type") == "Replace" and step.get("content") == " ":
            return step.get("pattern", {}).get("String")
    return None


class TokenBytes:
    """Each token's own bytes, OpenAI's logprobs `bytes`, which a client joins to rebuild a
    character split over tokens: for a byte-level BPE's learned token the bytes its
    vocabulary entry spells, for a byte-fallback token (`<0xC3>`) its byte, for a
    SentencePiece token its text with its word-boundary mark as a space, otherwise (an added
    token, another model) the UTF-8 of the token decoded alone. Cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _byte_level_bytes() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
        self.boundary = None if self.byte_level else _word_boundary(tokenizer.decoder)
        self.added = set(tokenizer.get_added_tokens_decoder())
        self.cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        found = self.cache.get(token)
        if found is None:
            found = self.cache[token] = self._bytes(token)
        return found

    def _bytes(self, token: int) -> bytes:
        spelled = self.tokenizer.id_to_token(token)
        if spelled is not None and token not in self.added:
            if self.byte_level is not None and all(c in self.byte_level for c in spelled):
                return bytes(self.byte_level[c] for c in spelled)
            fallback = _BYTE_FALLBACK.fullmatch(spelled)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if self.boundary:
                return spelled.replace(self.boundary, " ").encode()
        return self.tokenizer.decode([token]).encode()

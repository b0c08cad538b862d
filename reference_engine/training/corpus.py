"""The demo corpus: the Python source files of the running interpreter's standard library,
split by file into train and held-out sets with a fixed rule, and a byte-level BPE
tokenizer trained on the train files."""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..tokenizer import EOS_TOKEN, train_byte_level_bpe

HELDOUT_MODULUS = 10  # a file is held out when crc32(its relative path) % 10 == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """The split rule: by file, from the path alone, so it is the same on every machine."""
    return zlib.crc32(relative_path.encode()) % HELDOUT_MODULUS == 0


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[str, ...]  # relative paths, sorted
    heldout: tuple[str, ...]

    @classmethod
    def from_stdlib(cls, max_files: int | None = None) -> Corpus:
        """Every `.py` file under the stdlib folder (third-party site-packages excluded).
        `max_files` keeps the first files in path order (smoke runs)."""
        root = stdlib_root()
        paths = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*.py")
            if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
        )
        if max_files is not None:
            paths = paths[:max_files]
        train = tuple(p for p in paths if not is_heldout(p))
        heldout = tuple(p for p in paths if is_heldout(p))
        if not train or not heldout:
            raise ValueError(f"{root}: too few Python files for a train/held-out split")
        return cls(root, train, heldout)

    def text(self, relative_path: str) -> str:
        return (self.root / relative_path).read_bytes().decode("utf-8", errors="replace")

    def texts(self, paths: tuple[str, ...]) -> list[str]:
        return [self.text(p) for p in paths]


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int) -> Tokenizer:
    """BPE over the first `max_chars` characters of the train texts, in file order."""
    budget, sample = max_chars, []
    for text in texts:
        if budget <= 0:
            break
        sample.append(text[:budget])
        budget -= len(sample[-1])
    return train_byte_level_bpe(sample, vocab_size)


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts encoded and joined, each followed by the end-of-text token. [n_tokens]"""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, count: int, length: int,
                   generator: torch.Generator) -> torch.Tensor:
    """`count` windows of `length` tokens at random offsets. [count, length]"""
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])

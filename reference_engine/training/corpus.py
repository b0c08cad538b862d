"""The demo corpus: the Python source files of a pinned list of pure-Python wheels from PyPI,
split by package into train and held-out sets, and a byte-level BPE tokenizer trained on the
train files.

`corpus.lock.json` (beside this file) names every wheel by version, URL and sha256, and says
which packages are held out. `fetch` downloads the wheels into a cache folder and checks
their hashes, so the same corpus is rebuilt on any machine; a machine without internet gets
the cache folder copied from one that has it. `pin` writes a new lock (the newest stable
pure-Python wheel of each package uploaded before a cut-off date):

    python -m reference_engine.training.corpus --cutoff 2026-11-01 --heldout requests,rich \
        --out LOCK requests rich urllib3 ...

Vendored copies of other packages (`_vendor/`, `extern/`...) are left out, so a held-out
package cannot reach the train set inside another one.
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..errors import ReferenceEngineError
from ..tokenizer import EOS_TOKEN, train_byte_level_bpe

LOCK = Path(__file__).resolve().parent / "corpus.lock.json"
SIMPLE_INDEX = "https://pypi.org/simple"
VENDORED = frozenset({"_vendor", "vendor", "_vendored", "vendored", "extern", "_extern"})


class CorpusError(ReferenceEngineError):
    """A corpus that cannot be fetched, checked or read."""


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    url: str
    sha256: str
    size: int
    heldout: bool


def read_lock(path: Path = LOCK) -> list[Wheel]:
    try:
        data = json.loads(Path(path).read_text())
        return [Wheel(**row) for row in data["wheels"]]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path}: not a corpus lock ({exc})") from exc


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(wheels: list[Wheel], cache: Path, log: Callable[[str], None] = print) -> None:
    """Every wheel of the lock in `cache`, with its pinned sha256: present ones are checked,
    missing ones downloaded (from the lock's URL) and checked before they are kept."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [w for w in wheels if not (cache / w.filename).exists()]
    total = sum(w.size for w in missing)
    done = 0
    for i, wheel in enumerate(missing, 1):
        part = cache / (wheel.filename + ".part")
        try:
            with urllib.request.urlopen(wheel.url, timeout=120) as response, open(part, "wb") as f:
                while block := response.read(1 << 20):
                    f.write(block)
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise CorpusError(
                f"cannot download {wheel.url}: {exc}; copy a filled corpus "
                f"cache to {cache} on a machine without internet"
            ) from exc
        if sha256_of(part) != wheel.sha256:
            part.unlink()
            raise CorpusError(f"{wheel.filename}: sha256 differs from the lock")
        part.rename(cache / wheel.filename)
        done += wheel.size
        log(
            f"corpus: fetched {i}/{len(missing)} {wheel.filename} "
            f"({done / 2**20:.1f} of {total / 2**20:.1f} MiB)"
        )
    for wheel in wheels:
        if wheel not in missing and sha256_of(cache / wheel.filename) != wheel.sha256:
            raise CorpusError(
                f"{cache / wheel.filename}: sha256 differs from the lock (delete it to download it again)"
            )


def source_members(archive: zipfile.ZipFile) -> list[str]:
    """The wheel's `.py` files, vendored copies of other packages left out, in name order."""
    return sorted(
        name
        for name in archive.namelist()
        if name.endswith(".py")
        and not VENDORED & set(name.split("/")[:-1])
        and archive.getinfo(name).file_size > 0
    )


@dataclass(frozen=True)
class Corpus:
    root: Path  # the wheel cache
    train: tuple[str, ...]  # "wheel filename:member path", sorted
    heldout: tuple[str, ...]

    @classmethod
    def from_lock(
        cls, cache: Path, lock: Path = LOCK, max_files: int | None = None, log: Callable[[str], None] = print
    ) -> Corpus:
        """The locked wheels (fetched into `cache` when missing). `max_files` keeps the first
        files of each split in order (smoke runs)."""
        wheels = read_lock(lock)
        fetch(wheels, cache, log)
        train, heldout = [], []
        for wheel in wheels:
            with zipfile.ZipFile(cache / wheel.filename) as archive:
                names = [f"{wheel.filename}:{m}" for m in source_members(archive)]
            (heldout if wheel.heldout else train).extend(names)
        if max_files is not None:
            train, heldout = train[:max_files], heldout[: max(1, max_files // 8)]
        if not train or not heldout:
            raise CorpusError(f"{lock}: too few Python files for a train/held-out split")
        return cls(Path(cache), tuple(sorted(train)), tuple(sorted(heldout)))

    def text(self, path: str) -> str:
        filename, member = path.split(":", 1)
        with zipfile.ZipFile(self.root / filename) as archive:
            return archive.read(member).decode("utf-8", errors="replace")

    def texts(self, paths: tuple[str, ...]) -> list[str]:
        by_wheel: dict[str, list[str]] = {}
        for path in paths:
            filename, member = path.split(":", 1)
            by_wheel.setdefault(filename, []).append(member)
        read: dict[str, str] = {}
        for filename, members in by_wheel.items():
            with zipfile.ZipFile(self.root / filename) as archive:
                for member in members:
                    read[f"{filename}:{member}"] = archive.read(member).decode("utf-8", errors="replace")
        return [read[p] for p in paths]


def pin(
    names: list[str], heldout: set[str], cutoff: str, out: Path = LOCK, index: str = SIMPLE_INDEX
) -> None:
    """Write a lock: per package, the newest final release uploaded before `cutoff`
    (ISO date) that has a pure-Python (`py3-none-any`) wheel."""
    from packaging.utils import parse_wheel_filename  # a development tool, not a runtime need

    rows = []
    for name in names:
        request = urllib.request.Request(
            f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        best = None
        for f in files:
            if not f["filename"].endswith(".whl") or f.get("yanked") or f["upload-time"] >= cutoff:
                continue
            _, version, _, tags = parse_wheel_filename(f["filename"])
            if (
                version.is_prerelease
                or version.is_devrelease
                or not any(
                    t.interpreter.startswith("py3") and t.abi == "none" and t.platform == "any" for t in tags
                )
            ):
                continue
            if best is None or version > best[0]:
                best = (version, f)
        if best is None:
            raise CorpusError(f"{name}: no pure-Python wheel before {cutoff}")
        version, f = best
        rows.append(
            {
                "name": name,
                "version": str(version),
                "filename": f["filename"],
                "url": f["url"],
                "sha256": f["hashes"]["sha256"],
                "size": f["size"],
                "heldout": name in heldout,
            }
        )
        print(f"{name} {version} {f['size'] / 2**20:.1f} MiB", file=sys.stderr)
    out.write_text(json.dumps({"cutoff": cutoff, "index": index, "wheels": rows}, indent=1) + "\n")


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int) -> Tokenizer:
    """BPE over about `max_chars` characters of the train texts: files at an even stride
    through the (sorted) train set, so every part of the corpus is seen."""
    stride = max(1, sum(map(len, texts)) // max_chars)
    budget, sample = max_chars, []
    for text in texts[::stride] + texts:
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


def random_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`count` windows of `length` tokens at random offsets. [count, length]

    Starts are drawn from [0, len(stream) - length), so the window ending at the stream's last
    token is never drawn: these are the draws the shipped demo pair was trained with (and that
    `--from-pair` repeats), kept as they are. A stream of `length` tokens or fewer is refused."""
    if len(stream) <= length:
        raise CorpusError(f"a token stream of {len(stream)} tokens is too short for windows of {length}")
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ..errors import exit_with

    p = argparse.ArgumentParser(
        prog="python -m reference_engine.training.corpus",
        description="Pin a corpus lock from PyPI's simple index.",
    )
    p.add_argument("names", nargs="+", help="package names")
    p.add_argument("--cutoff", required=True, help="ISO date: only uploads before it")
    p.add_argument("--heldout", default="", help="comma-separated packages to hold out")
    p.add_argument("--out", type=Path, default=LOCK, help=f"lock to write (default {LOCK})")
    p.add_argument("--index", default=SIMPLE_INDEX)
    ns = p.parse_args(argv)
    try:
        pin(ns.names, set(filter(None, ns.heldout.split(","))), ns.cutoff, ns.out, ns.index)
    except (ValueError, OSError) as exc:
        return exit_with(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Workloads: synthetic prompts, JSONL datasets, built-in prompt sets; arrival processes.

Everything is seeded, so two runs send the same prompts in the same order.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None  # per-prompt output length, when the dataset gives one


class WorkloadError(ValueError):
    pass


_WORDS = ("the model drafts a block of tokens and the target verifies them in one pass "
          "accepted tokens stay rejected ones are replaced by the target choice").split()


def synthetic(num: int, input_len: int, seed: int, as_text: bool = False,
              vocab_size: int = 400) -> list[Prompt]:
    """`num` prompts of `input_len` random token ids (or about that many words of text)."""
    if num <= 0 or input_len <= 0:
        raise WorkloadError(f"synthetic workload needs num and input_len > 0, got {num}, {input_len}")
    rng = random.Random(seed)
    if as_text:
        return [Prompt(text=" ".join(rng.choice(_WORDS) for _ in range(input_len)))
                for _ in range(num)]
    return [Prompt(token_ids=tuple(rng.randrange(1, vocab_size) for _ in range(input_len)))
            for _ in range(num)]


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Rows with `prompt` (text) or `messages` (chat), optionally `max_tokens` /
    `output_len`: the custom-dataset format of vLLM's and SGLang's benchmark clients."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"dataset {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{n}: not valid JSON ({exc})") from None
        max_tokens = row.get("max_tokens", row.get("output_len"))
        if isinstance(row.get("prompt"), str):
            prompts.append(Prompt(text=row["prompt"], max_tokens=max_tokens))
        elif isinstance(row.get("messages"), list):
            prompts.append(Prompt(messages=tuple(row["messages"]), max_tokens=max_tokens))
        else:
            raise WorkloadError(f"{path}:{n}: needs a 'prompt' string or a 'messages' list")
    if not prompts:
        raise WorkloadError(f"{path}: no prompts")
    return prompts


BUILTIN_DIR = Path(__file__).parent / "prompts"


def builtin(name: str) -> list[Prompt]:
    """Built-in prompt sets shipped with the package: code, math, chat (and mixed)."""
    names = sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))
    if name == "mixed":
        return [p for n in names for p in load_jsonl(BUILTIN_DIR / f"{n}.jsonl")]
    if name not in names:
        raise WorkloadError(f"unknown built-in prompt set '{name}', expected one of "
                            f"{', '.join(names + ['mixed'])}")
    return load_jsonl(BUILTIN_DIR / f"{name}.jsonl")


def take(prompts: list[Prompt], num: int, seed: int) -> list[Prompt]:
    """`num` prompts in a seeded order, cycling when the set is smaller."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(num)]


async def arrivals(count: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..count-1 at arrival times: all at once when rate is inf; otherwise gaps
    drawn from a gamma distribution with mean 1/rate and shape `burstiness` (1 = Poisson)."""
    rng = random.Random(seed)
    for i in range(count):
        yield i
        if math.isfinite(rate) and i + 1 < count:
            gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
            await asyncio.sleep(gap)

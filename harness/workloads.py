"""Workloads: synthetic prompts, JSONL datasets, built-in prompt sets; arrival processes.

`mixed_long` mixes long prompts among short ones, each tagged with its group, so that a run
reports TTFT and ITL of the short requests beside a long prefill apart from the long ones'.
Everything is seeded, so two runs send the same prompts in the same order. A prompt read
from a file or a built-in set knows its source (`FILE:LINE`, `builtin:SET#INDEX`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None  # per-prompt output length, when the dataset gives one
    source: str | None = field(default=None, compare=False)  # where it was read
    group: str | None = field(default=None, compare=False)  # one of GROUPS, metrics per group


class WorkloadError(ValueError):
    pass


_WORDS = (
    "the model drafts a block of tokens and the target verifies them in one pass "
    "accepted tokens stay rejected ones are replaced by the target choice"
).split()


def synthetic(
    num: int, input_len: int, seed: int, as_text: bool = False, vocab_size: int = 400
) -> list[Prompt]:
    """`num` prompts of `input_len` random token ids (or about that many words of text)."""
    if num <= 0 or input_len <= 0:
        raise WorkloadError(f"synthetic workload needs num and input_len > 0, got {num}, {input_len}")
    rng = random.Random(seed)
    if as_text:
        return [Prompt(text=" ".join(rng.choice(_WORDS) for _ in range(input_len))) for _ in range(num)]
    return [
        Prompt(token_ids=tuple(rng.randrange(1, vocab_size) for _ in range(input_len))) for _ in range(num)
    ]


GROUPS = ("short", "long")  # the groups of a mixed_long workload


def mixed_long(
    num: int,
    input_len: int,
    long_input_len: int,
    long_share: float,
    seed: int,
    as_text: bool = False,
    vocab_size: int = 400,
) -> list[Prompt]:
    """`num` synthetic prompts of `input_len` tokens (group `short`) with a share `long_share` of
    `long_input_len` tokens (group `long`), spread evenly: prompt i is long when the running
    count floor(i x share) steps up, so every window of 1 / share prompts holds one long one."""
    if not 0 < long_share < 1:
        raise WorkloadError(f"long_share must be in (0, 1), got {long_share}")
    if long_input_len <= input_len:
        raise WorkloadError(
            f"long prompts ({long_input_len} tokens) must be longer than short ones ({input_len})"
        )
    short = synthetic(num, input_len, seed, as_text, vocab_size)
    long = synthetic(num, long_input_len, seed + 1, as_text, vocab_size)
    return [
        replace(long[i], group="long")
        if math.floor((i + 1) * long_share) > math.floor(i * long_share)
        else replace(short[i], group="short")
        for i in range(num)
    ]


def row_max_tokens(row: dict, source: str) -> int | None:
    """A dataset row's output length: `max_tokens`, else `output_len` (a null is left out), a
    positive integer; None when it gives neither."""
    for name in ("max_tokens", "output_len"):
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkloadError(f"{source}: '{name}' must be a positive integer, got {value!r}")
        return value
    return None


def jsonl_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """The JSON objects of a JSON-lines file, each with its `path:line`; blank lines are
    skipped and anything else that is not an object is a WorkloadError naming its line."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"dataset {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise WorkloadError(f"{path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    # rows end at a line feed only: str.splitlines would also cut a row at U+2028, U+2029 or
    # U+0085, which JSON carries raw inside a string
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{n}: not valid JSON ({exc})") from None
        source = f"{path}:{n}"
        if not isinstance(row, dict):
            raise WorkloadError(f"{source}: a JSON object per line, got {type(row).__name__}")
        yield source, row


def is_token_ids(value) -> bool:
    """A non-empty list of token ids: integers (not bools) from 0 below 2**31."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)
    )


def prompt_from_row(row: dict, source: str) -> Prompt:
    """One dataset row as a prompt: `prompt` (text or token ids) or chat `messages`."""
    max_tokens = row_max_tokens(row, source)
    if isinstance(row.get("prompt"), str):
        return Prompt(text=row["prompt"], max_tokens=max_tokens, source=source)
    if is_token_ids(row.get("prompt")):
        return Prompt(token_ids=tuple(row["prompt"]), max_tokens=max_tokens, source=source)
    if isinstance(row.get("messages"), list):
        bad = [m for m in row["messages"] if not _is_message(m)]
        if bad:  # an empty list is a prompt the comparison counts unusable
            raise WorkloadError(
                f"{source}: 'messages' must be a list of message objects with a string 'role', "
                f"got {bad[0]!r:.80}"
            )
        return Prompt(messages=tuple(row["messages"]), max_tokens=max_tokens, source=source)
    raise WorkloadError(
        f"{source}: needs a 'prompt' string or a non-empty list of token ids (integers "
        "from 0), or a 'messages' list"
    )


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Rows with `prompt` (text, or a list of token ids: the OpenAI API's other prompt form)
    or `messages` (chat), optionally `max_tokens` / `output_len`: the custom-dataset format of
    vLLM's and SGLang's benchmark clients."""
    prompts = [prompt_from_row(row, source) for source, row in jsonl_rows(path)]
    if not prompts:
        raise WorkloadError(f"{path}: no prompts")
    return prompts


def _is_message(entry) -> bool:
    """A chat message as the OpenAI API takes it: an object with a string role."""
    return isinstance(entry, dict) and isinstance(entry.get("role"), str)


BUILTIN_DIR = Path(__file__).parent / "prompts"


def builtin(name: str) -> list[Prompt]:
    """Built-in prompt sets shipped with the package: code, math, chat (and mixed), and the
    HTTP gate's `gate` set (`gate:128,512`: only the prompts of those context lengths)."""
    if name == "gate" or name.startswith("gate:"):
        sizes = GATE_CONTEXTS
        if name != "gate":
            try:
                sizes = tuple(int(s) for s in name[5:].split(","))
            except ValueError:
                sizes = ()
            if not sizes or set(sizes) - set(GATE_CONTEXTS):
                raise WorkloadError(
                    f"built-in set '{name}': expected gate:SIZES with sizes "
                    f"from {', '.join(map(str, GATE_CONTEXTS))}"
                )
        return gate_prompts(sizes)
    names = sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))
    if name not in names + ["mixed"]:
        raise WorkloadError(
            f"unknown built-in prompt set '{name}', expected one of "
            f"{', '.join(names + ['mixed', 'gate', 'gate:128,512'])}"
        )
    return [
        replace(p, source=f"builtin:{n}#{i}")
        for n in (names if name == "mixed" else [name])
        for i, p in enumerate(load_jsonl(BUILTIN_DIR / f"{n}.jsonl"))
    ]


# the HTTP gate's set: prompts of about these many tokens, this many of each
GATE_CONTEXTS = (128, 512, 4096)
GATE_COUNTS = {128: 12, 512: 12, 4096: 4}
TOKENS_PER_WORD = 1.3  # English prose under a typical BPE vocabulary (Qwen, Llama 3)

_SUBJECTS = (
    "the engine",
    "a draft model",
    "the target model",
    "each request",
    "the scheduler",
    "a kernel",
    "the cache",
    "the server",
    "every block",
    "the client",
    "a reviewer",
    "the benchmark",
)
_VERBS = (
    "reads",
    "writes",
    "checks",
    "keeps",
    "drops",
    "sends",
    "counts",
    "holds",
    "builds",
    "moves",
    "compares",
    "repeats",
)
_OBJECTS = (
    "the next token",
    "a block of tokens",
    "the key-value cache",
    "one batch",
    "the prompt",
    "its own state",
    "the logits",
    "a short answer",
    "the first chunk",
    "every position",
    "the accepted prefix",
    "a list of numbers",
)
_TAILS = (
    "before the step ends",
    "in one pass",
    "at the same time",
    "without a copy",
    "when the batch is full",
    "after the verify",
    "for every row",
    "in a fixed order",
    "while the queue grows",
    "once per second",
)
_QUESTIONS = (
    "What does the passage say the scheduler does?",
    "Which part of the passage mentions the cache?",
    "Summarise the passage in one sentence.",
    "What is the last thing the passage says?",
)


def gate_prompts(sizes: tuple[int, ...] = GATE_CONTEXTS) -> list[Prompt]:
    """Prompts of about 128, 512 and 4096 tokens (a passage of seeded sentences and one
    question), interleaved so that a batch mixes lengths; the same text on every machine.
    Sources are `builtin:gate#N`, numbered over the whole set, so a subset keeps them."""
    order = [
        (size, k) for k in range(max(GATE_COUNTS.values())) for size in GATE_CONTEXTS if k < GATE_COUNTS[size]
    ]
    prompts = []
    for n, (size, k) in enumerate(order):
        if size not in sizes:
            continue
        rng = random.Random(f"gate-{size}-{k}")
        words, sentences = 0, []
        while words < size / TOKENS_PER_WORD - 16:
            sentence = " ".join(rng.choice(part) for part in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS))
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
            words += len(sentence.split())
        text = (
            f"Passage {n + 1}:\n"
            + " ".join(sentences)
            + "\n\nQuestion: "
            + rng.choice(_QUESTIONS)
            + "\nAnswer:"
        )
        prompts.append(Prompt(text=text, source=f"builtin:gate#{n}"))
    return prompts


def take(prompts: list[Prompt], num: int, seed: int) -> list[Prompt]:
    """`num` prompts in a seeded order, cycling when the set is smaller."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(num)]


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each of `count` requests is due, in seconds from the start: all at 0 when rate is
    inf; otherwise gaps drawn from a gamma distribution with mean 1/rate and shape
    `burstiness` (1 = Poisson)."""
    if not math.isfinite(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(count):
        times.append(t)
        if i + 1 < count:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


async def arrivals(count: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..count-1 at their `arrival_times`. Each waits for its own due time on the
    clock, so a late wake-up (a busy machine) does not push every later arrival back."""
    start = time.perf_counter()
    for i, due in enumerate(arrival_times(count, rate, burstiness, seed)):
        wait = start + due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i

"""A soak: a DFlash engine under arrivals and departures for a while, every finished output
checked against plain greedy decode.

    python -m reference_engine.bench.soak [--model DIR --draft DIR | --random-shape NAME]
        [--concurrency 32] [--duration 600] [--out soak.json]

Requests arrive in bursts of random size whenever slots are free, so the running batch (and
with it the CUDA graphs' bucket and the verify widths) keeps changing; they ask for 8 to
`--max-tokens` greedy tokens (EOS ignored), and a share of them (`--abort-share`) is aborted
mid-flight, so slots and state are handed over in every phase. After `--duration` seconds
(or `--requests` requests) no request arrives and the running ones finish. Then one plain
engine (same device, numerics and batching) decodes every finished request's prompt, and
each speculative output must equal it: in the exact numerics a plain engine's batched output
is each prompt's plain greedy output alone, so one batched run is the reference. Any
exception in a step ends the soak as an error. The plain engine decodes each distinct prompt
once, for the most tokens any request of it asked for (a greedy output of n tokens begins the
longer one), which keeps the check short after a long soak. The summary (JSON, `--out`)
counts steps, requests, aborts, errors, mismatches (the first differing position of each),
the batch sizes and verify widths seen, and tokens per second; the exit status is 0 only
with no error and no mismatch.

Without --model or --random-shape: the shipped demo pair (reference_engine/assets/demo) on
its held-out prompts. A random shape's draft is random, so its proposals are rarely
accepted: the soak then exercises the verify and commit at every width the engine chooses,
not acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..checkpoint import load_draft, load_target, parse_dtype
from ..demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from ..engine_args import add_engine_options, resolve_device, resolve_dtype
from ..errors import ReferenceEngineError, exit_with
from ..runtime.engine import Engine, EngineConfig
from ..runtime.request import SamplingParams
from .shapes import TARGET_SHAPES, random_pair

PROGRESS_EVERY_S = 10.0
SHORTEST = 8  # the fewest tokens a random prompt has and a request asks for
Finished = tuple[list[int], int, list[int]]  # a finished request's prompt, max_tokens and output


@dataclass
class Soak:
    steps: int = 0
    arrived: int = 0
    aborted: int = 0
    finished: dict[str, tuple[list[int], int, list[int]]] = field(
        default_factory=dict
    )  # id -> prompt, n, out
    errors: list[str] = field(default_factory=list)
    batch_sizes: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    output_tokens: int = 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reference_engine.bench.soak", description=__doc__.split("\n\n")[0]
    )
    add_engine_options(p, "model", "draft", "block_size", "commit_strategy", "dtype", "device")
    p.add_argument(
        "--random-shape", choices=sorted(TARGET_SHAPES), help="random-weight target and draft of a real shape"
    )
    p.add_argument("--concurrency", type=int, default=32, help="slots: requests decoded at once")
    p.add_argument("--duration", type=float, default=600.0, help="seconds during which requests arrive")
    p.add_argument("--requests", type=int, default=None, help="stop arrivals after this many requests too")
    p.add_argument(
        "--max-tokens", type=int, default=256, help="the most output tokens a request asks for (at least 8)"
    )
    p.add_argument(
        "--prompt-len", type=int, default=256, help="a random shape's longest random prompt (at least 8)"
    )
    p.add_argument("--abort-share", type=float, default=0.1, help="share of requests aborted mid-flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON summary")
    add_engine_options(p, "numerics", "enforce_eager", "verify_width", "gpu_memory_utilization")
    return p


def load(args: argparse.Namespace):
    """The target, its draft and the prompt pool (token ids)."""
    device = resolve_device(args.device)
    rng = random.Random(args.seed)
    if args.random_shape:
        dtype = parse_dtype(
            ("bfloat16" if device.type == "cuda" else "float32") if args.dtype == "auto" else args.dtype
        )
        block = args.block_size or 16
        target, draft = random_pair(args.random_shape, str(device), dtype, args.seed, block)
        pool = random_prompts(rng, target.config.vocab_size, args.prompt_len)
        return target, draft, pool
    model = args.model or str(DEMO_TARGET)
    draft_dir = args.draft or (str(DEMO_DRAFT) if args.model is None else None)
    if draft_dir is None:
        raise ReferenceEngineError("--model needs --draft: a soak runs DFlash against plain greedy")
    target = load_target(model, dtype=resolve_dtype(args.dtype, model, device), device=device)
    draft = load_draft(draft_dir, target)
    if args.model is None:
        pool = [row["prompt_ids"] for row in demo_prompts()]
    else:
        pool = random_prompts(rng, target.config.vocab_size, args.prompt_len)
    return target, draft, pool


def engine_config(args: argparse.Namespace, context: int, speculative: bool) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.concurrency,
        max_model_len=context,
        block_size=args.block_size if speculative else None,
        commit_strategy=args.commit_strategy,
        numerics=args.numerics,
        enforce_eager=args.enforce_eager,
        verify_width=args.verify_width,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def run(engine: Engine, pool: list[list[int]], args: argparse.Namespace) -> Soak:
    """Arrivals, aborts and finishes for `args.duration` seconds, then the running requests
    finish; returns what happened."""
    rng = random.Random(args.seed + 1)
    soak, sizes = Soak(), Counter()
    wanted: dict[str, tuple[list[int], int]] = {}
    start = last = time.monotonic()
    numbers = iter(range(10**9))
    while True:
        now = time.monotonic()
        arriving = now - start < args.duration and (args.requests is None or soak.arrived < args.requests)
        if not arriving and not engine.has_unfinished():
            break
        scheduler = engine.scheduler
        free = len(scheduler.free_slots) - len(scheduler.waiting)
        if arriving and free > 0:
            burst = rng.randint(0, free)  # the batch size keeps moving
            if args.requests is not None:
                burst = min(burst, args.requests - soak.arrived)
            for _ in range(burst):
                rid = f"s{next(numbers)}"
                prompt, n = list(rng.choice(pool)), rng.randint(SHORTEST, args.max_tokens)
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
                wanted[rid] = (prompt, n)
                soak.arrived += 1
        running = [s.request_id for s in scheduler.active.values()]
        if running and rng.random() < args.abort_share * len(running) / max(args.max_tokens / 4, 1):
            victim = rng.choice(running)
            engine.abort(victim)
            wanted.pop(victim)
            soak.aborted += 1
        sizes[len(scheduler.active)] += 1
        try:
            engine.step()
        except Exception:  # the soak's verdict: any step that raises
            soak.errors.append(traceback.format_exc(limit=8))
            break
        soak.steps += 1
        for rid in [r for r in wanted if r in scheduler.finished]:
            out = engine.collect(rid).output_ids
            prompt, n = wanted.pop(rid)
            soak.finished[rid] = (prompt, n, out)
            soak.output_tokens += len(out)
        if now - last >= PROGRESS_EVERY_S:
            last = now
            print(
                f"soak: {now - start:.0f} s, {soak.steps} steps, {soak.arrived} arrived, "
                f"{len(soak.finished)} finished, {soak.aborted} aborted",
                file=sys.stderr,
                flush=True,
            )
    soak.seconds = time.monotonic() - start
    soak.batch_sizes = sizes
    return soak


def plain_reference(
    engine: Engine, finished: dict[str, tuple[list[int], int, list[int]]]
) -> dict[str, list[int]]:
    """Every finished request's plain greedy output, by a plain engine that decodes each
    distinct prompt once, as many at once as it has slots, for the most tokens any request
    of that prompt asked for: greedy decoding with EOS ignored gives n tokens that begin the
    longer output, so each request's reference is its first n."""
    longest: dict[tuple[int, ...], int] = {}
    for prompt, n, _ in finished.values():
        key = tuple(prompt)
        longest[key] = max(n, longest.get(key, 0))
    ids = {key: f"ref-{i}" for i, key in enumerate(longest)}
    for key, n in longest.items():
        engine.add_request(ids[key], list(key), SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    outputs = {key: engine.collect(rid).output_ids for key, rid in ids.items()}
    return {rid: outputs[tuple(prompt)][:n] for rid, (prompt, n, _) in finished.items()}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary(soak: Soak, reference: dict[str, list[int]], engine: Engine) -> dict:
    mismatches = {
        rid: first_difference(out, reference[rid])
        for rid, (_, _, out) in soak.finished.items()
        if out != reference[rid]
    }
    return {
        "device": str(engine.device),
        "cuda_graphs": engine.runner.captured,
        "numerics": engine.numerics,
        "concurrency": engine.config.max_num_seqs,
        "seconds": soak.seconds,
        "steps": soak.steps,
        "arrived": soak.arrived,
        "finished": len(soak.finished),
        "aborted": soak.aborted,
        "errors": soak.errors,
        "mismatches": mismatches,
        "output_tokens": soak.output_tokens,  # of the finished requests
        "output_tokens_per_s": soak.output_tokens / soak.seconds if soak.seconds else 0.0,
        "batch_sizes": dict(sorted(soak.batch_sizes.items())),
        "verify_widths": engine.stats().get("verify_widths", {}),
        "mean_acceptance_length": engine.stats()["spec"]["mean_acceptance_length"],
    }


def random_prompts(rng: random.Random, vocab: int, longest: int) -> list[list[int]]:
    """256 prompts of random ids, each SHORTEST to `longest` tokens."""
    return [[rng.randrange(vocab) for _ in range(rng.randint(SHORTEST, longest))] for _ in range(256)]


def check_args(args: argparse.Namespace) -> None:
    """Refuse a soak that would check nothing or not what was named."""
    for flag, value in (("--max-tokens", args.max_tokens), ("--prompt-len", args.prompt_len)):
        if value < SHORTEST:
            raise ReferenceEngineError(f"{flag} must be at least {SHORTEST}, got {value}")
    if args.random_shape and (args.model or args.draft):
        raise ReferenceEngineError(
            "--random-shape makes its own target and draft: give it without --model or --draft"
        )
    if args.concurrency < 1:
        raise ReferenceEngineError(f"--concurrency must be at least 1, got {args.concurrency}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise ReferenceEngineError(f"--duration must be a finite number of seconds > 0, got {args.duration}")
    if args.requests is not None and args.requests < 1:
        raise ReferenceEngineError(f"--requests must be at least 1, got {args.requests}")
    if not 0.0 <= args.abort_share <= 1.0:
        raise ReferenceEngineError(f"--abort-share must be in [0, 1], got {args.abort_share}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_args(args)
        target, draft, pool = load(args)
        context = max(map(len, pool)) + args.max_tokens
        engine = Engine(target, draft, engine_config(args, context, True))
        plain = Engine(target, None, engine_config(args, context, False))
    except ReferenceEngineError as exc:
        return exit_with(exc)
    with torch.inference_mode():
        soak = run(engine, pool, args)
        result = summary(soak, plain_reference(plain, soak.finished), engine)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    ok = not result["errors"] and not result["mismatches"]
    print(
        f"soak {'PASS' if ok else 'FAIL'}: {result['finished']} finished, {result['aborted']} aborted, "
        f"{len(result['errors'])} errors, {len(result['mismatches'])} mismatches over {soak.seconds:.0f} s",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

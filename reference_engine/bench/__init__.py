"""Engine-level benchmark: plain decode vs DFlash on one checkpoint pair, per concurrency.

    python scripts/bench_engine.py [--model DIR --draft DIR | --random-shape qwen3-8b
        [--draft-arch dflash,dflash2]] [--prompts FILE.jsonl] [--oracle-acceptance X]
        [--concurrency 1,4,8,16] [--modes plain,dflash] [--profile-capture] [--out FILE.csv] ...

Without --model or --random-shape: the shipped demo pair (reference_engine/assets/demo)
on its held-out prompts. For each concurrency c the engine gets `--num-prompts` requests
(default c) of `--input-len` random prompt tokens (or the rows of `--prompts`, in order,
cycled) and `--output-len` output tokens (EOS ignored), all
queued at once, with c slots. Each mode (and numerics) has one engine per concurrency,
built (CUDA graphs captured) before its warm-up run and reused for its measured runs, as a
server keeps one. Plain and DFlash runs alternate, `--repeats` times each
after one warm-up pair; the table and CSV give medians over the repeats, each with its spread
(`<column>_min`, `<column>_max`; printed as `median (min-max)`), and a warning names every
printed figure whose repeats disagree by more than 10% of the median. `--modes dflash`
(or `plain`) measures one mode only; with --oracle-acceptance the continuations then come
from the unmeasured plain warm-up run over the same prompts. With --random-shape,
`--draft-arch dflash,dflash2` measures a draft of each architecture on the one target, each
on its own engines, interleaved with plain as several numerics are; each row names its
`draft`, and two more tables set the DFlash2 step against the DFlash step and give the
share of the DFlash2 draft phase its convolution and selector take (bench/drafts.py).

Columns: output_tokens_per_s = all output tokens / wall time of the run (prefill
included); mean_acceptance_length = committed tokens per DFlash step, bonus included;
ms_<phase> = milliseconds spent in that phase over the whole run (CUDA-event time on a
GPU, monotonic host time on a CPU: `phase_clock` says which), phases as in stats.PHASES;
n_<phase> = times the phase ran; ms_step = host wall time inside engine.step() over the
run and `steps` its count, so ms_step minus the top-level phases is the step's time
outside every phase (the nested phases, stats.NESTED, are not top-level: `sample` runs inside
`prefill` and `decode`, an eager DFlash2 draft's `conv` and `selector` inside `draft`, each
counted once per draft forward; under CUDA graphs the draft is one replay and they stay 0).
Each column is a median on its own. distinct_experts (a mixture-of-experts target) = distinct
experts a MoE layer routed a step's rows to, per layer and step: decode steps (plain) or
verifies (DFlash), counted on the device in every run; with --floor the step's floor reads
that many experts a layer (bench/floor.py), measured per mode. The floor also reads each
request's cache at the run's mean context (prompt plus half the output): `floor_cache_bytes`.
`floor_prefill_ms` is the compute floor of the run's prompts (the vendor's products and fused
causal attention over each whole prompt, bench/floor.prefill_compute_floor) and
`prefill_over_floor` the prefill phase's time over it (prefill steps that also decode other
requests count whole).

--profile-capture calls cudaProfilerStart after each concurrency's warm-up and
cudaProfilerStop after its repeats, so `nsys profile --capture-range=cudaProfilerApi
--capture-range-end=stop` records the measured repeats only, no graph capture or warm-up
(the first concurrency's under `stop`: profile one concurrency per process, as
scripts/profile.sh does). A no-op on a CPU.

With --oracle-acceptance X the draft still runs, but its proposals are replaced by the
plain run's outputs and each step accepts a scheduled count, mean acceptance length X
(forced: random bfloat16 weights do not reproduce a plain continuation under the verify
kernels, see runtime/oracle.OracleProposer; random weights are otherwise accepted about never).
The output of forced runs is not lossless; the gates check losslessness, this measures
cost.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import platform
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import load_draft, load_target, parse_dtype
from ..demo import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
from ..engine_args import NUMERICS_HELP, add_engine_options, engine_config, resolve_device, resolve_dtype
from ..errors import ReferenceEngineError, RequestError, exit_with
from ..kernels import NUMERICS, default_numerics
from ..models.moe import ExpertCensus, census_of, count_experts
from ..runtime.engine import Engine
from ..runtime.oracle import OracleProposer
from ..runtime.request import SamplingParams
from ..runtime.stats import PHASES
from ..runtime.tensor_parallel import init_tensor_parallel, leads, rank_device, share_with_draft
from ..tokenizer import load_tokenizer
from .drafts import arch_of, print_drafts
from .floor import prefill_compute_floor, weight_streaming_floor
from .shapes import DRAFT_ARCHS, TARGET_SHAPES, random_draft, random_pair

MODES = ("plain", "dflash")


@dataclass(frozen=True)
class BenchArgs:
    model: str | None
    draft: str | None
    random_shape: str | None
    draft_arch: tuple[str, ...]
    prompts: str | None
    oracle_acceptance: float | None
    concurrency: tuple[int, ...]
    modes: tuple[str, ...]
    num_prompts: int | None
    input_len: int
    output_len: int
    block_size: int | None
    commit_strategy: str
    checkpoint_every: int | None
    dtype: str
    device: str
    gpu_memory_utilization: float
    verify_width: str
    steps_per_turn: int
    draft_span: str
    measure_step_costs: bool
    prefill_chunk: int
    max_num_batched_tokens: int | None
    kv_cache_tokens: int | None
    kv_cell_tokens: int
    repeats: int
    seed: int
    profile_capture: bool
    out: str | None
    numerics: tuple[str | None, ...]
    enforce_eager: bool
    floor: bool
    tensor_parallel_size: int

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="python scripts/bench_engine.py", description=__doc__.split("\n\n")[0]
        )
        add_engine_options(p, "model", "draft")
        p.add_argument(
            "--random-shape",
            choices=sorted(TARGET_SHAPES),
            help="random-weight target and 5-layer block-16 draft of a real shape",
        )
        p.add_argument(
            "--draft-arch",
            help="--random-shape only: the draft, dflash (default) or dflash2 (docs/dflash2.md); "
            "comma-separated, each is measured interleaved and DFlash2 set against DFlash",
        )
        p.add_argument(
            "--prompts",
            help="JSONL prompts: `prompt_ids` (token ids) or `prompt` (text, the target's tokenizer) per row",
        )
        p.add_argument(
            "--oracle-acceptance",
            type=float,
            default=None,
            help="replace proposals to reach this mean acceptance length",
        )
        p.add_argument("--concurrency", default="1,4,8,16")
        p.add_argument(
            "--modes",
            default=",".join(MODES),
            help="modes to measure, comma-separated: plain, dflash (default both)",
        )
        p.add_argument("--num-prompts", type=int, default=None)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        add_engine_options(p, "block_size", "commit_strategy", "checkpoint_every")
        add_engine_options(
            p,
            "dtype",
            "device",
            "gpu_memory_utilization",
            "verify_width",
            "steps_per_turn",
            "draft_span",
            "measure_step_costs",
        )
        add_engine_options(p, "prefill_chunk", "max_num_batched_tokens", "kv_cache_tokens", "kv_cell_tokens")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--profile-capture",
            action="store_true",
            help="cudaProfilerStart/Stop around the measured repeats, for "
            "nsys profile --capture-range=cudaProfilerApi",
        )
        p.add_argument("--out", help="CSV file for the per-(mode, concurrency) rows")
        # several numerics, comma-separated, are measured interleaved
        add_engine_options(
            p,
            "numerics",
            "enforce_eager",
            "tensor_parallel_size",
            numerics={
                "choices": None,
                "help": "comma-separated, to compare them interleaved; each one of: " + NUMERICS_HELP,
            },
        )
        p.add_argument(
            "--floor",
            action="store_true",
            help="measure the streaming floor per concurrency (every weight read once, and "
            "each request's cache at the run's mean context, graph-captured) and give each "
            "step time as a multiple of it",
        )
        return p

    @classmethod
    def parse(cls, argv: list[str] | None) -> BenchArgs:
        p = cls.parser()
        ns = p.parse_args(argv)
        if ns.random_shape is not None and ns.model is not None:
            p.error("give either --model DIR --draft DIR or --random-shape NAME, not both")
        if ns.draft is not None and ns.model is None:
            p.error("--draft needs --model (the target it drafts for)")
        if ns.random_shape is None and ns.model is None:  # the shipped demo pair
            ns.model, ns.draft = str(DEMO_TARGET), str(DEMO_DRAFT)
            ns.prompts = ns.prompts or str(DEMO_PROMPTS)
        if ns.model is not None and ns.draft is None:
            p.error("--model needs --draft")
        if ns.draft_arch is not None and ns.random_shape is None:
            p.error("--draft-arch needs --random-shape (a checkpoint's draft has its own architecture)")
        archs = tuple(a.strip() for a in (ns.draft_arch or "dflash").split(","))
        if not set(archs) <= set(DRAFT_ARCHS) or len(set(archs)) != len(archs):
            p.error(
                f"--draft-arch must be distinct values of {', '.join(DRAFT_ARCHS)}, got {ns.draft_arch!r}"
            )
        ns.draft_arch = archs
        try:
            ns.concurrency = tuple(int(c) for c in ns.concurrency.split(","))
        except ValueError:
            p.error(f"--concurrency must be comma-separated integers, got {ns.concurrency!r}")
        if any(c <= 0 for c in ns.concurrency) or ns.repeats <= 0:
            p.error("--concurrency values and --repeats must be positive")
        if ns.num_prompts is not None and ns.num_prompts <= 0:
            p.error(f"--num-prompts must be positive, got {ns.num_prompts}")
        modes = tuple(m.strip() for m in ns.modes.split(","))
        if not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
            p.error(f"--modes must be distinct values of {', '.join(MODES)}, got {ns.modes!r}")
        ns.modes = tuple(m for m in MODES if m in modes)
        if ns.numerics is None:
            ns.numerics = (None,)
        else:
            ns.numerics = tuple(n.strip() for n in ns.numerics.split(","))
            if not set(ns.numerics) <= set(NUMERICS) or len(set(ns.numerics)) != len(ns.numerics):
                p.error(
                    f"--numerics must be distinct values of {', '.join(NUMERICS)}, "
                    f"got {','.join(ns.numerics)!r}"
                )
        return cls(**vars(ns))


def load_pair(args: BenchArgs) -> tuple:
    """The target and its drafts (one per --draft-arch, or the checkpoint's), each rank's
    slice of the target under tensor parallelism."""
    device = resolve_device(args.device)
    if args.random_shape:
        # a real shape's checkpoints are bfloat16: `auto` runs them so on cuda, in float32 on cpu
        auto = "bfloat16" if device.type == "cuda" else "float32"
        dtype = parse_dtype(auto if args.dtype == "auto" else args.dtype)
    else:
        dtype = resolve_dtype(args.dtype, args.model, device)
    tp = None
    if args.tensor_parallel_size != 1:
        if len(args.numerics) != 1:  # the reductions follow one numerics, fixed when sharded
            raise RequestError("--tensor-parallel-size above 1 measures one --numerics at a time")
        numerics = args.numerics[0] or default_numerics(device, dtype)
        tp = init_tensor_parallel(args.tensor_parallel_size, device, numerics, "bench")
        device = rank_device(device, tp)
    if args.random_shape:
        block = 16 if args.block_size is None else args.block_size
        first, *others = args.draft_arch
        # under tensor parallelism this rank's slice, drawn a tensor at a time
        target, draft = random_pair(
            args.random_shape, str(device), dtype, args.seed, block, draft_arch=first, tensor_parallel=tp
        )
        drafts = [draft] + [
            random_draft(args.random_shape, str(device), dtype, args.seed, block, draft_arch=arch)
            for arch in others
        ]
    else:
        target = load_target(args.model, dtype=dtype, device=device, tensor_parallel=tp)
        drafts = [load_draft(args.draft, target)]
    if tp is not None:
        for draft in drafts:
            share_with_draft(draft, tp)
    return target, drafts


def make_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def read_prompts(path: str, model_dir: str | None, count: int) -> list[list[int]]:
    """`count` prompts from a JSONL file (`prompt_ids`, or `prompt` text encoded with the
    target's tokenizer), in file order, cycled when the file has fewer."""
    if not Path(path).is_file():
        raise ReferenceEngineError(f"--prompts {path}: no such file")
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ReferenceEngineError(f"{path}:{n}: not valid JSON ({exc})") from None
        if not isinstance(rows[-1], dict):
            raise ReferenceEngineError(f"{path}:{n}: each row must be a JSON object")
    if not rows:
        raise ReferenceEngineError(f"{path}: no prompts")
    tokenizer = None
    prompts = []
    for n, row in enumerate(rows, 1):
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
                raise ReferenceEngineError(
                    f"{path}: row {n}: prompt_ids must be a non-empty list of token ids"
                )
            prompts.append(list(ids))
        elif "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise ReferenceEngineError(f"{path}: row {n}: prompt must be a text")
            if tokenizer is None:
                if model_dir is None:
                    raise ReferenceEngineError(f"{path}: text prompts need --model's tokenizer")
                tokenizer = load_tokenizer(model_dir)
            prompts.append(tokenizer.encode(row["prompt"]).ids)
        else:
            raise ReferenceEngineError(f"{path}: each row needs `prompt_ids` or `prompt`")
    return [prompts[i % len(prompts)] for i in range(count)]


def make_engine(target, draft, prompts, args: BenchArgs, concurrency: int, numerics: str | None) -> Engine:
    """One engine (and its CUDA graphs) for every run of a mode and numerics at one
    concurrency, as a server keeps one: the graphs are captured here, outside the runs."""
    context = max(map(len, prompts)) + args.output_len
    config = engine_config(args, max_num_seqs=concurrency, max_model_len=context, numerics=numerics)
    engine = Engine(target, draft, config)
    costs = engine.verify_width.costs if engine.verify_width is not None else None
    if costs is not None and costs.measured and leads():
        print(f"# c={concurrency}: measured step ms by rows x verify width: {costs.text()}", flush=True)
    return engine


def mean_width(widths: dict[int, int] | None) -> float | None:
    """The mean verify width over a run's speculative steps (None without any)."""
    if not widths:
        return None
    return float(sum(w * n for w, n in widths.items()) / sum(widths.values()))


def widths_text(widths: dict[int, int] | None) -> str | None:
    """Steps per verify width as `width:steps` pairs, `;`-separated (a CSV cell)."""
    return ";".join(f"{w}:{n}" for w, n in sorted(widths.items())) if widths else None


def run_once(
    engine: Engine, prompts, args: BenchArgs, concurrency: int, continuations: list[list[int]] | None
) -> dict:
    """One run to completion on an idle engine (plain decode when it has no draft), its
    statistics started afresh. Returns the row and outputs."""
    engine.reset_stats()
    draft, target = engine.draft, engine.target
    census = census_of(target)
    if census is not None:
        census.reset()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    block = engine.block_size
    vocab = target.config.vocab_size
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        oracle = None
        if draft is not None and continuations is not None:
            oracle = OracleProposer.for_mean_acceptance(
                continuations[i], args.oracle_acceptance, block, vocab, forced=True
            )
        engine.add_request(str(i), prompt, params, oracle=oracle)
    steps, step_s = 0, 0.0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        step_s += time.perf_counter() - t0
        steps += 1
    wall = time.perf_counter() - start
    outputs = [engine.collect(str(i)).output_ids for i in range(len(prompts))]
    stats = engine.stats()
    phases = stats["phases"]
    on_gpu = engine.device.type == "cuda"
    kind = "device_s_" if on_gpu else "host_s_"
    total = sum(len(o) for o in outputs)
    row = {
        "mode": "plain" if draft is None else "dflash",
        "draft": None if draft is None else arch_of(draft),
        "numerics": engine.numerics,
        "kernels": engine.ops.name,  # torch (the references) or triton
        "cuda_graphs": engine.runner.captured,
        "concurrency": concurrency,
        "output_tokens_per_s": total / wall,
        "mean_acceptance_length": stats["spec"]["mean_acceptance_length"] if draft else 1.0,
        **{f"ms_{phase}": 1000 * phases.get(kind + phase, 0.0) for phase in PHASES},
        "ms_step": 1000 * step_s,
        "ms_per_step": 1000 * step_s / max(steps, 1),
        # one decode step (plain) or one draft -> verify -> accept -> commit step (DFlash)
        "ms_per_decode_step": decode_step_ms(phases, engine.timer.calls, kind, draft is not None),
        **{f"n_{phase}": engine.timer.calls[phase] for phase in PHASES},
        "phase_clock": "cuda_events" if on_gpu else "host",
        "distinct_experts": step_experts(census, block, draft is not None),
        "steps": steps,
        # DFlash: the verify width (draft tokens checked) per step, mean and counts
        "verify_width_mean": mean_width(stats.get("verify_widths")) if draft else None,
        "verify_widths": widths_text(stats.get("verify_widths")) if draft else None,
        # DFlash with graphs: drafts queued behind a commit that the next step took, or not
        "draft_ahead_queued": stats["draft_ahead"]["queued"] if draft else None,
        "draft_ahead_used": stats["draft_ahead"]["used"] if draft else None,
        "draft_ahead_widened": stats["draft_ahead"]["widened"] if draft else None,
        "output_tokens": total,
        "wall_s": wall,
    }
    return {"row": row, "outputs": outputs}


def step_experts(census: ExpertCensus | None, block: int, speculative: bool) -> float | None:
    """A mixture of experts: distinct experts per layer of a decode step (plain: one token a
    row) or of a verify (DFlash: any width up to the block's, its forward W + 1 tokens a row,
    1 through the block size; a plain step of a DFlash run is width 1). Prefill chunks are
    wider than a block unless the prompts are as short. None for a dense target."""
    if census is None:
        return None
    return census.mean_distinct(*range(1, block + 1) if speculative else (1,))


def decode_step_ms(phases: dict, calls: dict, kind: str, speculative: bool) -> float:
    """Milliseconds per decode step: the decode phase per call (plain), or the draft, verify,
    accept and commit phases per verify (DFlash)."""
    names = ("draft", "verify", "accept", "commit") if speculative else ("decode",)
    count = calls["verify" if speculative else "decode"]
    return 1000 * sum(phases.get(kind + name, 0.0) for name in names) / max(count, 1)


def mode_label(row: dict) -> str:
    """A row's mode as the floor tables print it: a speculative row by its draft's kind."""
    return (row.get("draft") or row["mode"]) if row["mode"] == "dflash" else row["mode"]


def print_floor(rows: list[dict]) -> None:
    moe = any(r.get("floor_experts_per_layer") is not None for r in rows)
    print(
        "mode | numerics | concurrency | ms per decode step | floor ms [min, max] | x floor | cache GB"
        + (" | distinct experts a layer" if moe else "")
    )
    for r in rows:
        print(
            f"{mode_label(r)} | {r['numerics']} | {r['concurrency']} | "
            f"{_figure(r, 'ms_per_decode_step', 2)} | "
            f"{r['floor_ms']:.2f} [{r['floor_ms_min']:.2f}, {r['floor_ms_max']:.2f}] | "
            f"{r['over_floor']:.2f} | {r['floor_cache_bytes'] / 1e9:.3f}"
            + (f" | {r['floor_experts_per_layer']:.1f}" if moe else "")
        )
    print("mode | numerics | concurrency | ms prefill | compute floor ms | x floor")
    for r in rows:
        print(
            f"{mode_label(r)} | {r['numerics']} | {r['concurrency']} | {_figure(r, 'ms_prefill', 1)} | "
            f"{r['floor_prefill_ms']:.1f} | {r['prefill_over_floor']:.2f}"
        )


def speedups(rows: list[dict]) -> list[dict]:
    """DFlash over plain per (draft, numerics, concurrency) with both modes measured: `tok_s`
    the ratio of output tokens per second (prefill included), `decode` the decode steps alone:
    mean acceptance length x plain ms per decode step / DFlash ms per decode step."""
    plains = {(r["numerics"], r["concurrency"]): r for r in rows if r["mode"] == "plain"}
    out = []
    for spec in rows:
        plain = plains.get((spec["numerics"], spec["concurrency"]))
        if (
            spec["mode"] != "dflash"
            or plain is None
            or not spec["ms_per_decode_step"]
            or not plain["ms_per_decode_step"]
            or not plain["output_tokens_per_s"]
        ):
            continue  # a run without decode steps (one output token) has no ratio
        out.append(
            {
                "draft": spec.get("draft"),
                "numerics": spec["numerics"],
                "concurrency": spec["concurrency"],
                "tok_s": spec["output_tokens_per_s"] / plain["output_tokens_per_s"],
                "decode": spec["mean_acceptance_length"]
                * plain["ms_per_decode_step"]
                / spec["ms_per_decode_step"],
                "step_ratio": spec["ms_per_decode_step"] / plain["ms_per_decode_step"],
            }
        )
    return out


def print_speedups(rows: list[dict]) -> None:
    table = speedups(rows)
    if not table:
        return
    print(
        "draft | numerics | concurrency | DFlash/plain tok/s | DFlash/plain decode steps | "
        "DFlash step / plain step"
    )
    for r in table:
        print(
            f"{r['draft']} | {r['numerics']} | {r['concurrency']} | {r['tok_s']:.2f} | {r['decode']:.2f} | "
            f"{r['step_ratio']:.2f}"
        )


SPREAD_WARNING = 0.10  # repeats whose min-max range exceeds this share of the median disagree


def median_row(rows: list[dict]) -> dict:
    """Medians over repeats of every float column, each with its spread: `<column>_min` and
    `<column>_max` right after it."""
    out: dict = {}
    for key, value in rows[0].items():
        if isinstance(value, float):
            values = [r[key] for r in rows]
            out[key] = statistics.median(values)
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
        else:
            out[key] = value
    out["repeats"] = len(rows)
    return out


def disagreements(row: dict, columns: list[str]) -> list[str]:
    """The printed figures of a median row whose repeats spread by more than SPREAD_WARNING."""
    out = []
    for col in columns:
        median, low, high = row.get(col), row.get(f"{col}_min"), row.get(f"{col}_max")
        if (
            isinstance(median, float)
            and median > 0
            and low is not None
            and (high - low) / median > SPREAD_WARNING
        ):
            out.append(
                f"{row['mode']} c={row['concurrency']} {col} {median:.1f} "
                f"({low:.1f}-{high:.1f}, {(high - low) / median:.0%} of the median)"
            )
    return out


def mean_context(prompts: list[list[int]], args: BenchArgs) -> int:
    """Positions a decode step's query sees, on average over a run: the mean prompt length
    and half the output (the floor reads that much cache per request, bench/floor.py)."""
    return round(statistics.mean(len(p) for p in prompts) + args.output_len / 2)


def benchmark(args: BenchArgs) -> list[dict]:
    target, drafts = load_pair(args)
    device = str(target.model.embed_tokens.weight.device)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor()
    print(
        f"# device {device} ({gpu}), dtype {target.model.embed_tokens.weight.dtype}, "
        f"{args.random_shape or args.model}, draft {', '.join(type(d).__name__ for d in drafts)}",
        flush=True,
    )
    if args.profile_capture and not device.startswith("cuda"):
        print(
            f"# --profile-capture: no CUDA device ({device}), so no profiler capture range "
            "is opened (a no-op here)",
            flush=True,
        )
    capture = args.profile_capture and device.startswith("cuda")

    @functools.cache
    def prefill_floor(tokens: int) -> float:
        return prefill_compute_floor(target, tokens).ms_median

    if target.config.is_moe:  # counted in every run, graphs included (bench/floor.py: why)
        count_experts(target, ExpertCensus(device))
    rows = []
    for c in args.concurrency:
        count = args.num_prompts or c
        if args.prompts:
            prompts = read_prompts(args.prompts, args.model, count)
        else:
            prompts = make_prompts(target.config.vocab_size, count, args.input_len, args.seed + c)
        # unmeasured warm-up (compile caches, allocator); without a measured plain run it
        # covers every prompt, so that its outputs can be the oracle's continuations
        oracle = args.oracle_acceptance is not None
        warm_prompts = prompts if oracle and "plain" not in args.modes else prompts[:c]
        engines = {}
        for numerics in args.numerics:
            plain = make_engine(target, None, prompts, args, c, numerics)
            warm = run_once(plain, warm_prompts, args, c, None)
            if "plain" in args.modes:
                engines["plain", None, numerics] = plain
            del plain
            for draft in drafts if "dflash" in args.modes else ():
                engine = engines["dflash", arch_of(draft), numerics] = make_engine(
                    target, draft, prompts, args, c, numerics
                )
                run_once(engine, prompts[:c], args, c, warm["outputs"] if oracle else None)
                del engine
        with capture_range(capture):
            measured = measure(engines, prompts, args, c, warm["outputs"])
        del engines
        for runs in measured.values():
            row = median_row(runs)
            if args.floor:
                # an MoE step's floor reads the experts its runs routed to: one per mode
                experts, context = row["distinct_experts"], mean_context(prompts, args)
                floor = weight_streaming_floor(target, rows=c, experts_per_layer=experts, context=context)
                prefill = sum(prefill_floor(len(p)) for p in prompts)
                row.update(floor_prefill_ms=prefill, prefill_over_floor=row["ms_prefill"] / prefill)
                row.update(
                    floor_ms=floor.ms_median,
                    floor_cache_bytes=floor.cache_bytes,
                    floor_ms_min=floor.ms_min,
                    floor_ms_max=floor.ms_max,
                    floor_gb_per_s=floor.gb_per_s,
                    floor_experts_per_layer=floor.experts_per_layer,
                    over_floor=row["ms_per_decode_step"] / floor.ms_median,
                )
            rows.append(row)
        if args.out and leads():  # after every concurrency, so an interrupted run keeps what it measured
            write_csv(args.out, rows)
    return rows


def measure(
    engines: dict, prompts, args: BenchArgs, concurrency: int, warm_outputs: list[list[int]]
) -> dict[str, list[dict]]:
    """`args.repeats` runs of each mode, draft and numerics on its engine in `engines`, keyed
    (mode, draft, numerics), alternating; the rows of each key's runs."""
    oracle = args.oracle_acceptance is not None
    measured: dict[tuple, list[dict]] = {key: [] for key in engines}
    for r in range(args.repeats):
        for numerics in args.numerics:
            continuations = warm_outputs if oracle else None
            if "plain" in args.modes:
                plain = run_once(engines["plain", None, numerics], prompts, args, concurrency, None)
                measured["plain", None, numerics].append(plain["row"])
                continuations = plain["outputs"] if oracle else None
            for key in [k for k in engines if k[0] == "dflash" and k[2] == numerics]:
                spec = run_once(engines[key], prompts, args, concurrency, continuations)
                measured[key].append(spec["row"])
        done = [
            f"{mode}{f' {draft}' if draft and len(args.draft_arch) > 1 else ''} ({runs[-1]['numerics']}) "
            f"{runs[-1]['output_tokens_per_s']:.1f} tok/s, {runs[-1]['ms_per_step']:.2f} ms/step"
            for (mode, draft, _), runs in measured.items()
        ]
        print(f"  c={concurrency} repeat {r + 1}/{args.repeats}: {'; '.join(done)}", flush=True)
    return measured


@contextmanager
def capture_range(enabled: bool) -> Iterator[None]:
    """A CUDA profiler capture range (cudaProfilerStart/Stop) around the block, for
    `nsys profile --capture-range=cudaProfilerApi`; nothing when not enabled."""
    if not enabled:
        yield
        return
    torch.cuda.synchronize()  # the warm-up's kernels stay out of the capture
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def write_csv(path: str, rows: list[dict]) -> None:
    """Every row's columns, in first-seen order (a column only some modes have is empty in
    the others' rows)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    """Medians over the repeats, each float as `median (min-max)`; a warning line for every
    figure whose repeats disagree by more than SPREAD_WARNING of the median."""
    cols = [
        "mode",
        "draft",
        "numerics",
        "concurrency",
        "output_tokens_per_s",
        "mean_acceptance_length",
        "ms_per_step",
        *[f"ms_{p}" for p in PHASES],
    ]
    print(f"# medians over {rows[0].get('repeats', 1) if rows else 0} repeats, (min-max) in parentheses")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(_figure(row, c) for c in cols))
    warnings = [w for row in rows for w in disagreements(row, cols)]
    for warning in warnings:
        print(f"# warning: repeats disagree by more than {SPREAD_WARNING:.0%}: {warning}")
    if warnings:
        print("# (a busy or throttled machine; more --repeats or a quieter machine narrow it)")


def _figure(row: dict, col: str, digits: int = 1) -> str:
    """`median (min-max)` of a median row's column; other values as they are."""
    value = row[col]
    if not isinstance(value, float):
        return str(value)
    low, high = row.get(f"{col}_min"), row.get(f"{col}_max")
    if low is None or high is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    args = BenchArgs.parse(argv)
    try:
        if args.out and not Path(args.out).resolve().parent.is_dir():  # before measuring, not after
            raise ReferenceEngineError(f"--out {args.out}: no folder {Path(args.out).parent} to write it in")
        rows = benchmark(args)
    except ReferenceEngineError as exc:
        return exit_with(exc)
    if not leads():  # under tensor parallelism every rank measured the same steps; one reports
        return 0
    print_table(rows)
    print_speedups(rows)
    print_drafts(rows)
    if args.floor:
        print_floor(rows)
    if args.out:
        print(f"wrote {args.out}")
    return 0

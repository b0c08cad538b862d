"""Generate for one prompt from the command line.

    python -m reference_engine.generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3)
        --max-tokens N [--dtype auto|float64|float32|bfloat16] [--device auto|cpu|cuda]
        [--stop-ids 5,6] [--ignore-eos] [--temperature T --top-p P --top-k K --seed S]
        [--draft DIR [--block-size N] [--commit-strategy replay|per_token|recompute]]
        [--json] [--tensor-parallel-size N (under torchrun --nproc-per-node N)]

Without --draft: plain decode. With --draft: DFlash speculative decoding, lossless.
With --json it prints one JSON object: prompt_ids, output_ids, text, finish_reason, and
with a draft also block_size, commit_strategy and acceptance_lengths (one int per step:
the tokens that step committed, accepted + bonus, cut at a stop; the first token, from
prefill, not counted).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from .checkpoint import load_draft, load_target
from .engine_args import add_engine_options, resolve_device, resolve_dtype
from .errors import ReferenceEngineError, RequestError, exit_with
from .kernels import default_numerics
from .runtime.decode import generate_plain
from .runtime.engine import EngineConfig
from .runtime.one_request import generate_speculative
from .runtime.request import SamplingParams
from .runtime.tensor_parallel import init_tensor_parallel, leads, rank_device, share_with_draft
from .tokenizer import load_tokenizer


def parse_id_list(text: str, what: str) -> list[int]:
    """ "1,2,3" -> [1, 2, 3]; an empty text is no ids, an empty entry ("1,,3") a mistake."""
    if not text.strip():
        return []
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise RequestError(f"{what} must be comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class GenerateArgs:
    model: str
    prompt: str | None
    prompt_ids: str | None
    max_tokens: int
    dtype: str
    device: str
    stop_ids: str
    ignore_eos: bool
    max_model_len: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    draft: str | None
    block_size: int | None
    commit_strategy: str
    json: bool
    numerics: str | None
    tensor_parallel_size: int

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m reference_engine.generate")
        add_engine_options(p, "model", model={"required": True})
        prompt = p.add_mutually_exclusive_group(required=True)
        prompt.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
        prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
        p.add_argument("--max-tokens", type=int, required=True)
        add_engine_options(p, "dtype", "device")
        p.add_argument("--stop-ids", default="", help="extra stop token ids, comma-separated")
        p.add_argument("--ignore-eos", action="store_true")
        add_engine_options(p, "max_model_len")
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
        p.add_argument("--seed", type=int, default=0, help="sampling seed")
        add_engine_options(p, "draft", "block_size", "commit_strategy")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        add_engine_options(p, "numerics", "tensor_parallel_size")
        return p

    @classmethod
    def parse(cls, argv: list[str] | None) -> GenerateArgs:
        return cls(**vars(cls.parser().parse_args(argv)))


def run(args: GenerateArgs) -> dict:
    if args.draft is None and args.block_size is not None:
        raise RequestError("--block-size needs --draft (--dflash-draft-model-path)")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, args.model, device)
    numerics = args.numerics or default_numerics(device, dtype)
    tp = init_tensor_parallel(args.tensor_parallel_size, device, numerics, "generate")
    device = rank_device(device, tp)
    model = load_target(args.model, dtype=dtype, device=device, tensor_parallel=tp)
    tokenizer = None
    if args.prompt is not None:
        tokenizer = load_tokenizer(args.model)
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(
                "--prompt is not valid UTF-8 text (check the shell's locale or the bytes passed)"
            ) from None
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = parse_id_list(args.prompt_ids, "--prompt-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop_token_ids=tuple(parse_id_list(args.stop_ids, "--stop-ids")),
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    extra = {}
    if args.draft is None:
        result = generate_plain(
            model,
            prompt_ids,
            params,
            max_model_len=args.max_model_len,
            generator=generator,
            numerics=args.numerics,
        )
    else:
        draft = load_draft(args.draft, model)
        if tp is not None:
            share_with_draft(draft, tp)
        block_size = draft.config.block_size if args.block_size is None else args.block_size
        options = EngineConfig(
            block_size=block_size,
            commit_strategy=args.commit_strategy,
            max_model_len=args.max_model_len,
            numerics=args.numerics,
        )
        result = generate_speculative(model, draft, prompt_ids, params, options, generator=generator)
        extra = {
            "acceptance_lengths": result.acceptance_lengths,
            "block_size": options.block_size,
            "commit_strategy": options.commit_strategy,
        }
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(args.model)
        except ReferenceEngineError:
            tokenizer = None
    text = tokenizer.decode(result.output_ids) if tokenizer is not None else None
    return {
        "prompt_ids": prompt_ids,
        "output_ids": result.output_ids,
        "text": text,
        "finish_reason": result.finish_reason,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    args = GenerateArgs.parse(argv)
    try:
        out = run(args)
    except ReferenceEngineError as exc:
        return exit_with(exc)
    if not leads():  # under tensor parallelism every rank ran the same steps; one prints
        return 0
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"] if out["text"] is not None else " ".join(map(str, out["output_ids"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m reference_engine.checkpoint make-tiny`: write a tiny random checkpoint.

python -m reference_engine.checkpoint make-tiny
    --arch {qwen3,qwen3_5,llama,qwen3_moe,qwen3_5_moe} --out DIR
    [--seed N] [--layers N] [--hidden N] [--vocab N] [--multimodal-wrapper]
    [--tie-word-embeddings] [--bias] [--expert-layout per_expert|fused]
    [--shards N] [--dtype float32|bfloat16]
python -m reference_engine.checkpoint make-tiny --arch {dflash,dflash2} --target DIR --out DIR
    [--block-size N] [--layers N] [--seed N]
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ReferenceEngineError, exit_with
from . import parse_dtype
from .synthetic import EXPERT_LAYOUTS, TINY_ARCHS, TINY_DRAFT_ARCHS, make_tiny_draft, make_tiny_target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference_engine.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint")
    tiny.add_argument("--arch", required=True, choices=[*TINY_ARCHS, *TINY_DRAFT_ARCHS])
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--target", help="drafts only: the target model directory to match")
    tiny.add_argument("--block-size", type=int, default=8, help="drafts only")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 4 for targets, 2 for drafts)"
    )
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument(
        "--multimodal-wrapper",
        action="store_true",
        help="Qwen3.5 and Qwen3.5-MoE only: write the multimodal wrapper layout",
    )
    tiny.add_argument(
        "--expert-layout",
        default="per_expert",
        choices=EXPERT_LAYOUTS,
        help="MoE only: one tensor per expert (what save_pretrained writes) or fused 3-D tensors",
    )
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument("--bias", action="store_true", help="attention_bias (and, for llama, mlp_bias) true")
    tiny.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    tiny.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.arch in TINY_DRAFT_ARCHS:
            if not args.target:
                parser.error(f"--arch {args.arch} needs --target DIR")
            out = make_tiny_draft(
                args.out,
                args.target,
                block_size=args.block_size,
                layers=2 if args.layers is None else args.layers,
                seed=args.seed,
                dtype=parse_dtype(args.dtype),
                arch=args.arch,
            )
            print(out)
            return 0
        out = make_tiny_target(
            args.out,
            arch=args.arch,
            seed=args.seed,
            layers=4 if args.layers is None else args.layers,
            hidden=args.hidden,
            vocab=args.vocab,
            tie_word_embeddings=args.tie_word_embeddings,
            multimodal_wrapper=args.multimodal_wrapper,
            bias=args.bias,
            expert_layout=args.expert_layout,
            shards=args.shards,
            dtype=parse_dtype(args.dtype),
        )
    except ReferenceEngineError as exc:
        return exit_with(exc)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

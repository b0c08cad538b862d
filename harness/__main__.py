"""Command line: `python -m harness bench ...` (one server) and `python -m harness ab ...`.

    python -m harness bench --base-url URL [--model NAME] [--endpoint completions|chat|sglang]
        [--concurrency 1,4,8,16] [--num-prompts N] [--input-len N] [--output-len N]
        [--dataset FILE.jsonl | --builtin code|math|chat|mixed] [--out DIR] ...
    python -m harness ab (--a-url URL | --a-cmd CMD) (--b-url URL | --b-cmd CMD) [...] --out DIR

`--a-cmd`/`--b-cmd` are command templates with `{port}`, e.g.
"python -m reference_engine.serve --model tiny/qwen3_5 --port {port}".
Writes DIR/requests.jsonl, DIR/summary.csv (one row per label, concurrency and repeat)
and the same rows as DIR/summary.json, DIR/meta.json, and for `ab` DIR/ab.csv; then
builds DIR/report.md when `reports` is importable.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

from .ab import ManagedServer, metadata, ratios, write_meta
from .bench import LoadSpec, done_runs, measure
from .client import ENDPOINT_KINDS, Endpoint
from .server_kind import SERVER_KINDS, resolve
from .tokens import TextTokenizer
from .workloads import WorkloadError, builtin, load_jsonl, synthetic, take


def _peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-kind", default="auto", choices=SERVER_KINDS,
                   help="which OpenAI extensions the server(s) accept (auto: probe /v1/models, "
                   "/metrics and one tiny request; unknown servers get plain OpenAI)")
    p.add_argument("--tokenizer", default=None,
                   help="the model's tokenizer directory (tokenizer.json), for servers that "
                   "report no token ids")


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name sent in requests")
    _peer_args(p)
    p.add_argument("--endpoint", default="completions", choices=ENDPOINT_KINDS)
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests per concurrency (default 4 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="JSONL with 'prompt' or 'messages' per line")
    source.add_argument("--builtin", help="built-in prompt set: code, math, chat, mixed")
    p.add_argument("--text", action="store_true", help="synthetic prompts as text, not ids")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="arrivals per second (default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--resume", action="store_true", help="skip runs already in DIR/summary.csv")
    p.add_argument("--notes", default=None, help="recorded in meta.json and the report")
    p.add_argument("--out", default="results/run", help="output directory")


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="token-by-token equivalence of two servers")
    c.add_argument("--baseline", required=True, help="baseline base URL (DFlash off)")
    c.add_argument("--candidate", required=True, help="candidate base URL (DFlash on)")
    c.add_argument("--model", default=None)
    c.add_argument("--api-key", default=None)
    _peer_args(c)
    source = c.add_mutually_exclusive_group()
    source.add_argument("--prompts", help="JSONL with 'prompt' per line")
    source.add_argument("--builtin", default=None, help="code, math, chat or mixed")
    c.add_argument("--num-prompts", type=int, default=None, help="default: the whole set")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--concurrency", type=int, default=4)
    c.add_argument("--policy", default="tie-tolerant", choices=["strict", "tie-tolerant"])
    c.add_argument("--tie-threshold", type=float, default=0.1)
    c.add_argument("--max-tie-rate", type=float, default=0.05)
    c.add_argument("--max-divergences", type=int, default=5)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="results/compare")


def run_compare(args) -> int:
    import asyncio

    from .compare import ComparePolicy, compare, write_outputs

    pool = load_jsonl(args.prompts) if args.prompts else builtin(args.builtin or "mixed")
    prompts = [p for p in pool if p.text is not None or p.token_ids is not None]
    if args.num_prompts:
        prompts = take(prompts, args.num_prompts, args.seed)
    policy = ComparePolicy(args.policy, args.tie_threshold, args.max_tie_rate,
                           args.max_divergences)
    tokenizer = TextTokenizer(args.tokenizer) if args.tokenizer else None
    baseline, candidate = (endpoint_for(url, args, "completions", tokenizer)
                           for url in (args.baseline, args.candidate))
    results, summary = asyncio.run(compare(baseline, candidate, prompts, args.max_tokens,
                                           args.concurrency, policy))
    write_outputs(Path(args.out), results, summary)
    print(json.dumps(summary, indent=2))
    first = next((d for r in results for d in r.divergences), None)
    if first is not None:
        print(f"first divergence: position {first.position}, baseline {first.baseline_token} "
              f"vs candidate {first.candidate_token}, margin {first.margin}, {first.kind}")
    return 0 if summary["verdict"] == "pass" else 1


def endpoint_for(url: str, args, kind: str, tokenizer: TextTokenizer | None) -> Endpoint:
    """The endpoint with the server's accepted extensions (probed unless named) and, when no
    --model is given, the first model the server lists."""
    found = resolve(args.server_kind, url, args.model, args.api_key)
    model = args.model or (found.models[0] if found.models else None)
    print(f"{url}: server kind {found.kind.name} ({found.kind.evidence})", file=sys.stderr)
    return Endpoint(url, model, kind, args.api_key, found.kind, tokenizer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness")
    sub = p.add_subparsers(dest="command", required=True)
    _compare_parser(sub)
    bench = sub.add_parser("bench", help="measure one server")
    bench.add_argument("--base-url", required=True)
    bench.add_argument("--label", default="A")
    _workload_args(bench)
    ab = sub.add_parser("ab", help="baseline A vs candidate B, interleaved")
    for side in ("a", "b"):
        group = ab.add_mutually_exclusive_group(required=True)
        group.add_argument(f"--{side}-url", help=f"attach to server {side.upper()}")
        group.add_argument(f"--{side}-cmd", help=f"start server {side.upper()} ({{port}} filled in)")
    _workload_args(ab)
    return p


def prompts_for(args, count: int) -> list:
    if args.dataset:
        pool = load_jsonl(args.dataset)
    elif args.builtin:
        pool = builtin(args.builtin)
    else:
        return synthetic(count, args.input_len, args.seed, as_text=args.text)
    return take(pool, count, args.seed)


def run(args, servers: dict[str, ManagedServer], out: Path, endpoint_of) -> list[dict]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    slo = {k: v for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms),
                             ("e2e", args.slo_e2e_ms)) if v is not None}
    skip = done_runs(out / "summary.csv") if args.resume else set()
    summaries = []
    for c in concurrencies:
        count = args.num_prompts or max(8, 4 * c)
        prompts = prompts_for(args, args.warmup + count)  # the same for A and B
        spec = LoadSpec(concurrency=c, num_prompts=count, output_len=args.output_len,
                        warmup=args.warmup, request_rate=args.request_rate,
                        burstiness=args.burstiness, timeout_s=args.timeout, seed=args.seed,
                        slo_ms=slo)
        for repeat in range(args.repeats):
            for label, server in servers.items():  # interleaved A, B, A, B
                if (label, c, repeat) in skip:
                    continue
                endpoint = endpoint_of(label)  # probed on first use only
                labels = {"label": label, "concurrency": c, "repeat": repeat}
                summaries.append(measure(endpoint, prompts, spec, out, labels,
                                         server.url + "/metrics"))
    return summaries


def print_table(summaries: list[dict]) -> None:
    cols = ["label", "concurrency", "repeat", "completed", "failed", "output_tokens_per_s",
            "ttft_ms_median", "tpot_ms_mean", "itl_token_ms_mean", "itl_chunk_ms_mean",
            "acceptance_length"]
    print(" | ".join(cols))
    for s in summaries:
        print(" | ".join(f"{s.get(c):.2f}" if isinstance(s.get(c), float) else str(s.get(c, ""))
                         for c in cols))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.command == "compare":
        try:
            return run_compare(args)
        except (WorkloadError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    out = Path(args.out)
    servers: dict[str, ManagedServer] = {}
    try:
        if args.command == "bench":
            servers[args.label] = ManagedServer(args.base_url)
        else:
            for side in ("a", "b"):
                url, cmd = getattr(args, f"{side}_url"), getattr(args, f"{side}_cmd")
                servers[side.upper()] = ManagedServer.start(cmd) if cmd else ManagedServer(url)
        tokenizer = TextTokenizer(args.tokenizer) if args.tokenizer else None
        endpoints: dict[str, Endpoint] = {}

        def endpoint_of(label: str) -> Endpoint:
            if label not in endpoints:
                endpoints[label] = endpoint_for(servers[label].url, args, args.endpoint,
                                                tokenizer)
            return endpoints[label]

        meta = metadata(argv, servers, args.notes)
        meta["tokenizer"] = args.tokenizer
        write_meta(out, meta)
        summaries = run(args, servers, out, endpoint_of)
        if endpoints:
            meta["server_kinds"] = {label: e.accepts.as_dict() for label, e in endpoints.items()}
            write_meta(out, meta)
        if (out / "summary.csv").exists():  # every row, a resumed run's earlier ones too
            with (out / "summary.csv").open() as f:
                rows = list(csv.DictReader(f))
            (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
        if args.command == "ab":
            ratios(summaries, out / "ab.csv")
    except (WorkloadError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for server in servers.values():
            server.stop()
    print_table(summaries)
    try:
        from reports.markdown import build_report
    except ImportError:  # reports needs pandas and matplotlib; rebuild later with them
        print("report not built (reports needs pandas and matplotlib): python -m reports "
              f"{out}")
    else:
        print(f"report: {build_report(out)}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

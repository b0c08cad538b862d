"""Command line: `python -m harness bench ...` (one server), `python -m harness ab ...` and
`python -m harness compare ...` (the HTTP equivalence gate; docs/harness-compare.md).

    python -m harness bench --base-url URL [--model NAME] [--endpoint completions|chat|sglang]
        [--concurrency 1,4,8,16] [--num-prompts N] [--input-len N] [--output-len N]
        [--dataset FILE.jsonl | --builtin code|math|chat|mixed] [--out DIR] ...
    python -m harness ab (--a-url URL | --a-cmd CMD) (--b-url URL | --b-cmd CMD) [...] --out DIR

`--a-cmd`/`--b-cmd` are command templates with `{port}`, e.g.
"python -m reference_engine.serve --model tiny/qwen3_5 --port {port}".
Writes DIR/requests.jsonl, DIR/summary.csv (one row per label, concurrency and repeat)
and the same rows as DIR/summary.json, DIR/meta.json, for `ab` DIR/ab.csv and the output of
each server it started (DIR/server-A.log, server-B.log); then builds DIR/report.md when
`reports` is importable. DIR is checked and locked first (output.py): one run per folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
from pathlib import Path

from .ab import ManagedServer, machine_load, metadata, ratios, summary_numbers, write_meta
from .arguments import (
    auto_or_positive_int,
    base_url,
    concurrency_list,
    finite_non_negative_float,
    finite_positive_float,
    non_negative_int,
    positive_float,
    positive_int,
    rate,
)
from .client import ENDPOINT_KINDS, Endpoint
from .load import CLIENT_CORE_SHARE, STREAMS_PER_CLIENT, LoadSpec, client_processes_for, measure
from .outcome import verdict_line
from .output import OutputError, claim
from .resume import (
    ResumeConflict,
    bench_identity,
    check_identity,
    holds_rows,
    prepare,
    read_request_rows,
    trim_torn_tail,
    write_identity,
)
from .server_kind import SERVER_KINDS, resolve
from .tokens import TextTokenizer
from .workloads import GROUPS, WorkloadError, builtin, load_jsonl, mixed_long, synthetic, take


def _peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-kind",
        default="auto",
        choices=SERVER_KINDS,
        help="which OpenAI extensions the server(s) accept (auto: probe /v1/models, "
        "/metrics and one tiny request; unknown servers get plain OpenAI)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the model's tokenizer directory (tokenizer.json), for servers that report no token ids",
    )


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name sent in requests")
    _peer_args(p)
    p.add_argument("--endpoint", default="completions", choices=ENDPOINT_KINDS)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--concurrency", type=concurrency_list, default="1,4,8,16", help="comma-separated levels, each >= 1"
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="measured requests per concurrency, the same prompts at every level "
        "(default: a dataset's whole set, repeated until it reaches the highest "
        "concurrency; synthetic: 4 x the highest concurrency, >= 8)",
    )
    p.add_argument("--input-len", type=positive_int, default=64)
    p.add_argument("--output-len", type=positive_int, default=64)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="JSONL with 'prompt' or 'messages' per line")
    source.add_argument("--builtin", help="built-in prompt set: code, math, chat, mixed")
    p.add_argument("--text", action="store_true", help="synthetic prompts as text, not ids")
    p.add_argument(
        "--long-input-len",
        type=positive_int,
        default=None,
        help="synthetic: mix prompts of this many tokens among the --input-len ones (the "
        "long-and-short workload); TTFT and ITL are reported per group, short and long",
    )
    p.add_argument(
        "--long-share",
        type=rate,
        default=0.25,
        help="with --long-input-len: the share of prompts that are long, spread evenly (default 0.25)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="arrivals per second (default: all at once)",
    )
    p.add_argument("--burstiness", type=finite_positive_float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument(
        "--client-processes",
        type=auto_or_positive_int,
        default=None,
        help="processes the client spreads a closed loop's streams over (default auto: one per "
        f"{STREAMS_PER_CLIENT} streams, at most a {CLIENT_CORE_SHARE}th of the cores; one with "
        "--request-rate): one process reading tens of thousands of chunks a second times its "
        "own queue",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="per request, seconds: bounds the whole request, sending to its stream's end",
    )
    p.add_argument(
        "--max-failure-rate",
        type=rate,
        default=0.0,
        help="exit 1 when a run fails more than this share of its requests "
        "(default 0: any failed request fails the benchmark)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=finite_positive_float, default=None)
    p.add_argument("--slo-tpot-ms", type=finite_positive_float, default=None)
    p.add_argument("--slo-e2e-ms", type=finite_positive_float, default=None)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already done in DIR; measure failed and incomplete ones again",
    )
    p.add_argument("--notes", default=None, help="recorded in meta.json and the report")
    p.add_argument("--out", default="results/run", help="output directory")


def _compare_epilog() -> str:
    from .answer import ERRORS

    lines = [
        "exit status:",
        "  0   pass",
        "  1   fail: an answer differs (mismatch), ties above --max-tie-rate (strict: any tie), output after",
        "      a tie never compared (unchecked), or prompts a server would not take (unsent)",
        "  2   bad arguments or prompts file",
    ]
    for name, (status, what) in ERRORS.items():
        lines.append(f"  {status:<3} {what if name == 'http_error' else f'{name}: {what}'}")
    lines += [
        "  130 interrupted: the comparisons made are in DIR/compare.jsonl; rerun with --resume",
        "A run with errors exits with the status of its first error (by concurrency level, then prompt);",
        "stderr gets one line: `pass: ...`, `fail: REASON: ...` or `error: NAME: ...`.",
    ]
    return "\n".join(lines)


def _compare_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="token-by-token equivalence of two servers",
        description="Every prompt decoded greedily by both servers; the "
        "answers compared token by token (ids and text, length, finish_reason, "
        "prompt counts), divergences triaged as ties or mismatches.",
        epilog=_compare_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--baseline", required=True, type=base_url, help="baseline base URL (DFlash off)")
    c.add_argument("--candidate", required=True, type=base_url, help="candidate base URL (DFlash on)")
    c.add_argument("--model", default=None)
    c.add_argument("--api-key", default=None)
    _peer_args(c)
    source = c.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        help="JSONL with 'prompt' (text, or a list of token ids) or 'messages' (chat, sent to "
        "/v1/chat/completions) per line",
    )
    source.add_argument(
        "--builtin",
        default=None,
        help="code, math, chat, mixed, or the gate set: gate (prompts of about "
        "128, 512 and 4096 tokens) or gate:128,512 (those lengths only)",
    )
    c.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="a seeded subset of this many (default: the whole set)",
    )
    c.add_argument("--max-tokens", type=positive_int, default=64)
    c.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=[4],
        help="comma-separated levels, e.g. 1,8,16: at each the candidate gets every "
        "prompt, N in flight (closed loop); the baseline answers each prompt once",
    )
    c.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the candidate for streamed answers (default) or whole ones",
    )
    c.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="per request, seconds: bounds the whole request, sending to its stream's end",
    )
    c.add_argument("--policy", default="tie-tolerant", choices=["strict", "tie-tolerant"])
    c.add_argument("--tie-threshold", type=finite_non_negative_float, default=0.1)
    c.add_argument(
        "--max-tie-rate",
        type=rate,
        default=0.05,
        help="tie-tolerant policy: fail when a level's ties per compared prompt pass this "
        "fraction in [0, 1] (default 0.05)",
    )
    c.add_argument("--max-divergences", type=positive_int, default=5)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--resume",
        action="store_true",
        help="keep the comparisons already in DIR/compare.jsonl (those without an error) and make the rest",
    )
    c.add_argument("--out", default="results/compare")


def run_compare(args) -> int:
    from .compare import ComparePolicy

    pool = load_jsonl(args.prompts) if args.prompts else builtin(args.builtin or "mixed")
    prompts = take(pool, min(args.num_prompts, len(pool)), args.seed) if args.num_prompts else pool
    policy = ComparePolicy(args.policy, args.tie_threshold, args.max_tie_rate, args.max_divergences)
    tokenizer = TextTokenizer(args.tokenizer) if args.tokenizer else None
    out = Path(args.out)
    hold = claim(out)  # OutputError: exit 2 with its line, before any server is asked
    try:
        return _compare_into(out, args, prompts, policy, tokenizer)
    finally:
        hold.release()


def _compare_into(out: Path, args, prompts: list, policy, tokenizer: TextTokenizer | None) -> int:
    import asyncio

    from .answer import ERRORS
    from .compare import compare
    from .compare_io import RowLog, exit_status, run_identity, verdict_line, write_outputs

    baseline, candidate = (
        endpoint_for(url, args, "completions", tokenizer) for url in (args.baseline, args.candidate)
    )
    try:
        log = RowLog(out, args.resume, run_identity(baseline, candidate, policy, args.stream))
    except ResumeConflict as exc:  # the folder is left as it was
        print(f"error: resume_conflict: {exc}", file=sys.stderr)
        return ERRORS["resume_conflict"][0]
    if args.resume:
        print(
            f"resume: {len(log.kept)} comparisons kept, {log.dropped} lines dropped "
            "(errors are compared again)",
            file=sys.stderr,
        )
    try:
        results, summary = asyncio.run(
            compare(
                baseline,
                candidate,
                prompts,
                args.max_tokens,
                args.concurrency,
                policy,
                stream=args.stream,
                timeout=args.timeout,
                done=log.kept,
                on_result=log.append,
            )
        )
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {len(log.kept) + log.written} comparisons kept in "
            f"{log.path}; rerun with --resume to make the rest",
            file=sys.stderr,
        )
        return 130
    finally:
        log.close()
    write_outputs(out, results, summary)
    print(json.dumps(summary, indent=2))
    first = next((d for r in results for d in r.divergences), None)
    if first is not None:
        print(
            f"first divergence: position {first.position}, baseline {first.baseline_token} "
            f"vs candidate {first.candidate_token}, margin {first.margin}, {first.kind} "
            f"({first.what})"
        )
    for level in args.concurrency:
        if level > summary["distinct_prompts"] > 0:
            print(
                f"note: concurrency {level} with {summary['distinct_prompts']} prompts: at "
                f"most {summary['distinct_prompts']} in flight",
                file=sys.stderr,
            )
    if summary["unusable"]:
        print(
            f"note: {summary['unusable']} prompts cannot be sent (first: {summary['unusable_reasons'][0]})",
            file=sys.stderr,
        )
    print(verdict_line(results, summary), file=sys.stderr)
    return exit_status(summary)


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
    bench.add_argument("--base-url", required=True, type=base_url)
    bench.add_argument("--label", default="A")
    _workload_args(bench)
    ab = sub.add_parser("ab", help="baseline A vs candidate B, interleaved")
    for side in ("a", "b"):
        group = ab.add_mutually_exclusive_group(required=True)
        group.add_argument(f"--{side}-url", type=base_url, help=f"attach to server {side.upper()}")
        group.add_argument(f"--{side}-cmd", help=f"start server {side.upper()} ({{port}} filled in)")
        ab.add_argument(
            f"--{side}-label",
            default=None,
            help=f"what server {side.upper()} is, named in the report (e.g. "
            f"{'plain' if side == 'a' else 'dflash'})",
        )
    _workload_args(ab)
    return p


def prompt_pool(args) -> list | None:
    if args.dataset:
        return load_jsonl(args.dataset)
    if args.builtin:
        return builtin(args.builtin)
    return None  # synthetic


def prompts_for(args, count: int) -> list:
    pool = prompt_pool(args)
    if args.long_input_len is not None:
        if pool is not None:
            raise WorkloadError(
                "--long-input-len mixes synthetic prompts; it takes no --dataset or --builtin"
            )
        return mixed_long(
            count, args.input_len, args.long_input_len, args.long_share, args.seed, as_text=args.text
        )
    if pool is None:
        return synthetic(count, args.input_len, args.seed, as_text=args.text)
    return take(pool, count, args.seed)


def measured_count(args) -> int:
    """Measured requests per concurrency: the same at every level, so every level sees the
    same prompts (a dataset's whole set, repeated up to the highest concurrency)."""
    if args.num_prompts:
        return args.num_prompts
    top = max(args.concurrency)
    pool = prompt_pool(args)
    if pool is None:
        return max(8, 4 * top)
    return len(pool) * -(-top // len(pool))


def client_processes(args, concurrency: int) -> int:
    """The client processes asked for at `concurrency` (--client-processes, or the automatic
    choice); a run with an arrival rate takes one whatever this says (load.measure)."""
    return args.client_processes or client_processes_for(concurrency)


def run(
    args, servers: dict[str, ManagedServer], out: Path, endpoint_of, loads: list[dict], prompts: list
) -> list[dict]:
    """Measure every planned run not already done, each sending `prompts` (the warm-up's
    first, then the measured ones: the same for every server and level); `loads` gets each
    run's machine load before and after it (meta.json's `machine_load`)."""
    concurrencies = args.concurrency
    slo = {
        k: v
        for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms), ("e2e", args.slo_e2e_ms))
        if v is not None
    }
    count = len(prompts) - args.warmup
    planned = {(label, c, r): count for c in concurrencies for r in range(args.repeats) for label in servers}
    skip: set = set()
    if args.resume:
        resumed = prepare(out, planned, args.max_failure_rate)
        skip = resumed.done
        if resumed.repaired:
            print(f"resume: {resumed.repaired}", file=sys.stderr)
        if resumed.redo or resumed.dropped_lines:
            print(
                f"resume: {len(skip)} runs kept, {len(planned) - len(skip)} to measure "
                f"({len(resumed.redo)} failed or incomplete cleared, "
                f"{resumed.dropped_lines} torn lines dropped)",
                file=sys.stderr,
            )
    trim_torn_tail(out / "requests.jsonl")
    summaries = []
    for c in concurrencies:
        spec = LoadSpec(
            concurrency=c,
            num_prompts=count,
            output_len=args.output_len,
            warmup=args.warmup,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            timeout_s=args.timeout,
            seed=args.seed,
            slo_ms=slo,
            client_processes=client_processes(args, c),
        )
        for repeat in range(args.repeats):
            for label, server in servers.items():  # interleaved A, B, A, B
                if (label, c, repeat) in skip:
                    continue
                endpoint = endpoint_of(label)  # probed on first use only
                labels = {"label": label, "concurrency": c, "repeat": repeat}
                before = machine_load()
                summaries.append(measure(endpoint, prompts, spec, out, labels, server.url + "/metrics"))
                loads.append({**labels, "before": before, "after": machine_load()})
    return summaries


def print_table(summaries: list[dict]) -> None:
    cols = [
        "label",
        "concurrency",
        "repeat",
        "completed",
        "failed",
        "output_tokens_per_s",
        "ttft_ms_median",
        "tpot_ms_mean",
        "itl_token_ms_mean",
        "itl_chunk_ms_mean",
        "acceptance_length",
    ]
    cols += [  # a workload of short and long prompts: each group's own latencies
        f"{metric}_{group}_{stat}"
        for group in GROUPS
        if any(f"ttft_ms_{group}_median" in s for s in summaries)
        for metric, stat in (("ttft_ms", "median"), ("itl_token_ms", "mean"))
    ]
    print(" | ".join(cols))
    for s in summaries:
        print(
            " | ".join(f"{s.get(c):.2f}" if isinstance(s.get(c), float) else str(s.get(c, "")) for c in cols)
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if getattr(args, "client_processes", None) not in (None, 1) and not math.isinf(args.request_rate):
        print(
            "error: --client-processes spreads a closed loop; with --request-rate the client is one process",
            file=sys.stderr,
        )
        return 2
    if args.command == "compare":
        try:
            return run_compare(args)
        except (WorkloadError, ValueError, OSError, OutputError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:  # a tokenizer that cannot be read is a bad argument: refused before the folder or a server
        tokenizer = TextTokenizer(args.tokenizer) if args.tokenizer else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # so is a workload that cannot be built
        prompts = prompts_for(args, args.warmup + measured_count(args))
    except (WorkloadError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    fresh = not out.exists()
    try:
        hold = claim(out)
    except OutputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    servers: dict[str, ManagedServer] = {}
    identity = bench_identity(args)
    refusal = None  # nothing is started and the folder is left as it was
    if not args.resume and holds_rows(out):  # appending would put two benchmarks in one folder
        refusal = (
            f"{out} already holds measured rows (requests.jsonl, summary.csv): "
            "--resume continues that benchmark, another --out starts a new one"
        )
    elif args.resume:
        try:
            check_identity(out, identity)
        except ResumeConflict as exc:
            refusal = f"resume_conflict: {exc}"
    if refusal is not None:
        hold.release()
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        write_identity(out, identity)
        if args.command == "bench":
            servers[args.label] = ManagedServer(args.base_url)
        else:
            for side in ("a", "b"):
                url, cmd = getattr(args, f"{side}_url"), getattr(args, f"{side}_cmd")
                log = out / f"server-{side.upper()}.log"
                servers[side.upper()] = ManagedServer.start(cmd, log) if cmd else ManagedServer(url)
        endpoints: dict[str, Endpoint] = {}

        def endpoint_of(label: str) -> Endpoint:
            if label not in endpoints:
                endpoints[label] = endpoint_for(servers[label].url, args, args.endpoint, tokenizer)
            return endpoints[label]

        meta = metadata(argv, servers, args.notes)
        if args.command == "ab" and (args.a_label or args.b_label):
            meta["labels"] = {"A": args.a_label or "A", "B": args.b_label or "B"}
        meta["tokenizer"] = args.tokenizer
        write_meta(out, meta)
        meta["machine_load"] = []
        summaries = run(args, servers, out, endpoint_of, meta["machine_load"], prompts)
        if endpoints:
            meta["server_kinds"] = {label: e.accepts.as_dict() for label, e in endpoints.items()}
        write_meta(out, meta)
        rows: list[dict] = []
        if (out / "summary.csv").exists():  # every row, a resumed run's earlier ones too
            with (out / "summary.csv").open() as f:
                rows = list(csv.DictReader(f))
            (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
        if args.command == "ab":  # over every run in summary.csv, a resumed run's kept ones too
            ratios(summary_numbers(rows) if rows else summaries, out / "ab.csv")
    except (WorkloadError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a disk that filled up, a folder made unwritable during the run
        print(f"error: {exc}{'' if exc.filename else f' (writing into {out})'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept, _ = read_request_rows(out / "requests.jsonl")
        print(
            f"\ninterrupted: {len(kept)} measured requests kept in {out}; "
            "rerun with --resume to measure the rest",
            file=sys.stderr,
        )
        return 130
    finally:
        for server in servers.values():
            server.stop()
        hold.release()
    planned = [
        r
        for r in rows
        if r["label"] in servers
        and int(r["concurrency"]) in args.concurrency
        and int(r["repeat"]) < args.repeats
    ]
    failure = verdict_line(planned, args.max_failure_rate)
    if failure is not None and fresh and not any(int(float(r.get("completed") or 0)) for r in rows):
        shutil.rmtree(out, ignore_errors=True)  # nothing was measured: leave no stub folder
        print(f"error: {failure}; nothing measured, {out} removed", file=sys.stderr)
        return 1
    print_table(summaries)
    try:
        from reports.markdown import build_report
    except ImportError:  # reports needs pandas and matplotlib; rebuild later with them
        print(f"report not built (reports needs pandas and matplotlib): python -m reports {out}")
    else:
        print(f"report: {build_report(out)}")
    print(f"results: {out}")
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

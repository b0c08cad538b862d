"""Contracts of the harness's input side, on real files and real HTTP on loopback:

- argument types (harness/arguments.py): a concurrency level named twice, port 0, a scheme
  other than http(s), a rate above 1 and `--client-processes 0` are refused; `auto` is kept
  as None.
- the tokenizer (harness/tokens.py): a folder without tokenizer.json, or a tokenizer.json the
  tokenizers package cannot read, is one ValueError naming the path.
- workloads (harness/workloads.py): the long-and-short mix puts its long prompts where the
  running share steps up, each tagged with its group and of its group's length; a dataset
  row keeps a raw U+2028 inside its prompt, is refused without a usable prompt or with a
  message that has no role, and a file of blank lines holds no prompts; built-in sets number
  their prompts from 0; arrivals start at 0, one per request.
- resume (harness/resume.py): every workload option a bench run parses is part of the
  folder's identity; a run whose failure rate equals the threshold is kept; the last copy of
  a request row wins; only runs that left rows are reported as cleared; summary rows of
  runs outside the plan are kept.
- the verdict (harness/outcome.py): a run failing exactly the allowed share passes; a
  failed run is named with failed/sent.
- the output folder (harness/output.py): the probe file is removed, 16 MiB is the room
  wanted.
- server kinds (harness/server_kind.py): the extensions each kind sends and the table's
  continuous-usage column; the probe sends the model asked for.
- the command line (harness/__main__.py): a synthetic run measures at least 8 requests, a
  dataset is repeated whole up to the highest concurrency, `--long-input-len` takes no
  dataset, `--client-processes` takes no `--request-rate`, and a tokenizer that cannot be
  read is refused before the output folder is made; a negative or nan SLO, a nan tie
  threshold and an infinite burstiness are refused as arguments; an output folder whose lock
  cannot be opened, a dataset that is not UTF-8 (naming the file and line) and a model list
  that is not a list are one clear line, not a traceback.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from harness import arguments
from harness.__main__ import main, measured_count, parser, prompts_for
from harness.outcome import verdict_line
from harness.output import MIN_FREE_BYTES, check
from harness.resume import (
    IDENTITY_OPTIONS,
    ResumeConflict,
    bench_identity,
    check_identity,
    prepare,
    read_request_rows,
    write_identity,
)
from harness.server_kind import KNOWN, probe
from harness.tokens import TextTokenizer
from harness.workloads import WorkloadError, arrival_times, builtin, load_jsonl, mixed_long

from .openai_stub import serve

DEAD = "http://127.0.0.1:9"


def bench_args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["bench", "--base-url", DEAD, *argv])


def write_lines(path: Path, *rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- argument types
@pytest.mark.parametrize(
    ("convert", "text", "message"),
    [
        (arguments.positive_int, "0", "a whole number >= 1, got 0"),
        (arguments.non_negative_int, "-1", "a whole number >= 0, got -1"),
        (arguments.positive_float, "0", "a number > 0, got 0.0"),
        (arguments.concurrency_list, "1,4,1", "level 1 is named twice"),
        (arguments.base_url, "http://127.0.0.1:0", "port must be in 1-65535, got 0"),
        (arguments.base_url, "ftp://127.0.0.1:21", "expected http://HOST[:PORT]"),
        (arguments.base_url, "ws://127.0.0.1:8000", "expected http://HOST[:PORT]"),
        (arguments.rate, "1.5", "a fraction in [0, 1]"),
        (arguments.auto_or_positive_int, "0", "auto or a whole number >= 1"),
    ],
)
def test_argument_types_refuse_values_outside_their_range(convert, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        convert(text)


def test_argument_types_keep_auto_and_the_bounds() -> None:
    assert arguments.auto_or_positive_int("auto") is None
    assert arguments.auto_or_positive_int("1") == 1
    assert arguments.positive_int("1") == 1 and arguments.non_negative_int("0") == 0
    assert arguments.rate("1") == 1.0 and arguments.rate("0") == 0.0
    assert arguments.base_url("https://127.0.0.1:65535") == "https://127.0.0.1:65535"
    assert arguments.concurrency_list("16,1") == [16, 1]


# ----------------------------------------------------------------------------- the tokenizer
def test_a_folder_without_a_tokenizer_is_one_value_error_naming_it(tmp_path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        TextTokenizer(tmp_path)


def test_a_tokenizer_file_the_package_cannot_read_is_one_value_error_naming_it(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonesuch"}}')
    with pytest.raises(ValueError, match="is not a tokenizer the tokenizers package reads") as caught:
        TextTokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(caught.value)
    assert "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- workloads
def test_the_long_prompts_of_a_mix_are_where_the_share_steps_up_and_of_their_own_length() -> None:
    prompts = mixed_long(12, 4, 9, 0.25, seed=3)
    assert [p.group for p in prompts] == ["short", "short", "short", "long"] * 3
    assert all(len(p.token_ids) == (9 if p.group == "long" else 4) for p in prompts)
    third = mixed_long(9, 4, 9, 1 / 3, seed=3)
    assert [i for i, p in enumerate(third) if p.group == "long"] == [2, 5, 8]


def test_a_mix_is_seeded_and_its_short_and_long_prompts_differ() -> None:
    one, two = mixed_long(8, 5, 10, 0.5, seed=7), mixed_long(8, 5, 10, 0.5, seed=7)
    assert one == two
    assert mixed_long(8, 5, 10, 0.5, seed=8) != one


def test_a_raw_line_separator_inside_a_prompt_stays_in_its_row(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\u2028b\u2029c\u0085d"}\n{"prompt": "e"}\n', encoding="utf-8")
    prompts = load_jsonl(path)
    assert [p.text for p in prompts] == ["a\u2028b\u2029c\u0085d", "e"]
    assert [p.source for p in prompts] == [f"{path}:1", f"{path}:2"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": []}, "needs a 'prompt' string or a non-empty list"),
        ({"prompt": [1, "2"]}, "needs a 'prompt' string or a non-empty list"),
        ({"prompt": [True, 2]}, "needs a 'prompt' string or a non-empty list"),
        ({"messages": [{"content": "hi"}]}, "a string 'role'"),
        ({"messages": ["hi"]}, "a string 'role'"),
        ({"prompt": 5}, "needs a 'prompt' string"),
    ],
)
def test_a_dataset_row_without_a_usable_prompt_is_refused_naming_its_line(tmp_path, row, message) -> None:
    path = write_lines(tmp_path / "p.jsonl", {"prompt": "fine"}, row)
    with pytest.raises(WorkloadError, match=message) as caught:
        load_jsonl(path)
    assert f"{path}:2" in str(caught.value)


def test_a_dataset_of_blank_lines_holds_no_prompts(tmp_path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_text("\n  \n\t\n")
    with pytest.raises(WorkloadError, match="no prompts"):
        load_jsonl(path)


def test_an_empty_messages_list_is_a_prompt_of_its_own(tmp_path) -> None:
    path = write_lines(tmp_path / "p.jsonl", {"messages": [], "output_len": 3})
    [prompt] = load_jsonl(path)
    assert prompt.messages == () and prompt.max_tokens == 3


def test_built_in_sets_number_their_prompts_from_zero_in_each_set() -> None:
    code = builtin("code")
    assert [p.source for p in code] == [f"builtin:code#{i}" for i in range(len(code))]
    mixed = builtin("mixed")
    assert {p.source for p in mixed} >= {"builtin:chat#0", "builtin:code#0", "builtin:math#0"}
    assert len(mixed) == sum(len(builtin(n)) for n in ("chat", "code", "math"))


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_start_at_zero_one_per_request(burstiness: float) -> None:
    times = arrival_times(5, 2.0, burstiness, seed=4)
    assert len(times) == 5 and times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:]))
    assert arrival_times(1, 2.0, burstiness, seed=4) == [0.0]
    assert arrival_times(0, 2.0, burstiness, seed=4) == []


# ----------------------------------------------------------------------------- resume
OPTION_CHANGES = {
    "model": ["--model", "other"],
    "server_kind": ["--server-kind", "openai"],
    "tokenizer": ["--tokenizer", "/elsewhere"],
    "endpoint": ["--endpoint", "chat"],
    "num_prompts": ["--num-prompts", "9"],
    "input_len": ["--input-len", "9"],
    "output_len": ["--output-len", "9"],
    "builtin": ["--builtin", "code"],
    "text": ["--text"],
    "long_input_len": ["--long-input-len", "99"],
    "long_share": ["--long-share", "0.5"],
    "warmup": ["--warmup", "5"],
    "request_rate": ["--request-rate", "3"],
    "burstiness": ["--burstiness", "2"],
    "timeout": ["--timeout", "9"],
    "seed": ["--seed", "9"],
    "slo_ttft_ms": ["--slo-ttft-ms", "9"],
    "slo_tpot_ms": ["--slo-tpot-ms", "9"],
    "slo_e2e_ms": ["--slo-e2e-ms", "9"],
}


@pytest.mark.parametrize("name", sorted(OPTION_CHANGES))
def test_resume_with_any_other_workload_option_is_a_conflict_naming_it(tmp_path, name: str) -> None:
    assert name in IDENTITY_OPTIONS
    write_identity(tmp_path, bench_identity(bench_args()))
    write_lines(tmp_path / "requests.jsonl", {"label": "A", "concurrency": 1, "repeat": 0, "index": 0})
    check_identity(tmp_path, bench_identity(bench_args()))
    with pytest.raises(ResumeConflict, match=f"^the rows in .* were measured with other .*: {name} was "):
        check_identity(tmp_path, bench_identity(bench_args(*OPTION_CHANGES[name])))


def test_resume_does_not_hold_levels_repeats_threshold_labels_or_notes(tmp_path) -> None:
    write_identity(tmp_path, bench_identity(bench_args()))
    write_lines(tmp_path / "requests.jsonl", {"label": "A", "concurrency": 1, "repeat": 0, "index": 0})
    check_identity(
        tmp_path,
        bench_identity(
            bench_args(
                "--concurrency",
                "2,32",
                "--repeats",
                "3",
                "--max-failure-rate",
                "0.5",
                "--label",
                "B",
                "--notes",
                "n",
                "--api-key",
                "k",
            )
        ),
    )


def summary_file(path: Path, rows: list[tuple]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "concurrency", "repeat", "completed", "failed", "errors"])
        writer.writerows(rows)


def test_a_run_failing_exactly_the_allowed_share_is_kept(tmp_path) -> None:
    summary_file(tmp_path / "summary.csv", [("A", 1, 0, 3, 1, "HTTP 500")])
    resumed = prepare(tmp_path, {("A", 1, 0): 4}, max_failure_rate=0.25)
    assert resumed.done == {("A", 1, 0)} and resumed.redo == set()
    resumed = prepare(tmp_path, {("A", 1, 0): 4}, max_failure_rate=0.2)
    assert resumed.done == set() and resumed.redo == {("A", 1, 0)}


def test_the_last_copy_of_a_request_row_wins_and_only_runs_that_left_rows_are_cleared(tmp_path) -> None:
    summary_file(tmp_path / "summary.csv", [("A", 1, 0, 2, 0, ""), ("Z", 9, 0, 1, 0, "")])
    write_lines(
        tmp_path / "requests.jsonl",
        {"label": "A", "concurrency": 1, "repeat": 0, "index": 0, "copy": "first"},
        {"label": "A", "concurrency": 1, "repeat": 0, "index": 1, "copy": "only"},
        {"label": "A", "concurrency": 1, "repeat": 0, "index": 0, "copy": "second"},
        {"label": "A", "concurrency": 2, "repeat": 0, "index": 0, "copy": "unfinished"},
    )
    planned = {("A", 1, 0): 2, ("A", 2, 0): 2, ("A", 4, 0): 2}
    resumed = prepare(tmp_path, planned, max_failure_rate=0.0)
    assert resumed.done == {("A", 1, 0)}
    assert resumed.redo == {("A", 2, 0)}  # c=4 never ran: nothing of it to clear
    rows, dropped = read_request_rows(tmp_path / "requests.jsonl")
    assert dropped == 0
    assert [(r["index"], r["copy"]) for r in rows] == [(1, "only"), (0, "second")]
    with (tmp_path / "summary.csv").open() as f:
        kept = [(r["label"], r["concurrency"]) for r in csv.DictReader(f)]
    assert kept == [("A", "1"), ("Z", "9")]  # a run outside the plan stays


# ----------------------------------------------------------------------------- the verdict
def test_a_run_failing_exactly_the_allowed_share_passes_and_a_failed_run_says_failed_of_sent() -> None:
    rows = [{"label": "A", "concurrency": "4", "repeat": "0", "completed": "3", "failed": "1", "errors": "x"}]
    assert verdict_line(rows, 0.25) is None
    line = verdict_line(rows, 0.2)
    assert line == (
        "benchmark failed: 1 of 1 runs failed more than --max-failure-rate 0.2 of their requests "
        "(A c=4 r=0 1/4); first error: x"
    )


# ----------------------------------------------------------------------------- the output folder
def test_the_output_check_leaves_only_the_folder_and_wants_16_mib(tmp_path) -> None:
    out = tmp_path / "a" / "b"
    check(out)
    assert out.is_dir() and list(out.iterdir()) == []
    assert MIN_FREE_BYTES == 16 * 2**20


# ----------------------------------------------------------------------------- server kinds
def test_each_kind_sends_the_extensions_of_the_documented_table() -> None:
    """ignore_eos only when asked and accepted; continuous usage for ours, vLLM and SGLang;
    return_token_ids for vLLM alone."""
    for name, kind in KNOWN.items():
        assert kind.extras(ignore_eos=False).get("ignore_eos") is None
        assert ("ignore_eos" in kind.extras(ignore_eos=True)) == (name != "openai")
        assert ("continuous_usage_stats" in kind.stream_options()) == (name in ("ours", "vllm", "sglang"))
        assert kind.stream_options()["include_usage"] is True
        assert ("return_token_ids" in kind.extras(ignore_eos=False)) == (name == "vllm")
        assert kind.returns_ids == (name in ("ours", "vllm"))
        assert kind.as_dict()["prompt_ids"] is True


def test_the_probe_asks_for_the_model_it_was_given() -> None:
    bodies: list[dict] = []
    server, url = serve(lambda prompt, n: ["a"] * n, bodies)
    try:
        found = probe(url, model="asked-for")
        assert found.models == ("stub-model",)
        assert bodies and all(b.get("model") == "asked-for" for b in bodies)
        bodies.clear()
        probe(url)
        assert bodies and all(b.get("model") == "stub-model" for b in bodies)
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- the command line
def test_a_synthetic_run_measures_four_per_top_level_and_at_least_eight() -> None:
    assert measured_count(bench_args("--concurrency", "1")) == 8
    assert measured_count(bench_args("--concurrency", "1,3")) == 12
    assert measured_count(bench_args("--concurrency", "3", "--num-prompts", "5")) == 5


def test_a_dataset_is_repeated_whole_up_to_the_highest_concurrency(tmp_path) -> None:
    path = write_lines(tmp_path / "p.jsonl", *({"prompt": f"p{i}"} for i in range(5)))
    assert measured_count(bench_args("--dataset", str(path), "--concurrency", "1")) == 5
    assert measured_count(bench_args("--dataset", str(path), "--concurrency", "5")) == 5
    assert measured_count(bench_args("--dataset", str(path), "--concurrency", "6")) == 10
    assert measured_count(bench_args("--dataset", str(path), "--concurrency", "2,11")) == 15
    args = bench_args("--dataset", str(path), "--concurrency", "6", "--warmup", "2")
    prompts = prompts_for(args, args.warmup + measured_count(args))
    assert len(prompts) == 12
    assert {p.text for p in prompts} == {f"p{i}" for i in range(5)}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--long-input-len", "32", "--builtin", "code"], "--long-input-len mixes synthetic prompts"),
        (["--client-processes", "2", "--request-rate", "4"], "--client-processes spreads a closed loop"),
        (["--tokenizer", "{tmp}/nothing-here"], "no tokenizer.json there"),
        (["--long-input-len", "32", "--long-share", "1"], "long_share must be in (0, 1)"),
    ],
)
def test_a_bench_that_cannot_be_built_is_refused_before_its_folder(tmp_path, capsys, argv, message) -> None:
    out = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "--base-url", DEAD, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not out.exists()


# ------------------------------------------------------------------- values no run can use, refused
@pytest.mark.parametrize("value", ["-5", "nan"])
def test_an_slo_that_no_request_can_meet_is_a_bad_argument(value: str) -> None:
    with pytest.raises(SystemExit) as caught:
        bench_args("--slo-ttft-ms", value)
    assert caught.value.code == 2


def test_a_tie_threshold_that_is_not_a_number_is_a_bad_argument() -> None:
    with pytest.raises(SystemExit) as caught:
        parser().parse_args(["compare", "--baseline", DEAD, "--candidate", DEAD, "--tie-threshold", "nan"])
    assert caught.value.code == 2


def test_an_infinite_burstiness_is_a_bad_argument() -> None:
    with pytest.raises(SystemExit) as caught:
        bench_args("--request-rate", "4", "--burstiness", "inf")
    assert caught.value.code == 2


def test_an_output_folder_whose_lock_cannot_be_opened_is_refused_with_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    (out / ".lock").mkdir(parents=True)
    assert main(["bench", "--base-url", DEAD, "--num-prompts", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_dataset_that_is_not_utf8_is_refused_naming_the_file(tmp_path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(WorkloadError, match=str(path)):
        load_jsonl(path)


def test_a_model_list_that_is_not_a_list_names_no_models() -> None:
    bodies: list[dict] = []
    server, url = serve(lambda prompt, n: ["a"] * n, bodies)
    try:
        server.RequestHandlerClass.do_GET = lambda self: self.reply(200, {"object": "list", "data": 5})
        found = probe(url)
        assert found.models == () and found.kind.name == "openai"
    finally:
        server.shutdown()

"""The engine benchmark (reference_engine/bench/), run in-process on tiny checkpoints: one CSV row per
(mode, concurrency) with throughput, acceptance length, per-phase times and the step time
they add up to; the table on stdout; random real-shaped pairs; one mode alone; the profiler
capture range a no-op on the CPU; argument errors exit with code 2."""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from reference_engine import bench
from reference_engine.demo import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
from reference_engine.errors import ReferenceEngineError
from reference_engine.runtime.stats import NESTED, PHASES
from reference_engine.tokenizer import load_tokenizer

TinyPair = Callable[..., tuple[Path, Path]]
PHASE_COLUMNS = [f"ms_{phase}" for phase in PHASES]
TOP_LEVEL = [phase for phase in PHASES if phase not in NESTED]
TABLE_HEADER = " | ".join(
    [
        "mode",
        "draft",
        "numerics",
        "concurrency",
        "output_tokens_per_s",
        "mean_acceptance_length",
        "ms_per_step",
        *PHASE_COLUMNS,
    ]
)


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair: TinyPair) -> tuple[Path, Path]:
    return tiny_pair("qwen3", block_size=8)


@pytest.fixture(scope="module")
def checkpoint_run(pair_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """One benchmark over the tiny pair: (exit code, stdout, CSV rows)."""
    model, draft = pair_dirs
    out = tmp_path_factory.mktemp("bench") / "bench.csv"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = bench.main(
            [
                "--model",
                str(model),
                "--draft",
                str(draft),
                "--oracle-acceptance",
                "3",
                "--concurrency",
                "1,2",
                "--repeats",
                "1",
                "--input-len",
                "8",
                "--output-len",
                "12",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    return code, buffer.getvalue(), rows


def test_the_benchmark_exits_0_and_writes_one_row_per_mode_and_concurrency(checkpoint_run) -> None:
    code, stdout, rows = checkpoint_run
    assert code == 0
    assert [(r["mode"], int(r["concurrency"])) for r in rows] == [
        ("plain", 1),
        ("dflash", 1),
        ("plain", 2),
        ("dflash", 2),
    ]
    for column in ("output_tokens_per_s", "mean_acceptance_length", *PHASE_COLUMNS):
        assert column in rows[0], column
    for row in rows:
        assert float(row["output_tokens_per_s"]) > 0
        assert int(row["output_tokens"]) == 12 * int(row["concurrency"])
        assert all(float(row[c]) >= 0 for c in PHASE_COLUMNS)


def test_plain_rows_have_acceptance_length_1_and_no_speculative_phases(checkpoint_run) -> None:
    _, _, rows = checkpoint_run
    for row in rows:
        if row["mode"] != "plain":
            continue
        assert float(row["mean_acceptance_length"]) == 1.0
        assert float(row["ms_decode"]) > 0
        assert float(row["ms_draft"]) == float(row["ms_verify"]) == float(row["ms_commit"]) == 0


def test_dflash_rows_reach_the_oracle_acceptance_length_up_to_the_budget_cut(
    checkpoint_run,
) -> None:
    """Oracle 3 (accept 2 per step): 11 tokens after prefill commit 3 + 3 + 3 + 2, so the
    mean is 2.75; only the cut last step keeps it below 3."""
    _, _, rows = checkpoint_run
    for row in rows:
        if row["mode"] != "dflash":
            continue
        assert 2.3 <= float(row["mean_acceptance_length"]) <= 3.0
        assert float(row["mean_acceptance_length"]) == pytest.approx(2.75)
        assert int(row["steps"]) >= 4
        for phase in ("prefill", "draft", "verify", "commit", "sample", "schedule"):
            assert float(row[f"ms_{phase}"]) > 0, phase
        assert float(row["ms_decode"]) == 0


def test_step_time_holds_the_top_level_phases_and_counts_every_step(checkpoint_run) -> None:
    """One repeat on the host clock: ms_step (wall time in engine.step()) contains every
    top-level phase; `sample` runs inside prefill/decode and is not added again."""
    _, _, rows = checkpoint_run
    for row in rows:
        phases = sum(float(row[f"ms_{p}"]) for p in TOP_LEVEL)
        assert phases <= float(row["ms_step"]) <= 1000 * float(row["wall_s"])
        assert row["phase_clock"] == "host"
        assert int(row["n_schedule"]) == int(row["steps"])
        assert int(row["n_sample"]) >= int(row["concurrency"])  # at least each prompt's first


def test_per_step_figures_divide_by_the_steps_and_hold_every_phase_of_a_step(checkpoint_run) -> None:
    """ms_per_step is ms_step over the engine's steps (not its tokens), and a decode step's
    time (ms_per_decode_step) holds the decode phase per decode (plain), or the draft,
    verify, accept and commit phases per verify (DFlash)."""
    _, _, rows = checkpoint_run
    for row in rows:
        assert float(row["ms_per_step"]) == pytest.approx(float(row["ms_step"]) / int(row["steps"]))
        # throughput over the run's wall time, prefill and the host's work between steps included
        assert float(row["output_tokens_per_s"]) == pytest.approx(
            int(row["output_tokens"]) / float(row["wall_s"])
        )
        speculative = row["mode"] == "dflash"
        names = ("draft", "verify", "accept", "commit") if speculative else ("decode",)
        count = int(row["n_verify" if speculative else "n_decode"])
        want = sum(float(row[f"ms_{name}"]) for name in names) / count
        assert float(row["ms_per_decode_step"]) == pytest.approx(want)
        assert speculative == (float(row["ms_commit"]) > 0)


def test_the_printed_table_has_the_header_and_one_line_per_row(checkpoint_run) -> None:
    _, stdout, rows = checkpoint_run
    lines = stdout.splitlines()
    assert TABLE_HEADER in lines
    start = lines.index(TABLE_HEADER)
    table = lines[start + 1 : start + 1 + len(rows)]
    assert [line.split(" | ")[:4] for line in table] == [
        [r["mode"], r["draft"] or "None", r["numerics"], r["concurrency"]] for r in rows
    ]
    assert lines[-1].startswith("wrote ")


def test_a_random_real_shape_runs_without_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(
        [
            "--random-shape",
            "qwen3-small",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--concurrency",
            "1",
            "--repeats",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--oracle-acceptance",
            "4",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert TABLE_HEADER in lines
    start = lines.index(TABLE_HEADER)
    dflash = lines[start + 2].split(" | ")
    assert dflash[:4] == ["dflash", "dflash", "fast", "1"]  # the CPU runs the references: fast
    # 7 tokens after prefill: forced 3 + 1, then a block drafting the last 3 (bonus cut)
    assert dflash[5] == "3.5 (3.5-3.5)"  # the median and its min-max over the repeats


def test_one_mode_alone_with_the_oracle_takes_continuations_from_the_warm_up(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    out = tmp_path / "dflash.csv"
    code = bench.main(
        [
            "--random-shape",
            "qwen3-small",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--concurrency",
            "1,2",
            "--repeats",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--oracle-acceptance",
            "4",
            "--modes",
            "dflash",
            "--profile-capture",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    stdout = capsys.readouterr().out
    assert "--profile-capture: no CUDA device (cpu)" in stdout and "a no-op here" in stdout
    assert "plain" not in stdout.split("repeat 1/1:")[1].splitlines()[0]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("dflash", "1"), ("dflash", "2")]
    assert all(float(r["mean_acceptance_length"]) == 3.5 for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "m"], "--model needs --draft"),
        (["--draft", "d"], "--draft needs --model"),
        (["--model", "m", "--draft", "d", "--random-shape", "qwen3-small"], "give either"),
        (
            ["--random-shape", "qwen3-small", "--concurrency", "1,x"],
            "--concurrency must be comma-separated integers, got '1,x'",
        ),
        (["--random-shape", "qwen3-small", "--concurrency", "0"], "must be positive"),
        (["--random-shape", "qwen3-small", "--repeats", "0"], "must be positive"),
        (["--random-shape", "no-such-shape"], "invalid choice"),
        (
            ["--random-shape", "qwen3-small", "--modes", "plain,fast"],
            "--modes must be distinct values of plain, dflash, got 'plain,fast'",
        ),
        (["--random-shape", "qwen3-small", "--modes", "dflash,dflash"], "--modes must be distinct"),
    ],
    ids=[
        "model-without-draft",
        "draft-without-model",
        "model-and-shape",
        "concurrency-not-int",
        "concurrency-zero",
        "repeats-zero",
        "unknown-shape",
        "unknown-mode",
        "repeated-mode",
    ],
)
def test_bad_arguments_exit_with_code_2_and_say_why(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_checkpoint_is_one_error_line_with_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench.main(
        [
            "--model",
            str(tmp_path / "none"),
            "--draft",
            str(tmp_path / "none"),
            "--device",
            "cpu",
            "--concurrency",
            "1",
            "--repeats",
            "1",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err
    assert len(err.strip().splitlines()) == 1


def test_without_a_model_the_demo_pair_and_its_held_out_prompts_are_the_default() -> None:
    args = bench.BenchArgs.parse(["--concurrency", "1"])
    assert (args.model, args.draft, args.prompts) == (str(DEMO_TARGET), str(DEMO_DRAFT), str(DEMO_PROMPTS))


def test_prompts_come_from_a_jsonl_file_as_ids_or_text_in_order_and_cycled(
    pair_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = pair_dirs
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7]}\n\n{"prompt": "def greedy(logits):"}\n')
    prompts = bench.read_prompts(str(path), str(model), 3)
    encoded = load_tokenizer(model).encode("def greedy(logits):").ids
    assert prompts == [[5, 6, 7], encoded, [5, 6, 7]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no prompts"),
        ('{"text": "x"}\n', "needs `prompt_ids` or `prompt`"),
        ('{"prompt_ids": [1]}\n{oops\n', "prompts.jsonl:2: not valid JSON"),
        ("[1, 2]\n", "prompts.jsonl:1: each row must be a JSON object"),
    ],
)
def test_a_prompts_file_without_usable_rows_is_an_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ReferenceEngineError, match=message):
        bench.read_prompts(str(path), None, 1)


def test_the_benchmark_runs_the_given_prompts(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    model, draft = pair_dirs
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}\n')
    out = tmp_path / "bench.csv"
    with contextlib.redirect_stdout(io.StringIO()):
        code = bench.main(
            [
                "--model",
                str(model),
                "--draft",
                str(draft),
                "--prompts",
                str(path),
                "--concurrency",
                "1",
                "--repeats",
                "1",
                "--output-len",
                "6",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
    assert code == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["output_tokens"]) for r in rows] == [6, 6]


def test_a_missing_prompts_file_is_one_error_line_with_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench.main(
        ["--prompts", str(tmp_path / "none.jsonl"), "--device", "cpu", "--concurrency", "1", "--repeats", "1"]
    )
    assert code == 2
    # the demo pair is bfloat16: a note says it runs in float32 here, then the one error line
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --prompts ") and "no such file" in errors[0]


def test_numerics_are_compared_interleaved_and_named_in_every_row(tmp_path: Path) -> None:
    out = tmp_path / "numerics.csv"
    code = bench.main(
        [
            "--random-shape",
            "qwen3-small",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--concurrency",
            "1",
            "--repeats",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--numerics",
            "exact,fast",
            "--modes",
            "plain",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["numerics"], r["kernels"]) for r in rows] == [
        ("plain", "exact", "torch"),
        ("plain", "fast", "torch"),
    ]  # the CPU runs the references
    assert all(float(r["ms_per_step"]) > 0 and r["cuda_graphs"] == "False" for r in rows)


def test_bad_numerics_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.BenchArgs.parse(["--random-shape", "qwen3-small", "--numerics", "exact,loose"])
    assert exc.value.code == 2
    assert "--numerics must be distinct values of exact, fast, got 'exact,loose'" in capsys.readouterr().err


def test_the_speedups_follow_from_the_rows_and_are_printed(checkpoint_run) -> None:
    """DFlash over plain per concurrency: the tok/s ratio, and the decode steps' own ratio
    (acceptance length x plain step / DFlash step), computed from the CSV's columns."""
    _, stdout, rows = checkpoint_run
    typed = [
        {k: (float(v) if k.startswith(("ms_", "output_", "mean_")) else v) for k, v in r.items()}
        for r in rows
    ]
    table = bench.speedups(typed)
    assert [(r["numerics"], r["concurrency"]) for r in table] == [("fast", "1"), ("fast", "2")]
    for r in table:
        plain, spec = (
            next(x for x in typed if x["mode"] == m and x["concurrency"] == r["concurrency"])
            for m in ("plain", "dflash")
        )
        assert r["tok_s"] == spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
        assert (
            abs(
                r["decode"]
                - spec["mean_acceptance_length"] * plain["ms_per_decode_step"] / spec["ms_per_decode_step"]
            )
            < 1e-12
        )
    assert "DFlash/plain tok/s | DFlash/plain decode steps | DFlash step / plain step" in stdout


def test_no_speedup_row_for_runs_without_decode_steps() -> None:
    rows = [
        {
            "mode": "plain",
            "numerics": "fast",
            "concurrency": 1,
            "output_tokens_per_s": 5.0,
            "ms_per_decode_step": 0.0,
            "mean_acceptance_length": 1.0,
        },
        {
            "mode": "dflash",
            "numerics": "fast",
            "concurrency": 1,
            "output_tokens_per_s": 5.0,
            "ms_per_decode_step": 0.0,
            "mean_acceptance_length": 0.0,
        },
    ]
    assert bench.speedups(rows) == []


def test_each_mode_keeps_one_engine_per_concurrency_and_every_run_counts_only_itself(
    pair_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm-up and two repeats per mode on one engine each (built, graphs captured, once
    per concurrency, outside the runs): every run's counts are its own, the same in each
    run, as on a fresh engine; none carries the warm-up's or an earlier repeat's."""
    built, runs = [], []
    engine_class, run_once = bench.Engine, bench.run_once

    def counting_engine(target, draft, config):
        built.append(("plain" if draft is None else "dflash", config.max_num_seqs))
        return engine_class(target, draft, config)

    def recording_run(engine, *args, **kwargs):
        result = run_once(engine, *args, **kwargs)
        stats = engine.stats()
        histogram = stats["spec"]["acceptance_length_histogram"]
        runs.append(
            {
                **result["row"],
                "finished": stats["requests_finished"],
                "committed": sum(k * n for k, n in histogram.items()),
            }
        )
        return result

    monkeypatch.setattr(bench, "Engine", counting_engine)
    monkeypatch.setattr(bench, "run_once", recording_run)
    model, draft = pair_dirs
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            bench.main(
                [
                    "--model",
                    str(model),
                    "--draft",
                    str(draft),
                    "--oracle-acceptance",
                    "3",
                    "--concurrency",
                    "1,2",
                    "--repeats",
                    "2",
                    "--input-len",
                    "8",
                    "--output-len",
                    "12",
                    "--dtype",
                    "float32",
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
    assert built == [("plain", 1), ("dflash", 1), ("plain", 2), ("dflash", 2)]
    counts = ("steps", "output_tokens", "mean_acceptance_length", *[f"n_{phase}" for phase in PHASES])
    for mode in ("plain", "dflash"):
        for c in (1, 2):
            rows = [r for r in runs if r["mode"] == mode and r["concurrency"] == c]
            assert len(rows) == 3  # the warm-up and two repeats
            assert {tuple(r[k] for k in counts) for r in rows} == {tuple(rows[0][k] for k in counts)}
            for row in rows:
                assert row["n_schedule"] == row["steps"]
                # every token but each request's first (from its prefill) by a verify
                assert row["committed"] == (row["output_tokens"] - c if mode == "dflash" else 0)
                assert row["finished"] == c

"""Contracts of the engine benchmark's figures (reference_engine/bench/), the benchmark
report's plots and ratio table (reports/) and the benchmark scripts (scripts/), each figure
checked against a value worked out by hand.

The engine benchmark, driven with scripted runs in place of the engine's (every repeat's
throughput, step times and acceptance chosen): a CSV figure is the median of the measured
repeats, never of the warm-up; the progress line after a repeat gives that repeat's figures;
`--num-prompts` sets the requests of every concurrency and `--seed` the random prompts; the
weight-streaming floor is measured with the concurrency's rows and the cache at the mean
context (the prompt and half the output), `over_floor` is the decode step over the floor and
`prefill_over_floor` the prefill phase over the prompts' compute floor; DFlash is set against
plain of its own numerics (tok/s, the decode steps' speed-up and the step ratio DFlash over
plain), and DFlash2 against DFlash of its own numerics; the CSV has every column any row has.

The report: each side's acceptance-length bars are shares of its own steps, each ITL panel
draws its own concurrency's gaps, every side with per-position rates gets a panel, and a
ratio a fraction of a percent off 1 outside the noise is printed to three decimals and judged.

The scripts: the acceptance script evaluates the target, prompts, block sizes and output
length given and writes them per draft; profile_step reads ROWSxWIDTH cases and refuses a
width past the block or no rows; bench_kernels' copy bandwidth counts the bytes read and
written, and its table and CSV give exact over fast and each kernel's memory floor.

Refusals and robustness: --num-prompts below 1 is refused naming the flag (0 was read as
unset, -1 ended in a traceback), so is the acceptance script's --max-tokens 0 (a traceback
after loading every model), and a meta.json machine-load entry without its `before` reading
is passed over by the report instead of stopping it.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from reference_engine import bench
from reference_engine.bench import drafts
from reference_engine.bench.floor import Floor
from reference_engine.demo import DEMO_DRAFT
from reference_engine.runtime.stats import PHASES
from reports import markdown, plots, tables
from reports.results import ItlSamples, ResultSet, aggregate_repeats

# ---------------------------------------------------------------------------------------------
# the engine benchmark, its runs scripted

# per mode: the warm-up's figure first, then the three measured repeats'
SCRIPT = {
    "plain": {
        "output_tokens_per_s": (1000.0, 10.0, 40.0, 20.0),  # median 20 (mean 23.3; with the warm-up 30)
        "ms_per_decode_step": (100.0, 4.0, 6.0, 5.0),  # median 5
        "ms_per_step": (100.0, 7.0, 9.0, 8.0),  # median 8
        "ms_prefill": (100.0, 3.0, 3.0, 3.0),
        "mean_acceptance_length": (1.0, 1.0, 1.0, 1.0),
    },
    "dflash": {
        "output_tokens_per_s": (1000.0, 30.0, 90.0, 60.0),  # median 60
        "ms_per_decode_step": (100.0, 8.0, 12.0, 10.0),  # median 10
        "ms_per_step": (100.0, 11.0, 13.0, 12.0),
        "ms_prefill": (100.0, 6.0, 6.0, 6.0),
        "mean_acceptance_length": (9.0, 4.0, 4.0, 4.0),
    },
}
FLOOR = Floor(ms_median=2.5, ms_min=2.0, ms_max=3.0, bytes=10**9, repeats=20, cache_bytes=10**6)
PREFILL_FLOOR_MS_PER_TOKEN = 0.25


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair) -> tuple[Path, Path]:
    return tiny_pair("qwen3", block_size=8)


def scripted_benchmark(
    monkeypatch: pytest.MonkeyPatch, pair_dirs, tmp_path_factory, *extra: str, floor: bool = False
):
    """Runs `bench.main` on the tiny pair with engines that run nothing: each engine's first
    run (its warm-up) and its repeats return SCRIPT's figures. Returns (exit code, stdout,
    CSV rows, what was recorded: prompts per engine, floor calls)."""
    record = {"prompts": [], "floors": [], "prefill_tokens": []}

    def make_engine(target, draft, prompts, args, concurrency, numerics):
        record["prompts"].append((concurrency, [list(p) for p in prompts]))
        return SimpleNamespace(
            mode="plain" if draft is None else "dflash", draft=draft, numerics=numerics, runs=0
        )

    def run_once(engine, prompts, args, concurrency, continuations):
        i = engine.runs
        engine.runs += 1
        figures = {k: v[i] for k, v in SCRIPT[engine.mode].items()}
        row = {
            "mode": engine.mode,
            "draft": None if engine.draft is None else drafts.arch_of(engine.draft),
            "numerics": engine.numerics or "fast",
            "concurrency": concurrency,
            **{f"ms_{phase}": 0.0 for phase in PHASES},
            **figures,
            "distinct_experts": None,
        }
        return {"row": row, "outputs": [[1, 2, 3] for _ in prompts]}

    def weight_streaming_floor(target, **kwargs):
        record["floors"].append(kwargs)
        return FLOOR

    def prefill_compute_floor(target, tokens):
        record["prefill_tokens"].append(tokens)
        return SimpleNamespace(ms_median=PREFILL_FLOOR_MS_PER_TOKEN * tokens)

    monkeypatch.setattr(bench, "make_engine", make_engine)
    monkeypatch.setattr(bench, "run_once", run_once)
    monkeypatch.setattr(bench, "weight_streaming_floor", weight_streaming_floor)
    monkeypatch.setattr(bench, "prefill_compute_floor", prefill_compute_floor)
    model, draft = pair_dirs
    out = tmp_path_factory.mktemp("bench") / "bench.csv"
    argv = [
        "--model",
        str(model),
        "--draft",
        str(draft),
        "--concurrency",
        "1,2",
        "--repeats",
        "3",
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
        *(["--floor"] if floor else []),
        *extra,
    ]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = bench.main(argv)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    return code, buffer.getvalue(), rows, record


def by_mode(rows: list[dict], mode: str, concurrency: int) -> dict:
    return next(r for r in rows if r["mode"] == mode and int(r["concurrency"]) == concurrency)


def test_a_csv_figure_is_the_median_of_the_measured_repeats_never_of_the_warm_up(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    code, _, rows, _ = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory)
    assert code == 0
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("plain", "1"),
        ("dflash", "1"),
        ("plain", "2"),
        ("dflash", "2"),
    ]
    for c in (1, 2):
        plain, dflash = by_mode(rows, "plain", c), by_mode(rows, "dflash", c)
        # 10, 40, 20: median 20 (the mean would be 23.3, and the warm-up's 1000 would make it 30)
        assert float(plain["output_tokens_per_s"]) == 20.0
        assert (float(plain["output_tokens_per_s_min"]), float(plain["output_tokens_per_s_max"])) == (
            10.0,
            40.0,
        )
        assert float(plain["ms_per_decode_step"]) == 5.0
        assert float(dflash["output_tokens_per_s"]) == 60.0
        assert (float(dflash["output_tokens_per_s_min"]), float(dflash["output_tokens_per_s_max"])) == (
            30.0,
            90.0,
        )
        assert float(dflash["ms_per_decode_step"]) == 10.0
        # the warm-up's 9.0 stays out: every measured repeat accepted 4
        assert float(dflash["mean_acceptance_length"]) == 4.0
        assert int(plain["repeats"]) == int(dflash["repeats"]) == 3


def test_the_progress_line_after_a_repeat_gives_that_repeats_figures(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    _, stdout, _, _ = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory)
    lines = [line.strip() for line in stdout.splitlines() if line.strip().startswith("c=1 repeat")]
    assert lines == [
        "c=1 repeat 1/3: plain (fast) 10.0 tok/s, 7.00 ms/step; dflash (fast) 30.0 tok/s, 11.00 ms/step",
        "c=1 repeat 2/3: plain (fast) 40.0 tok/s, 9.00 ms/step; dflash (fast) 90.0 tok/s, 13.00 ms/step",
        "c=1 repeat 3/3: plain (fast) 20.0 tok/s, 8.00 ms/step; dflash (fast) 60.0 tok/s, 12.00 ms/step",
    ]


def test_the_speedups_printed_are_dflash_over_plain_of_the_medians(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    """tok/s 60 / 20 = 3.00; decode steps 4 x 5 / 10 = 2.00; a DFlash step over a plain step
    10 / 5 = 2.00."""
    _, stdout, _, _ = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory)
    lines = stdout.splitlines()
    header = lines.index(
        "draft | numerics | concurrency | DFlash/plain tok/s | DFlash/plain decode steps | "
        "DFlash step / plain step"
    )
    assert lines[header + 1 : header + 3] == [
        "dflash | fast | 1 | 3.00 | 2.00 | 2.00",
        "dflash | fast | 2 | 3.00 | 2.00 | 2.00",
    ]


def test_num_prompts_sets_the_requests_of_every_concurrency(monkeypatch, pair_dirs, tmp_path_factory) -> None:
    _, _, _, record = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, "--num-prompts", "3")
    assert [(c, len(prompts)) for c, prompts in record["prompts"]] == [(1, 3), (1, 3), (2, 3), (2, 3)]
    assert all(len(p) == 8 for _, prompts in record["prompts"] for p in prompts)  # --input-len


def test_without_num_prompts_each_concurrency_sends_as_many_requests_as_its_slots(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    _, _, _, record = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory)
    assert [(c, len(prompts)) for c, prompts in record["prompts"]] == [(1, 1), (1, 1), (2, 2), (2, 2)]


def test_the_seed_draws_the_random_prompts(monkeypatch, pair_dirs, tmp_path_factory) -> None:
    _, _, _, first = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, "--seed", "0")
    _, _, _, again = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, "--seed", "0")
    _, _, _, other = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, "--seed", "7")
    assert first["prompts"] == again["prompts"]
    for (_, seed0), (_, seed7) in zip(first["prompts"], other["prompts"]):
        assert seed0 != seed7


def test_the_floor_reads_the_rows_and_mean_context_of_each_concurrency(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    """Prompts of 8 tokens and 12 output tokens: the mean context is 8 + 12 / 2 = 14; the
    floor of concurrency c streams c rows."""
    _, _, _, record = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, floor=True)
    assert [(f["rows"], f["context"]) for f in record["floors"]] == [(1, 14), (1, 14), (2, 14), (2, 14)]


def test_a_step_over_the_floor_is_the_decode_step_over_the_floor_time(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    """Floor 2.5 ms: a plain decode step of 5 ms is 2.0x the floor, a DFlash step of 10 ms
    4.0x (ms_per_step, 8 and 12 ms, is not the decode step). The prompts' compute floor is
    0.25 ms a token, 2 ms for a prompt of 8, so the prefill phase of 3 ms (plain) over c
    prompts is 1.5 / c times it, 6 ms (DFlash) 3 / c."""
    _, stdout, rows, _ = scripted_benchmark(monkeypatch, pair_dirs, tmp_path_factory, floor=True)
    for c in (1, 2):
        plain, dflash = by_mode(rows, "plain", c), by_mode(rows, "dflash", c)
        assert float(plain["floor_ms"]) == 2.5
        assert float(plain["over_floor"]) == 2.0
        assert float(dflash["over_floor"]) == 4.0
        assert float(plain["floor_prefill_ms"]) == 2.0 * c
        assert float(plain["prefill_over_floor"]) == pytest.approx(1.5 / c)
        assert float(dflash["prefill_over_floor"]) == pytest.approx(3.0 / c)
    assert "plain | fast | 2 | 5.00 (4.00-6.00) | 2.50 [2.00, 3.00] | 2.00 | 0.001" in stdout
    assert "dflash | fast | 2 | 10.00 (8.00-12.00) | 2.50 [2.00, 3.00] | 4.00 | 0.001" in stdout


def test_the_prefill_floor_counts_every_prompt_of_num_prompts(
    monkeypatch, pair_dirs, tmp_path_factory
) -> None:
    """Three prompts of 8 tokens at each concurrency: 3 x 2 ms of compute floor, so a 3 ms
    plain prefill phase is 0.5x it."""
    _, _, rows, _ = scripted_benchmark(
        monkeypatch, pair_dirs, tmp_path_factory, "--num-prompts", "3", floor=True
    )
    for c in (1, 2):
        assert float(by_mode(rows, "plain", c)["floor_prefill_ms"]) == 6.0
        assert float(by_mode(rows, "plain", c)["prefill_over_floor"]) == 0.5


# ---------------------------------------------------------------------------------------------
# the benchmark's ratios on hand-made rows


def row(mode: str, numerics: str, tok_s: float, step_ms: float, acceptance: float, **extra) -> dict:
    return {
        "mode": mode,
        "draft": None if mode == "plain" else "dflash",
        "numerics": numerics,
        "concurrency": 1,
        "output_tokens_per_s": tok_s,
        "ms_per_decode_step": step_ms,
        "mean_acceptance_length": acceptance,
        **extra,
    }


def test_each_numerics_dflash_is_set_against_the_plain_of_its_own_numerics() -> None:
    """exact: 30 / 10 tok/s = 3.0, decode 4 x 5 / 10 = 2.0, step 10 / 5 = 2.0; fast: 80 / 20
    = 4.0, decode 4 x 4 / 16 = 1.0, step 16 / 4 = 4.0."""
    rows = [
        row("plain", "exact", 10.0, 5.0, 1.0),
        row("dflash", "exact", 30.0, 10.0, 4.0),
        row("plain", "fast", 20.0, 4.0, 1.0),
        row("dflash", "fast", 80.0, 16.0, 4.0),
    ]
    got = [(r["numerics"], r["tok_s"], r["decode"], r["step_ratio"]) for r in bench.speedups(rows)]
    assert got == [("exact", 3.0, 2.0, 2.0), ("fast", 4.0, 1.0, 4.0)]


def test_each_numerics_dflash2_is_set_against_the_dflash_of_its_own_numerics() -> None:
    """exact: 3 / 2 ms = 1.5 a step and (3 / 3) / (2 / 2) = 1.0 a draft forward; fast: 12 / 4
    = 3.0 a step and (6 / 2) / (4 / 4) = 3.0 a draft forward."""

    def spec(arch: str, numerics: str, step_ms: float, draft_ms: float, n_draft: int) -> dict:
        return {
            "mode": "dflash",
            "draft": arch,
            "numerics": numerics,
            "concurrency": 1,
            "ms_per_decode_step": step_ms,
            "ms_draft": draft_ms,
            "n_draft": n_draft,
        }

    rows = [
        spec("dflash", "exact", 2.0, 2.0, 2),
        spec("dflash", "fast", 4.0, 4.0, 4),
        spec("dflash2", "exact", 3.0, 3.0, 3),
        spec("dflash2", "fast", 12.0, 6.0, 2),
    ]
    got = [
        (r["numerics"], r["dflash_ms"], r["step_ratio"], r["draft_ratio"])
        for r in drafts.draft_comparison(rows)
    ]
    assert got == [("exact", 2.0, 1.5, 1.0), ("fast", 4.0, 3.0, 3.0)]


def test_the_csv_has_every_column_any_row_has(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    bench.write_csv(
        str(path), [{"mode": "plain", "ms": 1.0}, {"mode": "dflash", "ms": 2.0, "over_floor": 3.0}]
    )
    assert path.read_text().splitlines() == ["mode,ms,over_floor", "plain,1.0,", "dflash,2.0,3.0"]


# ---------------------------------------------------------------------------------------------
# the report's plots


def results_of(rows: list[dict], **fields) -> ResultSet:
    """A result set of hand-made summary rows (JSON columns already parsed)."""
    parts = {"ab": None, "requests": None, "itl": {}, "meta": {}, "compare_md": None, "compare_summary": None}
    return ResultSet(Path("run"), pd.DataFrame(rows), missing=(), **(parts | fields))


def summary_row(label: str, concurrency: int, repeat: int = 0, **values) -> dict:
    return {"label": label, "concurrency": concurrency, "repeat": repeat, **values}


def drawn(draw, results: ResultSet) -> Figure:
    figure = Figure()
    colors = {label: f"C{i}" for i, label in enumerate(results.labels)}
    outcome = draw(figure, results, aggregate_repeats(results.summary), colors)
    assert isinstance(outcome, str), outcome
    return figure


def test_each_sides_acceptance_bars_are_shares_of_its_own_steps() -> None:
    """A took 1 step of length 1 and 3 of length 2 (shares 0.25, 0.75, mean 1.75); B 6 and 2
    of 8 steps (0.75, 0.25, mean 1.25): each side's bars add up to 1."""
    rows = [
        summary_row("A", 1, acceptance_histogram={1: 1.0, 2: 3.0}),
        summary_row("B", 1, acceptance_histogram={1: 6.0, 2: 2.0}),
    ]
    ax = drawn(plots.acceptance_histogram, results_of(rows)).axes[0]
    assert [p.get_height() for p in ax.patches] == pytest.approx([0.25, 0.75, 0.75, 0.25])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "A (mean 1.75, 4 steps)",
        "B (mean 1.25, 8 steps)",
    ]


def test_each_itl_panel_draws_the_gaps_of_its_own_concurrency() -> None:
    """Per-token gaps of 1 ms at concurrency 1 and of 10 ms at concurrency 4 (chunk gaps 2
    and 20): each panel's curves lie at its own level's values."""
    itl = {
        ("A", 1): ItlSamples(np.full(8, 1.0), np.full(4, 2.0)),
        ("A", 4): ItlSamples(np.full(8, 10.0), np.full(4, 20.0)),
    }
    rs = results_of([summary_row("A", 1), summary_row("A", 4)], itl=itl)
    figure = drawn(plots.itl_distribution, rs)
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["concurrency 1", "concurrency 4"]
    levels = [[sorted(set(line.get_xdata())) for line in ax.lines] for ax in panels]
    assert levels == [[[1.0], [2.0]], [[10.0], [20.0]]]


def test_every_side_with_per_position_rates_gets_its_own_panel() -> None:
    rows = [
        summary_row("A", 1, acceptance_per_position=[0.8, 0.4]),
        summary_row("B", 1, acceptance_per_position=[0.9, 0.6, 0.3]),
    ]
    figure = drawn(plots.acceptance_positions, results_of(rows))
    assert [ax.get_title() for ax in figure.axes] == ["A", "B"]
    assert [list(ax.lines[0].get_ydata()) for ax in figure.axes] == [[0.8, 0.4], [0.9, 0.6, 0.3]]


# ---------------------------------------------------------------------------------------------
# the scripts

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_acceptance_script_evaluates_the_target_prompts_block_sizes_and_tokens_given(
    pair_dirs, tmp_path: Path, monkeypatch, capsys
) -> None:
    script = load_script("eval_demo_drafts")
    model, draft = pair_dirs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [8, 9]}\n')
    calls = []

    def evaluate(target, draft, prompts, block_sizes, max_tokens):
        calls.append(
            (target.config.vocab_size, target.config.num_hidden_layers, prompts, block_sizes, max_tokens)
        )
        row = {"mean_acceptance_length": 2.5, "acceptance_rate": 0.25, "mismatched_requests": 1}
        return {B: row for B in block_sizes}

    monkeypatch.setattr(script, "evaluate", evaluate)
    out = tmp_path / "acceptance.json"
    argv = [str(draft), "--target", str(model), "--prompts", str(prompts), "--block-sizes", "2,6"]
    assert script.main([*argv, "--max-tokens", "24", "--device", "cpu:0", "--out", str(out)]) == 0
    written = json.loads((model / "config.json").read_text())
    want = (written["vocab_size"], written["num_hidden_layers"], [[5, 6, 7], [8, 9]], (2, 6), 24)
    assert calls == [want]
    stdout = capsys.readouterr().out
    assert (
        f"{draft}: B=6: mean acceptance length 2.500, acceptance rate 0.250, 1 of 2 requests differ" in stdout
    )
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu:0"
    figures = {"mean_acceptance_length": 2.5, "acceptance_rate": 0.25, "mismatched_requests": 1}
    assert saved["acceptance"] == {str(draft): {"2": figures, "6": figures}}


def test_the_acceptance_script_reads_the_target_given_not_the_demo_one(tmp_path: Path, capsys) -> None:
    script = load_script("eval_demo_drafts")
    assert script.main([str(DEMO_DRAFT), "--target", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_demo_drafts.py: ") and str(tmp_path / "absent") in err


@pytest.mark.parametrize(
    ("text", "cases"),
    [("4x7", [(4, 7)]), ("1x1,16x15", [(1, 1), (16, 15)])],
)
def test_profile_step_reads_rows_by_verify_width(text: str, cases: list) -> None:
    assert load_script("profile_step").parse_cases(text) == cases


@pytest.mark.parametrize("text", ["4x16", "4x0", "0x3", "4", "4x7x1", "ax3"])
def test_profile_step_refuses_a_width_past_the_block_or_no_rows(text: str) -> None:
    with pytest.raises(SystemExit, match="--cases"):
        load_script("profile_step").parse_cases(text)


class FakeTensor:
    """A device tensor of bench_kernels' copy-bandwidth probe, never allocated: its size alone."""

    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def random_(self) -> FakeTensor:
        return self

    def copy_(self, other: FakeTensor) -> FakeTensor:
        return self


def without_a_device(real):
    """`torch` for bench_kernels on a machine without CUDA: a CUDA device that is said to be
    there, and tensors of one element wherever a kernel's input is drawn (the timings are
    scripted, so no kernel reads them)."""

    class Torch:
        def __getattr__(self, name):
            return getattr(real, name)

    fake = Torch()
    fake.cuda = SimpleNamespace(is_available=lambda: True, get_device_name=lambda: "scripted")
    fake.randn = fake.rand = lambda *shape, **kw: real.zeros(1)
    fake.arange = lambda n, **kw: real.arange(n)
    fake.zeros = lambda *shape, **kw: real.zeros(1, dtype=real.long)
    fake.empty = lambda numel, **kw: FakeTensor(numel)
    fake.empty_like = lambda t: FakeTensor(t.numel())
    return fake


@pytest.fixture
def bench_kernels(monkeypatch):
    """scripts/bench_kernels.py with every exact kernel timed at 3 ms, its counterpart at 2 ms
    and a device-to-device copy at 4 ms; one 1000 x 500 projection."""
    import torch

    script = load_script("bench_kernels")
    ref = script.ref
    fast = {ref.linear, ref.rms_norm, ref.attention, ref.gated_delta}
    exact = {script.matmul, script.rms_norm, script.attention, script.gated_delta}

    def median_ms(fn, *args) -> float:
        if fn in fast:
            return 2.0
        if fn in exact:
            return 3.0
        return 4.0  # the copy

    monkeypatch.setattr(script, "torch", without_a_device(torch))
    monkeypatch.setattr(script, "median_ms", median_ms)
    monkeypatch.setattr(script, "PROJECTIONS", {"p": (1000, 500)})
    return script


def test_the_copy_bandwidth_counts_the_bytes_read_and_written(bench_kernels) -> None:
    """2^30 int16 elements read and written in 4 ms: 2 x 2^31 bytes / 4 ms = 1073.7 GB/s."""
    assert bench_kernels.copy_bandwidth() == pytest.approx(2 * 2**31 / 4e-3 / 1e9)


def test_the_kernel_table_and_csv_give_exact_over_fast_and_the_memory_floor(
    bench_kernels, tmp_path: Path, capsys
) -> None:
    """exact 3 ms over fast 2 ms = 1.50; the floor of a 1000 x 500 bfloat16 product of M rows
    reads and writes (1000 x 500 + 500 M + 1000 M) x 2 bytes at 1073.74 GB/s: 0.00093 ms at
    M = 1; an attention row's floor reads b (ctx + T) keys and values of 8 x 128 bfloat16s."""
    out = tmp_path / "kernels.csv"
    assert bench_kernels.main(["--out", str(out)]) == 0
    bw = 2 * 2**31 / 4e-3 / 1e9
    stdout = capsys.readouterr().out
    assert f"device scripted, copy bandwidth {bw:.0f} GB/s" in stdout
    table = [
        line.split()
        for line in stdout.splitlines()
        if line.startswith(("matmul ", "rms_norm ", "attention "))
    ]
    assert table[0] == ["matmul", "p", "M=1", "3.0000", "2.0000", "1.50", "0.0009"]
    assert all(line[-2] == "1.50" for line in table)
    rows = list(csv.DictReader(out.open()))
    assert [r["shape"] for r in rows[:5]] == [f"p M={m}" for m in (1, 16, 64, 256, 1024)]
    assert [r["kernel"] for r in rows[5:]] == ["rms_norm"] + ["attention"] * 4 + ["gated_delta"] * 3
    assert all((float(r["exact_ms"]), float(r["fast_ms"])) == (3.0, 2.0) for r in rows)
    assert float(rows[0]["memory_floor_ms"]) == pytest.approx((1000 * 500 + 500 + 1000) * 2 / bw / 1e6)
    assert float(rows[4]["memory_floor_ms"]) == pytest.approx(
        (1000 * 500 + 1024 * 500 + 1024 * 1000) * 2 / bw / 1e6
    )
    attention = next(r for r in rows if r["shape"] == "b=16 T=16 ctx=1024")
    assert float(attention["memory_floor_ms"]) == pytest.approx(16 * 1040 * 8 * 128 * 2 * 2 / bw / 1e6)


def test_the_kernel_benchmark_without_a_device_exits_2(capsys) -> None:
    script = load_script("bench_kernels")
    if script.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert script.main([]) == 2
    assert capsys.readouterr().err == "error: this benchmark needs a CUDA device\n"


# ---------------------------------------------------------------------------------------------
# the report's tables


def ab_rows(*rows: tuple) -> pd.DataFrame:
    columns = ["metric", "concurrency", "a_median", "b_median", "ratio", "ci_low", "ci_high", "within_noise"]
    return pd.DataFrame([dict(zip(columns, r)) for r in rows])


def test_a_ratio_just_off_one_outside_the_noise_is_judged_not_rounded_away() -> None:
    """B at 99.6% of A's throughput, the interval clear of 1: a 0.4% regression the table
    shows as 0.996 and calls worse; 0.4% faster in TTFT (ratio 0.996) is better."""
    table = tables.ratio_table(
        ab_rows(
            ("output_tokens_per_s", 1, 1000.0, 996.0, 0.996, 0.994, 0.998, False),
            ("ttft_ms_median", 1, 50.0, 49.8, 0.996, 0.994, 0.998, False),
        )
    )
    lines = table.splitlines()
    assert (
        lines[2]
        == "| Output throughput (tok/s) | 1 | 1,000.0 | 996.0 | 0.996 | [0.994, 0.998] | no | worse |"
    )
    assert lines[3] == "| TTFT p50 (ms) | 1 | 50.00 | 49.80 | 0.996 | [0.994, 0.998] | no | better |"


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("count", ["0", "-1"])
def test_a_num_prompts_below_one_is_refused_naming_the_flag(count: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.BenchArgs.parse(["--random-shape", "qwen3-small", "--num-prompts", count])
    assert exc.value.code == 2
    assert "--num-prompts" in capsys.readouterr().err


def test_the_acceptance_script_refuses_max_tokens_below_one_naming_the_flag(capsys) -> None:
    script = load_script("eval_demo_drafts")
    try:
        code = script.main([str(DEMO_DRAFT), "--block-sizes", "4", "--max-tokens", "0"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_a_machine_load_entry_without_its_before_reading_does_not_stop_the_report(tmp_path: Path) -> None:
    (tmp_path / "summary.csv").write_text(
        "label,concurrency,repeat,output_tokens_per_s\nA,1,0,10\nB,1,0,12\n"
    )
    (tmp_path / "meta.json").write_text('{"machine_load": [{"label": "A", "concurrency": 1, "repeat": 0}]}')
    report = markdown.build_report(tmp_path).read_text()
    assert "Concurrency 1: B delivers 1.20x the output throughput of A" in report


def test_the_itl_bars_are_the_mean_gaps_not_the_medians() -> None:
    """Per-token ITL means of 3 and 4 ms at concurrencies 1 and 2 (medians a third of them),
    chunk ITL means of 6 and 8 ms: bars of the means, per token then per chunk."""
    rows = [
        summary_row(
            "A",
            c,
            itl_token_ms_mean=m,
            itl_token_ms_median=m / 3,
            itl_chunk_ms_mean=2 * m,
            itl_chunk_ms_median=2 * m / 3,
        )
        for c, m in ((1, 3.0), (2, 4.0))
    ]
    ax = drawn(plots.itl_bars, results_of(rows)).axes[0]
    assert [p.get_height() for p in ax.patches] == [3.0, 4.0, 6.0, 8.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A per token", "A per chunk"]

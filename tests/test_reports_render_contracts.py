"""Direct checks, on small hand-made inputs, of how the reports render and of the benchmark's
named model shapes.

The profile (`reports/profile.py`): notes are listed once, runs without a concurrency are
"Other runs", per-token figures have three decimals and milliseconds two, rows run top-level,
other, nested, step, a phase a run lacks fills all of its columns, the GPU column is per
token too, `--top-kernels 0` shows no kernels, a 90-character kernel name is kept whole, the
plot falls back to total ms, draws a negative `other` as nothing and labels a bar without a
concurrency by its mode, an empty commands file adds no section, and the definitions follow
the source.

The benchmark's shapes (`reference_engine/bench/shapes.py`): unknown draft architectures
and shapes are refused, a DFlash2 draft has the published DFlash2 choices, `random_pair`
passes its draft options on and draws the draft from its own stream, and the Qwen3-8B,
Qwen3.5-4B and Llama-3.1-8B shapes are the published ones.

The plots (`reports/plots.py`): PNGs carry no Software tag, throughput starts at zero with
error bars from the slowest to the fastest repeat and n the most repeats, any one
percentile or ITL mean is enough to draw, ITL bars are centred, the ITL CDF ends near the
p99.5 gap in rows of four panels, the acceptance histogram shows every length as a share
with a step-weighted mean, per-position rates start at position 1 on drafting labels only,
and the concurrency axis turns log2 at a ratio of 4.

The report (`reports/markdown.py`): `note` and lists of notes, a title from the folder's
name, metadata cells up to 100 characters, `n/a` for null, commands as code blocks, the
acceptance sentence, token-count sums, the equivalence summary as JSON, `~~~` fences, and
the order of the sections.

The verdict (`reports/verdict.py`): intervals with an unknown end, a zero baseline, a ratio
of exactly 1, the mismatch list's limit, whose acceptance is given, the order of
disagreeing repeats, the busy machine's highest load, saturation's minimum sample, threshold
and worst point, the client and server busy notes, equal TTFTs, and an empty verdict.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from reference_engine.bench import shapes
from reference_engine.config import DraftConfig, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.models import expected_shapes
from reports import markdown, plots, profile, verdict
from reports.phases import PhaseTimes
from reports.results import ItlSamples, ResultSet, aggregate_repeats

# --- reports/profile.py ---------------------------------------------------------------------


def _run(mode: str, concurrency: int | None, **fields) -> PhaseTimes:
    label = mode if concurrency is None else f"{mode}-c{concurrency}"
    phases = fields.pop("phase_ms", {"decode": 6.0, "sample": 1.0})
    return PhaseTimes(
        label, mode, concurrency, fields.pop("source", "timer"), fields.pop("step_ms", 10.0), phases, **fields
    )


def _cells(table: str, first: str) -> list[str]:
    line = next(row for row in table.splitlines() if row.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_a_note_shared_by_several_runs_is_listed_once() -> None:
    """The profile's notes are the runs' notes without repeats, in first-seen order."""
    runs = [_run("plain", 1, notes=("shared", "one")), _run("dflash", 1, notes=("shared", "two"))]
    text = profile.render_profile("x", runs, "caption", None, 10)
    assert text.count("- shared\n") == 1
    assert text.index("- shared") < text.index("- one") < text.index("- two")


def test_runs_without_a_concurrency_are_grouped_as_other_runs() -> None:
    """A run whose label carries no concurrency is shown under `## Other runs`, never as
    `Concurrency None`."""
    text = profile.render_profile("x", [_run("plain", 4), _run("dflash", None)], "caption", None, 10)
    assert "## Concurrency 4" in text and "## Other runs" in text
    assert "None" not in text


def test_side_by_side_figures_have_three_decimals_per_token_and_two_in_ms() -> None:
    """Per-token figures are printed to 3 decimals, total milliseconds to 2."""
    with_tokens = profile.side_by_side([_run("plain", 1, output_tokens=4)])
    assert _cells(with_tokens, "decode")[1:3] == ["1.500", "60.0"]
    without = profile.side_by_side([_run("plain", 1)])
    assert _cells(without, "decode")[1:3] == ["6.00", "60.0"]


def test_side_by_side_rows_run_top_level_then_other_then_nested_then_step() -> None:
    """Row order: the top-level phases, `other`, the nested phases, and `step` last."""
    table = profile.side_by_side([_run("plain", 1)])
    titles = [row.split("|")[1].strip() for row in table.splitlines()[2:]]
    assert titles == ["decode", "other", "sample (inside prefill, decode; not summed)", "**step (total)**"]


def test_a_phase_one_run_lacks_fills_every_column_of_that_run_gpu_included() -> None:
    """A phase a run did not time gets a `–` in each of that run's columns, its GPU column
    too, so every row has as many cells as the header."""
    gpu = _run("plain", 1, phase_ms={"decode": 6.0}, gpu_ms={"decode": 5.0, "step": 9.0})
    spec = _run("dflash", 1, phase_ms={"draft": 3.0, "verify": 4.0})
    table = profile.side_by_side([gpu, spec])
    widths = {len(row.strip().strip("|").split("|")) for row in table.splitlines()}
    assert widths == {6}
    assert _cells(table, "draft")[1:4] == ["–", "–", "–"]


def test_the_gpu_column_is_per_output_token_like_the_host_column() -> None:
    """With token counts known, the GPU-projected time is divided by the output tokens too."""
    run = _run("plain", 1, phase_ms={"decode": 6.0}, gpu_ms={"decode": 5.0, "step": 9.0}, output_tokens=4)
    assert _cells(profile.side_by_side([run]), "decode")[1:4] == ["1.500", "60.0", "1.250"]


def test_no_kernel_table_or_kernel_line_when_no_kernels_are_asked_for() -> None:
    """`top` 0 (`--top-kernels 0`) leaves out both the kernel table and its summary line."""
    kernels = pd.DataFrame({"kernel": ["gemm"], "instances": [2], "total_ms": [4.0]})
    run = _run("plain", 1, source="nsys", kernels=kernels)
    assert profile.kernel_table(run, 0) is None
    text = profile.render_profile("x", [run], "caption", None, 0)
    assert "All kernels" not in text and "gemm" not in text


def test_a_kernel_name_of_exactly_90_characters_is_kept_whole() -> None:
    """Only names longer than KERNEL_NAME_CHARS are cut."""
    name = "k" * profile.KERNEL_NAME_CHARS
    kernels = pd.DataFrame({"kernel": [name], "instances": [1], "total_ms": [1.0]})
    table = profile.kernel_table(_run("plain", 1, source="nsys", kernels=kernels), 10)
    assert f"| `{name}` |" in table and "…" not in table


class _Recorded(Figure):
    made: list[Figure] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Recorded.made.append(self)


def _drawn(monkeypatch: pytest.MonkeyPatch, path: Path, runs: list[PhaseTimes]) -> tuple[str, Figure]:
    _Recorded.made = []
    monkeypatch.setattr(profile, "Figure", _Recorded)
    caption = profile.draw_breakdown(path, runs)
    (figure,) = _Recorded.made
    return caption, figure


def test_without_token_or_step_counts_for_every_run_the_plot_is_in_total_ms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per step only when every run knows its steps: one run without a step count puts the
    whole plot in ms over all steps."""
    counted = _run("plain", 1, instances={"step": 5})
    caption, _ = _drawn(monkeypatch, tmp_path / "p.png", [counted, _run("dflash", 1)])
    assert "in ms (all steps)" in caption


def test_a_negative_other_is_drawn_as_an_empty_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phases that add up past the step leave `other` negative; its bar segment has height 0,
    so no segment reaches below the axis."""
    over = _run("dflash", 1, phase_ms={"verify": 8.0, "draft": 4.0})
    _, figure = _drawn(monkeypatch, tmp_path / "p.png", [over])
    heights = [patch.get_height() for patch in figure.axes[0].patches]
    assert heights and min(heights) >= 0
    assert sum(heights) == pytest.approx(12.0)


def test_a_bar_of_a_run_without_concurrency_is_labelled_by_its_mode_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bar labels are `mode` and `c=N` on a second line, or the mode alone without a concurrency."""
    _, figure = _drawn(monkeypatch, tmp_path / "p.png", [_run("plain", 2), _run("dflash", None)])
    labels = [tick.get_text() for tick in figure.axes[0].get_xticklabels()]
    assert labels == ["plain\nc=2", "dflash"]


def test_an_empty_commands_file_adds_no_commands_section() -> None:
    """The Commands section holds what scripts/profile.sh ran; with nothing recorded there is
    no section (and no empty code block)."""
    for commands in (None, ""):
        assert "## Commands" not in profile.render_profile("x", [_run("plain", 1)], "c", commands, 10)
    assert "## Commands\n\n```\nrun it\n```" in profile.render_profile(
        "x", [_run("plain", 1)], "c", "run it\n", 10
    )


def test_the_definitions_follow_the_source_of_the_runs() -> None:
    """Timer runs are explained with the timer's definitions, nsys runs with Nsight's."""
    timer = profile.render_profile("x", [_run("plain", 1)], "c", None, 10)
    assert profile.DEFINITIONS["timer"] in timer and profile.DEFINITIONS["nsys"] not in timer
    nsys_text = profile.render_profile("x", [_run("plain", 1, source="nsys")], "c", None, 10)
    assert profile.DEFINITIONS["nsys"] in nsys_text and profile.DEFINITIONS["timer"] not in nsys_text


# --- reference_engine/bench/shapes.py --------------------------------------------------------


def test_an_unknown_draft_architecture_is_refused() -> None:
    """`draft_raw` builds only the architectures of DRAFT_ARCHS; any other is a ConfigError
    that names them."""
    with pytest.raises(ConfigError, match="unknown draft arch 'eagle', expected one of dflash, dflash2"):
        shapes.draft_raw("qwen3-small", 16, 5, "eagle")


def test_an_unknown_shape_is_refused_with_the_known_ones() -> None:
    """`random_pair` refuses a shape it has no config for with a ConfigError listing the
    shapes it has, before drawing anything."""
    with pytest.raises(ConfigError, match="unknown shape 'qwen9-1b', expected one of qwen3-8b, qwen3.5-4b"):
        shapes.random_pair("qwen9-1b", "cpu", torch.float32)


def test_a_dflash2_draft_carries_the_published_dflash2_choices_on_the_dflash_heads() -> None:
    """A DFlash2 draft: every layer a sliding window of 2048, the block attended
    non-causally, kernel 2, groups of 16, selector rank 256 and top-k 16; the heads and
    width are those of the DFlash draft of the same shape."""
    dflash2 = DraftConfig.from_hf(shapes.draft_raw("qwen3-8b", 16, 5, "dflash2"))
    assert dflash2.is_dflash2
    assert dflash2.layer_types == ("sliding_attention",) * 5 and dflash2.sliding_window == 2048
    assert dflash2.causal is False
    fields = (
        dflash2.conv_kernel_size,
        dflash2.conv_group_size,
        dflash2.selector_rank,
        dflash2.selector_top_k,
    )
    assert fields == (2, 16, 256, 16)
    dflash = DraftConfig.from_hf(shapes.draft_raw("qwen3-8b", 16, 5))
    heads = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_size")
    assert [getattr(dflash2, f) for f in heads] == [getattr(dflash, f) for f in heads]


def test_random_pair_draws_the_draft_it_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """`random_pair` hands its shape, seed, block size, draft layers and draft architecture
    on to the draft it draws (`draft_arch="dflash2"` pairs the target with a DFlash2 draft)."""
    asked = []
    monkeypatch.setattr(shapes, "random_draft", lambda *args, **kwargs: asked.append((args, kwargs)))
    shapes.random_pair(
        "qwen3-small", "cpu", torch.float32, 5, block_size=4, draft_layers=1, draft_arch="dflash2"
    )
    ((args, kwargs),) = asked
    call = dict(zip(("shape", "device", "dtype", "seed", "block_size", "draft_layers", "draft_arch"), args))
    call |= kwargs
    assert call == {
        "shape": "qwen3-small",
        "device": "cpu",
        "dtype": torch.float32,
        "seed": 5,
        "block_size": 4,
        "draft_layers": 1,
        "draft_arch": "dflash2",
    }


def test_the_draft_does_not_repeat_the_targets_random_draws() -> None:
    """Target and draft of one seed are drawn from different streams: the draft's first
    weight is not a rescaled copy of the target's first draws."""
    target, draft = shapes.random_pair("qwen3-small", "cpu", torch.float32, draft_layers=1, seed=7)
    first = draft.layers[0].self_attn.q_proj.weight.detach().flatten()
    embed = target.model.embed_tokens.weight.detach().flatten()[: first.numel()]
    correlation = torch.corrcoef(torch.stack([first, embed]))[0, 1].abs().item()
    assert correlation < 0.1


def test_qwen3_8b_real_shape_has_the_published_parameter_count() -> None:
    """Qwen3-8B: 36 layers of width 4096 and MLP width 12288, 8.19B parameters, 399 tensors."""
    config = TargetConfig.from_hf(shapes.TARGET_SHAPES["qwen3-8b"])
    found = expected_shapes(config)
    assert len(found) == 3 + 36 * 11
    assert 8.1 <= sum(math.prod(s) for s in found.values()) / 1e9 <= 8.3


def test_qwen3_5_4b_real_shape_has_24_gated_deltanet_layers_of_32() -> None:
    """Qwen3.5-4B's text model: 32 layers, every fourth full attention, so 24 Gated DeltaNet
    layers (docs/engine.md sizes its recurrent state by them)."""
    config = TargetConfig.from_hf(shapes.TARGET_SHAPES["qwen3.5-4b"])
    assert config.num_hidden_layers == 32
    assert len(config.linear_layers) == 24 and config.attention_layers == tuple(range(3, 32, 4))


def test_llama_real_shape_stops_at_each_of_its_three_end_tokens() -> None:
    """Llama-3.1-8B-Instruct ends a turn at any of <|end_of_text|>, <|eom_id|> and <|eot_id|>."""
    config = TargetConfig.from_hf(shapes.TARGET_SHAPES["llama3.1-8b"])
    assert config.eos_token_ids == (128001, 128008, 128009)


# --- reports/plots.py ------------------------------------------------------------------------


def _results(rows: list[dict], **fields) -> ResultSet:
    """A result set of hand-made summary rows (JSON columns already parsed)."""
    parts = {"ab": None, "requests": None, "itl": {}, "meta": {}, "compare_md": None, "compare_summary": None}
    parts |= fields
    return ResultSet(Path("run"), pd.DataFrame(rows), missing=(), **parts)


def _row(label: str, concurrency: int, repeat: int = 0, **values) -> dict:
    return {"label": label, "concurrency": concurrency, "repeat": repeat, **values}


def _draw(draw, results: ResultSet):
    figure = Figure()
    colors = {label: f"C{i}" for i, label in enumerate(results.labels)}
    return draw(figure, results, aggregate_repeats(results.summary), colors), figure


def _legend(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_plot_files_carry_no_software_tag(tmp_path: Path) -> None:
    """The PNGs are written without matplotlib's Software tag, so the same data gives the
    same bytes whatever the matplotlib version."""
    rs = _results([_row("A", 1, output_tokens_per_s=10.0), _row("A", 2, output_tokens_per_s=18.0)])
    drawn = [p for p in plots.write_plots(rs, tmp_path) if p.drawn]
    assert [p.filename for p in drawn] == ["throughput.png"]
    data = (tmp_path / "throughput.png").read_bytes()
    assert b"Software" not in data and b"atplotlib" not in data


def test_the_throughput_axis_starts_at_zero() -> None:
    """Throughput is read against zero: the y axis starts at 0, however high the values."""
    rs = _results([_row("A", 1, output_tokens_per_s=1000.0), _row("A", 4, output_tokens_per_s=1010.0)])
    _, figure = _draw(plots.throughput, rs)
    assert figure.axes[0].get_ylim()[0] == 0


def test_throughput_error_bars_run_from_the_slowest_to_the_fastest_repeat() -> None:
    """Each point is the median of its repeats; its error bar spans the minimum and maximum
    repeat (an uneven spread stays uneven)."""
    rs = _results([_row("A", 1, r, output_tokens_per_s=v) for r, v in enumerate((100.0, 110.0, 200.0))])
    _, figure = _draw(plots.throughput, rs)
    (container,) = figure.axes[0].containers
    (segment,) = container.lines[2][0].get_segments()
    assert sorted(y for _, y in segment) == [100.0, 200.0]
    assert list(container.lines[0].get_ydata()) == [110.0]


def test_the_throughput_legend_counts_the_most_repeats_of_a_label() -> None:
    """A label's legend entry gives n as the most repeats any of its points has (a run cut
    short has fewer at its last point)."""
    rows = [_row("A", 1, r, output_tokens_per_s=10.0) for r in range(3)]
    rows += [_row("A", 2, r, output_tokens_per_s=20.0) for r in range(2)]
    _, figure = _draw(plots.throughput, _results(rows))
    assert _legend(figure.axes[0]) == ["A (n=3)"]


def test_latency_percentiles_are_drawn_from_any_one_percentile() -> None:
    """A summary with TTFT medians only still gets the percentile plot, with the median line."""
    rs = _results([_row("A", 1, ttft_ms_median=5.0), _row("A", 2, ttft_ms_median=6.0)])
    outcome, figure = _draw(plots.latency_percentiles, rs)
    assert isinstance(outcome, str)
    assert [line.get_label() for line in figure.axes[0].lines] == ["A p50"]


def test_itl_bars_are_drawn_from_the_per_token_means_alone() -> None:
    """The ITL bar plot needs per-token or chunk means, not both."""
    rs = _results([_row("A", 1, itl_token_ms_mean=5.0)])
    outcome, _ = _draw(plots.itl_bars, rs)
    assert isinstance(outcome, str)


def test_itl_bars_of_one_concurrency_are_centred_on_its_tick() -> None:
    """The bars of one concurrency (each label per token and per chunk) fill 0.8 of the
    slot, centred on its tick; a label missing at a concurrency leaves an empty bar."""
    rows = [_row(label, c, itl_token_ms_mean=5.0, itl_chunk_ms_mean=9.0) for label in "AB" for c in (1, 4)]
    outcome, figure = _draw(plots.itl_bars, _results(rows[:-1]))
    assert isinstance(outcome, str)
    ax = figure.axes[0]
    for tick in (0, 1):
        near = [p for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - tick) < 0.5]
        assert min(p.get_x() for p in near) == pytest.approx(tick - 0.4)
        assert max(p.get_x() + p.get_width() for p in near) == pytest.approx(tick + 0.4)


def test_the_itl_distribution_axis_ends_near_the_p99_5_gap_not_at_a_stall() -> None:
    """One stalled gap does not stretch the CDF's x axis: it ends at 1.1 x the p99.5 gap."""
    gaps = np.concatenate([np.linspace(1.0, 10.0, 999), [5000.0]])
    itl = {("A", 1): ItlSamples(token_ms=gaps, chunk_ms=gaps)}
    _, figure = _draw(plots.itl_distribution, _results([_row("A", 1)], itl=itl))
    right = figure.axes[0].get_xlim()[1]
    assert right == pytest.approx(1.1 * float(np.quantile(gaps, plots.CLIP_QUANTILE)))
    assert right < 100


def test_the_itl_distribution_has_at_most_four_panels_a_row() -> None:
    """Five concurrencies: two rows of four panels, the last three hidden."""
    gaps = np.array([1.0, 2.0, 3.0])
    itl = {("A", c): ItlSamples(token_ms=gaps, chunk_ms=gaps) for c in (1, 2, 4, 8, 16)}
    _, figure = _draw(plots.itl_distribution, _results([_row("A", 1)], itl=itl))
    assert figure.axes[0].get_subplotspec().get_gridspec().get_geometry() == (2, 4)
    assert [ax.get_visible() for ax in figure.axes] == [True] * 5 + [False] * 3


def _histogram_rows() -> list[dict]:
    return [
        _row("B", 1, 0, acceptance_histogram={1: 10.0, 2: 20.0}),
        _row("B", 1, 1, acceptance_histogram={4: 30.0}),
    ]


def test_the_acceptance_histogram_shows_every_length_up_to_the_longest() -> None:
    """Lengths run from the shortest to the longest seen; one that no step reached is an
    empty slot."""
    _, figure = _draw(plots.acceptance_histogram, _results(_histogram_rows()))
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["1", "2", "3", "4"]


def test_acceptance_histogram_bars_are_shares_of_all_steps_with_the_mean_in_the_legend() -> None:
    """Bar heights are each length's share of all steps (they add up to 1); the legend gives
    the mean length weighted by steps and the number of steps."""
    _, figure = _draw(plots.acceptance_histogram, _results(_histogram_rows()))
    ax = figure.axes[0]
    assert [p.get_height() for p in ax.patches] == pytest.approx([1 / 6, 2 / 6, 0.0, 3 / 6])
    assert _legend(ax) == ["B (mean 2.83, 60 steps)"]


def test_per_position_acceptance_starts_at_draft_position_one_with_a_panel_per_drafting_label() -> None:
    """Positions are numbered from 1; only labels with per-position rates get a panel."""
    rows = [_row("A", 1), _row("B", 1, acceptance_per_position=[0.9, 0.6, 0.3])]
    _, figure = _draw(plots.acceptance_positions, _results(rows))
    assert [ax.get_title() for ax in figure.axes] == ["B"]
    (line,) = figure.axes[0].lines
    assert list(line.get_xdata()) == [1, 2, 3]


def test_the_concurrency_axis_is_log2_from_a_ratio_of_four() -> None:
    """Concurrencies spanning a factor of 4 or more get a base-2 log axis; less stays linear."""
    for levels, scale in (((1, 4), "log"), ((1, 3), "linear")):
        rs = _results([_row("A", c, output_tokens_per_s=10.0) for c in levels])
        _, figure = _draw(plots.throughput, rs)
        assert figure.axes[0].get_xscale() == scale


def test_a_label_missing_a_value_at_one_concurrency_still_gets_its_plot() -> None:
    """Throughput known for some points only is still plotted (the points it has)."""
    rows = [_row("A", 1, output_tokens_per_s=10.0), _row("A", 4, output_tokens_per_s=float("nan"))]
    outcome, figure = _draw(plots.throughput, _results(rows))
    assert isinstance(outcome, str)
    assert list(figure.axes[0].containers[0].lines[0].get_xdata()) == [1]


# --- reports/markdown.py ---------------------------------------------------------------------


def _report(rows: list[dict] | None = None, **fields) -> str:
    rows = rows or [_row("A", 1, output_tokens_per_s=10.0)]
    return markdown.render_report(_results(rows, **fields), [])


def test_a_single_note_may_be_given_as_note() -> None:
    """meta.json's `note` (one string) is shown like `notes`."""
    assert "> **Note:** one run only" in _report(meta={"note": "one run only"})


def test_a_list_of_notes_gives_one_note_line_each() -> None:
    """Each entry of a `notes` list is its own note line."""
    text = _report(meta={"notes": ["first", "second"]})
    assert "> **Note:** first\n> **Note:** second" in text


def test_the_default_title_names_the_results_folder_not_its_path() -> None:
    """Without a title in meta.json the report is titled by the folder's name, so the same
    files give the same report wherever the folder lies."""
    rs = replace(_results([_row("A", 1)]), directory=Path("/some/where/run-7"))
    assert markdown.render_report(rs, []).startswith("# Benchmark report: run-7\n")


def _run_table(meta: dict) -> str:
    return _report(meta=meta).split("## Run")[1].split("## Metric definitions")[0]


def test_metadata_of_up_to_100_characters_stays_in_the_table() -> None:
    """Values of at most LONG_VALUE characters are table cells; longer ones and values with
    a newline are code blocks."""
    run = _run_table({"short": "x" * 100, "long": "y" * 101, "lines": "a\nb"})
    assert f"| short | {'x' * 100} |" in run
    assert f"`long`:\n\n```\n{'y' * 101}\n```" in run
    assert "`lines`:\n\n```\na\nb\n```" in run


def test_absent_metadata_values_read_n_a() -> None:
    """A null in meta.json is shown as `n/a`, not as JSON's `null`."""
    run = _run_table({"versions": {"vllm": None, "python": "3.12"}})
    assert "| versions.vllm | n/a |" in run and "null" not in run


def test_commands_are_code_blocks_and_an_argv_list_reads_as_one_line() -> None:
    """Keys naming a command (`command` or `cmd`) are code blocks however short; a command's
    argv list is joined with spaces."""
    run = _run_table({"server_cmd": "serve", "commands": {"A": ["python", "-m", "serve", "--port", "1"]}})
    assert "`server_cmd`:\n\n```\nserve\n```" in run
    assert "`commands.A`:\n\n```\npython -m serve --port 1\n```" in run


def test_no_acceptance_sentence_when_one_label_has_acceptance() -> None:
    """The "No acceptance metrics" sentence appears only when no row has an acceptance length."""
    rows = [_row("A", 1, acceptance_length=float("nan")), _row("B", 1, acceptance_length=3.5)]
    assert "No acceptance metrics" not in _report(rows)
    rows = [_row("A", 1, acceptance_length=float("nan")), _row("B", 1, acceptance_length=float("nan"))]
    assert "No acceptance metrics" in _report(rows)


def test_token_counts_sum_streams_without_done_and_skip_unknown_sources() -> None:
    """Per label: streams without [DONE] summed over repeats and concurrencies; the count
    sources are those named, a row without one adds none."""
    rows = [
        _row("A", 1, 0, count_source="server_ids", server_kind="ours", streams_without_done=1),
        _row("A", 1, 1, count_source=None, server_kind="ours", streams_without_done=2),
        _row("A", 4, 0, count_source="usage", server_kind="ours", streams_without_done=None),
    ]
    text = _report(rows)
    assert "| A | ours | server_ids, usage | 3 |" in text


def test_the_equivalence_summary_prints_values_as_json() -> None:
    """Without compare.md, compare_summary.json is a table whose non-text values are JSON
    (`true`, `[1, 2]`)."""
    text = _report(compare_summary={"verdict": "pass", "identical": True, "levels": [[1, 2]]})
    section = text.split("## HTTP equivalence")[1]
    assert "| verdict | pass |" in section and "| identical | true |" in section
    assert "| levels | [[1, 2]] |" in section


def test_headings_inside_a_tilde_fence_of_compare_md_stay_as_they_are() -> None:
    """Lines inside `~~~` fences, like those inside backtick fences, are not headings."""
    text = _report(compare_md="# Top\n\n~~~\n# kept\n~~~\n\n## Sub\n")
    assert "### Top\n\n~~~\n# kept\n~~~\n\n#### Sub" in text


def test_the_report_sections_come_in_their_documented_order() -> None:
    """Verdict, run, definitions, results, failures, plots, then the HTTP equivalence."""
    rows = [_row("A", 1, output_tokens_per_s=10.0, completed=3, failed=0)]
    text = _report(rows, meta={"gpu": "x"}, compare_md="same\n")
    order = [
        "## Verdict",
        "## Run",
        "## Metric definitions",
        "## Results by concurrency",
        "## Failures",
        "## Plots",
    ]
    positions = [text.index(heading) for heading in [*order, "## HTTP equivalence"]]
    assert positions == sorted(positions)


# --- reports/verdict.py ----------------------------------------------------------------------


def _ab(ratio: float, low: float, high: float, noise: bool = False) -> pd.DataFrame:
    row = {"metric": "output_tokens_per_s", "concurrency": 1, "ratio": ratio, "ci_low": low, "ci_high": high}
    return pd.DataFrame([{**row, "within_noise": noise}])


def _pair(a: float, b: float, **fields) -> ResultSet:
    return _results([_row("A", 1, output_tokens_per_s=a), _row("B", 1, output_tokens_per_s=b)], **fields)


def test_an_interval_with_an_unknown_end_is_not_printed() -> None:
    """The speed-up sentence gives the 95% interval only when both ends are known."""
    text = verdict.verdict_section(_pair(10.0, 20.0, ab=_ab(2.0, float("nan"), 2.2)))
    assert "Concurrency 1: B delivers 2.00x the output throughput of A: B is faster." in text
    assert "interval" not in text


def test_no_speed_up_against_a_zero_baseline_without_ab_csv() -> None:
    """From the medians alone, a concurrency where A made 0 tokens/s gives no sentence."""
    text = verdict.verdict_section(_pair(0.0, 20.0))
    assert "Concurrency 1" not in text


def test_a_ratio_of_exactly_one_from_the_medians_is_no_clear_difference() -> None:
    """Equal medians without `ab.csv` read as no clear difference, not as slower."""
    text = verdict.verdict_section(_pair(10.0, 10.0))
    assert "delivers 1.00x the output throughput of A (no interval: `ab.csv` absent): no clear" in text
    assert "slower" not in text


def _outputs(mismatched: int, total: int = 8) -> dict:
    out = {}
    for index in range(total):
        out[("A", 1, 0, index)] = (1, 2, 3)
        out[("B", 1, 0, index)] = (1, 9, 3) if index < mismatched else (1, 2, 3)
    return out


def test_five_mismatches_are_all_listed_and_a_sixth_is_counted_as_more() -> None:
    """Up to MISMATCHES_LISTED mismatches are listed; past that the rest are counted."""
    five = verdict.verdict_section(_pair(10.0, 10.0, outputs=_outputs(5)))
    assert "**Outputs differ**: 5 of 8 requests" in five
    assert five.count("(first difference at output token 1)") == 5 and "more" not in five
    six = verdict.verdict_section(_pair(10.0, 10.0, outputs=_outputs(6)))
    assert six.count("(first difference at output token 1)") == 5
    assert "request 4 (first difference at output token 1); and 1 more (identical: 2/8)" in six


def test_acceptance_is_given_for_each_side_that_has_it() -> None:
    """With acceptance figures on both sides (DFlash against DFlash2) the verdict gives both,
    A's first; with them on one side, that side's alone."""
    rows = [_row("A", 1, acceptance_length=2.0), _row("B", 1, acceptance_length=4.0)]
    text = verdict.verdict_section(_results(rows))
    assert (
        "Mean acceptance length of A (bonus token included): 2.00 at c=1. "
        "Mean acceptance length of B (bonus token included): 4.00 at c=1."
    ) in text
    rows = [_row("A", 1), _row("B", 1, acceptance_length=4.0)]
    text = verdict.verdict_section(_results(rows))
    assert "Mean acceptance length of B (bonus token included): 4.00 at c=1." in text
    assert "Mean acceptance length of A" not in text


def test_the_widest_disagreement_between_repeats_is_listed_first() -> None:
    """Points whose repeats disagree are listed widest spread first."""
    rows = [_row("A", 1, r, output_tokens_per_s=v) for r, v in enumerate((100.0, 120.0))]
    rows += [_row("B", 1, r, output_tokens_per_s=v) for r, v in enumerate((100.0, 200.0))]
    text = verdict.verdict_section(_results(rows))
    assert "(B at c=1: 67%, A at c=1: 18%)" in text


def _load(label: str, load: float) -> dict:
    return {"label": label, "concurrency": 1, "repeat": 0, "before": {"load": [load] * 3, "cpus": 2}}


def test_a_busy_machine_is_reported_at_its_highest_load() -> None:
    """The busy-machine warning names the run with the highest load, not the first busy one."""
    meta = {"machine_load": [_load("A", 3.1), _load("B", 5.5), _load("A", 1.0)]}
    text = verdict.verdict_section(_pair(10.0, 10.0, meta=meta))
    assert "Before 2 of 3 runs" in text and "(highest 5.5, before B c=1 repeat 0)" in text


def _gaps(fast: int, total: int) -> ItlSamples:
    gaps = np.array([0.1] * fast + [5.0] * (total - fast))
    return ItlSamples(token_ms=gaps, chunk_ms=gaps)


def test_twenty_gaps_are_enough_to_judge_saturation() -> None:
    """Saturation is judged from 20 gaps on (fewer is too few to tell)."""
    text = verdict.verdict_section(_pair(10.0, 10.0, itl={("A", 1): _gaps(20, 20)}))
    assert "100% of the gaps between token-bearing chunks of A at concurrency 1" in text
    assert "saturated" not in verdict.verdict_section(_pair(10.0, 10.0, itl={("A", 1): _gaps(19, 19)}))


def test_saturation_warns_above_a_tenth_of_fast_gaps_and_names_the_worst_point() -> None:
    """Exactly 10% of gaps under 0.5 ms is no warning (more than 10% is); of several
    saturated points the warning names the one with the largest share."""
    assert "saturated" not in verdict.verdict_section(_pair(10.0, 10.0, itl={("A", 1): _gaps(2, 20)}))
    itl = {("A", 1): _gaps(10, 20), ("B", 1): _gaps(18, 20)}
    text = verdict.verdict_section(_pair(10.0, 10.0, itl=itl))
    assert "90% of the gaps between token-bearing chunks of B at concurrency 1" in text


def test_a_client_at_exactly_the_busy_share_is_not_warned_about() -> None:
    """The client warning needs a share past CLIENT_BUSY; at one client process it says
    `1 client process`."""
    calm = _results([_row("A", 1, client_cpu=0.85, client_processes=1)])
    assert "client was busy" not in verdict.verdict_section(calm)
    busy = _results([_row("A", 1, client_cpu=0.9, client_processes=1)])
    assert "(A at concurrency 1 (1 client process))" in verdict.verdict_section(busy)


def test_each_sides_busy_server_is_reported_with_its_own_share() -> None:
    """The host-side note gives each side's own busiest share."""
    rows = [_row("A", 1, server_cpu=0.9), _row("B", 1, server_cpu=0.95)]
    text = verdict.verdict_section(_results(rows))
    assert "A's server process 90% (concurrency 1); B's server process 95% (concurrency 1)" in text


def test_an_equal_ttft_carries_no_closed_loop_note() -> None:
    """The closed-loop note is for a lower TTFT of B; an equal one is not noted."""
    rows = [_row(label, 4, output_tokens_per_s=10.0, ttft_ms_median=50.0) for label in "AB"]
    assert "Note on TTFT" not in verdict.verdict_section(_results(rows))
    rows[1]["ttft_ms_median"] = 40.0
    assert "**Note on TTFT at concurrency 4:**" in verdict.verdict_section(_results(rows))


def test_a_verdict_with_nothing_to_say_is_left_out() -> None:
    """A single-label run without acceptance, request counts or warnings has no verdict
    section at all (not an empty heading)."""
    rs = _results([_row("A", 1, output_tokens_per_s=10.0)])
    assert verdict.verdict_section(rs) == ""
    assert "## Verdict" not in markdown.render_report(rs, [])

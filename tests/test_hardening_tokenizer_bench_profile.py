"""Contracts of a token's bytes (reference_engine/tokenizer.py), the engine benchmark's floors
(reference_engine/bench/floor.py) and the phase profile read back from Nsight Systems
statistics or the benchmark's CSV (reports/nsys.py, reports/phases.py, reports/profile.py).

Token bytes (`TokenBytes`): each of a byte-level vocabulary's 256 byte tokens is its own
byte, every one of them (the soft hyphen 0xAD and the no-break space 0xA0 included), so the
tokens of any text join into its UTF-8; a SentencePiece vocabulary whose decoder is a
Metaspace writes its word-boundary mark as a space in the token's bytes, though decoding the
token alone drops it; an added token is its text and a special one nothing.

The floors: a projection replaced after fusing is noticed, and the weight floor then reads
each linear once, never the stale stack besides them; the prefill compute floor multiplies
the LM head over the prompt's last row only, under tensor parallelism too, where a rank holds
a slice of the vocabulary; a sliding-window layer's prefill attention is cut to its window.

The benchmark's rows: the mean verify width weighs each width by its steps; a median row's
range is the least and greatest repeat whatever their order; repeats exactly 10% apart do not
disagree. The soak: its throughput is its finished tokens over its seconds; the plain
reference decodes each prompt once, for the most tokens any request of it asked, and each
request's reference is the first n tokens of that output, as decoding it alone gives.

The profile: a report whose file holds a header and no rows is missing, not an empty table;
a table ends at the first line of another width, whatever follows it; a capture's instances
are those of its host ranges (nvtx_sum), not of its GPU projection; the GPU time of `other`
is the step's GPU time less the top-level phases' only (a nested phase runs inside one of
them); a top-level phase that ran, even for 0 ms, has its row; per-token figures without a
token count are unknown, not 0; labels of any concurrency (c16 after c8, numerically);
labels without a concurrency are listed under "Other runs"; the side-by-side table gives
host and GPU time per output token; the detail table's GPU column is each phase's GPU
projection; the kernel table's mean is in microseconds per launch; a benchmark CSV with
several runs of one mode and concurrency (two drafts) loses none of them.
"""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from reference_engine import bench
from reference_engine.bench import soak
from reference_engine.bench.floor import prefill_compute_floor, streamed_weights
from reference_engine.bench.shapes import random_pair
from reference_engine.checkpoint import load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.tensor_parallel import TensorParallel
from reference_engine.tokenizer import SPECIAL_TOKENS, TokenBytes, build_tiny_tokenizer
from reports.nsys import REPORTS, load_capture, read_table
from reports.phases import (
    OTHER,
    STEP,
    TOP_LEVEL,
    PhaseTimes,
    bench_rows,
    breakdown,
    from_capture,
    load_profiles,
)
from reports.profile import build_profile, detail_table, kernel_table, side_by_side

FIXTURES = Path(__file__).parent / "fixtures" / "nsys"


def fixture_rows(label: str, report: str) -> list[dict[str, str]]:
    with open(FIXTURES / f"{label}_{report}.csv", newline="") as f:
        return list(csv.DictReader(f))


def domain_ms(label: str, report: str, column: str) -> dict[str, float]:
    """Our domain's ranges of a fixture report -> the column in ms (ns in the file)."""
    return {
        r["Range"].removeprefix("dflash:"): float(r[column]) / 1e6
        for r in fixture_rows(label, report)
        if r["Range"].startswith("dflash:")
    }


def copy_capture(label: str, directory: Path, as_label: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for report in REPORTS:
        shutil.copy(FIXTURES / f"{label}_{report}.csv", directory / f"{as_label or label}_{report}.csv")


def table_row(markdown: str, first_cell: str) -> list[str]:
    """The cells of the markdown table row whose first cell is `first_cell`."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in\n{markdown}")


# ---------------------------------------------------------------------------------------------
# A token's bytes


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return build_tiny_tokenizer(512)


def test_each_byte_token_of_a_byte_level_vocabulary_is_its_own_byte(tiny_tokenizer: Tokenizer) -> None:
    """The 256 one-character tokens of a byte-level BPE are the 256 bytes, one each: none
    falls back to decoding (a lone byte of a longer character decodes to U+FFFD)."""
    spelled = TokenBytes(tiny_tokenizer)
    added = set(tiny_tokenizer.get_added_tokens_decoder())
    singles = [
        i
        for i in range(tiny_tokenizer.get_vocab_size())
        if i not in added and len(tiny_tokenizer.id_to_token(i)) == 1
    ]
    assert len(singles) == 256
    assert sorted(spelled(i) for i in singles) == [bytes([b]) for b in range(256)]


@pytest.mark.parametrize("text", ["í", "soft\u00adhyphen", "no\u00a0break", "ĭ ŭ", "\u0100\u017f"])
def test_the_bytes_of_a_texts_tokens_join_into_its_utf8(tiny_tokenizer: Tokenizer, text: str) -> None:
    """Characters whose UTF-8 holds the bytes 0xA0 or 0xAD (the bytes a byte-level
    vocabulary spells by a stand-in character) still join back into the text."""
    spelled = TokenBytes(tiny_tokenizer)
    ids = tiny_tokenizer.encode(text).ids
    assert b"".join(spelled(i) for i in ids) == text.encode()


def test_an_added_token_is_its_text_and_a_special_token_nothing(tiny_tokenizer: Tokenizer) -> None:
    """In a byte-level vocabulary: an added token that is not special (`<think>`, as Qwen3
    adds it) is its text, a special token (end of text) no bytes."""
    tok = Tokenizer.from_str(tiny_tokenizer.to_str())
    tok.add_tokens(["<think>"])
    spelled = TokenBytes(tok)
    assert spelled(tok.token_to_id("<think>")) == b"<think>"
    assert [spelled(tok.token_to_id(t)) for t in SPECIAL_TOKENS] == [b""] * len(SPECIAL_TOKENS)


def test_a_metaspace_vocabularys_word_boundary_is_a_space_in_its_bytes() -> None:
    """A SentencePiece vocabulary decoded by a Metaspace decoder (no Replace step): `▁caf` is
    b" caf", although decoding it alone gives "caf"; byte-fallback tokens are their byte."""
    vocab = {"<unk>": 0, "\u2581caf": 1, "<0xC3>": 2, "<0xA9>": 3, "\u2581ok": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    assert tok.decode([1]) == "caf"
    spelled = TokenBytes(tok)
    assert [spelled(i) for i in (1, 2, 3, 4)] == [b" caf", b"\xc3", b"\xa9", b" ok"]
    assert b"".join(spelled(i) for i in (1, 2, 3, 4)).decode() == " café ok"


# ---------------------------------------------------------------------------------------------
# The floors


def test_a_projection_replaced_after_fusing_is_read_once_and_the_stale_stack_never(tiny_checkpoint) -> None:
    """After fuse_projections, a layer whose projection was replaced (not updated in place)
    runs its linears one by one again: the floor reads them, each once, and not the stacked
    matrix they no longer view; the bytes are those of the unfused model."""
    from reference_engine.models import fuse_projections

    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    unfused = sum(w.numel() for w in streamed_weights(model))
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    stale = mlp.fused.weight
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach().clone())
    weights = streamed_weights(model)
    assert all(w is not stale for w in weights)
    assert any(w is mlp.up_proj.weight for w in weights) and any(w is mlp.gate_proj.weight for w in weights)
    assert sum(w.numel() for w in weights) == unfused


def test_a_tensor_parallel_ranks_prefill_floor_multiplies_its_lm_head_slice_over_the_last_row_only() -> None:
    """A tensor-parallel rank's LM head holds its slice of the vocabulary; the prefill floor
    still knows it for the head and multiplies it over the prompt's last row only."""
    tp = TensorParallel(0, 2, "exact")
    target, _ = random_pair("qwen3-small", "cpu", torch.float32, seed=3, tensor_parallel=tp)
    c = target.config
    head = target.lm_head.weight
    assert head.shape[0] == c.vocab_size // 2
    body = [w for w in streamed_weights(target) if w is not head]
    tokens = 16
    want = 2.0 * tokens * sum(w.numel() for w in body) + 2.0 * head.numel()
    want += len(c.attention_layers) * 2.0 * tokens * tokens * c.num_attention_heads * c.head_dim
    assert prefill_compute_floor(target, tokens, repeats=1).flops == want


def test_a_sliding_window_layers_prefill_attention_is_cut_to_its_window(tiny_checkpoint) -> None:
    """A sliding-window layer's queries see at most its window, as its cache holds: up to the
    window the prefill floor's arithmetic is full attention's, past it less."""
    overrides = (("use_sliding_window", True), ("sliding_window", 8), ("max_window_layers", 1))
    windowed = load_target(tiny_checkpoint("qwen3", config_overrides=overrides), dtype=torch.float32)
    full = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    assert "sliding_attention" in windowed.config.layer_types
    assert (
        prefill_compute_floor(windowed, 8, repeats=1).flops == prefill_compute_floor(full, 8, repeats=1).flops
    )
    assert (
        prefill_compute_floor(windowed, 64, repeats=1).flops
        < prefill_compute_floor(full, 64, repeats=1).flops
    )


# ---------------------------------------------------------------------------------------------
# The benchmark's rows and the soak's reference


def test_the_mean_verify_width_weighs_each_width_by_its_steps() -> None:
    """Three steps at width 1 and one at 15: 18 / 4 tokens a step, not the mean of the two
    widths seen."""
    assert bench.mean_width({1: 3, 15: 1}) == 4.5
    assert bench.mean_width({}) is None and bench.mean_width(None) is None


def test_a_median_rows_range_is_the_least_and_the_greatest_repeat_in_any_order() -> None:
    rows = [{"mode": "plain", "concurrency": 1, "x": v} for v in (5.0, 1.0, 3.0)]
    out = bench.median_row(rows)
    assert (out["x"], out["x_min"], out["x_max"]) == (3.0, 1.0, 5.0)


def test_repeats_exactly_ten_percent_apart_do_not_disagree() -> None:
    """The warning is for a spread past 10% of the median; (52.5 - 47.5) / 50 is not past it."""
    row = {"mode": "plain", "concurrency": 1, "x": 50.0, "x_min": 47.5, "x_max": 52.5}
    assert bench.disagreements(row, ["x"]) == []
    assert bench.disagreements({**row, "x_max": 52.6}, ["x"]) != []


def test_the_soak_reference_decodes_a_prompt_once_for_its_longest_request(tiny_checkpoint) -> None:
    """Requests of one prompt asking for 6 and then 3 tokens: the plain engine decodes the
    prompt for 6, and each request's reference is the first n tokens of that greedy output,
    as decoding the prompt alone for n gives."""
    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float64)

    def plain() -> Engine:
        return Engine(target, None, EngineConfig(max_num_seqs=4, max_model_len=64))

    first, second = [5, 6, 7, 8], [9, 10, 11]
    finished = {"long": (first, 6, []), "short": (first, 3, []), "other": (second, 4, [])}
    with torch.inference_mode():
        reference = soak.plain_reference(plain(), finished)
        alone = {}
        for rid, (prompt, n, _) in finished.items():
            engine = plain()
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            alone[rid] = engine.collect(rid).output_ids
    assert {rid: len(ids) for rid, ids in reference.items()} == {"long": 6, "short": 3, "other": 4}
    assert reference == alone
    assert reference["short"] == reference["long"][:3]


# ---------------------------------------------------------------------------------------------
# Nsight Systems statistics


def test_a_report_file_with_a_header_and_no_rows_is_missing(tmp_path: Path) -> None:
    copy_capture("dflash-c1", tmp_path)
    path = tmp_path / "dflash-c1_nvtx_gpu_proj_sum.csv"
    path.write_text(path.read_text().splitlines()[0] + "\n")
    capture = load_capture(tmp_path, "dflash-c1")
    assert capture.missing == ("nvtx_gpu_proj_sum",)
    assert capture.gpu is None and capture.ranges is not None
    times = from_capture(capture, {})
    assert times.gpu_ms == {} and times.notes == ("dflash-c1: nvtx_gpu_proj_sum absent or empty",)


def test_a_table_ends_at_its_first_line_of_another_width() -> None:
    """The first kernel table only: after a blank line, a memory-operation table of the
    same number of columns is not read as more kernels."""
    text = (
        "Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name\n"
        "60.0,3000000,3,1000000.0,1000000.0,1000000,1000000,0.0,gemm\n"
        "40.0,2000000,4,500000.0,500000.0,500000,500000,0.0,copy\n"
        "\n"
        "Time (%),Total Time (ns),Count,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Operation\n"
        "100.0,9000000,9,1000000.0,1000000.0,1000000,1000000,0.0,[CUDA memcpy Host-to-Device]\n"
    )
    table = read_table(text, "cuda_gpu_kern_sum")
    assert table["kernel"].tolist() == ["gemm", "copy"]
    assert table["total_ms"].tolist() == pytest.approx([3.0, 2.0])


def test_a_captures_instances_are_its_host_ranges_not_its_gpu_projection() -> None:
    """nvtx_sum counts every range the host opened; nvtx_gpu_proj_sum only those that
    launched GPU work (fewer prefill ranges in this capture): the phase's instances, and so
    its mean time, are the host's."""
    times = from_capture(load_capture(FIXTURES, "dflash-c1"), {})
    host = {
        r["Range"].removeprefix("dflash:"): int(r["Instances"])
        for r in fixture_rows("dflash-c1", "nvtx_sum")
        if r["Range"].startswith("dflash:")
    }
    gpu = {
        r["Range"].removeprefix("dflash:"): int(r["Range Instances"])
        for r in fixture_rows("dflash-c1", "nvtx_gpu_proj_sum")
        if r["Range"].startswith("dflash:")
    }
    assert host["prefill"] != gpu["prefill"]
    assert times.instances == host
    table = breakdown(times)
    assert table.loc["prefill", "mean_ms"] == pytest.approx(times.phase_ms["prefill"] / host["prefill"])


def test_the_gpu_time_of_other_leaves_out_the_nested_phases() -> None:
    """`other` on the GPU = the step's projected time less the top-level phases' that ran;
    `sample` runs inside prefill, so its GPU time is already theirs."""
    times = from_capture(load_capture(FIXTURES, "dflash-c1"), {})
    gpu = domain_ms("dflash-c1", "nvtx_gpu_proj_sum", "Total Proj Time (ns)")
    assert gpu["sample"] > 0
    top = sum(v for p, v in gpu.items() if p in TOP_LEVEL)
    assert breakdown(times).loc[OTHER, "gpu_ms"] == pytest.approx(gpu[STEP] - top, rel=1e-12)


def test_a_top_level_phase_that_ran_for_no_measurable_time_keeps_its_row() -> None:
    times = PhaseTimes(
        "dflash-c2",
        "dflash",
        2,
        "timer",
        10.0,
        {"schedule": 1.0, "verify": 6.0, "accept": 0.0},
        instances={STEP: 5, "accept": 5, "verify": 5},
    )
    table = breakdown(times)
    assert "accept" in table.index and table.loc["accept", "total_ms"] == 0.0
    assert table.loc["accept", "instances"] == 5 and bool(table.loc["accept", "summed"])
    assert table.loc[OTHER, "total_ms"] == pytest.approx(3.0)


def test_per_token_figures_without_a_token_count_are_unknown_not_zero() -> None:
    times = PhaseTimes("plain-c1", "plain", 1, "timer", 10.0, {"decode": 8.0})
    table = breakdown(times)
    assert table["per_token_ms"].isna().all()
    counted = breakdown(PhaseTimes("plain-c1", "plain", 1, "timer", 10.0, {"decode": 8.0}, output_tokens=4))
    assert counted.loc["decode", "per_token_ms"] == pytest.approx(2.0)


def test_labels_of_a_concurrency_of_two_digits_are_read_and_ordered_numerically(tmp_path: Path) -> None:
    """`plain-c16` is concurrency 16 (mode `plain`), listed after concurrency 8."""
    for label in ("plain-c8", "dflash-c8"):
        copy_capture(label, tmp_path)
    copy_capture("plain-c1", tmp_path, "plain-c16")
    copy_capture("dflash-c1", tmp_path, "dflash-c16")
    profiles = load_profiles(tmp_path)
    assert [(p.mode, p.concurrency) for p in profiles] == [
        ("plain", 8),
        ("dflash", 8),
        ("plain", 16),
        ("dflash", 16),
    ]
    text = build_profile(tmp_path).read_text()
    assert "## Concurrency 16" in text and "## Other runs" not in text


def test_captures_without_a_concurrency_are_listed_under_other_runs(tmp_path: Path) -> None:
    copy_capture("plain-c1", tmp_path, "baseline")
    copy_capture("dflash-c1", tmp_path)
    text = build_profile(tmp_path).read_text()
    assert "## Concurrency 1" in text and "## Other runs" in text
    assert text.index("## Concurrency 1") < text.index("## Other runs") < text.index("### baseline")


def phase_run(mode: str, tokens: int | None, step: float, phases: dict, gpu: dict) -> PhaseTimes:
    return PhaseTimes(f"{mode}-c1", mode, 1, "nsys", step, phases, gpu_ms=gpu, output_tokens=tokens)


def test_the_side_by_side_table_gives_host_and_gpu_time_per_output_token() -> None:
    plain = phase_run("plain", 10, 50.0, {"decode": 40.0}, {STEP: 45.0, "decode": 35.0})
    dflash = phase_run("dflash", 20, 60.0, {"verify": 30.0, "draft": 12.0}, {STEP: 50.0, "verify": 24.0})
    table = side_by_side([plain, dflash])
    assert table.splitlines()[0] == (
        "| Phase | plain ms/token | plain % of step | plain GPU ms/token | dflash ms/token | "
        "dflash % of step | dflash GPU ms/token |"
    )
    assert table_row(table, "decode") == ["decode", "4.000", "80.0", "3.500", "–", "–", "–"]
    assert table_row(table, "verify") == ["verify", "–", "–", "–", "1.500", "50.0", "1.200"]
    assert table_row(table, "**step (total)**")[1:] == ["5.000", "100.0", "4.500", "3.000", "100.0", "2.500"]


def test_the_detail_tables_gpu_column_is_each_phases_gpu_projection() -> None:
    times = from_capture(load_capture(FIXTURES, "dflash-c1"), {})
    gpu = domain_ms("dflash-c1", "nvtx_gpu_proj_sum", "Total Proj Time (ns)")
    host = domain_ms("dflash-c1", "nvtx_sum", "Total Time (ns)")
    table = detail_table(times)
    assert table.splitlines()[0].endswith("| GPU proj (ms) |")
    for phase in ("verify", "draft", "commit"):
        row = table_row(table, phase)
        assert row[2] == f"{host[phase]:,.2f}" and row[-1] == f"{gpu[phase]:,.2f}"


def test_the_kernel_tables_mean_is_microseconds_per_launch() -> None:
    kernels = pd.DataFrame({"kernel": ["gemm", "copy"], "instances": [4, 10], "total_ms": [2.0, 0.5]})
    times = PhaseTimes("plain-c1", "plain", 1, "nsys", 10.0, {"decode": 8.0}, kernels=kernels)
    table = kernel_table(times, 10)
    assert table_row(table, "`gemm`") == ["`gemm`", "4", "2.00", "80.0", "500.0"]
    assert table_row(table, "`copy`") == ["`copy`", "10", "0.50", "20.0", "50.0"]


def test_a_benchmark_csv_with_two_drafts_at_one_concurrency_loses_neither(tmp_path: Path) -> None:
    (tmp_path / "bench.csv").write_text(
        "mode,draft,numerics,concurrency,ms_step,ms_verify,steps,output_tokens\n"
        "plain,,exact,1,50.0,0.0,20,20\n"
        "dflash,dflash,exact,1,30.0,20.0,6,20\n"
        "dflash,dflash2,exact,1,40.0,25.0,7,20\n"
    )
    """A run that measured two drafts (`--draft-arch dflash,dflash2`) has two rows of one mode
    and concurrency: the profile keeps both, each labelled with its draft, and a capture of
    that run counts the tokens of both."""
    profiles = load_profiles(tmp_path, "timer")
    assert sorted(p.step_ms for p in profiles) == [30.0, 40.0, 50.0]
    assert not any(math.isnan(p.step_ms) for p in profiles)
    assert sorted(p.label for p in profiles) == [
        "dflash-c1 draft dflash",
        "dflash-c1 draft dflash2",
        "plain-c1",
    ]
    run = bench_rows(tmp_path)[("dflash", 1)]
    assert from_capture(load_capture(FIXTURES, "dflash-c1"), {("dflash", 1): run}).output_tokens == 40

"""The weight-streaming floor (reference_engine/bench/floor.py): which weights a decode
step streams, and a measurement that counts their bytes; the engine benchmark's --floor."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from reference_engine import bench
from reference_engine.bench import step_experts
from reference_engine.bench.floor import streamed_weights, weight_streaming_floor
from reference_engine.checkpoint import load_target
from reference_engine.models.moe import ExpertCensus


def test_a_step_streams_every_matrix_and_the_embedding_only_as_a_tied_head(tiny_checkpoint) -> None:
    untied = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    tied = load_target(tiny_checkpoint("qwen3", tie_word_embeddings=True), dtype=torch.float32)
    for model in (untied, tied):
        names = {id(p): n for n, p in model.named_parameters()}
        got = {names[id(w)] for w in streamed_weights(model)}
        matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
        assert ("model.embed_tokens.weight" in got) == model.config.tie_word_embeddings
        assert got == matrices - ({"model.embed_tokens.weight"} - got)
        assert "lm_head.weight" in got or model.config.tie_word_embeddings


def test_a_fused_model_streams_its_stacks_once_and_the_same_bytes(tiny_checkpoint) -> None:
    from reference_engine.models import fuse_projections

    model = load_target(tiny_checkpoint("qwen3_5"), dtype=torch.float32)
    before = streamed_weights(model)
    fuse_projections(model)
    after = streamed_weights(model)
    assert len(after) < len(before)  # q, k, v (and gate, up; the four GDN inputs) as one each
    assert sum(w.numel() for w in after) == sum(w.numel() for w in before)
    stacks = {w.data_ptr() for w in after}
    assert len(stacks) == len(after)  # no matrix read twice


def test_the_floor_counts_the_bytes_it_streams_and_its_spread(tiny_checkpoint) -> None:
    model = load_target(tiny_checkpoint("qwen3_5"), dtype=torch.float32)
    floor = weight_streaming_floor(model, repeats=5)
    assert floor.bytes == sum(w.numel() * 4 for w in streamed_weights(model))
    assert 0 < floor.ms_min <= floor.ms_median <= floor.ms_max and floor.repeats == 5
    assert floor.gb_per_s == pytest.approx(floor.bytes / (floor.ms_median / 1000) / 1e9)  # GB/s


def test_the_benchmark_gives_each_step_as_a_multiple_of_the_floor(tmp_path: Path, capsys) -> None:
    out = tmp_path / "floor.csv"
    assert (
        bench.main(
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
                "--floor",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(out.open()))
    for row in rows:
        ratio = float(row["ms_per_decode_step"]) / float(row["floor_ms"])
        assert abs(float(row["over_floor"]) - ratio) < 1e-9
        assert float(row["floor_ms_min"]) <= float(row["floor_ms"]) <= float(row["floor_ms_max"])
        prefill = float(row["ms_prefill"]) / float(row["floor_prefill_ms"])
        assert abs(float(row["prefill_over_floor"]) - prefill) < 1e-9
        assert int(row["floor_cache_bytes"]) > 0  # 8 prompt tokens and half of 4 output tokens
    # the CPU's step costs are flat: every DFlash step verifies the whole block (15 tokens)
    (spec,) = [r for r in rows if r["mode"] == "dflash"]
    assert float(spec["verify_width_mean"]) == 15.0 and spec["verify_widths"] == f"15:{spec['steps']}"
    printed = capsys.readouterr().out
    assert "ms per decode step | floor ms [min, max] | x floor | cache GB" in printed
    assert "ms prefill | compute floor ms | x floor" in printed


def test_an_moe_floor_reads_the_experts_it_is_told_and_k_by_default() -> None:
    from reference_engine.bench.shapes import random_pair

    target, _ = random_pair("qwen3-moe-small", "cpu", torch.float32)
    config = target.config
    expert = 3 * config.moe_intermediate_size * config.hidden_size  # gate, up and down
    dense = sum(w.numel() for w in streamed_weights(target, experts_per_layer=0))
    for n in (1, 4, 9):
        weights = streamed_weights(target, experts_per_layer=n)
        assert sum(w.numel() for w in weights) == dense + config.num_hidden_layers * n * expert
        assert len({(w.data_ptr(), w.shape) for w in weights}) == len(weights)  # each one once
    floor = weight_streaming_floor(target, repeats=2)
    assert floor.experts_per_layer == config.num_experts_per_tok == 4
    assert floor.bytes == 4 * (dense + config.num_hidden_layers * 4 * expert)
    assert weight_streaming_floor(target, repeats=2, experts_per_layer=6.4).bytes == 4 * (
        dense + config.num_hidden_layers * 6 * expert
    )
    # a mean of 6.6 distinct experts reads 7, the nearest whole count (not 6, cut down)
    assert weight_streaming_floor(target, repeats=2, experts_per_layer=6.6).bytes == 4 * (
        dense + config.num_hidden_layers * 7 * expert
    )


def test_the_benchmark_counts_the_distinct_experts_of_each_step(tmp_path: Path, capsys) -> None:
    """One token routes to exactly k experts a layer; a verify of B tokens to at least k and
    at most min(E, B x k); the floor of each mode reads what its steps routed to."""
    out = tmp_path / "moe.csv"
    argv = ["--random-shape", "qwen3-moe-small", "--dtype", "float32", "--device", "cpu"]
    argv += ["--concurrency", "1,2", "--repeats", "1", "--input-len", "8", "--output-len", "12"]
    argv += ["--block-size", "4", "--floor", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    plain = [r for r in rows if r["mode"] == "plain"]
    dflash = [r for r in rows if r["mode"] == "dflash"]
    assert float(plain[0]["distinct_experts"]) == 4.0  # c1: one token a step
    assert 4.0 < float(plain[1]["distinct_experts"]) <= 8.0  # c2: two tokens (rarely the same 4)
    for r in dflash:
        assert 4.0 < float(r["distinct_experts"]) <= 16.0
        assert float(r["floor_experts_per_layer"]) == float(r["distinct_experts"])
    assert "distinct experts a layer" in capsys.readouterr().out


def test_with_a_context_the_floor_reads_each_requests_cache_too(tiny_checkpoint) -> None:
    """Keys and values of every attention layer at the context per request, and every Gated
    DeltaNet layer's float32 state per request, on top of the weights."""
    from reference_engine.bench.floor import cache_matrices

    for family in ("qwen3", "qwen3_5"):
        model = load_target(tiny_checkpoint(family), dtype=torch.float32)
        c = model.config
        kinds = c.layer_types
        kv = 2 * 3 * 50 * c.num_key_value_heads * c.head_dim * 4
        state = 3 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        want = sum(state if k == "linear_attention" else kv for k in kinds)
        assert sum(m.numel() * m.element_size() for m in cache_matrices(model, 3, 50)) == want
        weights = weight_streaming_floor(model, repeats=2, rows=3)
        floor = weight_streaming_floor(model, repeats=2, rows=3, context=50)
        assert weights.cache_bytes == 0 and floor.cache_bytes == want
        assert floor.bytes == weights.bytes + want


def test_a_sliding_window_layer_reads_at_most_its_window_of_cache(tiny_checkpoint) -> None:
    """A sliding-window layer's query sees its last `sliding_window` keys, however long the
    context: the floor reads that many of its rows per request, the full layers the context."""
    from reference_engine.bench.floor import cache_matrices

    overrides = (("use_sliding_window", True), ("sliding_window", 8), ("max_window_layers", 1))
    model = load_target(tiny_checkpoint("qwen3", config_overrides=overrides), dtype=torch.float32)
    c = model.config
    assert c.sliding_window == 8 and "sliding_attention" in c.layer_types
    row = 2 * c.num_key_value_heads * c.head_dim * 4  # a position's key and value, float32
    for context in (5, 50):
        seen = [min(context, 8) if k == "sliding_attention" else context for k in c.layer_types]
        want = sum(3 * n * row for n in seen)
        assert sum(m.numel() * m.element_size() for m in cache_matrices(model, 3, context)) == want


def test_the_mean_context_is_the_mean_prompt_and_half_the_output() -> None:
    from types import SimpleNamespace

    assert bench.mean_context([[1] * 10, [2] * 20], SimpleNamespace(output_len=8)) == 19


def test_the_prefill_floor_counts_every_product_over_the_prompt_and_the_causal_attention(
    tiny_checkpoint,
) -> None:
    from reference_engine.bench.floor import prefill_compute_floor

    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    c = model.config
    floor = prefill_compute_floor(model, 40, repeats=2)
    body = [w for w in streamed_weights(model) if w.shape[0] != c.vocab_size]
    want = 2.0 * 40 * sum(w.numel() for w in body) + 2.0 * c.vocab_size * c.hidden_size
    want += c.num_hidden_layers * 2.0 * 40 * 40 * c.num_attention_heads * c.head_dim
    assert floor.flops == want and floor.tokens == 40 and floor.repeats == 2
    assert 0 < floor.ms_min <= floor.ms_median <= floor.ms_max


def test_the_census_means_over_every_width_a_speculative_run_verified_at() -> None:
    """`--verify-width auto` verifies at several widths: the distinct experts of a run are the
    mean over all of its verifies, each call weighted alike, not those of the full block's."""
    from reference_engine.models.moe import ExpertCensus

    census = ExpertCensus("cpu")
    census.counter(8).add_(torch.tensor([3 * 20, 3]))  # three verifies of 8 tokens, 20 experts each
    census.counter(16).add_(torch.tensor([40, 1]))  # one of 16 tokens, 40 experts
    census.counter(128).add_(torch.tensor([90, 1]))  # a prefill chunk
    assert census.mean_distinct(16) == 40.0
    assert census.mean_distinct(*range(1, 17)) == (60 + 40) / 4
    assert census.mean_distinct(2, 4) is None


def test_the_census_counts_as_many_widths_as_its_buffer_has_rows_and_no_more() -> None:
    """Each new width takes the next row of the buffer allocated up front; a width past its last
    row gets no counter (its calls go uncounted) and reads as never having run, while every
    width within it, the last row included, counts and reads back."""
    census = ExpertCensus("cpu", widths=2)
    first, last = census.counter(1), census.counter(8)
    assert first is not None and last is not None
    first.add_(torch.tensor([4, 1]))
    last.add_(torch.tensor([6, 2]))
    assert census.counter(16) is None  # a third width: past the buffer
    assert torch.equal(census.counter(8), last)
    assert census.mean_distinct(8) == 3.0
    assert census.mean_distinct(1, 8, 16) == (4 + 6) / 3
    assert census.mean_distinct(16) is None
    census.reset()
    assert census.mean_distinct(1, 8) is None


def test_a_speculative_runs_experts_are_read_from_its_verifies_at_every_width() -> None:
    """The census rows a step's figure reads: plain reads one-token steps; DFlash reads every
    verify width 1 through the block size (a full block included) and leaves prefill out."""
    block = 4
    census = ExpertCensus("cpu")
    for tokens, distinct in ((1, 4), (2, 6), (block, 12), (16, 40)):  # 16: a prefill chunk
        counter = census.counter(tokens)
        counter += torch.tensor([distinct, 1])
    assert step_experts(None, block, speculative=True) is None  # a dense target
    assert step_experts(census, block, speculative=False) == 4.0
    assert step_experts(census, block, speculative=True) == (4 + 6 + 12) / 3

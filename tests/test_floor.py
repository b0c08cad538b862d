"""The weight-streaming floor (reference_engine/bench/floor.py): which weights a decode
step streams, and a measurement that counts their bytes; the engine benchmark's --floor."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from reference_engine import bench
from reference_engine.bench.floor import streamed_weights, weight_streaming_floor
from reference_engine.checkpoint import load_target


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
    assert floor.gb_per_s > 0


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
    assert "ms per decode step | floor ms [min, max] | x floor" in capsys.readouterr().out

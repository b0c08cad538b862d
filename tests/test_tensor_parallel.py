"""The tensor-parallel pieces (reference_engine/runtime/tensor_parallel.py) and the
`--tensor-parallel-size` of the entry points; the exactness gates are
gates/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from gates.parallel import run_group
from reference_engine import bench, generate
from reference_engine.checkpoint import load_target
from reference_engine.errors import ConfigError
from reference_engine.runtime.tensor_parallel import TensorParallel, shard_target, sharded_config
from reference_engine.serving.server import main as serve_main


def generate_job(rank: int, world_size: int, argv: list[str]) -> dict:
    return generate.run(generate.GenerateArgs.parse(argv))


def test_generate_under_two_ranks_prints_what_one_process_prints(tiny_pair, capsys) -> None:
    target, draft = map(str, tiny_pair("qwen3_5", block_size=4))
    argv = ["--model", target, "--draft", draft, "--prompt-ids", "5,17,33,2", "--max-tokens", "6"]
    argv += ["--ignore-eos", "--dtype", "float64", "--device", "cpu"]
    assert generate.main([*argv, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    ranks = run_group(2, generate_job, [*argv, "--tensor-parallel-size", "2"])
    assert ranks[0]["output_ids"] == ranks[1]["output_ids"] == alone["output_ids"]


def test_a_size_without_its_processes_fails_with_one_line(qwen3_checkpoint, capsys) -> None:
    argv = ["--model", str(qwen3_checkpoint), "--prompt-ids", "1,2", "--max-tokens", "2"]
    assert generate.main([*argv, "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--tensor-parallel-size 2 needs 2 processes" in err and "torchrun --nproc-per-node 2" in err


def test_the_sharded_config_holds_one_ranks_heads_and_widths(tiny_checkpoint) -> None:
    model = load_target(tiny_checkpoint("qwen3_5_moe"))
    config = model.config
    shard = sharded_config(config, TensorParallel(1, 2, "exact"))
    assert shard.num_attention_heads == config.num_attention_heads // 2
    assert shard.num_key_value_heads == 1 == config.num_key_value_heads  # copied, not split
    assert shard.linear_num_value_heads == config.linear_num_value_heads // 2
    assert shard.conv_dim == config.conv_dim // 2
    assert shard.moe_intermediate_size == config.moe_intermediate_size // 2
    assert shard.vocab_size == config.vocab_size  # the logits are gathered whole


def test_sharding_keeps_one_ranks_rows_of_each_projection(qwen3_checkpoint) -> None:
    """Rank 1 of 2 keeps the second half of the query heads and of the MLP's intermediate
    rows, the matching columns of o_proj and down_proj, and the second half of the vocabulary."""
    whole = load_target(qwen3_checkpoint, dtype=torch.float64)
    model = shard_target(load_target(qwen3_checkpoint, dtype=torch.float64), TensorParallel(1, 2, "exact"))
    a, b = whole.model.layers[0], model.model.layers[0]
    half = a.self_attn.q_proj.weight.shape[0] // 2
    assert torch.equal(b.self_attn.q_proj.weight, a.self_attn.q_proj.weight[half:])
    assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, half:])
    width = a.mlp.gate_proj.weight.shape[0] // 2
    assert torch.equal(b.mlp.up_proj.weight, a.mlp.up_proj.weight[width:])
    assert torch.equal(b.mlp.down_proj.weight, a.mlp.down_proj.weight[:, width:])
    vocab = whole.config.vocab_size // 2
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight[vocab:])
    assert torch.equal(model.model.embed_tokens.weight, whole.model.embed_tokens.weight[vocab:])


def test_a_size_that_does_not_divide_the_heads_is_refused(qwen3_checkpoint) -> None:
    model = load_target(qwen3_checkpoint)
    with pytest.raises(
        ConfigError, match="num_attention_heads 4 is not a multiple of --tensor-parallel-size 3"
    ):
        shard_target(model, TensorParallel(0, 3, "exact"))


def test_the_server_at_a_size_without_its_processes_fails_with_one_line(qwen3_checkpoint, capsys) -> None:
    argv = ["--model", str(qwen3_checkpoint), "--device", "cpu", "--tensor-parallel-size", "2"]
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "torchrun --nproc-per-node 2 -m reference_engine.serve" in err


def test_the_benchmark_under_tensor_parallelism_takes_one_numerics(tiny_pair, capsys) -> None:
    target, draft = map(str, tiny_pair("qwen3", block_size=4))
    argv = ["--model", target, "--draft", draft, "--device", "cpu", "--tensor-parallel-size", "2"]
    assert bench.main([*argv, "--numerics", "exact,fast"]) == 2
    assert "measures one --numerics at a time" in capsys.readouterr().err
    assert bench.main(argv) == 2
    assert "--tensor-parallel-size 2 needs 2 processes" in capsys.readouterr().err


def bench_job(rank: int, world_size: int, argv: list[str]) -> int:
    return bench.main(argv)


def test_the_benchmark_on_a_random_shape_runs_on_two_ranks(tmp_path) -> None:
    """Each rank draws its own slice of the random target (bench.shapes.random_pair) and the
    ranks step together; rank 0 writes one row per mode."""
    out = tmp_path / "tp.csv"
    argv = [
        "--random-shape",
        "qwen3-small",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
    ]
    argv += ["--concurrency", "2", "--input-len", "8", "--output-len", "6", "--repeats", "1"]
    argv += ["--oracle-acceptance", "2", "--block-size", "4", "--out", str(out)]
    assert run_group(2, bench_job, argv) == [0, 0]
    rows = out.read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("plain") and rows[2].startswith("dflash"), rows

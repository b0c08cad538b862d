"""Per-rank loading under tensor parallelism (`checkpoint.load_target(...,
tensor_parallel=tp)`, the slicing of runtime/tensor_parallel.py's `shard_of`): each rank reads
only its parts of the checkpoint's tensors, and holds what loading whole and then
`shard_target` would give it, to the bit. The ranks are TensorParallel objects made
directly (no process group: loading communicates nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_engine import checkpoint
from reference_engine.checkpoint import load_target, read_config
from reference_engine.config import FAMILIES, TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.models import CausalLM, expected_shapes
from reference_engine.runtime.tensor_parallel import (
    RowParallelOutput,
    Shard,
    TensorParallel,
    shard_plan,
    shard_target,
)

# (arch, make_tiny_target options) for each family, and variants that reach the other
# loader paths: tied embeddings over two files, biases (row-parallel ones move to the
# reduction), the fused expert layout. Hybrids at hidden 128 have 4 key heads, so 4 ranks.
CHECKPOINTS = [(family, {}) for family in FAMILIES] + [
    ("qwen3", {"tie_word_embeddings": True, "shards": 2}),
    ("llama", {"bias": True}),
    ("qwen3_moe", {"expert_layout": "fused"}),
    ("qwen3_5", {"hidden": 128}),
    ("qwen3_5_moe", {"hidden": 128}),
    ("qwen3_5_moe", {"hidden": 128, "expert_layout": "fused", "multimodal_wrapper": True}),
]


def checkpoint_id(case: tuple[str, dict]) -> str:
    arch, options = case
    return "-".join([arch, *(f"{k}={v}" for k, v in options.items())])


def ranks(world_size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, world_size, "exact") for rank in range(world_size)]


def held(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every tensor a rank's model holds: its parameters, and the row-parallel biases its
    reductions add."""
    tensors = dict(model.state_dict())
    for name, module in model.named_modules():
        for hook in module._forward_hooks.values():
            if isinstance(hook, RowParallelOutput) and hook.bias is not None:
                tensors[f"{name}.(reduction bias)"] = hook.bias
    return tensors


def differing(a: CausalLM, b: CausalLM) -> list[str]:
    """The names of the tensors two models hold differently (in shape or in any bit)."""
    ta, tb = held(a), held(b)
    names = sorted(set(ta) | set(tb))
    return [n for n in names if n not in ta or n not in tb or not torch.equal(ta[n], tb[n])]


def shards_degree(path: Path, world_size: int) -> bool:
    config = config_of(path)
    try:
        shard_plan(config, expected_shapes(config), TensorParallel(0, world_size, "exact"))
    except ConfigError:
        return False
    return True


def config_of(path: Path) -> TargetConfig:
    return TargetConfig.from_hf(read_config(path))


@pytest.fixture(params=CHECKPOINTS, ids=checkpoint_id)
def target_dir(request, tiny_checkpoint) -> Path:
    arch, options = request.param
    return tiny_checkpoint(arch, **options)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_loads_what_loading_whole_then_sharding_gives_it_bit_for_bit(
    target_dir: Path, world_size: int
) -> None:
    if not shards_degree(target_dir, world_size):
        pytest.skip(f"the heads of this checkpoint do not divide over {world_size} ranks")
    whole = load_target(target_dir, dtype=torch.float64)
    for tp in ranks(world_size):
        loaded = load_target(target_dir, dtype=torch.float64, tensor_parallel=tp)
        cut = shard_target(whole, tp)
        assert differing(loaded, cut) == [], f"rank {tp.rank} of {world_size}"
        assert loaded.config == cut.config
        assert loaded.model.embed_tokens.start == cut.model.embed_tokens.start


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_reads_its_share_of_the_split_tensors_and_the_replicated_ones_whole(
    target_dir: Path, world_size: int
) -> None:
    """Bytes read from the files, per rank: the replicated tensors (norms, router) whole,
    1/N of every split tensor, and of the KV projections 1/N, or one KV head's rows when there
    are fewer KV heads than ranks (that head is copied). Nothing else: exactly the bytes of
    what the rank holds."""
    if not shards_degree(target_dir, world_size):
        pytest.skip(f"the heads of this checkpoint do not divide over {world_size} ranks")
    config = config_of(target_dir)
    whole = load_target(target_dir, dtype=torch.float32)  # the tiny checkpoints' dtype on disk
    plan = shard_plan(config, expected_shapes(config), TensorParallel(0, world_size, "exact"))
    sizes = {name: t.numel() * t.element_size() for name, t in whole.state_dict().items()}
    replicated = sum(size for name, size in sizes.items() if plan[name] is None)
    kv = sum(size for name, size in sizes.items() if ".k_proj." in name or ".v_proj." in name)
    split = sum(sizes.values()) - replicated - kv
    share = replicated + split / world_size + kv / min(world_size, config.num_key_value_heads)
    for tp in ranks(world_size):
        reads: list[tuple[str, int]] = []
        model = load_target(target_dir, dtype=torch.float32, tensor_parallel=tp, reads=reads)
        read = sum(size for _, size in reads)
        assert read == sum(t.numel() * t.element_size() for t in held(model).values())
        assert read == share, f"rank {tp.rank} read {read} bytes, expected {share}"
        assert read < sum(sizes.values()) / world_size + replicated + kv  # about 1/N of the whole


def covering_faults(path: Path, world_size: int, plan_of=shard_plan) -> list[str]:
    """The split tensors whose parts over the ranks do not cover each index once: every index
    along the split dimension is some rank's, and two ranks' parts are disjoint or (a copied
    KV head) the same. A statement of the rule alone, independent of the loader."""
    config = config_of(path)
    shapes = expected_shapes(config)
    plans = [plan_of(config, shapes, tp) for tp in ranks(world_size)]
    faults = []
    for name, shape in shapes.items():
        if plans[0][name] is None:
            continue
        parts = [frozenset(i for s, n in plan[name].pieces for i in range(s, s + n)) for plan in plans]
        dim = plans[0][name].dim
        covered = frozenset().union(*parts) == frozenset(range(shape[dim]))
        if not covered or any(a & b and a != b for a in parts for b in parts):
            faults.append(name)
    return faults


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ranks_parts_of_every_split_tensor_cover_it_once(target_dir: Path, world_size: int) -> None:
    if not shards_degree(target_dir, world_size):
        pytest.skip(f"the heads of this checkpoint do not divide over {world_size} ranks")
    assert covering_faults(target_dir, world_size) == []


# ----------------------------------------------------------------------------- planted faults
FAULTY = "model.layers.0.self_attn.q_proj.weight"


def one_head_off(config: TargetConfig, shapes: dict, tp: TensorParallel) -> dict[str, Shard | None]:
    """The true plan with rank 0's query heads of layer 0 one head later."""
    plan = shard_plan(config, shapes, tp)
    if tp.rank == 0:
        rows = config.head_dim * (2 if config.gated_attention else 1)
        plan[FAULTY] = Shard(0, tuple((start + rows, n) for start, n in plan[FAULTY].pieces))
    return plan


def test_planted_fault_a_loader_slice_one_head_off_is_caught_by_the_equality_check(
    qwen3_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tp = TensorParallel(0, 2, "exact")
    cut = shard_target(load_target(qwen3_checkpoint, dtype=torch.float64), tp)
    monkeypatch.setattr(checkpoint, "shard_plan", one_head_off)  # the loader's rule only
    loaded = load_target(qwen3_checkpoint, dtype=torch.float64, tensor_parallel=tp)
    assert differing(loaded, cut) == [FAULTY]


def test_planted_fault_a_rule_one_head_off_on_both_paths_is_caught_by_the_covering_check(
    qwen3_checkpoint: Path,
) -> None:
    """Loader and shard_target share the rule, so a fault in it leaves them equal; the
    covering check sees the overlap and the query head no rank has."""
    assert covering_faults(qwen3_checkpoint, 2) == []
    assert covering_faults(qwen3_checkpoint, 2, plan_of=one_head_off) == [FAULTY]


@pytest.mark.parametrize("shape", ["qwen3-small", "qwen3.5-small", "qwen3-moe-small"])
def test_a_random_shapes_rank_draws_its_slice_alone_and_holds_the_whole_draws_slice(shape: str) -> None:
    """The benchmark's random weights under tensor parallelism (`random_pair(...,
    tensor_parallel=tp)`): each rank keeps its slice of each tensor as it is drawn, and holds
    what drawing the whole target and `shard_target` give it, bit for bit."""
    from reference_engine.bench.shapes import random_pair

    whole, _ = random_pair(shape, "cpu", torch.float32, seed=3)
    for tp in ranks(2):
        alone, _ = random_pair(shape, "cpu", torch.float32, seed=3, tensor_parallel=tp)
        assert alone.tensor_parallel is tp
        assert differing(alone, shard_target(whole, tp)) == []

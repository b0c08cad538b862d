"""Tensor parallelism: one process per device, each holding a slice of every layer, exact
under DFlash.

Each rank keeps (`shard_of`, the one statement of the slicing) attention query heads and KV
heads (a KV head is copied to several ranks when there are fewer KV heads than ranks), Gated
DeltaNet key and value heads (their projections, conv channels, decay and gate
parameters), the MLP's and every expert's intermediate dimension (routing stays whole and
replicated, so every rank runs the same experts on the same tokens), and the vocabulary of
the embedding and of the LM head. The loader reads only these parts from the checkpoint's
files (`checkpoint.load_target(..., tensor_parallel=tp)`), so a rank never holds more than
its slice plus the replicated tensors; a benchmark's random target is drawn the same way,
a slice at a time (bench/shapes.random_pair), and `shard_target` cuts the same parts from a
target already loaded whole (the tests' reference for both). Column-parallel projections
need no communication; each row-parallel one (o_proj, down_proj, the experts' down products, Gated DeltaNet's
out_proj) leaves a partial sum that one reduction per sublayer completes, hooked on the
sublayer module, so the model files stay as they are. The per-slot state follows the
sharded config (`model.config` describes this rank's slice), so the KV caches and Gated
DeltaNet states hold this rank's heads only. The draft is small and replicated: it reads
the target's vocabulary-parallel embedding and LM head, whose logits are gathered.

The reductions are where tensor parallelism can break DFlash == plain greedy: an
all-reduce whose order of addition depends on the message size (NCCL picks its algorithm
and chunking by size) gives a token's hidden state different bits in a decode step of one
row and in a verify of B rows. In the `exact` numerics every rank gathers the partial sums
and adds them in rank order, rank 0 + rank 1 + ..., one rounding per addition in the model
dtype: the same bits on every rank and for any number of rows. The `fast` numerics call
the backend's all-reduce. With two ranks both are exact (a + b == b + a); from three ranks
on the order matters.

Launch: one process per device, as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment; multi-node through torchrun's rendezvous);
NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TargetConfig
from ..errors import ConfigError, RequestError
from ..kernels import NUMERICS
from ..models import CausalLM, build_target
from ..models.base import target_rotary
from ..models.dflash import DFlashDraft
from ..models.moe import SparseMoeBlock

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); older torch has only it
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

LAUNCH = "torchrun --nproc-per-node {n} -m reference_engine.{command} ... --tensor-parallel-size {n}"


class TensorParallel:
    """This process's place in the tensor-parallel group and the group's two collectives."""

    def __init__(self, rank: int, world_size: int, numerics: str, group: dist.ProcessGroup | None = None):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for a group of {world_size}")
        self.rank, self.world_size, self.numerics, self.group = rank, world_size, numerics, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, the same bits on every rank. `exact`: gathered and added
        in rank order one addition at a time (a tensor-wide sum could vectorise over ranks in
        a size-dependent way), so a row's bits do not depend on the rows sent with it."""
        if self.numerics == "fast":
            dist.all_reduce(x, group=self.group)
            return x
        parts = self.all_gather(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x stacked by rank: [world_size, *x.shape]."""
        x = x.contiguous()
        parts = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))  # by rank along dim 0
        _all_gather_single(parts, x, group=self.group)
        return parts.view(self.world_size, *x.shape)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [..., vocab / world] -> the whole
        vocabulary [..., vocab], rank 0's slice first (a copy: no arithmetic, exact)."""
        parts = self.all_gather(logits)
        return parts.movedim(0, -2).reshape(*logits.shape[:-1], -1)

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `size` units of `what`."""
        if size % self.world_size:
            raise ConfigError(f"{what} {size} is not a multiple of --tensor-parallel-size {self.world_size}")
        share = size // self.world_size
        return self.rank * share, share


def _launch_number(name: str, default: str | None, size: int, launch: str) -> int:
    """The whole number torchrun sets in the environment variable `name` (`default` when it
    is not set); one line naming it and the launch when it is missing or not a number."""
    text = os.environ.get(name, default)
    if text is None or not text.strip().isdigit():
        found = "not set" if text is None else f"{text!r}, not a whole number"
        raise RequestError(
            f"--tensor-parallel-size {size}: {name} is {found} in the environment; launch with `{launch}`"
        )
    return int(text)


def init_tensor_parallel(
    size: int, device: torch.device, numerics: str, command: str
) -> TensorParallel | None:
    """Join the group torchrun started this process in (None at size 1). Fails with one line
    when the processes do not match the size, or a rank has no device of its own. On CUDA
    the rank's device is cuda:LOCAL_RANK (read it back with `rank_device`)."""
    if size < 1:
        raise RequestError(f"--tensor-parallel-size must be at least 1, got {size}")
    launch = LAUNCH.format(n=size, command=command)
    world = _launch_number("WORLD_SIZE", "1", size, launch)
    if size == 1 and world == 1:
        return None
    if world != size:
        raise RequestError(
            f"--tensor-parallel-size {size} needs {size} processes, one per device, but this one "
            f"runs in a group of {world}: launch with `{launch}`"
        )
    rank = _launch_number("RANK", None, size, launch)
    local_rank = _launch_number("LOCAL_RANK", str(rank), size, launch)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RequestError(
                f"--tensor-parallel-size {size}: local rank {local_rank} has no GPU of its own "
                f"({torch.cuda.device_count()} visible here)"
            )
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(minutes=10))
    return TensorParallel(rank, size, numerics)


def leads() -> bool:
    """Whether this process prints and serves: rank 0 of a group, or a process on its own."""
    return not dist.is_initialized() or dist.get_rank() == 0


def rank_device(device: torch.device, tp: TensorParallel | None) -> torch.device:
    """The device this rank runs on: its own GPU under tensor parallelism on CUDA."""
    if tp is None or device.type != "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


# ----------------------------------------------------------------------------- sharding
class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding: ids outside them look up zeros, and the sum over
    ranks (one non-zero term per element, so exact in any order) is the whole lookup."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        super().__init__(*weight.shape, _weight=weight, _freeze=True)
        self.start, self.tp = start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~inside[..., None], 0))


class RowParallelOutput:
    """The hooks of a sublayer whose last product is row-parallel: its output is this rank's
    partial sum; the forward hook returns the sum over ranks plus the product's bias, which
    the sharding took off the linear so that it is added once. A residual the layer hands the
    sublayer (`residual=`, an MLP's: models/layers.MLP) is taken off the call by the pre-hook
    and added after the sum, once, where the sublayer would have added it to each rank's part."""

    def __init__(self, tp: TensorParallel, bias: torch.Tensor | None = None) -> None:
        self.tp, self.bias = tp, bias
        self.residual: torch.Tensor | None = None

    def take_residual(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.residual = kwargs.pop("residual", None)
        return args, kwargs

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(out)
        out = out if self.bias is None else out + self.bias
        residual, self.residual = self.residual, None
        return out if residual is None else residual + out


VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """The part of a tensor one rank keeps: along `dim`, the `pieces` (start, length) in order,
    concatenated (a fused projection keeps one piece of each of its parts)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor (a copy)."""
        return torch.cat([whole.narrow(self.dim, start, length) for start, length in self.pieces], self.dim)


def _rows(*pieces: tuple[int, int]) -> Shard:
    return Shard(0, pieces)


def _scaled(piece: tuple[int, int], unit: int, offset: int = 0) -> tuple[int, int]:
    """A piece counted in heads -> in rows of `unit` each, from `offset`."""
    return offset + piece[0] * unit, piece[1] * unit


def attention_heads(config: TargetConfig, tp: TensorParallel) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, count) of this rank's query heads and of its KV heads: KV heads split evenly,
    or, when there are fewer KV heads than ranks, the one KV head its query heads read."""
    heads, kv_heads, n = config.num_attention_heads, config.num_key_value_heads, tp.world_size
    query = tp.split(heads, "num_attention_heads")
    if kv_heads % n and n % kv_heads:
        raise ConfigError(
            f"num_key_value_heads {kv_heads} neither divides nor is a multiple of --tensor-parallel-size {n}"
        )
    return query, (tp.rank * kv_heads // n, max(1, kv_heads // n))


def _attention_shard(proj: str, leaf: str, config: TargetConfig, tp: TensorParallel) -> Shard | None:
    query, kv = attention_heads(config, tp)
    d = config.head_dim
    if proj == "q_proj":  # gated: query and gate interleaved per head, 2 * head_dim rows each
        return _rows(_scaled(query, d * (2 if config.gated_attention else 1)))
    if proj in ("k_proj", "v_proj"):
        return _rows(_scaled(kv, d))
    if proj == "o_proj" and leaf == "weight":
        return Shard(1, (_scaled(query, d),))
    return None  # q_norm, k_norm; o_proj's bias is added once, after the reduction


def _gated_deltanet_shard(proj: str, leaf: str, config: TargetConfig, tp: TensorParallel) -> Shard | None:
    """Key heads and value heads split evenly (value heads 2i, 2i+1 read key head i for a
    ratio of 2, so contiguous shares stay together)."""
    keys = tp.split(config.linear_num_key_heads, "linear_num_key_heads")
    values = tp.split(config.linear_num_value_heads, "linear_num_value_heads")
    dk, dv, key_dim = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_key_dim
    if proj in ("in_proj_qkv", "conv1d"):  # q, k and v channels
        return _rows(_scaled(keys, dk), _scaled(keys, dk, key_dim), _scaled(values, dv, 2 * key_dim))
    if proj == "in_proj_z":
        return _rows(_scaled(values, dv))
    if proj in ("in_proj_a", "in_proj_b") or leaf in ("dt_bias", "A_log"):
        return _rows(values)
    if proj == "out_proj":
        return Shard(1, (_scaled(values, dv),))
    return None  # the gated norm, per value head dimension


def _mlp_shard(proj: str, leaf: str, shape: tuple[int, ...], tp: TensorParallel) -> Shard | None:
    """The intermediate dimension split: gate and up by rows, down by columns; every expert's
    (gate_up [E, 2I, H] gate rows first, down [E, H, I]) and the shared expert's alike. The
    router and the shared expert's gate stay whole, so routing is the same on every rank."""
    if proj in ("gate_proj", "up_proj"):
        return _rows(tp.split(shape[0], "the MLP's intermediate size"))
    if proj == "down_proj" and leaf == "weight":
        return Shard(1, (tp.split(shape[1], "the MLP's intermediate size"),))
    if leaf == "gate_up_proj":
        first, count = tp.split(shape[1] // 2, "moe_intermediate_size")
        return Shard(1, ((first, count), (shape[1] // 2 + first, count)))
    if leaf == "down_proj":
        return Shard(2, (tp.split(shape[2], "moe_intermediate_size"),))
    return None  # the router, the shared expert's gate, down_proj's bias


def shard_of(name: str, shape: tuple[int, ...], config: TargetConfig, tp: TensorParallel) -> Shard | None:
    """The part of the target's tensor `name` (whole: `shape`) that this rank keeps, or None
    for one every rank holds whole (norms, the router, the row-parallel biases). The one
    statement of the slicing: the loader reads these parts from the files, and
    `shard_target` cuts them from a target loaded whole."""
    if name in VOCAB_PARALLEL:
        return _rows(tp.split(config.vocab_size, "vocab_size"))
    owner, _, leaf = name.rpartition(".")
    module = owner.rpartition(".")[2]  # q_proj, in_proj_qkv, experts, ...
    if ".self_attn." in name:
        return _attention_shard(module, leaf, config, tp)
    if ".linear_attn." in name:
        return _gated_deltanet_shard(module, leaf, config, tp)
    if ".mlp." in name:
        return _mlp_shard(module, leaf, shape, tp)
    return None


def shard_plan(
    config: TargetConfig, shapes: dict[str, tuple[int, ...]], tp: TensorParallel
) -> dict[str, Shard | None]:
    """`shard_of` for every tensor of the target (shapes: `models.expected_shapes`); fails on
    a size the heads or widths do not divide before anything is read (the layers' sizes
    named before the vocabulary's)."""
    names = sorted(shapes, key=lambda name: name in VOCAB_PARALLEL)
    return {name: shard_of(name, shapes[name], config, tp) for name in names}


def sharded_config(config: TargetConfig, tp: TensorParallel) -> TargetConfig:
    """The config of this rank's slice (what the per-slot state is sized by): heads and
    intermediate widths divided, a KV head copied when there are fewer than ranks."""
    n = tp.world_size

    def share(value: int) -> int:
        return value // n

    return replace(
        config,
        num_attention_heads=share(config.num_attention_heads),
        num_key_value_heads=max(1, share(config.num_key_value_heads)),
        linear_num_key_heads=share(config.linear_num_key_heads),
        linear_num_value_heads=share(config.linear_num_value_heads),
        intermediate_size=share(config.intermediate_size),
        moe_intermediate_size=share(config.moe_intermediate_size),
        shared_expert_intermediate_size=share(config.shared_expert_intermediate_size),
    )


def sharded_target(
    config: TargetConfig, tensors: dict[str, torch.Tensor], tp: TensorParallel, device: torch.device | str
) -> CausalLM:
    """This rank's target around its tensors (the parts `shard_plan` names, by checkpoint
    name): the modules are those of the sharded config, so every tensor's shape is checked
    against them, plus the vocabulary-parallel embedding and LM head; each row-parallel
    sublayer gets its reduction, with its last product's bias taken off to be added once."""
    first, count = tp.split(config.vocab_size, "vocab_size")
    with torch.device("meta"):
        model = build_target(sharded_config(config, tp))
        model.model.embed_tokens = VocabParallelEmbedding(torch.empty(count, config.hidden_size), first, tp)
        if not config.tie_word_embeddings:
            model.lm_head = nn.Linear(config.hidden_size, count, bias=False)
    model.load_state_dict(tensors, strict=True, assign=True)
    for layer in model.model.layers:
        if getattr(layer, "is_linear", False):
            _reduce(layer.linear_attn, tp, layer.linear_attn.out_proj)
        else:
            _reduce(layer.self_attn, tp, layer.self_attn.o_proj)
        if isinstance(layer.mlp, SparseMoeBlock):  # the shared expert's down_proj has no bias
            _reduce(layer.mlp, tp)
        else:
            _reduce(layer.mlp, tp, layer.mlp.down_proj)
    model.rotary = target_rotary(config).to(device)
    model.gather_logits = tp.gather_vocab
    model.tensor_parallel = tp
    return model.eval().requires_grad_(False)


def _reduce(module: nn.Module, tp: TensorParallel, last: nn.Linear | None = None) -> None:
    """Hook the reduction of a sublayer whose last product (`last`) is row-parallel."""
    bias = None
    if last is not None and last.bias is not None:
        bias, last.bias = last.bias.detach(), None
    hooks = RowParallelOutput(tp, bias)
    module.register_forward_pre_hook(hooks.take_residual, with_kwargs=True)
    module.register_forward_hook(hooks)


def shard_target(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """This rank's slice of a target loaded whole (the reference the tests hold the sliced
    loader and the sliced random draw to; a checkpoint is read slice by slice instead:
    `checkpoint.load_target(..., tensor_parallel=tp)`): a new model, the
    one the loader builds, around the parts `shard_of` names cut from the whole model's
    tensors (those every rank holds whole are shared with it, not copied)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the target is already sharded")
    whole = model.state_dict()
    plan = shard_plan(model.config, {name: tuple(t.shape) for name, t in whole.items()}, tp)
    tensors = {name: t if plan[name] is None else plan[name].take(t) for name, t in whole.items()}
    sharded = sharded_target(model.config, tensors, tp, model.model.norm.weight.device)
    if hasattr(model, "source_path"):
        sharded.source_path = model.source_path
    return sharded


def share_with_draft(draft: DFlashDraft, tp: TensorParallel) -> DFlashDraft:
    """The draft stays whole on every rank (a few layers: splitting it would add reductions
    to every draft forward for little memory); its logits come from the target's
    vocabulary-parallel LM head and are gathered."""
    draft.gather_logits = tp.gather_vocab
    return draft

"""Tensor parallelism: one process per device, each holding a slice of every layer, exact
under DFlash.

A loaded target is sharded in place (`shard_target`): attention query heads and KV heads
(a KV head is copied to several ranks when there are fewer KV heads than ranks), Gated
DeltaNet key and value heads (their projections, conv channels, decay and gate
parameters), the MLP's and every expert's intermediate dimension (routing stays whole and
replicated, so every rank runs the same experts on the same tokens), and the vocabulary of
the embedding and of the LM head. Column-parallel projections need no communication;
each row-parallel one (o_proj, down_proj, the experts' down products, Gated DeltaNet's
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
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TargetConfig
from ..errors import ConfigError, RequestError
from ..kernels import NUMERICS
from ..models import CausalLM
from ..models.dflash import DFlashDraft
from ..models.layers import MLP, SelfAttention
from ..models.moe import SparseMoeBlock
from ..models.qwen3_5 import GatedDeltaNet

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


def init_tensor_parallel(
    size: int, device: torch.device, numerics: str, command: str
) -> TensorParallel | None:
    """Join the group torchrun started this process in (None at size 1). Fails with one line
    when the processes do not match the size, or a rank has no device of its own. On CUDA
    the rank's device is cuda:LOCAL_RANK (read it back with `rank_device`)."""
    if size < 1:
        raise RequestError(f"--tensor-parallel-size must be at least 1, got {size}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 and world == 1:
        return None
    if world != size:
        raise RequestError(
            f"--tensor-parallel-size {size} needs {size} processes, one per device, but this one "
            f"runs in a group of {world}: launch with `{LAUNCH.format(n=size, command=command)}`"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
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
    """A forward hook on a sublayer whose last product is row-parallel: its output is this
    rank's partial sum; the hook returns the sum over ranks plus the product's bias, which
    the sharding took off the linear so that it is added once."""

    def __init__(self, tp: TensorParallel, bias: torch.Tensor | None = None) -> None:
        self.tp, self.bias = tp, bias

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _keep(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        setattr(module, name, nn.Parameter(value.contiguous().clone(), requires_grad=False))


def _columns(linear: nn.Linear, pieces: list[tuple[int, int]]) -> None:
    """Keep the output rows (pieces of (start, length)) of a column-parallel linear."""
    _keep(linear, "weight", torch.cat([linear.weight[s : s + n] for s, n in pieces]))
    if linear.bias is not None:
        _keep(linear, "bias", torch.cat([linear.bias[s : s + n] for s, n in pieces]))
    linear.out_features = linear.weight.shape[0]  # FusedLinears sizes its views by it


def _row_parallel(linear: nn.Linear, start: int, length: int) -> torch.Tensor | None:
    """Keep the input columns of a row-parallel linear; returns its bias, taken off."""
    _keep(linear, "weight", linear.weight[:, start : start + length])
    linear.in_features = length
    bias = linear.bias
    linear.bias = None
    return None if bias is None else bias.detach().clone()


def _hook(module: nn.Module, tp: TensorParallel, bias: torch.Tensor | None = None) -> None:
    module.register_forward_hook(RowParallelOutput(tp, bias))


def shard_attention(attn: SelfAttention, tp: TensorParallel) -> None:
    """Query heads split evenly; KV heads split evenly, or, when there are fewer KV heads
    than ranks, the one KV head this rank's query heads read copied to it."""
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    first, count = tp.split(heads, "num_attention_heads")
    if kv_heads % tp.world_size and tp.world_size % kv_heads:
        raise ConfigError(
            f"num_key_value_heads {kv_heads} neither divides nor is a multiple of "
            f"--tensor-parallel-size {tp.world_size}"
        )
    kv_count = max(1, kv_heads // tp.world_size)
    kv_first = tp.rank * kv_heads // tp.world_size
    q_rows = d * (2 if attn.gated else 1)  # gated: query and gate interleaved per head
    _columns(attn.q_proj, [(first * q_rows, count * q_rows)])
    _columns(attn.k_proj, [(kv_first * d, kv_count * d)])
    _columns(attn.v_proj, [(kv_first * d, kv_count * d)])
    _hook(attn, tp, _row_parallel(attn.o_proj, first * d, count * d))
    attn.num_heads, attn.num_kv_heads = count, kv_count
    attn.fused = None


def shard_gated_deltanet(gdn: GatedDeltaNet, tp: TensorParallel) -> None:
    """Key heads and value heads split evenly (value heads 2i, 2i+1 read key head i for a
    ratio of 2, so contiguous shares stay together): the q, k and v channels of the input
    projection and of the conv, z, a, b, the decay parameters and out_proj's columns."""
    k_first, k_count = tp.split(gdn.num_k_heads, "linear_num_key_heads")
    v_first, v_count = tp.split(gdn.num_v_heads, "linear_num_value_heads")
    dk, dv, key_dim = gdn.k_dim, gdn.v_dim, gdn.key_dim
    channels = [(k_first * dk, k_count * dk), (key_dim + k_first * dk, k_count * dk)]
    channels.append((2 * key_dim + v_first * dv, v_count * dv))
    _columns(gdn.in_proj_qkv, channels)
    _keep(gdn.conv1d, "weight", torch.cat([gdn.conv1d.weight[s : s + n] for s, n in channels]))
    _columns(gdn.in_proj_z, [(v_first * dv, v_count * dv)])
    _columns(gdn.in_proj_b, [(v_first, v_count)])
    _columns(gdn.in_proj_a, [(v_first, v_count)])
    _keep(gdn, "dt_bias", gdn.dt_bias[v_first : v_first + v_count])
    _keep(gdn, "A_log", gdn.A_log[v_first : v_first + v_count])
    _hook(gdn, tp, _row_parallel(gdn.out_proj, v_first * dv, v_count * dv))
    gdn.num_k_heads, gdn.num_v_heads = k_count, v_count
    gdn.key_dim, gdn.value_dim = k_count * dk, v_count * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim
    gdn.conv1d.in_channels = gdn.conv1d.out_channels = gdn.conv1d.groups = gdn.conv_dim
    gdn.fused = None


def shard_mlp(mlp: MLP, tp: TensorParallel, hook: bool = True) -> None:
    """The intermediate dimension split: gate and up by rows, down by columns."""
    first, count = tp.split(mlp.gate_proj.out_features, "the MLP's intermediate size")
    _columns(mlp.gate_proj, [(first, count)])
    _columns(mlp.up_proj, [(first, count)])
    bias = _row_parallel(mlp.down_proj, first, count)
    if hook:
        _hook(mlp, tp, bias)
    mlp.fused = None


def shard_moe(block: SparseMoeBlock, tp: TensorParallel) -> None:
    """Every expert's intermediate dimension split (gate_up [E, 2I, H] gate rows first, down
    [E, H, I]), and the shared expert's; the router and the shared expert's gate stay whole,
    so routing is the same on every rank. One reduction for the block's output."""
    experts = block.experts
    width = experts.down_proj.shape[-1]
    first, count = tp.split(width, "moe_intermediate_size")
    gate_up = experts.gate_up_proj
    gate, up = gate_up[:, first : first + count], gate_up[:, width + first : width + first + count]
    _keep(experts, "gate_up_proj", torch.cat([gate, up], dim=1))
    _keep(experts, "down_proj", experts.down_proj[..., first : first + count])
    if block.shared_expert is not None:
        shard_mlp(block.shared_expert, tp, hook=False)
    _hook(block, tp)


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


def shard_target(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """Keep this rank's slice of every layer of a loaded target, in place (before the engine
    is built: fused projections and CUDA graphs are made from the slices)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the target is already sharded")
    config = model.config
    for layer in model.model.layers:
        mixer = layer.linear_attn if getattr(layer, "is_linear", False) else layer.self_attn
        if isinstance(mixer, GatedDeltaNet):
            shard_gated_deltanet(mixer, tp)
        else:
            shard_attention(mixer, tp)
        if isinstance(layer.mlp, SparseMoeBlock):
            shard_moe(layer.mlp, tp)
        else:
            shard_mlp(layer.mlp, tp)
    first, count = tp.split(config.vocab_size, "vocab_size")
    embed = model.model.embed_tokens.weight[first : first + count].contiguous().clone()
    model.model.embed_tokens = VocabParallelEmbedding(embed, first, tp)
    if not config.tie_word_embeddings:
        _keep(model.lm_head, "weight", model.lm_head.weight[first : first + count])
    model.gather_logits = tp.gather_vocab
    model.config = sharded_config(config, tp)
    model.tensor_parallel = tp
    return model


def share_with_draft(draft: DFlashDraft, tp: TensorParallel) -> DFlashDraft:
    """The draft stays whole on every rank (a few layers: splitting it would add reductions
    to every draft forward for little memory); its logits come from the target's
    vocabulary-parallel LM head and are gathered."""
    draft.gather_logits = tp.gather_vocab
    return draft

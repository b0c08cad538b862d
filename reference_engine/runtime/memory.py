"""Device memory for the engine's state: what a token and a slot of state cost, how much of the
device the state may take, and whether the slots and context asked for fit.

The budget has vLLM's `--gpu-memory-utilization` meaning: the engine may use the share F of
the device's total memory; the weights and the measured activation peak of the largest
forward come out of it first, and the state gets the rest. The state is every tensor the
engine preallocates per slot: the KV caches of the target's attention layers and of the
draft (per token), the Gated DeltaNet conv and recurrent states with their saved copies and
the commit strategy's verify buffers (per slot, whatever the length).

A slot's caches are indexed by position (the attention kernels read `cache[slot, position]`
in place), so every slot holds the engine's whole room (context + one block): the state is
slots x room tokens, not the sum of what the running requests use. A configuration whose
slots x room does not fit the budget is refused at start with the numbers, before anything
is allocated. CUDA graphs keep their static outputs (the verify's and the draft's logits per
batch bucket) beside the activation peak; they come out of the share 1 - F left over, and
start-up reports what they took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels import Kernels
from ..models import CausalLM
from ..models.dflash import DFlashDraft

GiB = 1024**3


@dataclass(frozen=True)
class StateCost:
    """Bytes of preallocated state: per token of a slot's room, and per slot whatever the room."""

    per_token: int
    per_slot: int

    def bytes_for(self, slots: int, room: int, pool_rows: int | None = None) -> int:
        """`slots` slots of `room` tokens each, or with a pooled KV cache (kv_pool.py) their
        per-slot state and the pool's rows of tokens."""
        tokens = slots * room if pool_rows is None else pool_rows
        return slots * self.per_slot + tokens * self.per_token


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors an object holds as attributes, directly or in lists (None skipped)."""
    total = 0
    for value in vars(obj).values():
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def state_cost(build: Callable[[int, int, torch.device], list[object]]) -> StateCost:
    """The cost of the states `build(slots, room, device)` allocates, read off two of them built
    on the meta device (which allocates nothing): a slot of room 1 and of room 2."""
    meta = torch.device("meta")
    one, two = (sum(tensor_bytes(s) for s in build(1, room, meta) if s is not None) for room in (1, 2))
    return StateCost(per_token=two - one, per_slot=one - (two - one))


@dataclass(frozen=True)
class MemoryPlan:
    """The device memory of one engine, in bytes: the budget and what the state takes of it."""

    total: int  # the device's memory
    utilization: float  # F: the share the engine may use
    weights: int
    activations: int  # the measured peak of the largest forward
    cost: StateCost
    slots: int  # the state's slots (with the CUDA graphs' spare slot)
    room: int  # tokens a slot holds: the context and one block
    pool_rows: int | None = None  # a pooled KV cache: its rows of tokens (kv_pool.PoolLayout.rows)

    @property
    def budget(self) -> int:
        """What the state may take: F x total - weights - activations."""
        return int(self.utilization * self.total) - self.weights - self.activations

    @property
    def state(self) -> int:
        return self.cost.bytes_for(self.slots, self.room, self.pool_rows)

    @property
    def tokens_that_fit(self) -> int:
        """Tokens of room the budget holds at this many slots (0 when the slots' own state
        does not fit)."""
        left = self.budget - self.slots * self.cost.per_slot
        return max(0, left // self.cost.per_token) if self.cost.per_token else 0

    def describe(self) -> str:
        """One line for start-up: what the state reserved, out of which budget."""
        tokens = (
            f"{self.slots} slots x {self.room} tokens"
            if self.pool_rows is None
            else f"a pooled KV cache of {self.pool_rows} tokens for {self.slots} slots"
        )
        return (
            f"memory: state {self.state / GiB:.2f} GiB reserved ({tokens} x "
            f"{self.cost.per_token} B/token + {self.cost.per_slot} B/slot) of a budget of "
            f"{self.budget / GiB:.2f} GiB = {self.utilization:g} x {self.total / GiB:.2f} GiB - weights "
            f"{self.weights / GiB:.2f} GiB - activations {self.activations / GiB:.2f} GiB"
        )


def plan_memory(
    total: int,
    utilization: float,
    weights: int,
    activations: int,
    cost: StateCost,
    slots: int,
    room: int,
    max_num_seqs: int,
    max_model_len: int,
    pool_rows: int | None = None,
    cell_tokens: int = 1,
) -> MemoryPlan:
    """The plan of an engine whose state needs `slots` x `room` tokens (`max_num_seqs` and
    `max_model_len` as the user gave them, for the message), or, pooled, `pool_rows` tokens
    in cells of `cell_tokens`; ConfigError, one line with the numbers, when it does not fit
    the budget (advising a --kv-cache-tokens of whole cells, which the pool rounds up to)."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    plan = MemoryPlan(total, utilization, weights, activations, cost, slots, room, pool_rows)
    if plan.budget <= 0:
        raise ConfigError(
            f"no memory left for the state: {utilization:g} x {total / GiB:.2f} GiB of device memory "
            f"= {utilization * total / GiB:.2f} GiB, but the weights take {weights / GiB:.2f} GiB and "
            f"the activations {activations / GiB:.2f} GiB; raise --gpu-memory-utilization or use a "
            "larger device"
        )
    if plan.state > plan.budget and pool_rows is not None:
        fit = plan.tokens_that_fit
        raise ConfigError(
            f"the state does not fit: a pooled KV cache of {pool_rows} tokens x {cost.per_token} bytes "
            f"(+ {cost.per_slot} per slot for {slots} slots) exceeds the budget of {plan.budget / GiB:.2f} "
            f"GiB ({utilization:g} x {total / GiB:.2f} GiB - weights {weights / GiB:.2f} GiB - activations "
            f"{activations / GiB:.2f} GiB), which holds {fit} tokens; lower --kv-cache-tokens (at most "
            f"{max(0, (fit - room) // cell_tokens * cell_tokens)} fits with the spare room of {room}) "
            "or raise --gpu-memory-utilization"
        )
    if plan.state > plan.budget:
        fit = plan.tokens_that_fit
        raise ConfigError(
            f"the state does not fit: {cost.per_token} bytes per token (+ {cost.per_slot} per slot); "
            f"the budget of {plan.budget / GiB:.2f} GiB ({utilization:g} x {total / GiB:.2f} GiB - "
            f"weights {weights / GiB:.2f} GiB - activations {activations / GiB:.2f} GiB) holds "
            f"{fit} tokens over {slots} slots, but max_num_seqs {max_num_seqs} x max_model_len "
            f"{max_model_len} asks for {slots * room} (each slot holds the context and one block); "
            f"lower --max-model-len (at most {max(0, fit // slots - (room - max_model_len))} fits) or "
            f"--max-num-seqs, or raise --gpu-memory-utilization"
        )
    return plan


def weight_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the modules' parameters and buffers, each storage counted once (the draft
    borrows the target's embedding and LM head; fused projections are views of one stack)."""
    seen, total = set(), 0
    for module in modules:
        if module is None:
            continue
        for t in (*module.parameters(), *module.buffers()):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def activation_peak(
    target: CausalLM,
    draft: DFlashDraft | None,
    ops: Kernels,
    build: Callable[[int, int, torch.device], list],
    rows: int,
    block_size: int,
    prefill_tokens: int,
    record: str | None,
) -> int:
    """The device memory (CUDA) that the engine's largest forwards (`largest_forwards`)
    allocate beyond the state they write, run on a throwaway state of `rows` slots from
    `build`."""
    device = target.model.embed_tokens.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    with torch.inference_mode():
        state, draft_state = build(rows, prefill_tokens + block_size, device)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        largest_forwards(target, draft, ops, state, draft_state, rows, block_size, prefill_tokens, record)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del state, draft_state
    torch.cuda.empty_cache()
    return peak


def largest_forwards(
    target: CausalLM,
    draft: DFlashDraft | None,
    ops: Kernels,
    state,
    draft_state,
    rows: int,
    block_size: int,
    prefill_tokens: int,
    record: str | None,
) -> None:
    """The forwards whose activations the engine must leave room for, on any device: a
    prefill of `prefill_tokens` on one row and, with a draft, the draft (its proposals
    included) and the verify of `rows` full blocks of `block_size`."""
    device = target.model.embed_tokens.weight.device
    layers = draft.config.target_layer_ids if draft is not None else ()
    raw = draft is not None and draft.config.raw_last_layer
    ids = torch.zeros((1, prefill_tokens), dtype=torch.int64, device=device)
    slot = torch.zeros((1,), dtype=torch.int64, device=device)
    positions = torch.arange(prefill_tokens, device=device)[None]
    target(
        ids,
        positions,
        slot,
        state,
        prefill_tokens,
        capture_layers=layers,
        raw_last_layer=raw,
        last_only=True,
        ops=ops,
    )
    if draft is None:
        return
    block = torch.zeros((rows, block_size), dtype=torch.int64, device=device)
    slots = torch.arange(rows, device=device)
    positions = torch.arange(block_size, device=device)[None].repeat(rows, 1)
    valid = torch.full((rows,), block_size, dtype=torch.int64, device=device)
    embeds = target.embed(block) * draft.config.input_embedding_scale
    hidden = draft(embeds, positions, slots, draft_state, block_size, valid_len=valid, ops=ops)
    draft.proposals(hidden, target.lm_head_weight, ops, block[:, 0])
    del embeds, hidden
    target(
        block,
        positions,
        slots,
        state,
        block_size,
        capture_layers=layers,
        raw_last_layer=raw,
        valid_len=valid,
        record=record,
        ops=ops,
    )

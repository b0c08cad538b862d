"""Per-slot model state, preallocated once: attention KV caches, Gated DeltaNet conv and
recurrent states, and one saved copy of the Gated DeltaNet state per slot.

A request owns one slot. Its committed length lives in `lengths` (host ints, kept by the
caller that also builds the positions). Attention rows are indexed by position, so rolling
back is a length change. A Gated DeltaNet state summarises the whole prefix and cannot be
rolled back by length: `save` copies it aside before tokens that might be rejected, and
`restore` brings it back; the tokens between the saved point and the target length are
then run again (the commit strategies build on this).
"""

from __future__ import annotations

import math

import torch

from ..config import TargetConfig
from ..errors import ConfigError, RequestError
from ..kernels import EXACT_DTYPES
from ..kernels.reference import accumulation_dtype
from .kv_pool import PoolLayout
from .transfer import to_device

# how a verified block reaches a hybrid target's state (commit.py)
COMMIT_STRATEGIES = ("replay", "per_token", "recompute")


def check_strategy(name: str) -> str:
    if name not in COMMIT_STRATEGIES:
        raise ConfigError(f"unknown commit strategy '{name}', expected one of {', '.join(COMMIT_STRATEGIES)}")
    return name


# The `per_token` commit's checkpoints: a verify keeps the Gated DeltaNet state after block
# tokens 0, EVERY, 2 * EVERY, ... and its recurrence inputs; the commit runs a row on from the
# checkpoint at or before its boundary over at most EVERY - 1 tokens (commit.py). 1 keeps the
# state after every token. On the Qwen3.5-4B shape at 16 rows x 8 tokens, every state kept
# is 2 MiB a row and layer written by the verify: 6 GiB a step at 1, 0.75 GiB at 8.
PER_TOKEN_EVERY = 8
# The references' default: a `per_token` verify keeps no state but the row each token writes
# (u_t, a v_dim vector per head), and the commit makes the state after the boundary from the
# state before the block in one product (reference.gated_delta_after): on the demo pair at 16
# rows x 8 tokens that is an eighth of the memory the verify writes with a state kept after
# every token, and about 4 ms less of each layer's verify on a CPU core.
NO_CHECKPOINTS = 0


def checkpoint_every(device: torch.device | str, dtype: torch.dtype) -> int:
    """How often a `per_token` verify keeps the state: PER_TOKEN_EVERY where the gated delta
    rule runs token by token (the Triton kernel, CUDA in bfloat16, float16 or float32), so a
    run on from a checkpoint reaches the very bits of a run from the block's start;
    NO_CHECKPOINTS on the references, whose chunked form rounds by where a run starts, and
    whose commit then makes the state with the arithmetic of a rerun from the block's start,
    so `per_token` equals `recompute` bit for bit on both paths."""
    triton = torch.device(device).type == "cuda" and dtype in EXACT_DTYPES
    return PER_TOKEN_EVERY if triton else NO_CHECKPOINTS


def kept_states(T: int, every: int) -> int:
    """How many states a block of T tokens keeps, one after every `every`-th token from the
    first: ceil(T / every)."""
    if every < 1:
        raise ValueError(f"per-token checkpoints: every must be >= 1, got {every}")
    return -(-T // every)


def cell_map(pool: PoolLayout | None, num_slots: int, device: torch.device) -> torch.Tensor | None:
    """Each slot's row in a pooled cache, every slot on the spare row until it is placed;
    None without a pool."""
    if pool is None:
        return None
    return torch.full((num_slots,), pool.spare_cell, dtype=torch.int64, device=device)


class TargetState:
    def __init__(
        self,
        config: TargetConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        verify_len: int = 0,
        commit_strategy: str | None = None,
        pool: PoolLayout | None = None,
        every: int | None = None,
    ) -> None:
        """`verify_len` and `commit_strategy` size the buffers a speculative verify keeps
        for the `per_token` and `recompute` commit strategies (hybrid targets only); `every`
        spaces the `per_token` checkpoints (default: `checkpoint_every` of this device and
        dtype; a state built on the meta device to be measured gives its real device's). With
        a `pool` the attention caches are one pooled KV cache (kv_pool.py) and `cell_of` maps
        each slot to its run's row."""
        self.config = config
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.verify_len = verify_len
        n = config.num_hidden_layers
        kv_shape = (num_slots, max_len, config.num_key_value_heads, config.head_dim)
        conv_shape = (num_slots, config.conv_dim, config.linear_conv_kernel_dim - 1)
        rec_shape = (
            num_slots,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        state_dtype = accumulation_dtype(dtype)

        def alloc(kind: str, shape: tuple[int, ...], dt: torch.dtype) -> list:
            return [
                torch.zeros(shape, dtype=dt, device=self.device) if kind_i == kind else None
                for kind_i in self._kinds()
            ]

        self.pool = pool
        self.cell_of = cell_map(pool, num_slots, self.device)
        if pool is None:
            self.k_cache: list[torch.Tensor | None] = alloc("attention", kv_shape, dtype)
            self.v_cache: list[torch.Tensor | None] = alloc("attention", kv_shape, dtype)
        else:
            if pool.room != max_len:
                raise ValueError(f"a pool for rooms of {pool.room} tokens in a state of {max_len}")
            heads = (config.num_key_value_heads, config.head_dim)

            def pooled() -> list:
                kinds = self._kinds()
                return [pool.cache(*heads, dtype, self.device) if k == "attention" else None for k in kinds]

            self.k_cache, self.v_cache = pooled(), pooled()
        self.conv: list[torch.Tensor | None] = alloc("linear", conv_shape, dtype)
        self.recurrent: list[torch.Tensor | None] = alloc("linear", rec_shape, state_dtype)
        self.saved_conv: list[torch.Tensor | None] = alloc("linear", conv_shape, dtype)
        self.saved_recurrent: list[torch.Tensor | None] = alloc("linear", rec_shape, state_dtype)
        assert len(self.k_cache) == n
        self.lengths: list[int] = [0] * num_slots
        self.saved_lengths: list[int | None] = [None] * num_slots

        # What a verify pass keeps for the commit strategies; see commit.py.
        none = [None] * n
        self.verify_conv, self.verify_states, self.verify_inputs = none, none, none
        self.verify_written = none
        self.verify_q, self.verify_k, self.verify_v = none, none, none
        self.verify_g, self.verify_beta = none, none
        self.every = checkpoint_every(device, dtype) if every is None else every
        if commit_strategy is not None:
            check_strategy(commit_strategy)
        if config.is_hybrid and commit_strategy in ("per_token", "recompute") and verify_len:
            K, T = config.linear_conv_kernel_dim, verify_len
            hv, dk, dv = rec_shape[1:]
            self.verify_conv = alloc("linear", (num_slots, config.conv_dim, K - 1 + T), dtype)
            if commit_strategy == "per_token":
                # by the verify's batch row, not by slot (the commit of the same step reads
                # them), and flat: any batch's [rows, kept, ...] states and each of its
                # [rows, T, ...] inputs are one contiguous block at the start of their buffer
                # or region, which the verify writes in place (`verify_states_of`,
                # `verify_inputs_of`); row i sits at the same place for any row count (a
                # graph's verify of a padded bucket, an eager commit of its real rows)
                if self.every == NO_CHECKPOINTS:
                    self.verify_written = alloc("linear", (num_slots * hv * T * dv,), state_dtype)
                else:
                    kept = kept_states(T, self.every)
                    self.verify_states = alloc("linear", (num_slots * kept * hv * dk * dv,), state_dtype)
                self.verify_inputs = alloc("linear", (num_slots * T * hv * (2 * dk + dv + 2),), state_dtype)
            else:
                self.verify_q = alloc("linear", (num_slots, T, hv, dk), state_dtype)
                self.verify_k = alloc("linear", (num_slots, T, hv, dk), state_dtype)
                self.verify_v = alloc("linear", (num_slots, T, hv, dv), state_dtype)
                self.verify_g = alloc("linear", (num_slots, T, hv), state_dtype)
                self.verify_beta = alloc("linear", (num_slots, T, hv), state_dtype)

    def verify_conv_of(self, layer: int) -> torch.Tensor:
        """Where a verify keeps each slot's conv input (the conv state followed by the block's
        inputs) for the commit: [slots, conv_dim, kernel-1+B], written by the conv itself."""
        if self.verify_conv[layer] is None:
            raise RuntimeError("verify recording needs a state built with a commit strategy")
        return self.verify_conv[layer]

    def record_verify_inputs(
        self,
        layer: int,
        slots: torch.Tensor,  # [batch]
        q: torch.Tensor,  # [batch, T, v_heads, k_dim]
        k: torch.Tensor,  # [batch, T, v_heads, k_dim]
        v: torch.Tensor,  # [batch, T, v_heads, v_dim]
        g: torch.Tensor,  # [batch, T, v_heads]
        beta: torch.Tensor,  # [batch, T, v_heads]
    ) -> None:
        """Keep a verify pass's recurrence inputs where the strategy needs them elsewhere
        (`recompute`; `per_token` has them written in place, verify_inputs_of)."""
        if self.verify_q[layer] is not None:
            T = q.shape[1]
            self.verify_q[layer][slots, :T] = q
            self.verify_k[layer][slots, :T] = k
            self.verify_v[layer][slots, :T] = v
            self.verify_g[layer][slots, :T] = g
            self.verify_beta[layer][slots, :T] = beta

    def verify_states_of(self, layer: int, rows: int, T: int) -> torch.Tensor:
        """Where a verify of `rows` rows and T tokens keeps its checkpoints for the
        `per_token` commit: [rows, kept_states(T, every), v_heads, k_dim, v_dim], contiguous,
        row i of the batch at index i, checkpoint j the state after block token j * every."""
        buffer = self.verify_states[layer]
        if buffer is None:
            raise RuntimeError("per-token states need a state built with commit strategy per_token")
        self._check_fits(rows, T)
        shape = (rows, kept_states(T, self.every), *self.recurrent[layer].shape[1:])
        return buffer[: math.prod(shape)].view(shape)

    @property
    def keeps_written_rows(self) -> bool:
        """Whether a `per_token` verify keeps the rows its tokens write instead of states
        (NO_CHECKPOINTS, the references' default)."""
        return any(buffer is not None for buffer in self.verify_written)

    def verify_written_of(self, layer: int, rows: int, T: int) -> torch.Tensor:
        """Where a verify of `rows` rows and T tokens keeps the row each token writes, for
        the `per_token` commit without checkpoints (NO_CHECKPOINTS): [rows, v_heads, T,
        v_dim], contiguous, row i of the batch at index i."""
        buffer = self.verify_written[layer]
        if buffer is None:
            raise RuntimeError("the rows written need a per_token state without checkpoints (NO_CHECKPOINTS)")
        self._check_fits(rows, T)
        hv, _, dv = self.recurrent[layer].shape[1:]
        return buffer[: rows * hv * T * dv].view(rows, hv, T, dv)

    def verify_inputs_of(self, layer: int, rows: int, T: int) -> tuple[torch.Tensor, ...]:
        """Where a verify of `rows` rows and T tokens keeps its recurrence inputs for the
        `per_token` commit: q, k [rows, T, v_heads, k_dim], v [rows, T, v_heads, v_dim], g,
        beta [rows, T, v_heads], each contiguous."""
        buffer = self.verify_inputs[layer]
        if buffer is None:
            raise RuntimeError("per-token inputs need a state built with commit strategy per_token")
        self._check_fits(rows, T)
        hv, dk, dv = self.recurrent[layer].shape[1:]
        views, region = [], 0
        for inner in ((hv, dk), (hv, dk), (hv, dv), (hv,), (hv,)):  # q, k, v, g, beta
            size = rows * T * math.prod(inner)
            views.append(buffer[region : region + size].view(rows, T, *inner))
            region += self.num_slots * self.verify_len * math.prod(inner)  # room for the most rows
        return tuple(views)

    def _check_fits(self, rows: int, T: int) -> None:
        if rows > self.num_slots or T > self.verify_len:
            raise RuntimeError(
                f"a verify of {rows} rows and {T} tokens does not fit the per-token "
                f"states kept for {self.num_slots} rows of {self.verify_len} tokens"
            )

    def cache_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The attention caches' rows of `slots`: the slots themselves, or with a pool their
        runs' rows (on the device, so a CUDA graph reads the mapping as it is at replay)."""
        return slots if self.cell_of is None else self.cell_of.index_select(0, slots)

    def place(self, slot: int, cell: int) -> None:
        """A pooled cache: `slot`'s request holds the run starting at `cell`."""
        self._check_slot(slot)
        self.cell_of[slot] = cell

    def _kinds(self) -> list[str]:
        return [
            "attention" if i in self.config.attention_layers else "linear"
            for i in range(self.config.num_hidden_layers)
        ]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.num_slots})")

    def reset(self, slot: int) -> None:
        """Forget everything held for `slot` (a new request starts from zero state)."""
        self.reset_slots([slot])

    def reset_slots(self, slots: list[int]) -> None:
        """`reset` for several slots at once (the requests a step admits): one fill per state
        tensor, whatever their count. A fill per slot and tensor took about a tenth of a
        busy DFlash server's engine thread at c16 on the demo pair, on the H200."""
        for slot in slots:
            self._check_slot(slot)
        states = [t for t in (*self.conv, *self.recurrent) if t is not None]
        if slots and states:
            rows = to_device(slots, self.device)
            for tensor in states:
                tensor.index_fill_(0, rows, 0)
        for slot in slots:
            self.lengths[slot] = 0
            self.saved_lengths[slot] = None

    def save(self, slot: int) -> None:
        """Copy the slot's Gated DeltaNet state aside, tagged with the current length."""
        self.save_rows([slot])

    def save_rows(self, slots: list[int]) -> None:
        """`save` for several slots at once: one copy per state tensor, whatever their count."""
        for slot in slots:
            self._check_slot(slot)
        rows = to_device(slots, self.device)
        for live, saved in zip((*self.conv, *self.recurrent), (*self.saved_conv, *self.saved_recurrent)):
            if live is not None:
                saved.index_copy_(0, rows, live.index_select(0, rows))
        for slot in slots:
            self.saved_lengths[slot] = self.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Bring the slot back to `length` committed tokens.

        Dense targets: any length up to the current one. Hybrid targets: only the saved
        length (the caller replays tokens from there to reach a later one).
        """
        self._check_slot(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise RequestError(
                f"cannot roll slot {slot} back to length {length}: it holds {self.lengths[slot]} tokens"
            )
        if self.config.is_hybrid and length != self.lengths[slot]:
            if self.saved_lengths[slot] != length:
                raise RequestError(
                    f"hybrid state of slot {slot} can roll back only to its saved length "
                    f"{self.saved_lengths[slot]}, not {length}"
                )
            self.restore_saved(slot)
        self.lengths[slot] = length

    def restore_saved(self, slot: int) -> None:
        """Copy the saved Gated DeltaNet state back into the live one (lengths untouched)."""
        self._check_slot(slot)
        self.restore_rows([slot])

    def slot_rows(self, slots: list[int] | torch.Tensor) -> torch.Tensor:
        """Slots as a device index tensor: a host list is copied over, a device tensor (what
        a CUDA graph captures, free of host work) is used as it is."""
        return slots if isinstance(slots, torch.Tensor) else to_device(slots, self.device)

    def restore_rows(self, slots: list[int] | torch.Tensor) -> None:
        """`restore_saved` for several slots at once (`slot_rows`)."""
        rows = self.slot_rows(slots)
        for live, saved in zip((*self.conv, *self.recurrent), (*self.saved_conv, *self.saved_recurrent)):
            if live is not None:
                live.index_copy_(0, rows, saved.index_select(0, rows))

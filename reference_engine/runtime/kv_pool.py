"""A pooled KV cache: requests hold the cache rows they need, not every slot the longest room.

Without a pool every slot's keys and values span the engine's whole room (context + one
block), so the cache costs slots x room tokens whatever the requests use. With one
(`--kv-cache-tokens`) every attention layer of the target and of the draft keeps one pool of
C cells of S tokens (`--kv-cell-tokens`), and a request takes, at admission, the k = ceil(need
/ S) consecutive free cells that its prompt, its max_tokens and one block need (first fit).

Layout: the kernels address a cache as `cache[row, position]`, row x stride(0) + position x
stride(1). The pool is one tensor of C x S + L rows (L = the room), and the 4-D cache the
kernels take is the overlapping view `pool.as_strided((C + 1, L, h, d), (S*h*d, h*d, d, 1))`:
row c starts at cell c and runs on over the cells after it. A request whose run starts at
cell c is addressed as row c, and reads and writes only its positions, all inside its k
cells; rows past its run belong to other requests and it never reaches them. Row C (the L
rows after the last cell) belongs to the CUDA graphs' spare slot, whose padding rows write
there and nowhere else. So no kernel changes: a forward maps its slots to their rows through
`cell_of` on the device (one gather, captured in the graphs like any other op, reading the
mapping as it is when a graph replays), and the per-slot states (Gated DeltaNet) stay
indexed by slot.

The cost of runs over pages: a request needs k consecutive free cells; free cells apart do
not admit it (external fragmentation, no compaction: moving a live request would change its
cache rows mid-flight). Admission stays in arrival order: a request that does not fit yet
waits at the head of the queue until finished requests free a run long enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class PoolLayout:
    """C cells of S tokens, and the room L a request may reach (its row spans L positions)."""

    cells: int
    cell_tokens: int
    room: int

    def __post_init__(self) -> None:
        if self.cell_tokens <= 0:
            raise ConfigError(f"kv_cell_tokens must be positive, got {self.cell_tokens}")
        if self.cells * self.cell_tokens < self.room:
            raise ConfigError(
                f"a KV cache pool of {self.cells * self.cell_tokens} tokens ({self.cells} cells of "
                f"{self.cell_tokens}) does not hold one request of the full room ({self.room} tokens: "
                "the context and one block); raise --kv-cache-tokens or lower --max-model-len"
            )

    @classmethod
    def for_tokens(cls, tokens: int, cell_tokens: int, room: int) -> PoolLayout:
        """The layout of a pool of at least `tokens` tokens (whole cells)."""
        if cell_tokens <= 0:
            raise ConfigError(f"kv_cell_tokens must be positive, got {cell_tokens}")
        return cls(-(-tokens // cell_tokens), cell_tokens, room)

    @property
    def rows(self) -> int:
        """Rows of the pool tensor: every cell, and the spare row's room after them."""
        return self.cells * self.cell_tokens + self.room

    @property
    def spare_cell(self) -> int:
        """The row of the CUDA graphs' spare slot (past every cell)."""
        return self.cells

    def cells_for(self, tokens: int) -> int:
        return -(-tokens // self.cell_tokens)

    def cache(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's pool (zeros) as the overlapping [C + 1, L, kv_heads, head_dim] view the
        kernels take; the pool tensor is the view's base."""
        pool = torch.zeros((self.rows, kv_heads, head_dim), dtype=dtype, device=device)
        row = kv_heads * head_dim
        return pool.as_strided(
            (self.cells + 1, self.room, kv_heads, head_dim), (self.cell_tokens * row, row, head_dim, 1)
        )


class CellAllocator:
    """Runs of consecutive cells: first fit, freed whole."""

    def __init__(self, cells: int) -> None:
        self.cells = cells
        self.runs: dict[int, int] = {}  # first cell -> cells of a live run

    def allocate(self, count: int) -> int | None:
        """The first cell of `count` free consecutive cells, now taken; None if no run is free.
        A run holds at least one cell."""
        if count < 1:
            raise ValueError(f"a run of cells holds at least one cell, asked for {count}")
        start = 0
        for first, length in sorted(self.runs.items()):
            if first - start >= count:
                break
            start = first + length
        if start + count > self.cells:
            return None
        self.runs[start] = count
        return start

    def free(self, first: int) -> None:
        if first not in self.runs:
            raise RuntimeError(f"cell {first} does not start a live run")
        del self.runs[first]

    @property
    def free_cells(self) -> int:
        return self.cells - sum(self.runs.values())

    @property
    def largest_free_run(self) -> int:
        best, start = 0, 0
        for first, length in sorted(self.runs.items()):
            best, start = max(best, first - start), first + length
        return max(best, self.cells - start)

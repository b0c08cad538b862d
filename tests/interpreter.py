"""Triton's interpreter with a matrix product that gives every row the same arithmetic.

The interpreter (TRITON_INTERPRET=1, how the kernel tests run without CUDA) computes `tl.dot`
as one numpy matmul of the whole tile. numpy hands that to its BLAS, and OpenBLAS's AVX2
single-precision kernels (the ones it picks on Haswell-class Intel and on AMD Zen processors)
split a 16-row tile into row panels of 6, 6 and 4 that go through different micro-kernels:
one query row gets different bits at tile rows 0-5 than at rows 6-15, and a one-row product
differs again. Where the AVX-512 kernels run the rows happen to agree, which is why the same
tests pass on one machine and fail on the next with nothing changed in our code.

A GPU's matrix instruction gives every row of a tile the same sequence of operations, and that
is what the kernels' bitwise invariance tests rely on (a query alone and inside a verify
block sits at different tile rows). Those tests check the kernels' own indexing and key-block
order; to check that under the interpreter, `row_invariant_dots()` makes `tl.dot` multiply one
row at a time, the same one-row product for every row, whatever the processor. The compiled
kernels are checked for the same property on the device, without this.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextmanager
def row_invariant_dots() -> Iterator[None]:
    """Within the block, every interpreted `tl.dot` computes each output row by its own
    one-row product. Outside the interpreter it changes nothing."""
    if not interpreted():
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    tile_dot = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = []
        for i in range(a.data.shape[-2]):
            one = tile_dot(
                self,
                TensorHandle(a.data[..., i : i + 1, :], a.dtype.scalar),
                b,
                TensorHandle(d.data[..., i : i + 1, :], d.dtype.scalar),
                input_precision,
                max_num_imprecise_acc,
            )
            rows.append(one.data)
        return TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = tile_dot

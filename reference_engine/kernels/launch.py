"""Compiler options every Triton launch of ours passes, so that the bits of the exact numerics
depend on our code and not on a compiler default.

FP fusion (contracting a multiply and an add into one fused multiply-add) changes the
rounding of every sum of products. Triton has fused by default, and its default is to change
(Triton 3.9 warns that 3.10 turns it off unless `TRITON_DEFAULT_FP_FUSION` is set). The exact
numerics were measured bit-exact with fusion on, so every launch asks for it by name
(`LAUNCH`), except where one kernel runs the same arithmetic on two code paths whose results
must agree bit for bit, or where a kernel's roundings must follow the reference's step by step
(`UNFUSED`: attention, and the norms and RoPE before it). With fusion on, Triton writes plain
multiplies and adds and the assembler contracts them where it sees fit, which can differ
between the two paths of one kernel or drop a rounding the reference makes; with it off,
every multiply and add is written rounded (`mul.rn`, `add.rn`), which nothing may contract.
The interpreter ignores compiler options.
"""

from __future__ import annotations

LAUNCH: dict[str, bool] = {"enable_fp_fusion": True}
# attention: a key block runs masked or unmasked depending on the tile (kernels/attention.py);
# RoPE: each product and sum rounded to the model dtype as the reference rounds (kernels/rope.py)
UNFUSED: dict[str, bool] = {"enable_fp_fusion": False}

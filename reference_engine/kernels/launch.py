"""Compiler options every Triton launch of ours passes, so that the bits of the exact numerics
depend on our code and not on a compiler default.

FP fusion (contracting a multiply and an add into one fused multiply-add) changes the
rounding of every sum of products. Triton has fused by default, and its default is to change
(Triton 3.9 warns that 3.10 turns it off unless `TRITON_DEFAULT_FP_FUSION` is set). The exact
numerics were measured bit-exact with fusion on, so every launch asks for it by name
(`LAUNCH`), except where one kernel runs the same arithmetic on two code paths whose results
must agree bit for bit (`UNFUSED`). With fusion on, Triton writes plain multiplies and adds
and the assembler contracts them where it sees fit, which can differ between the two paths
of one kernel; with it off, every multiply and add is written rounded (`mul.rn`, `add.rn`),
which nothing may contract. The interpreter ignores compiler options.
"""

from __future__ import annotations

LAUNCH: dict[str, bool] = {"enable_fp_fusion": True}
# attention: a key block runs masked or unmasked depending on the tile (kernels/attention.py)
UNFUSED: dict[str, bool] = {"enable_fp_fusion": False}

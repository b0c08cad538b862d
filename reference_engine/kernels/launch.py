"""Compiler options every Triton launch of ours passes, so that the bits of the exact numerics
depend on our code and not on a compiler default.

FP fusion (contracting a multiply and an add into one fused multiply-add) changes the
rounding of every sum of products. Triton has fused by default, and its default is to change
(Triton 3.9 warns that 3.10 turns it off unless `TRITON_DEFAULT_FP_FUSION` is set). The exact
numerics were measured bit-exact with fusion on, so every launch asks for it by name. The
interpreter ignores compiler options.
"""

from __future__ import annotations

LAUNCH: dict[str, bool] = {"enable_fp_fusion": True}

"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU (the matmul
loaded by the tensor memory accelerator excepted: its descriptors are built on a device).

The interpreter (TRITON_INTERPRET=1, tests/test_kernels.py) runs a kernel's Python semantics,
which forgive what the compiler refuses: a loop-carried value whose shape changes between
iterations runs interpreted and fails to compile. Triton compiles to a cubin without a device
(the target named, ptxas bundled with triton), so each kernel is compiled here in the variants
the engine launches, and a kernel that would not build on the GPU fails the CPU tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

# kernel -> (pointer arguments with their element types, other arguments' types when not
# i32, the variants' constexprs); constexprs common to every variant first
KERNELS = {
    "attention._attention_kernel": (
        {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "out_ptr": "bf16", "slots_ptr": "i64"}
        | {"pos_ptr": "i64", "valid_ptr": "i64", "m_part": "fp32", "l_part": "fp32", "acc_part": "fp32"},
        {"scale_log2e": "fp32"},
        [
            {"CAUSAL": c, "SLIDING": s, "HAS_VALID": False, "IEEE": False, "SPLITS_APART": a}
            | {"SPLIT_LEN": 2048, "MASK_WHOLE": False, "D": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": 64}
            for c, s, a in ((True, False, True), (True, True, False), (False, False, False))
        ]
        + [  # a prefill chunk's wide tiles, head_dim 128 and 256
            {"CAUSAL": True, "SLIDING": False, "HAS_VALID": False, "IEEE": False, "SPLITS_APART": False}
            | {"SPLIT_LEN": 2048, "MASK_WHOLE": w, "D": d, "BLOCK_D": d, "BLOCK_M": 8192 // d, "BLOCK_N": 64}
            | {"num_warps": 4}
            for d, w in ((128, False), (256, False), (128, True))
        ],
    ),
    "attention._merge_kernel": (
        {"m_part": "fp32", "l_part": "fp32", "acc_part": "fp32", "out_ptr": "bf16"},
        {"scale_log2e": "fp32"},
        [{"D": 128, "BLOCK_D": 128, "BLOCK_M": 16}],
    ),
    "moe._route_kernel": (
        {"logits_ptr": "bf16", "weights_ptr": "bf16", "ids_ptr": "i64"},
        {},
        [{"TOP_K": 8, "RENORMALISE": r, "BLOCK_T": 1, "BLOCK_E": 256} for r in (True, False)],
    ),
    "moe._group_kernel": (
        {"ids_ptr": "i64", "order_ptr": "i32", "starts_ptr": "i32", "active_ptr": "i32", "census_ptr": "i64"},
        {},
        [{"CENSUS": c, "CHUNK": 32, "BLOCK_E": 128} for c in (True, False)],
    ),
    "moe._expert_group_kernel": (
        {"ids_ptr": "i64", "order_ptr": "i32", "starts_ptr": "i32", "active_ptr": "i32", "census_ptr": "i64"},
        {},
        [{"CENSUS": c, "CHUNK": 1024} for c in (True, False)],
    ),
    "moe._grouped_kernel": (
        {"a_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "order_ptr": "i32", "starts_ptr": "i32"}
        | {"active_ptr": "i32", "scale_ptr": "bf16"},
        {},
        [
            {"TOP_K": 8, "SWIGLU": g, "IEEE": False, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}
            for g, m, n, k in (
                (True, 16, 32, 128),
                (False, 16, 64, 128),
                (True, 16, 64, 128),
                (False, 16, 128, 128),
                (True, 64, 64, 64),
            )
        ],
    ),
    "moe._slot_sum_kernel": (
        {"x_ptr": "bf16", "res_ptr": "bf16", "out_ptr": "bf16"},
        {},
        [{"TOP_K": 8, "RESIDUAL": r, "BLOCK": 1024} for r in (True, False)],
    ),
    "rope._attention_inputs_kernel": (
        {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "qw_ptr": "bf16", "kw_ptr": "bf16"}
        | {"cos_ptr": "bf16", "sin_ptr": "bf16", "out_ptr": "bf16", "kc_ptr": "bf16", "vc_ptr": "bf16"}
        | {"slots_ptr": "i64", "pos_ptr": "i64"},
        {"eps": "fp32"},
        [
            {"NORM": n, "OFFSET": o, "D": 128, "RD": 128, "BLOCK_D": 128}
            for n, o in ((True, False), (False, False))
        ],
    ),
    "matmul._matmul_kernel": (
        {"x_ptr": "bf16", "w_ptr": "bf16", "bias_ptr": "bf16", "out_ptr": "bf16"},
        {},
        [
            {"HAS_BIAS": False, "IEEE": False, "EVEN_K": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256},
            {"HAS_BIAS": True, "IEEE": False, "EVEN_K": False, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128},
        ],
    ),
    "norms._norm_kernel": (
        {"x_ptr": "bf16", "w_ptr": "bf16", "z_ptr": "bf16", "out_ptr": "bf16", "res_ptr": "bf16"}
        | {"sum_ptr": "bf16"},
        {"eps": "fp32"},
        [{"KIND": k, "ADD": a, "BLOCK": 4096} for k, a in ((0, False), (1, True), (2, False))],
    ),
    "norms._silu_mul_kernel": (
        {"gate_ptr": "bf16", "up_ptr": "bf16", "out_ptr": "bf16"},
        {},
        [{"BLOCK": 1024}],
    ),
    "gated_delta._gated_delta_kernel": (
        {"q_ptr": "fp32", "k_ptr": "fp32", "v_ptr": "fp32", "g_ptr": "fp32", "beta_ptr": "fp32"}
        | {"state_ptr": "fp32", "valid_ptr": "i64", "out_ptr": "bf16", "final_ptr": "fp32"}
        | {"states_ptr": "fp32", "slots_ptr": "i64", "first_ptr": "i64", "init_ptr": "fp32"}
        | {"init_rows_ptr": "i64"},
        {},
        [
            {"HAS_SLOTS": h, "RESUME": r, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "PREFETCH": f}
            for h in (True, False)
            for r in (False, True)
            for f in (False, True)
        ],
    ),
    "gated_delta._inputs_kernel": (
        {"mixed_ptr": "bf16", "a_ptr": "bf16", "b_ptr": "bf16", "alog_ptr": "fp32", "dt_ptr": "bf16"}
        | {"q_ptr": "fp32", "k_ptr": "fp32", "v_ptr": "fp32", "g_ptr": "fp32", "beta_ptr": "fp32"},
        {"scale": "fp32", "eps": "fp32"},
        [{"KEY_DIM": 2048, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 128}],
    ),
    "gated_delta._conv_step_kernel": (
        {"x_ptr": "bf16", "state_ptr": "bf16", "slots_ptr": "i64", "valid_ptr": "i64", "w_ptr": "bf16"}
        | {"out_ptr": "bf16", "record_ptr": "bf16"},
        {},
        [{"KERNEL": 4, "RECORD": r, "BLOCK_C": 64, "BLOCK_T": 16, "BLOCK_W": 32} for r in (False, True)],
    ),
    "argmax._chunk_max_kernel": (
        {"x_ptr": "bf16", "best_ptr": "fp32", "id_ptr": "i64"},
        {},
        [{"CHUNK": 16384, "BLOCK": 4096}],
    ),
    "argmax._pick_kernel": ({"best_ptr": "fp32", "id_ptr": "i64", "out_ptr": "i64"}, {}, [{}]),
    "rows._copy_rows_kernel": (
        {"dst_ptr": "fp32", "dst_rows_ptr": "i64", "src_ptr": "fp32", "src_rows_ptr": "i64"},
        {},
        [{"BLOCK": 1024}],
    ),
    "rows._conv_state_at_kernel": (
        {"conv_ptr": "bf16", "rec_ptr": "bf16", "slots_ptr": "i64", "processed_ptr": "i64"},
        {},
        [{"W": 3, "BLOCK_C": 64, "BLOCK_W": 4}],
    ),
}

# compiled in one child process: the parent's TRITON_INTERPRET (set by the root conftest)
# turns every @triton.jit into an interpreted function
COMPILE = textwrap.dedent(
    """
    import importlib, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from reference_engine.kernels.launch import LAUNCH, UNFUSED

    failures, contractable = {}, {}
    unfused = set(json.loads(sys.argv[2]))
    for name, (pointers, scalars, variants) in json.loads(sys.argv[1]).items():
        module, kernel = name.split(".")
        fn = getattr(importlib.import_module("reference_engine.kernels." + module), kernel)
        for constexprs in variants:
            warps = constexprs.pop("num_warps", 4)
            def kind(a):
                return "*" + pointers[a] if a in pointers else scalars.get(a, "i32")
            signature = {a: "constexpr" if a in constexprs else kind(a) for a in fn.arg_names}
            fixed = {(fn.arg_names.index(a),): v for a, v in constexprs.items()}
            options = {"num_warps": warps, **(UNFUSED if name in unfused else LAUNCH)}
            try:
                source = ASTSource(fn=fn, signature=signature, constexprs=fixed)
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            except Exception as exc:
                failures.setdefault(name, []).append(f"{constexprs}: {type(exc).__name__}: {exc}")
                continue
            if name in unfused:  # float multiplies and adds the assembler may contract
                ops = re.findall(r"\\b(?:fma\\.rn|mul|add|sub)\\.f32\\b", compiled.asm["ptx"])
                contractable[name] = contractable.get(name, 0) + len(ops)
    print(json.dumps({"failures": failures, "contractable": contractable}))
    """
)
# the kernels launched with launch.UNFUSED (test_kernels.py checks which those are)
UNFUSED_KERNELS = ["attention._attention_kernel", "attention._merge_kernel", "rope._attention_inputs_kernel"]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(KERNELS), json.dumps(UNFUSED_KERNELS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode:
        pytest.fail(f"the compiling process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_kernel_compiles_for_sm90_in_every_variant(name: str, compiled: dict) -> None:
    found = compiled["failures"].get(name, [])
    assert not found, f"{name} does not compile:\n" + "\n".join(f[-2000:] for f in found)


@pytest.mark.parametrize("name", UNFUSED_KERNELS)
def test_the_unfused_kernels_hold_no_float_arithmetic_the_assembler_may_contract(
    name: str, compiled: dict
) -> None:
    """Compiled as the engine launches them (launch.UNFUSED), the attention kernels and the
    attention inputs write every float32 multiply and add rounded (mul.rn, add.rn, sub.rn), so
    the assembler cannot fuse a multiply-add on one of a key block's two paths and not on the
    other, nor fuse RoPE's products with their sum past the roundings between them. With
    fusion on, Triton writes them plain, and this counts them."""
    assert compiled["contractable"].get(name) == 0, f"{name}: {compiled['contractable'].get(name)} ops"

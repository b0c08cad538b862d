"""Every product of a forward goes through the engine's kernels table (reference_engine/kernels):
the exact numerics and the batch invariance the gates prove hold only for the table's
operators, so a layer that calls a module's own `nn.Linear` (torch's vendor product) instead
breaks them on a GPU while giving the same tokens on the CPU. Here the CPU's table never calls
`torch.nn.functional.linear`; with it made to raise, whole requests of every pair kind run
to the end (targets and drafts of each family: prefill, plain decode, draft, verify, accept,
commit)."""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

PAIRS = [
    ("qwen3", "dflash"),
    ("qwen3_5", "dflash"),
    ("llama", "dflash"),
    ("qwen3_moe", "dflash"),
    ("qwen3_5_moe", "dflash"),
    ("qwen3", "dflash2"),
    ("qwen3_5", "dflash2"),
]


def vendor_linear(*args, **kwargs):
    raise AssertionError("a product bypassed the kernels table (torch.nn.functional.linear)")


@pytest.mark.parametrize(("arch", "draft_arch"), PAIRS, ids=[f"{a}-{d}" for a, d in PAIRS])
def test_no_forward_calls_a_vendor_linear(tiny_pair, monkeypatch, arch: str, draft_arch: str) -> None:
    target_dir, draft_dir = tiny_pair(arch, block_size=8, draft_arch=draft_arch)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2, max_model_len=96, prefill_chunk=16))
    monkeypatch.setattr(torch.nn.functional, "linear", vendor_linear)
    engine.add_request("spec", list(range(3, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
    while engine.has_unfinished():
        outputs = engine.step()
        assert not [o.error for o in outputs if o.error], [o.error for o in outputs if o.error]
    assert len(engine.collect("spec").output_ids) == 20 and len(engine.collect("plain").output_ids) == 12
    assert engine.stats()["spec"]["steps"] > 0  # the draft and the verify ran

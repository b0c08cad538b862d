"""NVTX ranges through profiling.NvtxRanges, captured with a test double of the nvtx API."""

from __future__ import annotations

import time

import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.profiling import DOMAIN, RANGE_NAMES, NvtxRanges
from reference_engine.runtime.request import SamplingParams


class FakeNvtx:
    """Records push_range/pop_range as the nvtx module would receive them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def push_range(self, message=None, domain=None, **_) -> None:
        assert domain == DOMAIN
        self.events.append(("push", message))

    def pop_range(self, domain=None) -> None:
        assert domain == DOMAIN
        self.events.append(("pop", None))


def steps(events: list[tuple[str, str | None]]) -> list[list[str]]:
    """The ranges opened inside each `step`, in order; checks nesting on the way."""
    stack, out = [], []
    for kind, name in events:
        if kind == "push":
            if name == "step":
                assert not stack, "step ranges must not nest"
                out.append([])
            else:
                out[-1].append(name)
            stack.append(name)
        else:
            stack.pop()
    assert not stack, "every range is closed"
    return out


def test_a_dflash_run_emits_the_phase_ranges_in_order(tiny_pair) -> None:
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    fake = FakeNvtx()
    engine = Engine(target, draft, EngineConfig(max_num_seqs=2), NvtxRanges(True, fake))
    prompt = [5, 6, 7]
    engine.add_request(
        "a",
        prompt,
        SamplingParams(max_tokens=9, ignore_eos=True),
        oracle=OracleProposer(list(range(100, 120)), [3], 512),
    )
    while engine.has_unfinished():
        engine.step()
    per_step = steps(fake.events)
    assert {name for step in per_step for name in step} <= set(RANGE_NAMES)
    # the prompt's last chunk and the first speculative step share the first engine step
    assert per_step[0] == ["schedule", "prefill", "sample", "draft", "verify", "accept", "commit"]
    for step in per_step[1:]:
        assert step == ["schedule", "prefill", "draft", "verify", "accept", "commit"]
    assert len(per_step) == len(engine.collect("a").steps)


def test_an_eager_dflash2_draft_emits_a_range_per_convolution_and_one_for_the_selector(tiny_pair) -> None:
    """Four convolutions a layer (before and after attention and the MLP), then the selector,
    all inside `draft`."""
    target_dir, draft_dir = tiny_pair("qwen3", block_size=4, draft_arch="dflash2")
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    fake = FakeNvtx()
    engine = Engine(target, draft, EngineConfig(max_num_seqs=1), NvtxRanges(True, fake))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    draft_ranges = ["draft", *["conv"] * 4 * draft.config.num_hidden_layers, "selector"]
    per_step = steps(fake.events)
    assert per_step[0] == ["schedule", "prefill", "sample", *draft_ranges, "verify", "accept", "commit"]
    for step in per_step[1:]:
        assert step == ["schedule", "prefill", *draft_ranges, "verify", "accept", "commit"]


def test_plain_decode_emits_decode_and_sample(tiny_checkpoint) -> None:
    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float64)
    fake = FakeNvtx()
    engine = Engine(target, None, EngineConfig(max_num_seqs=1), NvtxRanges(True, fake))
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert steps(fake.events)[1] == ["schedule", "prefill", "decode", "sample"]


def test_ranges_are_off_by_default_and_cost_next_to_nothing(monkeypatch) -> None:
    monkeypatch.delenv("DFLASH_NVTX", raising=False)
    fake = FakeNvtx()
    off = NvtxRanges(api=fake)
    assert not off.enabled
    with off.range("verify"):
        pass
    assert fake.events == []
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with off.range("verify"):
            pass
    helper = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    bare = time.perf_counter() - t0
    print(f"\n1e5 disabled ranges: {helper * 1e3:.1f} ms; empty loop: {bare * 1e3:.1f} ms")
    assert (helper - bare) / n < 5e-6  # well under a microsecond per range on a quiet machine


def test_profiling_asked_for_without_nvtx_stays_off(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_nvtx(name, *args, **kwargs):
        if name == "nvtx":
            raise ImportError("no nvtx here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvtx)
    monkeypatch.setenv("DFLASH_NVTX", "1")
    assert not NvtxRanges().enabled

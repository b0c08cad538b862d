"""Runtime pieces of a step on small CPU shapes:

- host memory (runtime/host_memory.py): `keep_freed_memory` asks glibc for malloc.h's mmap
  threshold at glibc's largest and for the trim threshold, once per process, and reports
  whether glibc took both; `glibc` knows glibc by its version function.
- the DFlash2 sampled walk (runtime/walk.py): each slot's distribution is the request's
  (temperature, top-k, top-p) over its candidates' edge scores, and a slot that draws no
  token (its scores are not finite) leaves the walk on the anchor's row.
- prefill (runtime/prefill.py): a captured batch of first chunks that raises after writing
  its rows' state is retried row by row from reset slots within the same step, and a batch
  that mixes greedy and sampled requests draws each request's first token as it would be
  drawn alone.
- commit (runtime/commit.py): which strategies save the state before a verify and what the
  verify records for them.

The tiny hybrid target in float64; captured prefills stand in as in test_graphs.py.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.models import CausalLM
from reference_engine.runtime import host_memory
from reference_engine.runtime.commit import COMMIT_STRATEGIES, needs_snapshot, verify_record
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sampling import NOT_A_DISTRIBUTION
from reference_engine.runtime.walk import sample_walk
from tests.test_graphs import prefill_graphs

TinyCheckpoint = Callable[..., Path]
F64 = torch.float64


# ----------------------------------------------------------------------------- host memory
class RecordingLibc:
    """Stands in for glibc: records each mallopt call and answers `answer` (1: taken)."""

    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture
def first_call(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], RecordingLibc]:
    """`first_call(answer)`: this process as if keep_freed_memory had not run yet, with no
    malloc setting in the environment and a recording glibc answering `answer`."""

    def make(answer: int = 1) -> RecordingLibc:
        libc = RecordingLibc(answer)
        monkeypatch.setattr(host_memory, "_applied", None)
        monkeypatch.setattr(host_memory, "glibc", lambda: libc)
        for name in host_memory.USER_SETTINGS:
            monkeypatch.delenv(name, raising=False)
        return libc

    return make


def test_freed_blocks_are_kept_by_glibcs_mmap_threshold_at_its_largest_and_a_high_trim_threshold(
    first_call,
) -> None:
    """malloc.h: M_MMAP_THRESHOLD is -3, M_TRIM_THRESHOLD -1; glibc's largest mmap threshold
    is 4 MiB times sizeof(long) (32 MiB on 64-bit), and the trim threshold keeps 1 GiB."""
    libc = first_call()
    assert host_memory.keep_freed_memory() is True
    largest = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
    assert libc.calls == [(-3, largest), (-1, 1 << 30)]
    if ctypes.sizeof(ctypes.c_long) == 8:
        assert largest == 32 * 1024 * 1024


def test_malloc_settings_are_applied_once_and_the_first_outcome_stands(
    first_call, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings are process-wide: a later call (another engine) neither asks glibc again
    nor changes its answer, whatever the environment says by then."""
    libc = first_call()
    assert host_memory.keep_freed_memory() is True
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert host_memory.keep_freed_memory() is True
    assert len(libc.calls) == 2


def test_a_threshold_glibc_refuses_reports_the_settings_as_not_applied(first_call) -> None:
    libc = first_call(0)
    assert host_memory.keep_freed_memory() is False
    assert libc.calls[0][0] == -3


def test_a_setting_in_the_environment_leaves_malloc_alone(
    first_call, monkeypatch: pytest.MonkeyPatch
) -> None:
    libc = first_call()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert host_memory.keep_freed_memory() is False
    assert libc.calls == []


def test_glibc_is_told_from_other_c_libraries_by_its_version_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a glibc system the process's C library is found; a C library without
    gnu_get_libc_version (musl, say) is not taken for glibc, whose mallopt numbers it may
    not share."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert host_memory.glibc() is not None

    class OtherLibc:
        def mallopt(self, param: int, value: int) -> int:
            raise AssertionError("not glibc: its mallopt must not be called")

    monkeypatch.setattr(ctypes, "CDLL", lambda name: OtherLibc())
    assert host_memory.glibc() is None


# ----------------------------------------------------------------------------- sampled walk
def walk_inputs(seed: int, n: int = 4, K: int = 5, vocab: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct sorted candidates per slot and float64 edge scores."""
    g = torch.Generator().manual_seed(seed)
    candidates = torch.stack([torch.randperm(vocab, generator=g)[:K].sort().values for _ in range(n)])
    edges = torch.randn(n, K, K, dtype=F64, generator=g) * 2
    return candidates, edges


def nucleus(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution over one slot's K candidates, written out: softmax of the k
    best (ties kept) at temperature T, then the smallest set of most likely ones whose mass
    reaches top_p, renormalised."""
    scaled = logits / temperature
    if top_k:
        scaled = torch.where(scaled >= scaled.topk(top_k).values[-1], scaled, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (2, 1.0), (0, 0.5), (3, 0.7)])
def test_each_walk_slot_draws_from_the_requests_top_k_and_top_p_distribution(
    top_k: int, top_p: float
) -> None:
    """q at slot j is the request's distribution (temperature, top-k, top-p) over the edge
    scores from the candidate slot j - 1 drew, zero off the candidates; each proposal is one
    q gives mass to."""
    vocab, T = 40, 0.9
    for seed in range(3):
        candidates, edges = walk_inputs(seed, vocab=vocab)
        generator = torch.Generator().manual_seed(seed + 10)
        tokens, q = sample_walk(candidates, edges, vocab, T, top_k, top_p, generator)
        assert tokens.shape == (4,) and q.shape == (4, vocab)
        previous = 0
        for j in range(4):
            want = torch.zeros(vocab, dtype=F64)
            want[candidates[j]] = nucleus(edges[j, previous], T, top_k, top_p)
            torch.testing.assert_close(q[j], want, rtol=0, atol=1e-12)
            assert q[j, tokens[j]] > 0
            previous = candidates[j].tolist().index(int(tokens[j]))


def test_a_walk_of_top_k_one_is_the_best_edge_path() -> None:
    """top_k 1 leaves one token a slot: the walk is the path of best edges from the anchor."""
    candidates, edges = walk_inputs(7)
    tokens, q = sample_walk(candidates, edges, 40, 1.3, 1, 1.0, torch.Generator().manual_seed(0))
    previous = 0
    for j in range(4):
        best = int(edges[j, previous].argmax())
        assert int(tokens[j]) == int(candidates[j, best])
        assert float(q[j, candidates[j, best]]) == 1.0 and int((q[j] > 0).sum()) == 1
        previous = best


def test_a_slot_that_draws_no_token_leaves_the_walk_on_the_anchors_row() -> None:
    """Scores that are not finite give NOT_A_DISTRIBUTION at their slot (the verify fails
    that row's proposal, not the request); the walk goes on from row 0 of the next slot's
    edges, and every later slot still draws one of its candidates."""
    vocab, T = 40, 0.8
    candidates, edges = walk_inputs(3, vocab=vocab)
    edges[1] = float("nan")
    tokens, q = sample_walk(candidates, edges, vocab, T, 0, 1.0, torch.Generator().manual_seed(1))
    assert int(tokens[1]) == NOT_A_DISTRIBUTION
    want = torch.zeros(vocab, dtype=F64)
    want[candidates[2]] = torch.softmax(edges[2, 0] / T, dim=-1)
    torch.testing.assert_close(q[2], want, rtol=0, atol=1e-12)
    for j in (0, 2, 3):
        assert int(tokens[j]) in candidates[j].tolist()


# ----------------------------------------------------------------------------- prefill
PROMPTS = {"a": [5, 9, 3, 77, 12], "b": [40, 8, 1, 2, 3, 4], "c": [13, 4, 4]}


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3_5"), dtype=F64)


def batched_engine(target: CausalLM) -> tuple[Engine, dict]:
    """A plain CPU engine whose first chunks run in stand-in captured prefills (slot 3 pads)."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=4, prefill_chunk=16))
    return engine, prefill_graphs(engine, 16, pad_slot=3)


def test_a_batch_that_raises_after_writing_its_rows_is_retried_from_reset_slots_in_the_same_step(
    hybrid: CausalLM,
) -> None:
    """The first batched replay runs its body (every row's Gated DeltaNet and conv state
    written) and then raises: its rows are reset and each runs alone in that very step, so
    every request has its first token after one step and the output of plain decode."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine, stand_ins = batched_engine(hybrid)
    raised = []
    for e in stand_ins.values():
        correct = e.replay

        def replay(correct=correct, e=e) -> None:
            correct()
            if not raised and e.inputs.ids.shape[0] > 1:
                raised.append(True)
                raise RuntimeError("after the body")

        e.replay = replay
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    first = {out.request_id: out.new_token_ids for out in engine.step()}
    assert raised
    assert sorted(first) == sorted(PROMPTS) and all(len(t) == 1 for t in first.values())
    while engine.has_unfinished():
        engine.step()
    for rid, prompt in PROMPTS.items():
        seq = engine.get(rid)
        assert seq.finish_reason == "length", seq.error
        assert seq.output_ids == generate_plain(hybrid, prompt, params).output_ids, rid


def test_a_batch_of_greedy_and_sampled_first_chunks_draws_each_first_token_as_alone(hybrid: CausalLM) -> None:
    """One captured prefill holds a greedy and two sampled requests: the sampled ones draw
    their first tokens (and the rest) from their own seeds as in the eager engine, not the
    argmax the all-greedy batch takes."""
    params = {
        "a": SamplingParams(max_tokens=6, ignore_eos=True),
        "b": SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.5, seed=3),
        "c": SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.5, seed=8),
    }
    outputs = {}
    for captured in (False, True):
        if captured:
            engine, stand_ins = batched_engine(hybrid)
        else:
            engine = Engine(hybrid, None, EngineConfig(max_num_seqs=4, prefill_chunk=16))
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, params[rid])
        while engine.has_unfinished():
            engine.step()
        outputs[captured] = {rid: engine.get(rid).output_ids for rid in PROMPTS}
    assert [len(e.replays) for e in stand_ins.values() if e.replays] == [1]  # all three in one batch
    assert outputs[True] == outputs[False]
    argmax_firsts = [generate_plain(hybrid, PROMPTS[r], params["a"]).output_ids[0] for r in ("b", "c")]
    assert [outputs[True][r][0] for r in ("b", "c")] != argmax_firsts  # the draws tell them apart


# ----------------------------------------------------------------------------- commit
def test_replay_and_recompute_save_the_state_and_a_dense_verify_records_nothing() -> None:
    """replay and recompute start the commit from the state saved before the verify;
    per_token keeps its own. A dense target has no Gated DeltaNet state: its verify records
    nothing for any strategy; a hybrid's records for per_token and recompute."""
    assert {s: needs_snapshot(s) for s in COMMIT_STRATEGIES} == {
        "replay": True,
        "per_token": False,
        "recompute": True,
    }
    dense = SimpleNamespace(config=SimpleNamespace(is_hybrid=False))
    hybrid_model = SimpleNamespace(config=SimpleNamespace(is_hybrid=True))
    assert [verify_record(s, dense) for s in COMMIT_STRATEGIES] == [None, None, None]
    assert [verify_record(s, hybrid_model) for s in COMMIT_STRATEGIES] == [None, "per_token", "recompute"]

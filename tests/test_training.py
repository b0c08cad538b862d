"""The demo-pair training code: the chunked Gated DeltaNet equals the engine's recurrence,
training forwards compute what the engine computes, and the recipe runs end to end (tiny
settings) into checkpoints the engine loads, reproducibly from the seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target, make_tiny_draft
from reference_engine.kernels.reference import gated_delta as gated_delta_recurrence
from reference_engine.kernels.reference import l2_norm as l2_normalize
from reference_engine.models.dflash import DraftState
from reference_engine.models.qwen3_5 import chunked_gated_delta
from reference_engine.runtime.decode import generate_plain, new_state, prefill
from reference_engine.runtime.request import SamplingParams
from reference_engine.training.corpus import Corpus, is_heldout
from reference_engine.training.loops import (
    block_labels,
    block_logits,
    block_loss,
    greedy_continue,
    sequence_forward,
    target_views,
)

ROOT = Path(__file__).resolve().parent.parent


def delta_inputs(T: int, seed: int = 0, heads: int = 3, k_dim: int = 8, v_dim: int = 5):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2_normalize(randn(2, T, heads, k_dim)) * k_dim**-0.5
    k = l2_normalize(randn(2, T, heads, k_dim))
    g = -torch.rand(2, T, heads, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(2, T, heads, generator=gen, dtype=torch.float64)
    return q, k, randn(2, T, heads, v_dim), g, beta, randn(2, heads, k_dim, v_dim)


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (64, 16), (100, 32), (33, 64)])
def test_chunked_delta_rule_equals_the_token_by_token_recurrence(T: int, chunk: int) -> None:
    inputs = delta_inputs(T)
    out, final = gated_delta_recurrence(*inputs)
    chunked_out, chunked_final = chunked_gated_delta(*inputs, chunk=chunk)
    torch.testing.assert_close(chunked_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked_final, final, rtol=0, atol=1e-12)


def test_chunked_delta_rule_has_the_recurrences_gradients() -> None:
    inputs = [t.requires_grad_() for t in delta_inputs(20, seed=1)]
    weights = torch.randn(2, 20, 3, 5, dtype=torch.float64)
    grads = []
    for fn in (gated_delta_recurrence, lambda *a: chunked_gated_delta(*a, chunk=8)):
        out, final = fn(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum() + final.sum(), inputs))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_one_token_chunks_and_a_changed_input_are_told_apart() -> None:
    """One-token chunks (a trivially diagonal system) are exact too, and the comparison is
    sharp enough to see a 10% change in the keys."""
    q, k, v, g, beta, s0 = delta_inputs(16, seed=2)
    out, _ = gated_delta_recurrence(q, k, v, g, beta, s0)
    single, _ = chunked_gated_delta(q, k, v, g, beta, s0, chunk=1)
    torch.testing.assert_close(single, out, rtol=0, atol=1e-12)
    wrong, _ = chunked_gated_delta(q, k * 0.9, v, g, beta, s0, chunk=8)
    assert (wrong - out).abs().max() > 1e-3


@pytest.fixture(scope="module")
def hybrid_pair(tiny_checkpoint, tmp_path_factory):
    target_dir = tiny_checkpoint("qwen3_5", layers=3, hidden=64)
    draft_dir = make_tiny_draft(tmp_path_factory.mktemp("draft") / "d", target_dir, block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def test_sequence_forward_gives_the_engines_prefill_logits_and_features(hybrid_pair) -> None:
    target, draft = hybrid_pair
    ids = torch.randint(0, 500, (2, 70), generator=torch.Generator().manual_seed(0))
    layers = draft.config.target_layer_ids
    out = sequence_forward(target, ids, layers)
    for row in range(2):
        state = new_state(target, 70)
        positions = torch.arange(70)[None]
        ref = target(ids[row : row + 1], positions, torch.tensor([0]), state, 70, layers)
        torch.testing.assert_close(out.logits[row], ref.logits[0], rtol=0, atol=1e-9)
        torch.testing.assert_close(out.features[row], ref.features[0], rtol=0, atol=1e-9)


def test_greedy_continue_equals_plain_greedy_decode(hybrid_pair) -> None:
    target, _ = hybrid_pair
    prompts = torch.randint(0, 500, (3, 9), generator=torch.Generator().manual_seed(1))
    rows = greedy_continue(target, prompts, 12)
    for prompt, row in zip(prompts.tolist(), rows.tolist()):
        plain = generate_plain(target, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        assert row == prompt + plain.output_ids


def draft_in_the_engine(target, draft, seq: torch.Tensor, p: int, length: int) -> torch.Tensor:
    """The draft's logits for the block at anchor p, computed the way the engine does:
    prefill of the prefix (context features), then one block of `length` tokens."""
    cfg = draft.config
    state = new_state(target, len(seq))
    _, features = prefill(target, state, 0, seq[:p].tolist(), cfg.target_layer_ids)
    dstate = DraftState(cfg, 1, len(seq), torch.float64)
    draft.append_context(features[None], torch.arange(p)[None], torch.tensor([0]), dstate)
    block = torch.tensor([[seq[p].item()] + [cfg.mask_token_id] * (length - 1)])
    hidden = draft(target.embed(block) * cfg.input_embedding_scale,
                   torch.arange(p, p + length)[None], torch.tensor([0]), dstate, p + length)
    return draft.logits(hidden[:, 1:], target.lm_head_weight)[0]  # [length-1, vocab]


def test_block_logits_and_labels_are_what_the_engine_drafts_and_verifies(hybrid_pair) -> None:
    """Training sees what serving sees: context = target features before the anchor, block
    = anchor + masks at the anchor's positions (shorter blocks too), labels = the target's
    greedy choices."""
    target, draft = hybrid_pair
    B = draft.config.block_size
    seqs = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[5, 30], [17, 36]])
    lengths = torch.tensor([B, 2, 3, B])
    features, greedy = target_views(target, seqs, draft.config.target_layer_ids, batch=1)
    logits = block_logits(draft, target, seqs, features, anchors, lengths)
    labels = block_labels(greedy, anchors, B)
    for i, (row, p) in enumerate([(0, 5), (0, 30), (1, 17), (1, 36)]):
        n = lengths[i].item() - 1
        ref = draft_in_the_engine(target, draft, seqs[row], p, n + 1)
        torch.testing.assert_close(logits[i, :n], ref, rtol=0, atol=1e-9)
        plain = generate_plain(target, seqs[row, : p + 1].tolist(),
                               SamplingParams(max_tokens=1, ignore_eos=True))
        assert labels[i, 0].item() == plain.output_ids[0]
        full = target(seqs[row : row + 1], torch.arange(40)[None], torch.tensor([0]),
                      new_state(target, 40), 40).logits[0]
        assert labels[i].tolist() == full[p : p + B - 1].argmax(-1).tolist()


def test_block_loss_weights_early_slots_and_ignores_slots_past_a_blocks_length() -> None:
    labels = torch.tensor([[1, 2, 3], [1, 2, 3]])
    right = torch.nn.functional.one_hot(labels, 5).double() * 50
    wrong_last = right.clone()
    wrong_last[1, 2] = right[1, 2].roll(1)
    lengths = torch.tensor([4, 3])  # row 1 has slots 1..2 only: its slot 3 does not count
    assert block_loss(wrong_last, labels, lengths, 2.0) < 1e-12
    assert block_loss(wrong_last, labels, None, 2.0) > 1.0
    early, late = right.clone(), right.clone()
    early[0, 0], late[0, 2] = right[0, 0].roll(1), right[0, 2].roll(1)
    assert block_loss(early, labels, None, 2.0) > block_loss(late, labels, None, 2.0)


def test_the_split_rule_is_by_file_and_fixed() -> None:
    # the rule is pinned: changing it would silently move files between the sets
    assert is_heldout("email/contentmanager.py")
    assert not any(is_heldout(p) for p in ("os.py", "typing.py", "json/decoder.py"))
    corpus = Corpus.from_stdlib(max_files=200)
    assert not set(corpus.train) & set(corpus.heldout)
    assert all(is_heldout(p) for p in corpus.heldout)
    assert 0.03 < len(corpus.heldout) / 200 < 0.2


def smoke(out: Path, seed: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_demo_pair.py"), "--smoke", "--device",
         "cpu", "--seed", str(seed), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_smoke_recipe_writes_a_loadable_pair_reproducibly(tmp_path: Path) -> None:
    first, second = smoke(tmp_path / "a"), smoke(tmp_path / "b")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    for name in ("target/model.safetensors", "draft/model.safetensors",
                 "target/tokenizer.json", "heldout_prompts.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    results = json.loads((tmp_path / "a" / "training.json").read_text())
    assert set(results["acceptance"]) == {"2", "4"}
    assert all(row["mismatched_requests"] == 0 for row in results["acceptance"].values())
    card = (tmp_path / "a" / "MODEL_CARD.md").read_text()
    assert "| 4 |" in card and "held out when" in card
    target = load_target(tmp_path / "a" / "target")
    draft = load_draft(tmp_path / "a" / "draft", target)
    assert draft.config.block_size == 4 and target.config.is_hybrid


def test_recipe_rejects_bad_settings(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_demo_pair.py"), "--smoke",
         "--prompt-len", "60", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert "seq_len must hold a prompt and one block" in run.stderr


def test_a_corpus_too_small_to_split_is_one_error_line_with_code_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_demo_pair.py"), "--smoke",
         "--max-files", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "too few Python files" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_chunked_forward_refuses_padding_and_recording() -> None:
    from reference_engine.models.layers import ForwardContext, RotaryEmbedding

    rotary = RotaryEmbedding(4, 10000.0)
    positions = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="a chunked forward takes full rows"):
        ForwardContext(None, torch.tensor([0]), positions, 2, rotary, torch.float32,
                       valid_len=torch.tensor([1]), chunked=True)

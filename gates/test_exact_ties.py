"""Gate: an exact tie between two tokens' logits is broken the same way on every path, the
lowest token id winning (the numerics policy; vLLM #42960 is a divergence from a tie broken
one way by one path and the other way by another).

The checkpoint: a tiny target written by our own code in the real on-disk format, whose
output head (lm_head, or the embeddings of a tied target) has rows TWIN.. equal to rows ..TWIN:
each logit appears twice, so at every position the maximum is an exact tie between a token
v < TWIN and its twin v + TWIN. The lowest id is v; a wrong tie rule picks the twin, an id no
right answer holds. It is read back through `load_target` / `load_draft` in float64 on the
CPU (the kernels' reference path).

The expected output comes from the rule written out over full forwards (the ids whose logit
equals the maximum, the smallest of them), which also shows that every step of it is an exact
tie between v and v + TWIN and nothing else, so no check here passes for want of a tie. Then
every path must give it: plain decode alone; the continuous-batching engine's first token
after a (chunked) prefill and its batched decode rows, by the device argmax and by the per-row
choice a logprobs row brings; speculative decoding alone and batched, with the draft's own
proposals (each the lowest id of a tie seen in the draft's logits) and with scheduled
proposals that make the verify's choice decide at every block position. The Triton argmax
(interpreted on the CPU) takes the lowest id on ties placed across its block and chunk bounds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference_engine.checkpoint import load_draft, load_target, write_safetensors
from reference_engine.checkpoint.synthetic import make_tiny_draft, make_tiny_target
from reference_engine.kernels import TORCH
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import EngineRequest, run_engine
from .faults import planted

CUDA = torch.cuda.is_available()
if not CUDA:  # before triton is first imported: the argmax kernel then runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 512
TWIN = VOCAB // 2  # token v + TWIN has token v's head row
BLOCK_SIZE = 8
MAX_TOKENS = 18
PREFILL_CHUNK = 16  # the 40-token prompt prefills in three chunks
PROMPTS = ((3,), (17, 40, 99, 5, 250, 31, 8), tuple(range(1, 81, 2)))
# accepted draft tokens per step: full blocks (the verify's choice at every position), none,
# and partial ones
SCHEDULE = (7, 0, 3, 7, 1, 5)
TIE_PAIRS = {"dense": ("qwen3", False), "hybrid_tied": ("qwen3_5", True)}


@dataclass(frozen=True)
class TiePair:
    name: str
    target: CausalLM
    draft: DFlashDraft
    expected: dict[tuple[int, ...], list[int]]  # prompt -> the lowest-id greedy output


def write_tie_checkpoint(out: Path, arch: str, tied: bool) -> Path:
    """A tiny target whose head rows TWIN.. are copies of rows ..TWIN, as safetensors +
    config.json."""
    make_tiny_target(out, arch=arch, vocab=VOCAB, tie_word_embeddings=tied, seed=11, with_tokenizer=False)
    tensors = load_file(out / "model.safetensors")
    head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]  # [vocab, hidden]
    head[TWIN:] = head[:TWIN]
    write_safetensors(out, tensors)
    return out


def lowest_id_output(target: CausalLM, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy by the rule written out, one full forward per token; asserts that every step's
    maximum is an exact tie between exactly v and v + TWIN."""
    ids, out = list(prompt), []
    for step in range(max_tokens):
        logits, _ = prefill(target, new_state(target, len(ids)), 0, ids)  # [vocab]
        best = (logits == logits.max()).nonzero().flatten().tolist()
        assert len(best) == 2 and best[1] == best[0] + TWIN, (
            f"step {step} after {len(prompt)} prompt tokens: the maximum is at ids {best}, "
            f"not an exact tie between v and v + {TWIN}; the tie checkpoint is not what it claims"
        )
        out.append(best[0])
        ids.append(best[0])
    return out


_built: dict[str, TiePair] = {}


def tie_pair_named(name: str, tmp_path_factory: pytest.TempPathFactory) -> TiePair:
    """The tie pair `name` of TIE_PAIRS, written, loaded and decoded once per session."""
    if name not in _built:
        arch, tied = TIE_PAIRS[name]
        target_dir = write_tie_checkpoint(tmp_path_factory.mktemp(f"ties_{name}"), arch, tied)
        draft_dir = make_tiny_draft(
            tmp_path_factory.mktemp(f"ties_{name}_draft"), target_dir, block_size=BLOCK_SIZE, seed=3
        )
        target = load_target(target_dir, dtype=torch.float64)
        expected = {p: lowest_id_output(target, p, MAX_TOKENS) for p in PROMPTS}
        _built[name] = TiePair(name, target, load_draft(draft_dir, target), expected)
    return _built[name]


@pytest.fixture(scope="module", params=list(TIE_PAIRS))
def tie_pair(request: pytest.FixtureRequest, tmp_path_factory) -> TiePair:
    return tie_pair_named(request.param, tmp_path_factory)


def params(max_tokens: int = MAX_TOKENS, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def assert_lowest(got: list[int], expected: list[int], path: str) -> None:
    """`got` is the lowest-id output; else name the path and the first step it broke a tie."""
    if got == expected:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if i is None:
        raise AssertionError(f"{path}: {len(got)} tokens, expected {len(expected)}")
    what = "the first token after prefill" if i == 0 else f"output token {i}"
    twin = " (the higher id of the exact tie)" if got[i] == expected[i] + TWIN else ""
    raise AssertionError(f"{path}: {what} is {got[i]}{twin}, the lowest id of the tie is {expected[i]}")


# ------------------------------------------------------------------ the paths
def plain_decode_alone(pair: TiePair) -> None:
    for prompt, expected in pair.expected.items():
        got = generate_plain(pair.target, list(prompt), params()).output_ids
        assert_lowest(got, expected, f"plain decode alone, prompt of {len(prompt)}")


def engine_outputs(
    pair: TiePair,
    draft: DFlashDraft | None,
    prompts: list[tuple[int, ...]],
    sampling: list[SamplingParams],
    schedule: tuple[int, ...] | None = None,
) -> dict[str, list[int]]:
    """Each prompt's streamed output, all of them in one continuous batch."""
    engine = Engine(
        pair.target,
        draft,
        EngineConfig(max_num_seqs=len(prompts), block_size=BLOCK_SIZE, prefill_chunk=PREFILL_CHUNK),
    )
    requests = [EngineRequest(str(i), p, s, 0, schedule) for i, (p, s) in enumerate(zip(prompts, sampling))]
    references = {str(i): pair.expected[p] for i, p in enumerate(prompts)}
    return run_engine(engine, requests, references)


def engine_first_tokens(pair: TiePair) -> None:
    prompts = list(pair.expected)
    for draft in (None, pair.draft):
        mode = "speculative" if draft is not None else "plain"
        for batch in [[p] for p in prompts] + [prompts]:
            got = engine_outputs(pair, draft, batch, [params(1)] * len(batch))
            where = "alone" if len(batch) == 1 else f"in a batch of {len(batch)}"
            for i, prompt in enumerate(batch):
                assert_lowest(
                    got[str(i)], pair.expected[prompt][:1], f"{mode} engine, prompt of {len(prompt)} {where}"
                )


def engine_batched_rows(pair: TiePair) -> None:
    prompts = list(pair.expected)
    # all greedy: the device argmax; a row with logprobs: the per-row choice for every row
    for sampling, how in (
        ([params()] * 3, "device argmax"),
        ([params(), params(logprobs=1), params()], "per-row choice"),
    ):
        got = engine_outputs(pair, None, prompts, sampling)
        for i, prompt in enumerate(prompts):
            assert_lowest(got[str(i)], pair.expected[prompt], f"batched plain decode ({how}), row {i}")


@contextmanager
def recorded_proposals() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The draft's proposal logits [b, B-1, vocab] and tokens [b, B-1] of every step, as
    the engine got them (from whatever `DFlashDraft.proposals` is at the time)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    proposals = DFlashDraft.proposals

    def recording(self, hidden, lm_head_weight, ops=TORCH, *args, **kwargs):
        logits, tokens = proposals(self, hidden, lm_head_weight, ops, *args, **kwargs)
        seen.append((logits.clone(), tokens.clone()))
        return logits, tokens

    DFlashDraft.proposals = recording
    try:
        yield seen
    finally:
        DFlashDraft.proposals = proposals


def assert_proposals_lowest(seen: list[tuple[torch.Tensor, torch.Tensor]], path: str) -> None:
    assert seen, f"{path}: the draft proposed nothing"
    for step, (logits, tokens) in enumerate(seen):
        top = logits.max(dim=-1).values  # [b, B-1]
        low = tokens % TWIN
        tie = (logits.gather(-1, low[..., None])[..., 0] == top) & (
            logits.gather(-1, (low + TWIN)[..., None])[..., 0] == top
        )
        assert tie.all(), f"{path}: step {step}: a draft slot's maximum is not the exact tie"
        bad = (tokens >= TWIN).nonzero().tolist()
        assert not bad, (
            f"{path}: step {step}: the draft proposed the higher id of an exact "
            f"tie at (row, slot) {bad[:4]}: {tokens[tuple(zip(*bad[:1]))].tolist()}"
        )


def speculative_own_draft(pair: TiePair) -> None:
    prompts = list(pair.expected)
    for batch in [[p] for p in prompts] + [prompts]:
        where = "alone" if len(batch) == 1 else f"in a batch of {len(batch)}"
        with recorded_proposals() as seen:
            got = engine_outputs(pair, pair.draft, batch, [params()] * len(batch))
        for i, prompt in enumerate(batch):
            assert_lowest(
                got[str(i)],
                pair.expected[prompt],
                f"speculative decode (the draft's proposals) {where}, row {i}",
            )
        assert_proposals_lowest(seen, f"the draft's proposals {where}")


def speculative_verify(pair: TiePair) -> None:
    prompts = list(pair.expected)
    for batch in [[p] for p in prompts] + [prompts]:
        where = "alone" if len(batch) == 1 else f"in a batch of {len(batch)}"
        got = engine_outputs(pair, pair.draft, batch, [params()] * len(batch), SCHEDULE)
        for i, prompt in enumerate(batch):
            assert_lowest(
                got[str(i)], pair.expected[prompt], f"verify at every block position {where}, row {i}"
            )


PATHS: dict[str, Callable[[TiePair], None]] = {
    "plain decode alone": plain_decode_alone,
    "the first token after prefill": engine_first_tokens,
    "batched decode rows": engine_batched_rows,
    "speculative decode with the draft's proposals": speculative_own_draft,
    "the verify": speculative_verify,
}


def assert_every_path_takes_the_lowest_id(pair: TiePair) -> None:
    """Run every path; one AssertionError naming each path that broke a tie."""
    failures = []
    for name, path in PATHS.items():
        try:
            path(pair)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise AssertionError(f"{pair.name}: exact ties broken against the lowest id:\n" + "\n".join(failures))


# ------------------------------------------------------------------ the gate
def test_the_checkpoint_holds_an_exact_tie_at_every_step_and_loads_as_written(tie_pair: TiePair) -> None:
    head = tie_pair.target.lm_head_weight  # [vocab, hidden]
    assert torch.equal(head[:TWIN], head[TWIN:])
    assert tie_pair.target.config.tie_word_embeddings == TIE_PAIRS[tie_pair.name][1]
    # lowest_id_output asserted the tie at every step; the twins never appear
    assert all(len(out) == MAX_TOKENS and max(out) < TWIN for out in tie_pair.expected.values())


def test_plain_decode_alone_takes_the_lowest_id_on_every_exact_tie(tie_pair: TiePair) -> None:
    plain_decode_alone(tie_pair)


def test_the_first_token_after_prefill_takes_the_lowest_id_alone_and_in_a_batch(tie_pair: TiePair) -> None:
    engine_first_tokens(tie_pair)


def test_batched_decode_rows_take_the_lowest_id_by_device_argmax_and_per_row_choice(
    tie_pair: TiePair,
) -> None:
    engine_batched_rows(tie_pair)


def test_speculative_decode_and_the_drafts_proposals_take_the_lowest_id(tie_pair: TiePair) -> None:
    speculative_own_draft(tie_pair)


def test_the_verify_takes_the_lowest_id_at_every_block_position_alone_and_batched(tie_pair: TiePair) -> None:
    speculative_verify(tie_pair)


def test_the_triton_argmax_takes_the_lowest_id_on_ties_across_block_and_chunk_bounds() -> None:
    pytest.importorskip("triton")
    from reference_engine.kernels import argmax

    block, chunk = argmax.BLOCK_V, argmax.CHUNK_V
    vocab = 2 * chunk + block + 5  # three chunks, the last one ragged
    device = "cuda" if CUDA else "cpu"
    pairs = [  # (lowest, other) ids of one row's exact tie
        (3, 7),  # inside one block
        (block - 1, block),  # across a block bound
        (100, chunk - 1),  # first and last block of a chunk
        (chunk - 1, chunk),  # across a chunk bound
        (5, 2 * chunk + 7),  # first and last chunk
        (chunk + 1, vocab - 1),  # the ragged last block
        (0, vocab - 1),  # the ends of the vocabulary
    ]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(pairs) + 1, vocab, generator=gen)  # [rows, vocab]
    for row, (low, high) in enumerate(pairs):
        logits[row, low] = logits[row, high] = 40.0
    logits[-1, [10, chunk + 10, 2 * chunk + 10]] = 40.0  # one tie in each of three chunks
    for dtype in (torch.float32, torch.bfloat16):
        got = argmax.greedy(logits.to(device=device, dtype=dtype)).tolist()
        assert got == [low for low, _ in pairs] + [10], f"{dtype}: {got}"


# the faults of this gate's class: one path breaks exact ties toward the higher id
CATCHES = (
    "plain_decode_highest_on_tie",
    "first_token_highest_on_tie",
    "batched_rows_highest_on_tie",
    "draft_highest_on_tie",
    "verify_highest_on_tie",
)
CAUGHT_IN = {  # each fault, and a path the gate must name for it
    "plain_decode_highest_on_tie": "plain decode alone",
    "first_token_highest_on_tie": "the first token after prefill",
    "batched_rows_highest_on_tie": "batched decode rows",
    "draft_highest_on_tie": "speculative decode with the draft's proposals",
    "verify_highest_on_tie": "the verify",
}


@pytest.mark.parametrize("fault", CATCHES)
def test_the_gate_catches_a_path_that_breaks_exact_ties_toward_the_higher_id(
    tmp_path_factory, fault: str
) -> None:
    pair = tie_pair_named("dense", tmp_path_factory)
    with planted(fault), pytest.raises(AssertionError) as caught:
        assert_every_path_takes_the_lowest_id(pair)
    assert f"[{CAUGHT_IN[fault]}]" in str(caught.value), str(caught.value)

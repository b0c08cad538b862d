"""Gate: the verify scores every position it commits with plain decode's logits.

Output equality sees a verify fault only where it flips an argmax; on small models many do not
(one key short in a row's attention moves its logits, not always its choice). This gate
compares what the verify computes: for every block slot whose tokens, anchor included, are the
request's own tokens (the accepted prefix and the slot after it, whose logits choose the bonus
or the correction), the verify's logits there equal plain decode's logits at that position, to
1e-9 in float64 (1e-3 in float32; bfloat16 is not compared), for every request of a batch with
staggered arrivals, slot reuse and prompts of 1 to 300 tokens; each commit strategy, with
every draft token verified and with the widths taken in turn (plain steps, narrow and full
blocks). Planted fault: a verify narrower than the block that attends to one key fewer
(`narrow_verify_one_key_short`)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reference_engine.runtime.decode import decode_step, generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, recorded_verifies, state_tolerance, verify_gaps
from .faults import planted

CATCHES = ("narrow_verify_one_key_short", "full_verify_one_key_short")
BLOCK = 8
MAX_TOKENS = 20
WIDTHS = (0, 1, 3, 7, 2, 7)  # taken in turn by the "turns" runs
FULL_BLOCKS = (BLOCK - 1, 3, BLOCK - 1, BLOCK - 1, 0)  # the oracle's accepted counts, step by step


def plain_logits(pair: Pair, ids: list[int], prompt_len: int) -> dict[int, torch.Tensor]:
    """Plain decode's logits after each position from the prompt's last on: position -> [vocab]."""
    state = new_state(pair.target, len(ids) + 1)
    logits, _ = prefill(pair.target, state, 0, ids[:prompt_len])
    out = {prompt_len - 1: logits}
    for position in range(prompt_len, len(ids) - 1):
        out[position] = decode_step(pair.target, state, 0, ids[position])
    return out


def requests(pair: Pair) -> dict[str, list[int]]:
    rng = random.Random(5)
    vocab = pair.target.config.vocab_size - 16
    prompts = [list(p) for p in pair.prompts] + [[rng.randrange(vocab) for _ in range(n)] for n in (9, 33, 4)]
    return {f"r{i}": p for i, p in enumerate(prompts)}


def assert_verify_logits_are_plain_decodes(
    pair: Pair, strategy: str, widths: str, monkeypatch, oracle: bool = False
) -> int:
    """Runs the batch; returns how many verified positions were compared. `oracle`: the
    proposals are plain greedy's continuation at FULL_BLOCKS acceptance (whole blocks
    accepted, every slot of the furthest row's block its own), not the draft's."""
    tolerance = state_tolerance(pair)  # 1e-9 in float64, 1e-3 in float32; bfloat16 is not compared
    config = EngineConfig(max_num_seqs=4, block_size=BLOCK, commit_strategy=strategy, numerics=pair.numerics)
    engine = Engine(pair.target, pair.draft, config)
    if widths == "turns":
        turn = itertools.cycle(WIDTHS)
        monkeypatch.setattr(engine.verify_width, "choose", lambda limits, *_: min(next(turn), max(limits)))
    wanted = requests(pair)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    names = list(wanted)
    proposers = {name: None for name in names}
    if oracle:
        vocab = pair.target.config.vocab_size
        for name in names:
            truth = generate_plain(pair.target, wanted[name], params, numerics=pair.numerics).output_ids
            proposers[name] = OracleProposer(truth, FULL_BLOCKS, vocab)
    with recorded_verifies(engine) as seen:
        for name in names[:3]:
            engine.add_request(name, wanted[name], params, oracle=proposers[name])
        steps = 0
        while engine.has_unfinished() or steps < 3:
            if steps == 2:
                for name in names[3:]:
                    engine.add_request(name, wanted[name], params, oracle=proposers[name])
            engine.step()
            steps += 1
    sequences = {name: wanted[name] + engine.collect(name).output_ids for name in names}
    reference = {name: plain_logits(pair, ids, len(wanted[name])) for name, ids in sequences.items()}
    compared, worst = verify_gaps(seen, sequences, reference, tolerance)
    assert compared > 0, "no verified position was compared"
    assert not worst, f"verify logits != plain decode's at {len(worst)} positions: " + "; ".join(worst[:4])
    return compared


@pytest.mark.parametrize("widths", ["full", "turns"])
@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_the_verify_scores_each_committed_position_as_plain_decode(
    pair: Pair, strategy: str, widths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if strategy != "replay" and not pair.target.config.is_hybrid:
        pytest.skip("dense targets have one commit: the strategies are the hybrid state's")
    compared = assert_verify_logits_are_plain_decodes(pair, strategy, widths, monkeypatch)
    assert compared >= 6 * MAX_TOKENS // 2  # most committed tokens were chosen by a compared position


def test_the_gate_catches_a_narrow_verify_one_key_short(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        planted("narrow_verify_one_key_short"),
        pytest.raises(AssertionError, match="verify logits != plain"),
    ):
        assert_verify_logits_are_plain_decodes(pair, "replay", "turns", monkeypatch)


@pytest.mark.parametrize("strategy", ["replay", "per_token", "recompute"])
def test_the_verify_scores_whole_accepted_blocks_as_plain_decode(
    pair: Pair, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With whole blocks accepted the furthest row's last block slot, whose logits choose its
    bonus, is compared too (the draft's proposals seldom reach it)."""
    if strategy != "replay" and not pair.target.config.is_hybrid:
        pytest.skip("dense targets have one commit: the strategies are the hybrid state's")
    compared = assert_verify_logits_are_plain_decodes(pair, strategy, "full", monkeypatch, oracle=True)
    assert compared >= 6 * MAX_TOKENS // 2


def test_the_gate_catches_a_full_verify_one_key_short(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        planted("full_verify_one_key_short"),
        pytest.raises(AssertionError, match="verify logits != plain"),
    ):
        assert_verify_logits_are_plain_decodes(pair, "replay", "full", monkeypatch, oracle=True)

"""A request's first token left on the device after its prefill (prefill.py, `defer_first`,
on by default on CUDA): the step after the prefill takes it from the device, the engine emits
it once that step has read its results, and nothing about any output changes.

Runs on the CPU with the option forced on: the tiny float64 targets of test_engine.py, plain
and speculative, eager and with the speculative step run as if captured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.models import CausalLM
from reference_engine.runtime.engine import Engine
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.outputs import StepOutputs
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Phase, Sequence
from reference_engine.runtime.transfer import DeviceTokens, place_tokens
from tests.test_engine import LONG_PROMPT, PROMPTS, VOCAB, _as_if_captured, greedy, make_engine, reference

TinyPair = Callable[..., tuple[Path, Path]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request: pytest.FixtureRequest, tiny_pair: TinyPair):
    target_dir, draft_dir = tiny_pair(request.param, block_size=8)
    target = load_target(target_dir, dtype=torch.float64)
    return target, load_draft(draft_dir, target)


def requests(target: CausalLM) -> list[tuple[int, str, list[int], SamplingParams, list[int] | None]]:
    """(step to add at, id, prompt, params, oracle continuation): greedy requests of several
    lengths, one of one token, one whose first token is a stop token, a long prompt in chunks,
    a sampled one and one with logprobs (these two read their first token at once), added
    while others run."""
    first = reference(target, PROMPTS[2], greedy(4))[0]
    return [
        (0, "a", PROMPTS[0], greedy(20), None),
        (0, "one", PROMPTS[1], greedy(1), None),
        (1, "stop-first", PROMPTS[2], greedy(12, stop_token_ids=(first,)), None),
        (1, "long", LONG_PROMPT, greedy(16), None),
        (
            2,
            "sampled",
            PROMPTS[3],
            SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
            None,
        ),
        (2, "logprobs", PROMPTS[0], greedy(9, logprobs=2), None),
        (3, "oracle", PROMPTS[1], greedy(14), reference(target, PROMPTS[1], greedy(14))),
        (4, "b", PROMPTS[3], greedy(11), None),
    ]


def run(engine: Engine, target: CausalLM, defer: bool) -> dict:
    """Each request's stream (step, tokens, finished, reason), output, finish reason and
    speculative step records; asserts that no first token is left pending after a step."""
    engine.prefill.defer_first = defer
    todo = requests(target)
    streams: dict[str, list] = {}
    step = 0
    while todo or engine.has_unfinished():
        for entry in [e for e in todo if e[0] <= step]:
            _, rid, prompt, params, continuation = entry
            oracle = OracleProposer(continuation, [2, 5, 0], VOCAB) if continuation else None
            engine.add_request(rid, prompt, params, oracle=oracle)
            todo.remove(entry)
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(
                (step, out.new_token_ids, out.finished, out.finish_reason, out.new_logprobs)
            )
        assert all(s.pending is None for s in engine.scheduler.active.values())
        step += 1
        assert step < 300
    seqs = {rid: engine.collect(rid) for rid in streams}
    return {
        rid: (streams[rid], seq.output_ids, seq.finish_reason, seq.steps, seq.first_token_s is not None)
        for rid, seq in seqs.items()
    }


@pytest.mark.parametrize("mode", ["plain", "dflash", "dflash-captured"])
def test_a_first_token_left_on_the_device_changes_no_output(
    pair, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = pair
    taken = []
    value = DeviceTokens.value
    monkeypatch.setattr(DeviceTokens, "value", lambda self, i: taken.append(i) or value(self, i))

    def engine() -> Engine:
        e = make_engine(target, None if mode == "plain" else draft, max_num_seqs=3, prefill_chunk=16)
        if mode == "dflash-captured":
            _as_if_captured(e)
        return e

    read_at_once = run(engine(), target, defer=False)
    assert not taken
    deferred = run(engine(), target, defer=True)
    # every greedy request of more than one token left its first token on the device
    assert len(taken) == 5
    assert deferred == read_at_once
    for _, rid, prompt, params, _ in requests(target):
        if params.greedy and params.logprobs is None:
            want = reference(target, prompt, params)
            assert deferred[rid][1] == want, rid
    assert deferred["stop-first"][1] == deferred["stop-first"][1][:1]
    assert deferred["stop-first"][2] == "stop"
    assert deferred["one"][2] == "length"


def test_a_deferred_prefill_reads_nothing_from_the_device(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `defer_first` the prefill's sample phase makes no device-to-host read (on a GPU,
    such a read waits for every forward queued before it); the token arrives with the step's
    own read."""
    target, draft = pair
    engine = make_engine(target, draft, max_num_seqs=2)
    engine.prefill.defer_first = True
    recorded = engine.prefill.recorded
    inside = []
    tolist = torch.Tensor.tolist

    def watched(self):
        if inside:
            raise AssertionError("the prefill read a tensor back to the host")
        return tolist(self)

    def record(*args):
        inside.append(True)
        try:
            return recorded(*args)
        finally:
            inside.pop()

    monkeypatch.setattr(torch.Tensor, "tolist", watched)
    engine.prefill.recorded = record
    engine.add_request("r", PROMPTS[0], greedy(12))
    first = engine.step()
    assert first[0].new_token_ids == reference(target, PROMPTS[0], greedy(1))  # then the step's own
    while engine.has_unfinished():
        engine.step()
    assert engine.collect("r").output_ids == reference(target, PROMPTS[0], greedy(12))


def test_a_batched_prefill_leaves_each_finished_rows_token_and_no_other(pair) -> None:
    """Rows of one prefill whose prompts are not done yet keep prefilling and get no token;
    each done row's pending token is its own row's argmax."""
    target, _ = pair
    engine = make_engine(target, None, max_num_seqs=3)
    seqs = [
        Sequence(str(i), [1] * length, greedy(5), frozenset(), 0.0, False, slot=i, phase=Phase.PREFILL)
        for i, length in enumerate((4, 10, 6))
    ]
    logits = torch.randn(3, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    engine.prefill.defer_first = True
    engine.prefill.recorded(seqs, [4, 8, 6], logits, StepOutputs(VOCAB))
    assert seqs[1].pending is None and seqs[1].phase is Phase.PREFILL
    for seq, row in ((seqs[0], 0), (seqs[2], 2)):
        tokens, index = seq.pending
        assert seq.phase is Phase.RUNNING and not seq.output_ids
        assert tokens.value(index) == int(logits[row].argmax())
        assert seq.remaining == 4 and seq.generated == 1


def test_place_tokens_puts_each_device_token_at_its_row() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        rows = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, 100, (rows,), generator=g)
        groups = [
            DeviceTokens(torch.randint(100, 200, (int(k),), generator=g)) for k in torch.randint(1, 4, (3,))
        ]
        pending, want = [], ids.clone()
        for row in torch.randperm(rows, generator=g)[: int(torch.randint(0, rows + 1, (1,), generator=g))]:
            tokens = groups[int(torch.randint(0, 3, (1,), generator=g))]
            index = int(torch.randint(0, tokens.device.shape[0], (1,), generator=g))
            pending.append((int(row), tokens, index))
            want[int(row)] = tokens.device[index]
        place_tokens(ids, pending)
        assert torch.equal(ids, want)


def test_a_step_that_raises_drops_the_first_tokens_it_left(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose first step fails ends with "error" and no token: the first token its
    prefill left on the device is never emitted, and nothing keeps it."""
    target, draft = pair
    engine = make_engine(target, draft, max_num_seqs=2)
    engine.prefill.defer_first = True

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(engine.speculative_step, "verify", broken)
    engine.add_request("r", PROMPTS[0], greedy(12))
    outs = engine.step()
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([], "error")]
    seq = engine.collect("r")
    assert seq.pending is None and seq.output_ids == [] and seq.first_token_s is None

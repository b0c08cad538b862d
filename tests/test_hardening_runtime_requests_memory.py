"""Contracts of what a request asks for and how the engine answers it, checked from outside on
small CPU shapes:

- request checks (runtime/request.py): the repetition penalty takes both ends of its range;
  a temperature must be finite; a sampling value that is not a number is a RequestError; a
  greedy request with a repetition penalty is not served by the device argmax alone.
- token choice (runtime/token_choice.py, penalties.py): presence and frequency penalties count
  generated tokens only; the repetition penalty leaves the step's logits alone; zero top
  logprobs still report the chosen token.
- sequences and step outputs (sequence.py, outputs.py): a stop token that is the last allowed
  token ends the request as "stop"; tokens before one that is not a token are committed, and
  a stop among them ends the request so; an exception fails the rows it computed alone.
- sampling (sampling.py): a row with no mass draws NOT_A_DISTRIBUTION; a top_p that float32
  cannot hold still keeps the most likely token.
- the engine's settings (engine_config.py): each bounded setting takes its edge and refuses one
  step past it; counts that are not whole numbers are refused when the configuration is built.
- NVTX ranges (profiling.py): DFLASH_NVTX "0" or "" leaves them off; on, they push and pop in
  the `dflash` domain.

The tiny dense Qwen3 target in float32 (the sampling arithmetic's own width).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import CausalLM
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.outputs import StepOutputs
from reference_engine.runtime.profiling import DOMAIN, NvtxRanges
from reference_engine.runtime.request import REPETITION_PENALTY_RANGE, SamplingParams
from reference_engine.runtime.sampling import NOT_A_DISTRIBUTION, probabilities, sample
from reference_engine.runtime.sequence import Sequence
from reference_engine.runtime.token_choice import apply_repetition_penalty, choose_tokens

TinyCheckpoint = Callable[..., Path]
F32 = torch.float32
PROMPT = [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61]


@pytest.fixture(scope="module")
def target(tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint("qwen3"), dtype=F32)


def run_alone(target: CausalLM, params: SamplingParams, prompt: list[int] = PROMPT, **config):
    """One request through a plain engine to its end; the finished Sequence."""
    engine = Engine(target, None, EngineConfig(max_num_seqs=1, **config))
    engine.add_request("r", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return engine.collect("r")


# ----------------------------------------------------------------------------- request checks
def test_the_repetition_penalty_takes_both_ends_of_its_range_and_refuses_just_outside() -> None:
    """repetition_penalty in [0.01, 100]: both ends are taken; a hair outside either is refused,
    naming the range."""
    low, high = REPETITION_PENALTY_RANGE
    assert (low, high) == (0.01, 100.0)
    assert SamplingParams(repetition_penalty=low).repetition_penalty == low
    assert SamplingParams(repetition_penalty=high).repetition_penalty == high
    for value in (low * 0.999, high * 1.001):
        with pytest.raises(RequestError, match=r"repetition_penalty must be in \[0.01, 100.0\]"):
            SamplingParams(repetition_penalty=value)


def test_a_greedy_request_with_a_repetition_penalty_decodes_as_one_asking_for_logprobs(
    target: CausalLM,
) -> None:
    """A greedy request with a repetition penalty needs its logits on the host (argmax_only is
    off): its tokens are those of the same request asking for logprobs, which always takes the
    host path, and the penalty changes them from the unpenalised request's."""
    params = dict(max_tokens=10, ignore_eos=True)
    assert not SamplingParams(repetition_penalty=1.5).argmax_only
    plain = run_alone(target, SamplingParams(**params)).output_ids
    penalised = run_alone(target, SamplingParams(repetition_penalty=100.0, **params)).output_ids
    with_logprobs = run_alone(target, SamplingParams(repetition_penalty=100.0, logprobs=0, **params))
    assert penalised == with_logprobs.output_ids
    assert penalised != plain


@pytest.mark.parametrize(
    "asked",
    [
        {"temperature": "1"},
        {"top_p": None},
        {"repetition_penalty": "1.1"},
        {"presence_penalty": True},
        {"logit_bias": ((3, "5"),)},
        {"logit_bias": (3,)},
    ],
    ids=["temperature", "top_p", "repetition", "presence", "bias-value", "bias-pair"],
)
def test_a_sampling_value_that_is_not_a_number_is_a_request_error(asked: dict) -> None:
    """The Python API's callers get the RequestError the server turns into a 400, not a
    TypeError from a comparison."""
    with pytest.raises(RequestError, match="number"):
        SamplingParams(**asked)


@pytest.mark.parametrize("value", [float("inf"), 1e400])
def test_an_infinite_temperature_is_refused_as_not_finite(value: float) -> None:
    """temperature must be finite: logits / inf would flatten every row to the same
    distribution whatever the model said. The message names it."""
    with pytest.raises(RequestError, match=r"temperature must be finite, got inf"):
        SamplingParams(temperature=value)
    assert SamplingParams(temperature=1e30).temperature == 1e30


# ----------------------------------------------------------------------------- token choice
def plain_seq(prompt: list[int], output: list[int], **options) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=8, **options), frozenset(), 0.0, False)
    seq.output_ids = list(output)
    return seq


def test_presence_and_frequency_penalties_leave_prompt_tokens_alone() -> None:
    """OpenAI's penalties count generated tokens only: token 2, in the prompt three times but
    never generated, keeps its logit and wins; once generated, the same penalties sink it."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.5]], dtype=torch.float64)
    options = dict(presence_penalty=2.0, frequency_penalty=2.0, logprobs=3)
    tokens, logprobs = choose_tokens(logits, [plain_seq([2, 2, 2], [], **options)])
    assert tokens == [[2]]
    assert logprobs[0][0][2] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]), rel=1e-12)
    assert choose_tokens(logits, [plain_seq([2, 2, 2], [2], **options)])[0] == [[3]]


def test_the_repetition_penalty_leaves_the_callers_logits_alone() -> None:
    """apply_repetition_penalty returns a new row and choose_tokens leaves the step's logits
    as they were, so a later reader of the batch sees the model's own values."""
    row = torch.tensor([2.0, -1.0, 4.0, 0.5])
    out = apply_repetition_penalty(row, [0, 1, 0], 2.0)
    assert out.tolist() == [1.0, -2.0, 4.0, 0.5]
    assert row.tolist() == [2.0, -1.0, 4.0, 0.5]
    batch = torch.tensor([[2.0, -1.0, 4.0, 0.5], [2.0, -1.0, 4.0, 0.5]])
    choose_tokens(
        batch, [plain_seq([2], [0], repetition_penalty=4.0), plain_seq([1], [], repetition_penalty=4.0)]
    )
    assert batch.tolist() == [[2.0, -1.0, 4.0, 0.5]] * 2


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_zero_top_logprobs_report_the_chosen_token_alone(temperature: float) -> None:
    """logprobs 0: no alternatives, but the chosen token's own logprob is reported (OpenAI's
    `logprob` of the token), for a greedy row and for a sampled one alike."""
    logits = torch.tensor([[0.0, 5.0, -30.0, 4.0]], dtype=torch.float64)
    seq = plain_seq([0], [], temperature=temperature, logprobs=0, logit_bias=((2, 100.0),))
    seq.generator = torch.Generator().manual_seed(0)
    tokens, logprobs = choose_tokens(logits, [seq])
    assert tokens == [[2]]
    biased = logits[0].clone()
    biased[2] += 100.0
    assert logprobs == [[{2: pytest.approx(float(torch.log_softmax(biased, -1)[2]), rel=1e-12)}]]


# ----------------------------------------------------------------------------- sequences
def test_a_stop_token_that_is_also_the_last_allowed_token_ends_the_request_as_stop() -> None:
    """Sequence.append: the stop token is kept and ends the request with "stop", also when it
    is the max_tokens-th token; tokens past it are dropped."""
    seq = Sequence("r", [1], SamplingParams(max_tokens=3), frozenset({9}), 0.0, False)
    assert seq.append([4, 5]) == [4, 5] and seq.finish_reason is None
    assert seq.append([9, 6]) == [9]
    assert (seq.output_ids, seq.finish_reason) == ([4, 5, 9], "stop")
    longer = Sequence("l", [1], SamplingParams(max_tokens=3), frozenset({9}), 0.0, False)
    assert longer.append([4, 5, 6, 9]) == [4, 5, 6]
    assert longer.finish_reason == "length"


# ----------------------------------------------------------------------------- step outputs
def test_tokens_before_a_bad_one_are_committed_and_a_stop_among_them_ends_the_request_so() -> None:
    """StepOutputs.emit: the tokens before one that is not a token (the vocabulary's size, or
    NOT_A_DISTRIBUTION) are committed with their logprobs; when one of them is a stop token the
    request ends with "stop", otherwise it fails with "error", and a request already ended is
    not failed again."""
    outputs = StepOutputs(vocab_size=16)
    stopped = Sequence("s", [1], SamplingParams(max_tokens=8), frozenset({3}), 0.0, False)
    lps = [{2: -0.1}, {3: -0.2}, {16: -0.3}]
    assert outputs.emit(stopped, [2, 3, 16], lps) is True
    assert (stopped.output_ids, stopped.finish_reason, stopped.logprobs) == ([2, 3], "stop", lps[:2])
    outputs.fail(stopped, "late")
    assert stopped.finish_reason == "stop" and stopped.error is None

    failed = Sequence("f", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, False)
    assert outputs.emit(failed, [5, 16, 6]) is False
    assert (failed.output_ids, failed.finish_reason) == ([5], "error")
    assert "not finite" in failed.error
    drawn_none = Sequence("n", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, False)
    assert outputs.emit(drawn_none, [NOT_A_DISTRIBUTION]) is False
    assert (drawn_none.output_ids, drawn_none.finish_reason) == ([], "error")
    edge = Sequence("e", [1], SamplingParams(max_tokens=8), frozenset(), 0.0, False)
    assert outputs.emit(edge, [15]) is True and edge.output_ids == [15]
    items = [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs.items]
    assert items == [
        ("s", [2, 3], "stop"),
        ("f", [5], None),
        ("f", [], "error"),
        ("n", [], "error"),
        ("e", [15], None),
    ]


def test_an_exception_in_a_forward_fails_every_row_it_computed_and_no_other() -> None:
    """StepOutputs.failing: the exception ends each request of the block with "error" naming
    it; a request outside the block keeps going."""
    outputs = StepOutputs(vocab_size=16)
    rows = [Sequence(rid, [1], SamplingParams(), frozenset(), 0.0, False) for rid in ("a", "b", "c")]
    with outputs.failing(rows[:2]):
        raise ValueError("boom")
    assert [s.finish_reason for s in rows] == ["error", "error", None]
    assert rows[1].error == "engine error: ValueError: boom"


# ----------------------------------------------------------------------------- sampling
def test_a_row_with_no_mass_draws_not_a_distribution_and_the_other_rows_still_draw() -> None:
    """sample: a row of zeros (every token masked away) is not a distribution; it draws
    NOT_A_DISTRIBUTION, so the engine fails that request alone, and the batch's other rows
    draw their own token."""
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    drawn = sample(probs, torch.Generator().manual_seed(0))
    assert drawn.tolist() == [NOT_A_DISTRIBUTION, 2, NOT_A_DISTRIBUTION]


def test_a_top_p_float32_rounds_to_zero_still_keeps_the_most_likely_token() -> None:
    """top_p is taken in (0, 1]; the nucleus keeps the token that crosses the threshold, so the
    smallest top_p keeps the most likely token alone, also where float32 rounds it to 0."""
    SamplingParams(temperature=1.0, top_p=1e-46)
    probs = probabilities(torch.tensor([1.0, 3.0, 2.0]), 1.0, 0, 1e-46)
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_a_sampled_request_with_the_smallest_top_p_decodes_greedily(target: CausalLM) -> None:
    """A sampled request whose top_p keeps the most likely token alone decodes as greedy does
    on a float32 target, rather than failing as a numerical failure."""
    greedy = run_alone(target, SamplingParams(max_tokens=4, ignore_eos=True))
    nucleus = run_alone(
        target, SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, top_p=1e-46, seed=0)
    )
    assert nucleus.finish_reason == "length", nucleus.error
    assert nucleus.output_ids == greedy.output_ids


# ----------------------------------------------------------------------------- engine settings
@pytest.mark.parametrize(
    ("edge", "past", "message"),
    [
        (
            {"max_num_batched_tokens": 64, "prefill_chunk": 64},
            {"max_num_batched_tokens": 63, "prefill_chunk": 64},
            r"max_num_batched_tokens must be at least prefill_chunk \(64\), got 63",
        ),
        ({"max_waiting": 0}, {"max_waiting": -1}, r"max_waiting must be >= 0, got -1"),
        ({"block_size": 2}, {"block_size": 1}, r"block size must be >= 2, got 1"),
        (
            {"gpu_memory_utilization": 1.0},
            {"gpu_memory_utilization": 1.01},
            r"gpu_memory_utilization must be in \(0, 1\], got 1.01",
        ),
        (
            {"gpu_memory_utilization": 1e-3},
            {"gpu_memory_utilization": 0.0},
            r"gpu_memory_utilization must be in \(0, 1\], got 0.0",
        ),
        ({"kv_cache_tokens": 1}, {"kv_cache_tokens": 0}, r"kv_cache_tokens must be positive, got 0"),
        ({"kv_cell_tokens": 1}, {"kv_cell_tokens": 0}, r"kv_cell_tokens must be positive, got 0"),
        ({"steps_per_turn": 1}, {"steps_per_turn": 0}, r"steps_per_turn must be >= 1, got 0"),
        ({"max_model_len": 2}, {"max_model_len": 1}, r"max_model_len must be >= 2, got 1"),
        ({"checkpoint_every": 1}, {"checkpoint_every": 0}, r"checkpoint_every must be >= 1, got 0"),
        ({"numerics": "fast"}, {"numerics": "quick"}, r"numerics must be one of exact, fast, got 'quick'"),
        (
            {"verify_width": "fixed"},
            {"verify_width": "wide"},
            r"verify_width must be one of auto, fixed, got 'wide'",
        ),
        (
            {"draft_span": "verify"},
            {"draft_span": "half"},
            r"draft_span must be one of block, verify, got 'half'",
        ),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else None,
)
def test_each_engine_setting_takes_its_edge_and_refuses_one_step_past_it(
    edge: dict, past: dict, message: str
) -> None:
    """EngineConfig is checked when built: every bounded setting takes the last value of its
    range (a budget of exactly one chunk, no queue beyond the slots, the whole device, a pool
    of one token, one step a turn, a context of 2) and refuses one step past it by name."""
    config = EngineConfig(**edge)
    assert all(getattr(config, k) == v for k, v in edge.items())
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**past)


@pytest.mark.parametrize("field", ["max_num_seqs", "prefill_chunk", "kv_cell_tokens", "steps_per_turn"])
def test_a_count_in_the_engine_settings_that_is_not_a_whole_number_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: 2.5})


# ----------------------------------------------------------------------------- NVTX ranges
class RecordingNvtx:
    """The nvtx module's push_range/pop_range, recording what they were given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def push_range(self, message=None, domain=None) -> None:
        self.calls.append(("push", message, domain))

    def pop_range(self, domain=None) -> None:
        self.calls.append(("pop", domain))


@pytest.mark.parametrize(("value", "on"), [("0", False), ("", False), ("1", True), ("yes", True)])
def test_dflash_nvtx_zero_or_empty_leaves_the_ranges_off(monkeypatch, value: str, on: bool) -> None:
    """DFLASH_NVTX=1 (any value but "" and "0") turns the ranges on; "0" and "" leave them off.
    A range on pushes and pops in the `dflash` domain, both ends."""
    monkeypatch.setenv("DFLASH_NVTX", value)
    api = RecordingNvtx()
    ranges = NvtxRanges(api=api)
    assert ranges.enabled is on
    with ranges.range("verify"):
        pass
    assert api.calls == ([("push", "verify", DOMAIN), ("pop", DOMAIN)] if on else [])

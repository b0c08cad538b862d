"""Plain greedy decode: prefill (one-shot and chunked), decode steps against the slot state,
and how generate_plain ends an output (EOS, stop ids, max_tokens)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.errors import RequestError
from reference_engine.models import CausalLM
from reference_engine.runtime.decode import (
    FINISH_LENGTH,
    FINISH_STOP,
    decode_step,
    generate_plain,
    new_state,
    prefill,
    stop_ids,
)
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sampling import greedy
from reference_engine.tokenizer import EOS_TOKEN, load_tokenizer

PROMPT = [17, 301, 5, 88, 260, 42, 7, 199, 33, 410, 2, 95, 61]
LONG = 24  # output length of the reference runs below

CopyCheckpoint = Callable[[Path], Path]
TinyCheckpoint = Callable[..., Path]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request: pytest.FixtureRequest, tiny_checkpoint: TinyCheckpoint) -> CausalLM:
    return load_target(tiny_checkpoint(request.param), dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(model: CausalLM) -> list[int]:
    """LONG greedy tokens after PROMPT, EOS ignored."""
    out = generate_plain(model, PROMPT, SamplingParams(max_tokens=LONG, ignore_eos=True))
    return out.output_ids


def first_new_index(tokens: list[int], start: int = 1) -> int:
    """The first index >= start whose token did not occur earlier in `tokens`."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


@torch.inference_mode()
def recompute_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Last-position logits of the whole sequence from an empty state. [vocab]"""
    state = new_state(model, len(ids))
    out = model(
        torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), state, len(ids), last_only=True
    )
    return out.logits[0, -1]


# ----------------------------------------------------------------------------- decode steps
def test_cached_decode_equals_recomputing_the_whole_sequence(model: CausalLM) -> None:
    state = new_state(model, len(PROMPT) + LONG)
    logits, _ = prefill(model, state, 0, PROMPT)
    ids = list(PROMPT)
    for _ in range(LONG):
        torch.testing.assert_close(logits, recompute_logits(model, ids), rtol=0, atol=1e-10)
        token = int(greedy(logits))
        ids.append(token)
        logits = decode_step(model, state, 0, token)
    assert len(set(ids[len(PROMPT) :])) > 1


def test_generate_plain_output_is_the_greedy_chain_of_prefill_and_decode_steps(
    model: CausalLM, reference: list[int]
) -> None:
    state = new_state(model, len(PROMPT) + LONG)
    logits, _ = prefill(model, state, 0, PROMPT)
    chain = []
    for _ in range(LONG):
        chain.append(int(greedy(logits)))
        logits = decode_step(model, state, 0, chain[-1])
    assert chain == reference


def test_prefill_and_decode_step_advance_the_slot_length(model: CausalLM) -> None:
    state = new_state(model, 32, num_slots=2)
    logits, features = prefill(model, state, 1, PROMPT)
    assert logits.shape == (model.config.vocab_size,)
    assert features is None
    assert state.lengths == [0, len(PROMPT)]
    decode_step(model, state, 1, 3)
    assert state.lengths == [0, len(PROMPT) + 1]


@pytest.mark.parametrize("chunk_size", [1, 4, 7])
def test_chunked_prefill_equals_one_shot_prefill(model: CausalLM, chunk_size: int) -> None:
    layers = (0, model.config.num_hidden_layers - 1)
    one_state, chunk_state = new_state(model, 40), new_state(model, 40)
    one_logits, one_features = prefill(model, one_state, 0, PROMPT, capture_layers=layers)
    chunk_logits, chunk_features = prefill(
        model, chunk_state, 0, PROMPT, capture_layers=layers, chunk_size=chunk_size
    )
    assert chunk_state.lengths[0] == len(PROMPT)
    assert chunk_features.shape == (len(PROMPT), 2 * model.config.hidden_size)
    # float64; chunks change matmul shapes, so equal up to rounding, not bit for bit
    torch.testing.assert_close(chunk_logits, one_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(chunk_features, one_features, rtol=0, atol=1e-10)
    for token in (5, 400, 21):
        torch.testing.assert_close(
            decode_step(model, chunk_state, 0, token),
            decode_step(model, one_state, 0, token),
            rtol=0,
            atol=1e-10,
        )


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_generate_plain_with_chunked_prefill_gives_the_same_output(
    model: CausalLM, reference: list[int], chunk_size: int
) -> None:
    params = SamplingParams(max_tokens=LONG, ignore_eos=True)
    out = generate_plain(model, PROMPT, params, chunk_size=chunk_size)
    assert out.output_ids == reference


def test_prefill_features_are_the_captured_layer_outputs_in_order(model: CausalLM) -> None:
    hidden = model.config.hidden_size
    state = new_state(model, 40)
    _, both = prefill(model, state, 0, PROMPT, capture_layers=(0, 2))
    _, first = prefill(model, state, 0, PROMPT, capture_layers=(0,))
    _, third = prefill(model, state, 0, PROMPT, capture_layers=(2,))
    assert both.shape == (len(PROMPT), 2 * hidden)
    assert torch.equal(both[:, :hidden], first)
    assert torch.equal(both[:, hidden:], third)
    assert not torch.equal(first, third)


# ----------------------------------------------------------------------------- how outputs end
@pytest.mark.parametrize("max_tokens", [1, 2, 9, LONG])
def test_generate_plain_stops_at_max_tokens_with_finish_reason_length(
    model: CausalLM, reference: list[int], max_tokens: int
) -> None:
    out = generate_plain(model, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert out.output_ids == reference[:max_tokens]
    assert out.finish_reason == FINISH_LENGTH


def test_generate_plain_stops_at_a_stop_id_and_includes_it(model: CausalLM, reference: list[int]) -> None:
    k = first_new_index(reference, start=2)
    params = SamplingParams(max_tokens=LONG, stop_token_ids=(reference[k], 99999))
    out = generate_plain(model, PROMPT, params)
    assert out.output_ids == reference[: k + 1]
    assert out.output_ids[-1] == reference[k]
    assert out.finish_reason == FINISH_STOP


def test_stop_id_on_the_first_token_gives_a_one_token_output(model: CausalLM, reference: list[int]) -> None:
    params = SamplingParams(max_tokens=LONG, stop_token_ids=(reference[0],))
    out = generate_plain(model, PROMPT, params)
    assert out.output_ids == [reference[0]]
    assert out.finish_reason == FINISH_STOP


def test_stop_on_the_last_allowed_token_reports_stop(model: CausalLM, reference: list[int]) -> None:
    k = first_new_index(reference)
    params = SamplingParams(max_tokens=k + 1, stop_token_ids=(reference[k],))
    out = generate_plain(model, PROMPT, params)
    assert out.output_ids == reference[: k + 1]
    assert out.finish_reason == FINISH_STOP


@pytest.mark.parametrize("as_list", [False, True])
def test_generate_plain_stops_on_the_config_eos_unless_ignored(
    model: CausalLM,
    reference: list[int],
    copy_checkpoint: CopyCheckpoint,
    as_list: bool,
) -> None:
    k = first_new_index(reference)
    eos = reference[k]
    path = copy_checkpoint(model.source_path)
    raw = json.loads((path / "config.json").read_text())
    raw["eos_token_id"] = [eos, 0] if as_list else eos
    (path / "config.json").write_text(json.dumps(raw))
    with_eos = load_target(path, dtype=torch.float64)
    assert eos in with_eos.config.eos_token_ids

    out = generate_plain(with_eos, PROMPT, SamplingParams(max_tokens=LONG))
    assert out.output_ids == reference[: k + 1]
    assert out.finish_reason == FINISH_STOP

    ignored = generate_plain(with_eos, PROMPT, SamplingParams(max_tokens=LONG, ignore_eos=True))
    assert ignored.output_ids == reference
    assert ignored.finish_reason == FINISH_LENGTH


def test_tiny_checkpoint_eos_is_the_tokenizer_end_of_text(model: CausalLM) -> None:
    tokenizer = load_tokenizer(model.source_path)
    assert model.config.eos_token_ids == (tokenizer.token_to_id(EOS_TOKEN),)


def test_stop_ids_join_eos_and_request_stops_unless_eos_is_ignored(model: CausalLM) -> None:
    (eos,) = model.config.eos_token_ids
    assert stop_ids(model, SamplingParams(stop_token_ids=(4, 9))) == {eos, 4, 9}
    assert stop_ids(model, SamplingParams(stop_token_ids=(4,), ignore_eos=True)) == {4}


def test_generate_plain_fits_exactly_into_the_context(model: CausalLM, reference: list[int]) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = generate_plain(model, PROMPT, params, max_model_len=len(PROMPT) + 3)
    assert out.output_ids == reference[:3]


def test_generate_plain_refuses_an_output_one_token_past_the_context(model: CausalLM) -> None:
    """The context check is exact: prompt + max_tokens one past max_model_len is refused
    (one that fits exactly is served, the test above)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestError, match="exceeds the context"):
        generate_plain(model, PROMPT, params, max_model_len=len(PROMPT) + 3)


@pytest.mark.parametrize(
    "options", [{"logprobs": 2}, {"repetition_penalty": 1.2}], ids=["logprobs", "repetition_penalty"]
)
def test_generate_plain_refuses_either_option_only_the_engine_serves(model: CausalLM, options: dict) -> None:
    """The bare reference loop neither reports logprobs nor penalises repetition: either
    option on its own is refused with a pointer to the engine, never silently ignored."""
    with pytest.raises(RequestError, match="served by the engine"):
        generate_plain(model, PROMPT, SamplingParams(max_tokens=4, **options))


def test_a_temperature_below_the_greedy_threshold_decodes_greedily(qwen3_checkpoint: Path) -> None:
    """A positive temperature below GREEDY_BELOW is greedy in generate_plain too: in float32
    logits / 1e-40 overflow to inf and the softmax to NaN, so sampling at it would give no
    token at all; the output is greedy decode's."""
    f32 = load_target(qwen3_checkpoint, dtype=torch.float32)
    greedy_params = SamplingParams(max_tokens=8, ignore_eos=True)
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)
    out = generate_plain(f32, PROMPT, tiny, generator=torch.Generator().manual_seed(0))
    assert out.output_ids == generate_plain(f32, PROMPT, greedy_params).output_ids


def test_sampling_with_top_k_1_gives_the_greedy_output(model: CausalLM, reference: list[int]) -> None:
    params = SamplingParams(max_tokens=LONG, temperature=1.3, top_k=1, ignore_eos=True)
    out = generate_plain(model, PROMPT, params, generator=torch.Generator().manual_seed(3))
    assert out.output_ids == reference


def test_sampling_is_reproducible_from_the_generator_seed(model: CausalLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return generate_plain(model, PROMPT, params, generator=gen).output_ids

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_generate_plain_runs_in_bfloat16(qwen3_5_checkpoint: Path) -> None:
    bf16 = load_target(qwen3_5_checkpoint, dtype=torch.bfloat16)
    out = generate_plain(bf16, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.output_ids) == 8
    assert all(0 <= t < bf16.config.vocab_size for t in out.output_ids)

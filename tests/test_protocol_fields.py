"""OpenAI request fields read as the OpenAI API (and vLLM) define them, at
`serving.protocol.parse_request`: each field's accepted forms give the same request as its
plainest form, so a field read the wrong way shows as a difference here, not as a server that
quietly does something else."""

from __future__ import annotations

import pytest

from reference_engine.serving.protocol import ProtocolError, parse_request


def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
    return [ord(c) % 200 for c in text]


def parsed(chat: bool = False, **body):
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hello")
    return parse_request(
        body, "m", tokenize, chat, apply_chat_template=lambda m: m[-1]["content"] if m else "", vocab_size=256
    )


def test_a_stop_string_alone_is_one_stop_string_not_its_characters() -> None:
    assert parsed(stop="ab").stop == ("ab",)
    assert parsed(stop=["ab", "c"]).stop == ("ab", "c")
    assert parsed(chat=True, stop="ab").stop == ("ab",)


def test_chat_max_completion_tokens_is_the_token_budget() -> None:
    assert parsed(chat=True, max_completion_tokens=5).params.max_tokens == 5
    assert parsed(chat=True, max_tokens=7).params.max_tokens == 7
    assert parsed(max_tokens=9).params.max_tokens == 9


@pytest.mark.parametrize("chat", [False, True])
def test_top_k_minus_one_means_no_top_k(chat: bool) -> None:
    """vLLM's -1 and 0 both turn top-k off."""
    assert (
        parsed(chat=chat, top_k=-1, temperature=1.0).params.top_k
        == parsed(chat=chat, temperature=1.0).params.top_k
        == 0
    )
    assert parsed(chat=chat, top_k=5, temperature=1.0).params.top_k == 5


def test_stop_takes_up_to_four_strings() -> None:
    """OpenAI's limit: four stop strings are taken, a fifth is refused."""
    assert parsed(stop=["a", "b", "c", "d"]).stop == ("a", "b", "c", "d")
    with pytest.raises(ProtocolError, match="at most 4"):
        parsed(stop=["a", "b", "c", "d", "e"])


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_string_longer_than_the_limit_is_refused_naming_it(chat: bool) -> None:
    """Every token of a request is checked against its stop strings' prefixes on the event
    loop all requests share, so their length is bounded: MAX_STOP_CHARS characters are taken,
    one more is a 400 on `stop` that names the limit and the length, in a list as alone."""
    from reference_engine.serving.protocol import MAX_STOP_CHARS

    longest = "x" * MAX_STOP_CHARS
    assert parsed(chat=chat, stop=["a", longest]).stop == ("a", longest)
    for stop in ("y" * (MAX_STOP_CHARS + 1), ["a", "y" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(
            ProtocolError, match=f"at most {MAX_STOP_CHARS} characters.*{MAX_STOP_CHARS + 1}"
        ) as e:
            parsed(chat=chat, stop=stop)
        assert e.value.param == "stop" and e.value.status == 400


@pytest.mark.parametrize("n", [0, -1, 2])
def test_n_other_than_one_is_refused(n: int) -> None:
    with pytest.raises(ProtocolError, match="only n=1"):
        parsed(n=n)
    assert parsed(n=1).prompt_ids == parsed().prompt_ids


def test_chat_content_given_as_text_parts_is_the_same_request_as_a_string() -> None:
    """OpenAI's list of {"type": "text"} parts reaches the chat template as the joined text."""
    parts = [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]
    as_parts = parsed(chat=True, messages=[{"role": "user", "content": parts}])
    as_string = parsed(chat=True, messages=[{"role": "user", "content": "hello"}])
    assert as_parts.prompt_ids == as_string.prompt_ids


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    """A temperature too small for the sampling arithmetic (below 1e-5) decodes greedily, as 0
    does: the lowest id of a tie, the same output for every seed."""
    assert parsed(temperature=1e-6).params.greedy and parsed(temperature=0).params.greedy
    assert not parsed(temperature=1e-4).params.greedy


def test_a_requests_spec_decode_summary_sums_its_step_records_as_its_counters_do() -> None:
    """`spec_decode` (the usage chunk's per-request statistics) counts every step record of the
    request, as `Sequence.spec` does: steps, proposed, accepted, and each step's length."""
    import random

    from reference_engine.runtime.request import SamplingParams
    from reference_engine.runtime.sequence import Sequence
    from reference_engine.serving.protocol import spec_summary

    rng = random.Random(7)
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=500), frozenset(), 0.0, True)
    assert spec_summary(seq) == {
        "steps": 0,
        "proposed": 0,
        "accepted": 0,
        "acceptance_lengths": [],
        "fallback_reason": None,
    }
    for _ in range(40):
        proposed = rng.randint(1, 7)
        accepted = rng.randint(0, proposed)
        seq.record_step(proposed, accepted, accepted + rng.randint(0, 1), [3] * proposed)
    summary = spec_summary(seq)
    assert summary["steps"] == seq.spec.steps == 40
    assert (summary["proposed"], summary["accepted"]) == (seq.spec.proposed, seq.spec.accepted)
    assert summary["acceptance_lengths"] == [s.acceptance_length for s in seq.steps]
    assert sum(summary["acceptance_lengths"]) == sum(n * c for n, c in seq.spec.acceptance_lengths.items())
    plain = Sequence("p", [1], SamplingParams(max_tokens=5), frozenset(), 0.0, False)
    assert spec_summary(plain) is None and spec_summary(None) is None


def test_an_empty_stop_list_is_no_stop_strings() -> None:
    """`stop: []` is a request without stop strings (OpenAI, vLLM), not a server error."""
    assert parsed(stop=[]).stop == () and parsed(chat=True, stop=[]).stop == ()


def test_a_chat_top_logprobs_out_of_range_names_top_logprobs() -> None:
    """In chat, `logprobs` is the boolean and `top_logprobs` the count: a count out of range is
    refused naming `top_logprobs`; completions' `logprobs` count names `logprobs`."""
    with pytest.raises(ProtocolError) as caught:
        parsed(chat=True, logprobs=True, top_logprobs=21)
    assert caught.value.param == "top_logprobs" and "top_logprobs must be in [0, 20], got 21" in str(
        caught.value
    )
    with pytest.raises(ProtocolError) as caught:
        parsed(logprobs=21)
    assert caught.value.param == "logprobs"


@pytest.mark.parametrize("value", [0, False, "", {}])
def test_stop_token_ids_that_are_not_a_list_are_refused_even_when_falsy(value) -> None:
    """Every value of `stop_token_ids` but a list of integers (or null) is refused, the falsy
    ones too, rather than read as no stop ids."""
    with pytest.raises(ProtocolError) as caught:
        parsed(stop_token_ids=value)
    assert caught.value.param == "stop_token_ids"
    assert parsed(stop_token_ids=None).params.stop_token_ids == ()
    assert parsed(stop_token_ids=[]).params.stop_token_ids == ()


@pytest.mark.parametrize(
    "chat,body,field",
    [
        (False, {"max_tokens": 0}, "max_tokens"),
        (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (True, {"max_tokens": -1}, "max_tokens"),
        (False, {"top_p": 0.0}, "top_p"),
        (False, {"top_k": -2}, "top_k"),
    ],
)
def test_a_sampling_parameter_out_of_range_names_its_field(chat, body, field) -> None:
    """The checks SamplingParams makes come back naming the request's field (`param`), as the
    server's own checks do."""
    with pytest.raises(ProtocolError) as caught:
        parsed(chat=chat, **body)
    assert caught.value.param == field

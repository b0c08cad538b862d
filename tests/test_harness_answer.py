"""An answer is read strictly (harness/answer.py): whole or streamed, completions or chat, a
reply that is not an answer raises AnswerError with its class's name, never another
exception, and an answer that contradicts itself is refused."""

from __future__ import annotations

import json

import pytest

from harness.answer import (
    ERRORS,
    Answer,
    AnswerError,
    Ask,
    error_class,
    listed_ids,
    listed_texts,
    margin,
    read_stream,
    read_whole,
    request_body,
    token_pieces,
    token_texts,
)
from harness.client import Endpoint


def whole(**choice) -> bytes:
    body = {
        "choices": [{"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": "length", **choice}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    return json.dumps(body).encode()


def stream(*events, done: bool = True) -> str:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}" for e in events]
    return "\n\n".join(lines + (["data: [DONE]"] if done else [])) + "\n\n"


def chunk(text: str, ids: list[int] | None, finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, **extra}
    if ids is not None:
        choice["token_ids"] = ids
    return {"choices": [choice]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def test_a_whole_and_a_streamed_answer_read_the_same() -> None:
    a = read_whole(whole(), chat=False)
    b = read_stream(stream(chunk("a", [1]), chunk("b", [2], "length"), USAGE), chat=False)
    for answer in (a, b):
        assert (answer.text, answer.ids, answer.finish_reason) == ("ab", [1, 2], "length")
        assert (answer.completion_tokens, answer.prompt_tokens) == (2, 3)


def test_chat_answers_are_read_from_message_and_delta() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [5],
                "finish_reason": "stop",
            }
        ]
    }
    assert read_whole(json.dumps(body).encode(), chat=True).text == "hi"
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [5], "finish_reason": "stop"}]},
    ]
    answer = read_stream(stream(*events), chat=True)
    assert (answer.text, answer.ids, answer.finish_reason) == ("hi", [5], "stop")


def chat_whole(ids: tuple[int, ...] = (5,), **message) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", **message},
        "token_ids": list(ids),
        "finish_reason": "stop",
    }
    return json.dumps({"choices": [choice]}).encode()


def chat_chunk(finish: str | None = None, ids: list[int] | None = None, **delta) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"choices": [choice]}


CALL = {"type": "function", "name": "lookup", "arguments": '{"q": "kv"}'}


def test_a_chat_replys_reasoning_and_tool_calls_are_read_whole_and_streamed() -> None:
    """A stream's pieces are joined: reasoning by field, a tool call's name and arguments by
    its index; the call ids (drawn at random per request) are left out."""
    call = {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kv"}'}}
    whole_answer = read_whole(
        chat_whole((1, 2, 3, 4), content="hi", reasoning_content="think", tool_calls=[call]), chat=True
    )
    first_piece = {"index": 0, "id": "call_b", "type": "function", "function": {"name": "lookup"}}
    events = [
        chat_chunk(ids=[1], role="assistant", reasoning_content="thi"),
        chat_chunk(ids=[2], reasoning_content="nk", content="hi"),
        chat_chunk(ids=[3], tool_calls=[first_piece]),
        chat_chunk(ids=[4], tool_calls=[{"index": 0, "function": {"arguments": '{"q": '}}]),
        chat_chunk("stop", [], tool_calls=[{"index": 0, "function": {"arguments": '"kv"}'}}]),
    ]
    streamed = read_stream(stream(*events), chat=True)
    for answer in (whole_answer, streamed):
        assert answer.ids == [1, 2, 3, 4]
        assert (answer.text, answer.reasoning, answer.tool_calls) == (
            "hi",
            {"reasoning_content": "think"},
            [CALL],
        )


@pytest.mark.parametrize(
    "none", [{}, {"reasoning_content": None, "tool_calls": None}, {"reasoning_content": "", "tool_calls": []}]
)
def test_absent_null_and_empty_reasoning_and_tool_calls_read_the_same(none: dict) -> None:
    answer = read_whole(chat_whole(content="hi", **none), chat=True)
    assert (answer.reasoning, answer.tool_calls) == ({}, [])
    answer = read_stream(stream(chat_chunk("stop", [5], content="hi", **none)), chat=True)
    assert (answer.reasoning, answer.tool_calls) == ({}, [])


CHAT_STREAM_FAULTS = {
    "reasoning after the finish": stream(
        chat_chunk("stop", [5], content="hi"), chat_chunk(None, [], reasoning_content="more")
    ),
    "a tool call after the finish": stream(
        chat_chunk("stop", [5], content="hi"), chat_chunk(None, [], tool_calls=[{"index": 0}])
    ),
    "tool_calls not a list": stream(chat_chunk("stop", [5], tool_calls={"index": 0})),
    "reasoning not a string": stream(chat_chunk("stop", [5], reasoning_content=7)),
}


@pytest.mark.parametrize("fault", list(CHAT_STREAM_FAULTS))
def test_a_chat_stream_with_reasoning_or_tool_calls_out_of_place_is_named(fault: str) -> None:
    with pytest.raises(AnswerError) as caught:
        read_stream(CHAT_STREAM_FAULTS[fault], chat=True)
    assert caught.value.name == "malformed_body", caught.value


def test_a_plain_openai_stream_without_done_is_whole_after_its_finish_reason() -> None:
    answer = read_stream(stream(chunk("ab", None, "length"), done=False), chat=False)
    assert answer.ids is None and answer.text == "ab"


def test_the_same_finish_reason_again_without_a_token_is_no_fault() -> None:
    answer = read_stream(
        stream(chunk("a", [1], "stop"), chunk("", [], "stop"), USAGE | {"usage": {"completion_tokens": 1}}),
        chat=False,
    )
    assert (answer.ids, answer.finish_reason) == ([1], "stop")


WHOLE_FAULTS = {
    "not json": (b"<html>502</html>", "malformed_body"),
    "cut in half": (whole()[:30], "malformed_body"),
    "a list": (b"[1, 2]", "malformed_body"),
    "no choices": (b'{"id": "x"}', "malformed_body"),
    "empty choices": (b'{"choices": []}', "empty_choices"),
    "error object": (b'{"error": {"message": "boom"}}', "error_object"),
    "two choices": (
        json.dumps({"choices": [json.loads(whole())["choices"][0]] * 2}).encode(),
        "malformed_body",
    ),
    "text not a string": (whole(text=None), "malformed_body"),
    "ids not integers": (whole(token_ids=["a"]), "malformed_body"),
    "no finish_reason": (whole(finish_reason=None), "malformed_body"),
    "usage not the ids": (
        json.dumps({**json.loads(whole()), "usage": {"completion_tokens": 3}}).encode(),
        "inconsistent_answer",
    ),
    "usage not the prompt ids": (
        json.dumps({**json.loads(whole(prompt_token_ids=[7])), "usage": {"prompt_tokens": 2}}).encode(),
        "inconsistent_answer",
    ),
    "logprobs other ids": (whole(logprobs={"token_ids": [1, 3]}), "inconsistent_answer"),
    "usage not a count": (
        json.dumps({**json.loads(whole()), "usage": {"completion_tokens": "2"}}).encode(),
        "malformed_body",
    ),
}


@pytest.mark.parametrize("fault", list(WHOLE_FAULTS))
def test_a_whole_reply_that_is_not_an_answer_is_named(fault: str) -> None:
    content, name = WHOLE_FAULTS[fault]
    with pytest.raises(AnswerError) as caught:
        read_whole(content, chat=False)
    assert caught.value.name == name, caught.value


STREAM_FAULTS = {
    "not a stream": ("<html>502</html>", "malformed_body"),
    "an event not JSON": (stream(chunk("a", [1]), "{cut"), "malformed_body"),
    "no choice at all": (stream(USAGE), "empty_choices"),
    "an error event": (stream(chunk("a", [1]), {"error": {"message": "boom"}}), "error_object"),
    "no finish_reason": (stream(chunk("a", [1]), done=False), "truncated_stream"),
    "done without a finish_reason": (stream(chunk("a", [1])), "truncated_stream"),
    "tokens after the finish": (stream(chunk("a", [1], "length"), chunk("b", [2])), "malformed_body"),
    "two finish_reasons": (stream(chunk("a", [1], "length"), chunk("", [], "stop")), "malformed_body"),
    "ids in some chunks only": (stream(chunk("a", [1]), chunk("b", None, "length")), "malformed_body"),
    "a duplicated chunk": (
        stream(chunk("a", [1]), chunk("a", [1]), chunk("b", [2], "length"), USAGE),
        "inconsistent_answer",
    ),
    "a missing chunk": (stream(chunk("b", [2], "length"), USAGE), "inconsistent_answer"),
    "two choices": (stream({"choices": [chunk("a", [1])["choices"][0]] * 2}), "malformed_body"),
}


@pytest.mark.parametrize("fault", list(STREAM_FAULTS))
def test_a_stream_that_is_not_an_answer_is_named(fault: str) -> None:
    body, name = STREAM_FAULTS[fault]
    with pytest.raises(AnswerError) as caught:
        read_stream(body, chat=False)
    assert caught.value.name == name, caught.value


def test_every_error_class_has_its_own_exit_status() -> None:
    statuses = [status for status, _ in ERRORS.values()]
    assert len(set(statuses)) == len(statuses) and not {0, 1, 2, 130} & set(statuses)
    assert error_class("http_503") == "http_error" and error_class("timeout") == "timeout"


def test_the_margin_is_read_from_completions_and_chat_logprobs() -> None:
    completions = Answer(
        "ab",
        [1, 2],
        "length",
        logprobs={
            "top_token_logprobs": [[{"token_id": 1, "logprob": -0.1}, {"token_id": 9, "logprob": -0.3}]]
        },
    )
    chat = Answer(
        "ab",
        [1, 2],
        "length",
        logprobs={
            "content": [
                {
                    "token": "a",
                    "token_id": 1,
                    "logprob": -0.1,
                    "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "z", "logprob": -0.6}],
                }
            ]
        },
    )
    assert margin(completions, 0) == pytest.approx(0.2)
    assert margin(chat, 0) == pytest.approx(0.5)
    assert margin(chat, 1) is None


def reasoning_stream(*deltas: dict) -> Answer:
    events = [chat_chunk(None, [k + 1], **d) for k, d in enumerate(deltas)]
    return read_stream(stream(*events, chat_chunk("stop", [], content="")), chat=True)


@pytest.mark.parametrize(
    ("cand", "agrees"),
    [
        ([{"reasoning": "thi"}, {"reasoning": "nk"}], True),  # the other name
        (
            [
                {"reasoning_content": "thi", "reasoning": "thi"},
                {"reasoning_content": "nk", "reasoning": "nk"},
            ],
            True,
        ),
        ([{"reasoning_content": "think"}, {"reasoning": "think"}], False),  # a client reads it twice
        (
            [{"reasoning_content": "thi", "reasoning": "xx"}, {"reasoning_content": "nk", "reasoning": "yy"}],
            False,
        ),
    ],
    ids=["renamed", "both names alike", "one piece under each name", "both names differing"],
)
def test_reasoning_is_compared_as_a_client_reads_it_and_every_field_must_say_the_same(
    cand: list[dict], agrees: bool
) -> None:
    """A client reads a delta's first non-empty reasoning field: a stream that sends one
    piece under one name and the next under the other reads as both pieces, whatever each
    field holds on its own; a field a client may read instead must agree too."""
    from harness.divergence import text_round

    base = reasoning_stream({"reasoning_content": "thi"}, {"reasoning_content": "nk"})
    assert base.reasoning_seen == "think"
    divergence, _ = text_round(base, reasoning_stream(*cand), None, 0, 0.1)
    assert (divergence is None) == agrees, divergence
    if not agrees:
        assert divergence.what == "reasoning" and divergence.kind == "mismatch"


def test_alternatives_listed_by_text_only_name_no_ids() -> None:
    """listed_ids gives the ids of a position's alternatives, and None (not a set holding
    None) when the logprobs name them by text only, as chat logprobs without token_id do."""
    by_id = Answer(
        "ab",
        [1],
        "length",
        logprobs={
            "top_token_logprobs": [[{"token_id": 1, "logprob": -0.1}, {"token_id": 9, "logprob": -0.3}]]
        },
    )
    by_text = Answer(
        "a",
        [1],
        "length",
        logprobs={
            "content": [
                {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]},
            ]
        },
    )
    assert listed_ids(by_id, 0) == {1, 9}
    assert listed_ids(by_text, 0) is None
    assert listed_texts(by_text, 0) == {"a"}


def test_the_baseline_asks_for_two_alternatives_per_position_so_a_margin_can_be_read() -> None:
    """A margin is top-1 minus top-2: a request with logprobs asks for two alternatives,
    as `logprobs: 2` (completions) or `logprobs: true, top_logprobs: 2` (chat)."""
    endpoint = Endpoint("http://unused")
    chat = request_body(
        endpoint, Ask(4, messages=({"role": "user", "content": "hi"},)), logprobs=True, stream=False
    )
    text = request_body(endpoint, Ask(4, prompt="hi"), logprobs=True, stream=False)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert text["logprobs"] == 2 and "top_logprobs" not in text
    assert "logprobs" not in request_body(endpoint, Ask(4, prompt="hi"), logprobs=False, stream=False)


@pytest.mark.parametrize("echoed", [[7, 8], [7, 8, 9, 10]], ids=["fewer", "more"])
def test_echoed_prompt_ids_that_disagree_with_the_usage_count_either_way_are_refused(
    echoed: list[int],
) -> None:
    """usage.prompt_tokens (3 in `whole`) must be the number of echoed prompt ids: fewer or
    more ids are an inconsistent answer; exactly as many read fine."""
    assert read_whole(whole(prompt_token_ids=[7, 8, 9]), chat=False).prompt_ids == [7, 8, 9]
    with pytest.raises(AnswerError) as refused:
        read_whole(whole(prompt_token_ids=echoed), chat=False)
    assert refused.value.name == "inconsistent_answer"
    assert f"usage.prompt_tokens is 3 for {len(echoed)} prompt ids" in refused.value.message


def test_token_texts_pair_ids_and_pieces_only_where_both_are_there() -> None:
    """token_texts maps a position's generated id to its logprobs piece; where the logprobs
    list more pieces than there are ids, the extra positions name no id (and raise nothing)."""
    answer = Answer("ab", [5], "length", logprobs={"tokens": ["a", "b"]})
    assert token_texts(answer, 0) == {5: "a"}
    assert token_texts(answer, 1) == {}
    assert token_pieces(answer) == ["a", "b"]


def test_a_usage_count_of_zero_is_a_count_and_a_negative_one_is_not() -> None:
    """An answer that generated nothing (EOS first) reports completion_tokens 0: read as a
    count; a negative count is a malformed body."""
    body = {
        "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 0},
    }
    answer = read_whole(json.dumps(body).encode(), chat=False)
    assert (answer.ids, answer.completion_tokens, answer.prompt_tokens) == ([], 0, 3)
    body["usage"]["completion_tokens"] = -1
    with pytest.raises(AnswerError) as refused:
        read_whole(json.dumps(body).encode(), chat=False)
    assert refused.value.name == "malformed_body" and "usage.completion_tokens is -1" in refused.value.message

"""Contracts of what a request's client reads: the chunks of its stream and the whole reply
made from its events (serving/generation.py, serving/replies.py), the text detokenised from
its ids and cut at stop strings (serving/stop_strings.py), and the bodies that carry them
(serving/protocol.py).

The replies are made by the real reply generators from step outputs handed to the real
asyncio side of the engine (the scripted engine test_serve_app.py uses); text is the tiny
checkpoints' byte-level tokenizer's, or the toy vocabulary's where the tokens' texts must be
known exactly."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import ClientDisconnect

from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sequence import Sequence
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.protocol import chunk, full_response, logprobs_body, spec_summary, usage
from reference_engine.serving.replies import EventStream, respond
from reference_engine.serving.stop_strings import REPLACEMENT, GrowingText, IncrementalText, StopStringText
from reference_engine.tokenizer import load_tokenizer

from .test_serve_app import VOCAB, metrics_page, paced, parsed_request, scripted_server
from .test_serve_engine_loop import ScriptedEngine, out
from .test_serve_metrics import value


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("qwen3"))


def top2(ids: list[int]) -> list[dict[int, float]]:
    return [{t: -0.25, (t + 1) % len(VOCAB): -2.0} for t in ids]


def choices(events: list) -> list[dict]:
    return [e["choices"][0] for e in events[:-1] if "choices" in e and e["choices"]]


# ------------------------------------------------------------------ the whole reply
THREE_TURNS = [
    [([0, 1], None, 1.0, top2([0, 1]))],
    [([2], None, 2.0, top2([2]))],
    [([3, 4], "length", 3.0, top2([3, 4]))],
]


def test_a_whole_reply_read_while_the_engine_runs_gathers_every_chunk() -> None:
    """A whole reply that reads each step's output as it comes (one chunk a step) has the
    text, ids and logprobs of all of them, in order, and the usage of every token."""
    parsed = parsed_request(logprobs=1, params=SamplingParams(max_tokens=5))
    whole, _, _ = asyncio.run(paced(parsed, THREE_TURNS))
    choice = whole["choices"][0]
    assert (choice["text"], choice["token_ids"]) == ("Hello world!", [0, 1, 2, 3, 4])
    assert choice["logprobs"]["tokens"] == ["Hel", "lo", " wo", "rld", "!"]
    assert choice["logprobs"]["token_logprobs"] == [-0.25] * 5
    assert choice["logprobs"]["text_offset"] == [0, 3, 5, 8, 11]
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------ a stream's chunks
@pytest.mark.parametrize("chat", [False, True])
def test_every_chunk_of_a_stream_has_the_fields_of_its_kind(chat: bool) -> None:
    """Each chunk of a stream names the request, the served model, its object kind
    (`chat.completion.chunk` or `text_completion`) and an integer `created`; a chat chunk's
    delta always carries `content` as a string, empty while the text is held back for a stop
    string; the role comes once, in the first chunk, even when that chunk has no text."""
    turns = [[([1], None, 1.0)], [([2], None, 2.0)], [([3], "length", 3.0)]]
    parsed = parsed_request(chat=chat, stream=True, stop=("low",), params=SamplingParams(max_tokens=3))
    events, _, _ = asyncio.run(paced(parsed, turns))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == 3
    for e in chunks:
        assert e["id"] == "cmpl-1" and e["model"] == "toy"
        assert e["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert type(e["created"]) is int
        assert e["choices"][0]["index"] == 0
    if chat:
        deltas = [e["choices"][0]["delta"] for e in chunks]
        assert [d["content"] for d in deltas] == ["", "lo wo", "rld"]
        assert [d.get("role") for d in deltas] == ["assistant", None, None]
    else:
        assert [e["choices"][0]["text"] for e in chunks] == ["", "lo wo", "rld"]
    assert [e["choices"][0]["token_ids"] for e in chunks] == [[1], [2], [3]]
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None, None, "length"]


def test_the_body_of_a_chunk_is_plain_json_with_an_integer_created() -> None:
    """`chunk` and `full_response` give bodies whose `created` is whole seconds (an int), and
    that JSON encodes and decodes back unchanged."""
    for chat in (False, True):
        bodies = [
            chunk("cmpl-9", "toy", chat, "hi", [1], None, role=True),
            full_response("cmpl-9", "toy", chat, "hi", [1], "stop", None, usage(2, 1), None, [4, 5]),
        ]
        for body in bodies:
            assert type(body["created"]) is int
            assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_stream_whose_client_went_away_mid_stream_aborts_its_request(spec_version: str) -> None:
    """A streamed reply whose client goes away after its first chunk (the server's send
    failing, ASGI 2.4; or the client's disconnect message, before it): its request is
    aborted in the engine once and counted once, as "abort"."""
    engine = ScriptedEngine()
    server = scripted_server(engine)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        if spec_version == "2.4" and message.get("body"):
            raise OSError("connection reset")
        sent.append(message)

    async def receive() -> dict:
        while not sent or sent[-1]["type"] == "http.response.start":
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def scenario() -> None:
        replying = asyncio.ensure_future(respond(server, parsed_request(stream=True), 0.0))
        await asyncio.sleep(0)
        rid = engine.sent[-1][1]
        engine.receive([("added", rid, None)], EngineTotals())
        stream = await replying
        assert isinstance(stream, EventStream)
        engine.receive([out(rid, [0, 1], None, 1.0)], EngineTotals())
        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        if spec_version == "2.4":  # the server's send failing: starlette says the client went away
            with pytest.raises(ClientDisconnect):
                await asyncio.wait_for(stream(scope, receive, send), 5)
        else:
            await asyncio.wait_for(stream(scope, receive, send), 5)
        assert engine.sent.count(("abort", rid)) == 1

    asyncio.run(scenario())
    page = metrics_page(server)
    assert value(page, "dflash:request_success_total", finish_reason="abort") == 1


# ------------------------------------------------------------------ logprobs
# the chosen token (0) is not the most likely, and two alternatives tie
UNEVEN = [{0: -1.0, 5: -0.5, 3: -0.5}]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_rank_ties_by_token_id_and_give_each_alternatives_own_bytes(stream: bool) -> None:
    """Chat logprobs: the chosen token's own logprob (not the best one); its top alternatives
    ranked by logprob, ties by token id; each alternative's `token` and `bytes` its own."""
    parsed = parsed_request(chat=True, stream=stream, logprobs=2, params=SamplingParams(max_tokens=1))
    reply, _, _ = asyncio.run(paced(parsed, [[([0], "length", 1.0, UNEVEN)]]))
    if stream:
        content = [entry for c in choices(reply) for entry in c["logprobs"]["content"]]
    else:
        content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 1
    entry = content[0]
    assert (entry["token"], entry["token_id"], entry["logprob"]) == ("Hel", 0, -1.0)
    assert entry["bytes"] == list(b"Hel")
    assert entry["top_logprobs"] == [
        {"token": "rld", "token_id": 3, "logprob": -0.5, "bytes": list(b"rld")},
        {"token": " E", "token_id": 5, "logprob": -0.5, "bytes": list(b" E")},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_list_alternatives_most_likely_first(stream: bool) -> None:
    """Completions logprobs: `token_logprobs` is each chosen token's own logprob;
    `top_logprobs` (by text) and `top_token_logprobs` (by id) list the alternatives from the
    most likely down, in that order on the wire."""
    parsed = parsed_request(stream=stream, logprobs=3, params=SamplingParams(max_tokens=1))
    reply, _, _ = asyncio.run(paced(parsed, [[([0], "length", 1.0, UNEVEN)]]))
    lp = choices(reply)[0]["logprobs"] if stream else reply["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel"] and lp["token_ids"] == [0] and lp["text_offset"] == [0]
    assert lp["token_logprobs"] == [-1.0]
    assert [list(top.items()) for top in lp["top_logprobs"]] == [[(" E", -0.5), ("rld", -0.5), ("Hel", -1.0)]]
    assert lp["top_token_logprobs"] == [
        [{"token_id": 5, "logprob": -0.5}, {"token_id": 3, "logprob": -0.5}, {"token_id": 0, "logprob": -1.0}]
    ]


def test_a_streamed_completions_text_offsets_continue_across_its_chunks() -> None:
    """A completions stream read one chunk a step: each chunk's `text_offset`s go on from
    the token texts of the chunks before it, as the whole reply counts them."""
    parsed = parsed_request(stream=True, logprobs=1, params=SamplingParams(max_tokens=5))
    events, _, _ = asyncio.run(paced(parsed, THREE_TURNS))
    offsets = [c["logprobs"]["text_offset"] for c in choices(events)]
    assert offsets == [[0, 3], [5], [8, 11]]
    assert [c["logprobs"]["tokens"] for c in choices(events)] == [["Hel", "lo"], [" wo"], ["rld", "!"]]


def test_logprobs_body_counts_text_offsets_from_the_chunks_start() -> None:
    """`logprobs_body` for completions: each token's text_offset counts the texts of the
    tokens before it from the offset given (a chunk that continues a stream)."""
    body = logprobs_body(False, ["ab", "c", "def"], [1, 2, 3], [{1: -1.0}, {2: -1.0}, {3: -1.0}], str, 1, 7)
    assert body["text_offset"] == [7, 9, 10]
    assert body["token_logprobs"] == [-1.0, -1.0, -1.0]


# ------------------------------------------------------------------ spec_decode
def fallen_back_sequence() -> Sequence:
    """A request that left the speculative path before its first step."""
    seq = Sequence("r", [0, 1], SamplingParams(max_tokens=5), frozenset(), 0.0, False)
    seq.fallback_reason = "prompt_too_long"
    return seq


FALLEN_BACK = {
    "steps": 0,
    "proposed": 0,
    "accepted": 0,
    "acceptance_lengths": [],
    "fallback_reason": "prompt_too_long",
}


def test_a_request_that_fell_back_before_any_step_reports_why() -> None:
    """A request that left the speculative path before any step still gets a `spec_decode`
    summary, with no steps and its fallback reason, in the whole reply and in the usage
    chunk."""
    assert spec_summary(fallen_back_sequence()) == FALLEN_BACK
    turns = [[([0, 1], "length", 1.0)]]
    whole, _, _ = asyncio.run(paced(parsed_request(), turns, fallen_back_sequence()))
    assert whole["spec_decode"] == FALLEN_BACK
    events, _, _ = asyncio.run(
        paced(parsed_request(stream=True, include_usage=True), turns, fallen_back_sequence())
    )
    assert events[-2]["choices"] == [] and events[-2]["spec_decode"] == FALLEN_BACK


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_a_stop_string_ended_keeps_its_spec_decode_summary(stream: bool) -> None:
    """A reply that a stop string ended still carries the request's `spec_decode` summary
    (the sequence the request ended with), in the whole reply and in the usage chunk."""
    parsed = parsed_request(stream=stream, include_usage=stream, stop=("o w",))
    reply, engine, _ = asyncio.run(paced(parsed, [[([0, 1, 2, 3], None, 1.0)]], fallen_back_sequence()))
    assert ("abort", "cmpl-1") in engine.sent
    if stream:
        assert "".join(c["text"] for c in choices(reply)) == "Hell"
        assert reply[-2]["choices"] == [] and reply[-2]["spec_decode"] == FALLEN_BACK
    else:
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["spec_decode"] == FALLEN_BACK


# ------------------------------------------------------------------ detokenised text
def test_the_ids_a_push_returns_are_its_own(tokenizer) -> None:
    """The ids `StopStringText.push` returns are a list of their own: the caller reusing the
    list it pushed does not change them, with or without stop strings."""
    ids = tokenizer.encode("Hello world, this is a test.").ids
    for stops in ((), ("zzz",)):
        text = StopStringText(tokenizer.decode, stops)
        pushed = list(ids)
        got_text, got_ids = text.push(pushed, final=True)
        pushed[:] = [0] * len(pushed)
        assert got_ids == ids and got_text == tokenizer.decode(ids)


def test_a_byte_that_never_completes_a_character_waits_at_most_the_pending_limit(tokenizer) -> None:
    """Tokens whose text ends in an incomplete character (here the byte 0xFF, never part of
    UTF-8) stay pending while fewer than PENDING_LIMIT of them wait; the one that makes
    PENDING_LIMIT settles them all, as replacement characters."""
    invalid = tokenizer.token_to_id("ÿ")
    text = IncrementalText(tokenizer.decode)
    limit = IncrementalText.PENDING_LIMIT
    for k in range(1, limit):
        text.push(invalid)
        assert (str(text.settled_text), text.pending) == ("", REPLACEMENT * k), k
    text.push(invalid)
    assert (str(text.settled_text), text.pending) == (REPLACEMENT * limit, "")
    assert text.text() == tokenizer.decode([invalid] * limit)


def test_growing_text_ends_with_exactly_the_suffixes_of_its_string() -> None:
    """`GrowingText.endswith` answers as `str.endswith` for every suffix, the whole string
    and the empty one included, and for longer strings, across its blocks."""
    for length in (0, 5, GrowingText.BLOCK, GrowingText.BLOCK + 7):
        whole = "".join(chr(ord("a") + i % 26) for i in range(length))
        grown = GrowingText()
        for at in range(0, length, 1000):
            grown.append(whole[at : at + 1000])
        assert str(grown) == whole
        for k in sorted({0, 1, 2, max(length - 1, 0), length}):
            assert grown.endswith(whole[length - k :]), (length, k)
            assert grown.endswith("x" + whole[length - k :]) == whole.endswith("x" + whole[length - k :])
        assert not grown.endswith("x" + whole)

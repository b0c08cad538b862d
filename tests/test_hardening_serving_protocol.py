"""The OpenAI-compatible surface of the server, through a real server on loopback
(serving/protocol.py, replies.py, app.py), checked against the OpenAI API's documented
behaviour and docs/engine.md:
- /v1/models lists the served name as given (--served-model-name, case kept); every reply's
  `model` is that name, and a request naming another model is 404 `model_not_found`;
- a whole reply's shape: its id's prefix, `object`, `created`, one choice at index 0, the
  token budget's `finish_reason` "length", `usage` counting the generated tokens only, and a
  token-id prompt's `prompt_token_ids` as sent;
- a streamed reply: one id for all its chunks, the chunk objects, the role in the first chat
  delta only, the finish_reason on the last choice chunk only, its tokens the whole reply's;
  with `include_usage` one last chunk without choices carrying the whole reply's usage, and
  with `continuous_usage_stats` each chunk's usage counting the tokens streamed so far;
- each range edge the docs give (temperature, top_p, logprobs and top_logprobs, seed, the
  penalties, logit_bias values and token ids, top_k -1, max_tokens), each side answered 200 or
  400 with OpenAI's error body naming the field;
- max_completion_tokens as chat's budget with or without max_tokens, `n` other than 1
  refused, a `stop` string as one stop string and at most 4 of them, `ignore_eos`, top
  logprobs ranked most likely first, a completion's `text_offset` continuing over a stream's
  chunks, fields outside OpenAI's ignored while unimplemented ones are refused;
- malformed bodies and missing prompts answered with OpenAI's error body and a client status.
OpenAI's documented objects: every chunk of a stream has the same `created`, with
include_usage the chunks before the last carry `usage: null`, and a /v1/models entry has a
`created` (an integer).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from reference_engine.serving import protocol

from .server_process import ServerProcess

NAME = "Tiny-Ref"  # mixed case: the served name is kept as given
PROMPT = [5, 17, 99, 230, 41]
BUDGET = 6
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROUTES = [COMPLETIONS, CHAT]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--dtype", "float32", "--served-model-name", NAME)
    yield server
    server.stop()


def base(path: str, **extra) -> dict:
    body = {"model": NAME, "max_tokens": BUDGET, "temperature": 0, "ignore_eos": True}
    body.update(
        {"messages": [{"role": "user", "content": "hi there"}]} if path == CHAT else {"prompt": PROMPT}
    )
    body.update(extra)
    return {k: v for k, v in body.items() if v is not None}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def whole(server, path: str, **extra) -> dict:
    r = post(server, path, base(path, **extra))
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, **extra) -> list[dict]:
    """The stream's events before `[DONE]`, which must end it."""
    body = base(path, stream=True, **extra)
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def text_of(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice["text"]


def refused(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    """OpenAI's error body: {"error": {message, type, param, code}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    if status == 400:
        assert error["type"] == "invalid_request_error" and error["code"] == 400, error
    return error


# ----------------------------------------------------------------------------- the model
def test_models_lists_the_served_name_and_replies_carry_it(server) -> None:
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [(NAME, "model")]
    for path in ROUTES:
        assert whole(server, path)["model"] == NAME
        assert {e["model"] for e in stream(server, path)} == {NAME}


def test_a_models_entry_has_openais_fields(server) -> None:
    [entry] = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert {"id", "object", "created", "owned_by"} <= set(entry) and isinstance(entry["created"], int)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("model", [NAME.lower(), "gpt-4o"])
def test_a_request_for_another_model_is_404_model_not_found(server, path: str, model: str) -> None:
    error = refused(post(server, path, base(path, model=model)), "model", 404)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- the whole reply
@pytest.mark.parametrize("path", ROUTES)
def test_a_whole_reply_has_openais_shape_and_counts_the_generated_tokens(server, path: str) -> None:
    before = int(time.time())
    body = whole(server, path)
    chat = path == CHAT
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert isinstance(body["created"], int) and before <= body["created"] <= time.time() + 1
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == BUDGET
    if chat:
        assert choice["message"]["role"] == "assistant"
    else:
        assert choice["prompt_token_ids"] == PROMPT
    usage = body["usage"]
    assert usage["completion_tokens"] == BUDGET
    assert usage["total_tokens"] == usage["prompt_tokens"] + BUDGET
    if not chat:
        assert usage["prompt_tokens"] == len(PROMPT)


def test_a_token_id_prompt_is_taken_as_sent(server, model_dir) -> None:
    """The ids are not decoded and tokenised again: ids that the tokenizer would never
    give for their text (a run of special tokens, digits' ids out of order) reach the model."""
    from reference_engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    special = [tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    prompt = [*special, *PROMPT, 3, 3, 3]
    body = whole(server, COMPLETIONS, prompt=prompt)
    assert body["choices"][0]["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)


# ----------------------------------------------------------------------------- the stream
@pytest.mark.parametrize("path", ROUTES)
def test_a_stream_keeps_one_id_and_ends_with_the_usage_of_the_whole_reply(server, path: str) -> None:
    chat = path == CHAT
    reference = whole(server, path)
    events = stream(server, path, stream_options={"include_usage": True})
    *chunks, last = events
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith(
        "chatcmpl-" if chat else "cmpl-"
    )
    assert {e["object"] for e in events} == {"chat.completion.chunk" if chat else "text_completion"}
    assert all(isinstance(e["created"], int) for e in events)
    # the usage chunk: no choices, the whole request's usage
    assert last["choices"] == [] and last["usage"] == reference["usage"]
    assert all(e.get("usage") is None for e in chunks)
    choices = [c for e in chunks for c in e["choices"]]
    assert chunks and all(len(e["choices"]) == 1 and e["choices"][0]["index"] == 0 for e in chunks)
    assert [c["token_ids"] for c in choices if c["token_ids"]]
    assert sum((c["token_ids"] for c in choices), []) == reference["choices"][0]["token_ids"]
    assert "".join(text_of(c) for c in choices) == text_of(reference["choices"][0])
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    if chat:
        roles = [c["delta"].get("role") for c in choices]
        assert roles == ["assistant"] + [None] * (len(roles) - 1)


@pytest.mark.parametrize("path", ROUTES)
def test_a_stream_without_include_usage_sends_no_usage_chunk(server, path: str) -> None:
    events = stream(server, path)
    assert all(len(e["choices"]) == 1 and e.get("usage") is None for e in events)
    events = stream(server, path, stream_options={"include_usage": False})
    assert all(len(e["choices"]) == 1 and e.get("usage") is None for e in events)


@pytest.mark.parametrize("path", ROUTES)
def test_continuous_usage_counts_the_tokens_streamed_so_far(server, path: str) -> None:
    events = stream(server, path, stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, last = events
    streamed = 0
    for e in chunks:
        streamed += len(e["choices"][0]["token_ids"])
        usage = e["usage"]
        assert usage["completion_tokens"] == streamed
        assert (
            usage["total_tokens"]
            == usage["prompt_tokens"] + streamed
            == last["usage"]["prompt_tokens"] + streamed
        )
    assert streamed == BUDGET == last["usage"]["completion_tokens"]


def test_every_chunk_of_a_stream_has_the_same_created(model_dir, monkeypatch) -> None:
    """In process, with a clock that moves a second at each reading: the stream's `created` is
    its request's, not each chunk's."""
    from fastapi.testclient import TestClient

    from reference_engine.serving.app import create_app
    from reference_engine.serving.args import ServeArgs
    from reference_engine.serving.service import Server

    ticks = iter(range(1_700_000_000, 1_800_000_000))
    monkeypatch.setattr(protocol, "time", SimpleNamespace(time=lambda: float(next(ticks))))
    app = create_app(Server(ServeArgs.parse(["--model", str(model_dir), "--dtype", "float32"])))
    with TestClient(app) as client:
        body = {
            **base(COMPLETIONS, model=None, max_tokens=8),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", COMPLETIONS, json=body) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(d) for d in data[:-1]]
    assert len(events) > 2
    assert len({e["created"] for e in events}) == 1


def test_with_include_usage_every_other_chunk_carries_usage_null(server) -> None:
    *chunks, _ = stream(server, CHAT, stream_options={"include_usage": True})
    assert chunks and all("usage" in e and e["usage"] is None for e in chunks)


# ----------------------------------------------------------------------------- finish_reason and stops
@pytest.mark.parametrize("path", ROUTES)
def test_a_stop_token_id_ends_with_stop_and_the_budget_with_length(server, path: str) -> None:
    ids = whole(server, path)["choices"][0]["token_ids"]
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    for reply in (whole(server, path, stop_token_ids=[ids[at]]),):
        assert reply["choices"][0]["token_ids"] == ids[: at + 1]
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == at + 1
    choices = [e["choices"][0] for e in stream(server, path, stop_token_ids=[ids[at]])]
    assert sum((c["token_ids"] for c in choices), []) == ids[: at + 1]
    assert choices[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("path", ROUTES)
def test_a_stop_string_is_one_string_and_at_most_four_are_taken(server, path: str) -> None:
    reference = whole(server, path, max_tokens=12)["choices"][0]
    text = text_of(reference)
    c = next(ch for ch in text[1:] if not ch.isspace())
    never = c + "\u2603\u2603"  # begins with a character of the output, never occurs in it
    reply = whole(server, path, max_tokens=12, stop=never)["choices"][0]
    assert (text_of(reply), reply["finish_reason"]) == (text, "length")
    cut = whole(server, path, max_tokens=12, stop=[c])["choices"][0]
    assert (text_of(cut), cut["finish_reason"]) == (text[: text.index(c)], "stop")
    assert post(server, path, base(path, stop=["\u2603", "a\u2603", "b\u2603", "c\u2603"])).status_code == 200
    refused(
        post(server, path, base(path, stop=["\u2603", "a\u2603", "b\u2603", "c\u2603", "d\u2603"])), "stop"
    )


def test_ignore_eos_generates_past_the_end_of_text(server, config) -> None:
    eos = config["eos_token_id"]
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 4}
    ended = whole(server, COMPLETIONS, ignore_eos=False, **forced)["choices"][0]
    assert (ended["token_ids"], ended["finish_reason"], ended["text"]) == ([eos], "stop", "")
    ignored = whole(server, COMPLETIONS, ignore_eos=True, **forced)["choices"][0]
    assert (ignored["token_ids"], ignored["finish_reason"]) == ([eos] * 4, "length")


# ----------------------------------------------------------------------------- the budget
def test_max_completion_tokens_is_chats_budget_with_or_without_max_tokens(server) -> None:
    for extra, n in (
        ({"max_tokens": None, "max_completion_tokens": 3}, 3),
        ({"max_tokens": 5, "max_completion_tokens": 2}, 2),
        ({"max_tokens": 4, "max_completion_tokens": None}, 4),
    ):
        body = whole(server, CHAT, **extra)
        assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"] == n, extra
        assert body["choices"][0]["finish_reason"] == "length"
    refused(post(server, CHAT, base(CHAT, max_tokens=None, max_completion_tokens=0)), "max_completion_tokens")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("n", [0, 2, 5])
def test_n_other_than_one_is_refused(server, path: str, n: int) -> None:
    refused(post(server, path, base(path, n=n)), "n")


# ----------------------------------------------------------------------------- ranges
OK, BAD = True, False
EDGES = [
    ("temperature", 0, OK),
    ("temperature", 2, OK),
    ("temperature", 2.0001, BAD),
    ("temperature", -0.0001, BAD),
    ("top_p", 1, OK),
    ("top_p", 1e-30, OK),
    ("top_p", 0, BAD),
    ("top_p", 1.0001, BAD),
    ("top_k", -1, OK),
    ("top_k", -2, BAD),
    ("seed", 2**63 - 1, OK),
    ("seed", -(2**63), OK),
    ("seed", 2**63, BAD),
    ("seed", -(2**63) - 1, BAD),
    ("presence_penalty", 2, OK),
    ("presence_penalty", -2, OK),
    ("presence_penalty", 2.01, BAD),
    ("presence_penalty", -2.01, BAD),
    ("frequency_penalty", 2, OK),
    ("frequency_penalty", -2, OK),
    ("frequency_penalty", 2.01, BAD),
    ("frequency_penalty", -2.01, BAD),
    ("repetition_penalty", 0.01, OK),
    ("repetition_penalty", 100, OK),
    ("repetition_penalty", 0.009, BAD),
    ("repetition_penalty", 100.5, BAD),
    ("max_tokens", 1, OK),
    ("max_tokens", 0, BAD),
    ("logprobs", 20, OK),
    ("logprobs", 0, OK),
    ("logprobs", 21, BAD),
    ("logprobs", -1, BAD),
    ("logit_bias", {"7": -100, "8": 100}, OK),
    ("logit_bias", {"7": -100.5}, BAD),
    ("logit_bias", {"7": 100.5}, BAD),
    ("stop_token_ids", [True], BAD),
    ("ignore_eos", 1, BAD),
]


@pytest.mark.parametrize(("field", "value", "ok"), EDGES, ids=[f"{f}={v}" for f, v, _ in EDGES])
def test_each_range_edge_is_taken_or_refused_naming_its_field(server, field: str, value, ok: bool) -> None:
    r = post(server, COMPLETIONS, base(COMPLETIONS, **{field: value}))
    if ok:
        assert r.status_code == 200, r.text
    else:
        refused(r, field)


@pytest.mark.parametrize(("top", "ok"), [(0, OK), (20, OK), (21, BAD), (-1, BAD)])
def test_chat_top_logprobs_edges(server, top: int, ok: bool) -> None:
    r = post(server, CHAT, base(CHAT, logprobs=True, top_logprobs=top))
    if ok:
        assert r.status_code == 200, r.text
        assert all(len(e["top_logprobs"]) == top for e in r.json()["choices"][0]["logprobs"]["content"])
    else:
        refused(r, "top_logprobs")


def test_logit_bias_takes_every_token_of_the_vocabulary_and_none_past_it(server, config) -> None:
    vocab = config["vocab_size"]
    assert post(server, COMPLETIONS, base(COMPLETIONS, logit_bias={str(vocab - 1): 1})).status_code == 200
    refused(post(server, COMPLETIONS, base(COMPLETIONS, logit_bias={str(vocab): 1})), "logit_bias")


# ----------------------------------------------------------------------------- logprobs
def descending(values: list[float]) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


def test_top_logprobs_are_ranked_most_likely_first(server, model_dir) -> None:
    """Completions: `top_token_logprobs` ranked, and `top_logprobs`' texts in that order (two
    tokens of one text share a key: the dict follows the first); chat: exactly that many."""
    from reference_engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    body = whole(server, COMPLETIONS, logprobs=5, temperature=1.0, seed=3)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(lp["top_token_logprobs"]) == BUDGET
    for entry, by_id in zip(lp["top_logprobs"], lp["top_token_logprobs"]):
        ranked = [e["logprob"] for e in by_id]
        assert len(ranked) >= 5 and descending(ranked) and ranked[0] > ranked[-1]
        assert list(entry) == list(dict.fromkeys(tok.decode([e["token_id"]]) for e in by_id))
    chat = whole(server, CHAT, logprobs=True, top_logprobs=5, temperature=1.0, seed=3)
    for entry in chat["choices"][0]["logprobs"]["content"]:
        tops = [e["logprob"] for e in entry["top_logprobs"]]
        assert len(tops) == 5 and descending(tops) and tops[0] > tops[-1]
        by_id = {e["token_id"]: e["logprob"] for e in entry["top_logprobs"]}
        assert by_id.get(entry["token_id"], entry["logprob"]) == entry["logprob"] <= tops[0]


def test_a_streamed_completions_text_offset_continues_over_its_chunks(server) -> None:
    reference = whole(server, COMPLETIONS, logprobs=1, max_tokens=10)["choices"][0]["logprobs"]
    chunks = [e["choices"][0]["logprobs"] for e in stream(server, COMPLETIONS, logprobs=1, max_tokens=10)]
    assert len(chunks) > 1
    assert sum((c["text_offset"] for c in chunks), []) == reference["text_offset"]
    assert sum((c["tokens"] for c in chunks), []) == reference["tokens"]


# ----------------------------------------------------------------------------- fields
@pytest.mark.parametrize("path", ROUTES)
def test_fields_outside_openais_are_ignored_and_unimplemented_ones_refused(server, path: str) -> None:
    reference = whole(server, path)["choices"][0]["token_ids"]
    extras = {"user": "u-1", "metadata": {"k": "v"}, "some_server_extra": [1, {"x": None}], "min_p": 0.0}
    assert whole(server, path, **extras)["choices"][0]["token_ids"] == reference
    for name, value in (("best_of", 2), ("echo", True), ("suffix", "x")):
        refused(post(server, path, base(path, **{name: value})), name)
    if path == CHAT:
        assert whole(server, path, tools=[], tool_choice="none")["choices"][0]["token_ids"] == reference
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        refused(post(server, path, base(path, tools=tools)), "tools")
        refused(post(server, path, base(path, response_format={"type": "json_object"})), "response_format")


def test_loose_combinations_are_refused_naming_the_field(server) -> None:
    refused(post(server, CHAT, base(CHAT, top_logprobs=2)), "top_logprobs")
    refused(post(server, CHAT, base(CHAT, logprobs=False, top_logprobs=2)), "top_logprobs")
    for path in ROUTES:
        refused(post(server, path, base(path, stream_options={"include_usage": True})), "stream_options")
        refused(post(server, path, base(path, stream=True, stream_options=True)), "stream_options")


def test_malformed_bodies_get_openais_error_body_with_a_client_status(server) -> None:
    for content, status in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": [1], "prompt": [2]}', 400)):
        r = httpx.post(
            server.url + COMPLETIONS,
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        refused(r, None, status)
    r = httpx.post(
        server.url + COMPLETIONS, content=b"{}", headers={"content-type": "text/plain"}, timeout=30
    )
    refused(r, None, 415)
    refused(post(server, COMPLETIONS, {"model": NAME}), "prompt")
    refused(post(server, CHAT, {"model": NAME, "messages": []}), "messages")

"""The server reads requests strictly (serving/protocol.py, limits.py, app.py): a body not
declared as JSON is 415 (a browser's cross-origin form post cannot start a generation);
every standard OpenAI parameter we do not implement is refused naming it unless it carries
its "not used" value; loose values (top_logprobs without logprobs, stream_options that is
not an object or comes without stream, token ids spelt "1_0", duplicate keys, an unknown
role) are refused with a message; a top_p too small for float32 is served as the most
likely token; a chat template that fails in any way is a 400."""

from __future__ import annotations

import json

import httpx
import pytest

from reference_engine.serving.chat_template import compile_chat_template, render_chat_template
from reference_engine.serving.protocol import ProtocolError

from .server_process import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": [5, 17, 99], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    server = ServerProcess("--model", str(tiny_checkpoint("qwen3")), "--dtype", "float32")
    yield server
    server.stop()


def post(server, body: dict, path: str | None = None) -> httpx.Response:
    path = path or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    return httpx.post(server.url + path, json=body, timeout=30)


def refused(response: httpx.Response, param: str | None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_not_declared_as_json_gets_415(server, path: str, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps(CHAT if "chat" in path else COMPLETION)
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_in_capitals_is_json(server, content_type: str) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        content=json.dumps(COMPLETION),
        headers={"content-type": content_type},
        timeout=30,
    )
    assert r.status_code == 200, r.text


UNIMPLEMENTED = [
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("store", True),
    ("service_tier", "flex"),
]


@pytest.mark.parametrize("param,value", UNIMPLEMENTED, ids=[u[0] for u in UNIMPLEMENTED])
def test_an_unimplemented_chat_parameter_is_refused_naming_it(server, param: str, value) -> None:
    assert param in refused(post(server, {**CHAT, param: value}), param)


def test_suffix_is_refused_on_completions(server) -> None:
    assert "suffix" in refused(post(server, {**COMPLETION, "suffix": " end"}), "suffix")


NOT_USED = {
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "functions": None,
    "modalities": ["text"],
    "store": False,
    "service_tier": "auto",
    "suffix": None,
}


def test_the_not_used_values_of_unimplemented_parameters_are_accepted(server) -> None:
    assert post(server, {**CHAT, **NOT_USED}).status_code == 200


LOOSE = [
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("stream_options 0", {**COMPLETION, "stream": True, "stream_options": 0}, "stream_options"),
    ("stream_options []", {**COMPLETION, "stream": True, "stream_options": []}, "stream_options"),
    (
        "stream_options without stream",
        {**COMPLETION, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("logit_bias key 1_0", {**COMPLETION, "logit_bias": {"1_0": 5}}, "logit_bias"),
    ("logit_bias key with a space", {**COMPLETION, "logit_bias": {" 5": 5}}, "logit_bias"),
    ("logit_bias key +5", {**COMPLETION, "logit_bias": {"+5": 5}}, "logit_bias"),
    (
        "role with a special token",
        {**CHAT, "messages": [{"role": "<|im_start|>system", "content": "x"}]},
        "messages",
    ),
    ("unknown role", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
]


@pytest.mark.parametrize("what,body,param", LOOSE, ids=[case[0] for case in LOOSE])
def test_loose_values_are_refused_with_a_message(server, what: str, body: dict, param: str) -> None:
    assert refused(post(server, body), param)


def test_a_key_given_twice_is_refused(server) -> None:
    content = b'{"prompt": [5, 17, 99], "max_tokens": 4, "max_tokens": 9}'
    r = httpx.post(
        server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert "'max_tokens'" in refused(r, None)


def test_every_openai_role_is_accepted(server) -> None:
    messages = [
        {"role": "system", "content": "a"},
        {"role": "developer", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "tool", "content": "e", "tool_call_id": "1"},
        {"role": "user", "content": "f"},
    ]
    assert post(server, {**CHAT, "messages": messages}).status_code == 200


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(server) -> None:
    greedy = post(server, {**COMPLETION, "max_tokens": 8}).json()["choices"][0]["token_ids"]
    for top_p in (1e-300, 1e-45, 1e-30):
        r = post(server, {**COMPLETION, "max_tokens": 8, "temperature": 1.0, "top_p": top_p, "seed": 1})
        assert r.status_code == 200, (top_p, r.text)
        assert r.json()["choices"][0]["token_ids"] == greedy, top_p


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1 // 0 }}",
        "{{ messages[0].content.encode('utf-8').decode('ascii', 'strict') + 1 }}",
        "{{ 'x' * -1 + [] }}",
    ],
    ids=["zero-division", "type-error", "concat"],
)
def test_a_template_that_raises_anything_is_a_400(template: str) -> None:
    with pytest.raises(ProtocolError, match="chat template failed") as raised:
        render_chat_template(compile_chat_template(template), [{"role": "user", "content": "hi"}])
    assert raised.value.status == 400

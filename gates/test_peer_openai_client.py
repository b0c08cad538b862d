"""The official `openai` Python client (PyPI) against our server: it parses every response,
streamed, non-streamed and include_usage outputs agree, and errors map to its exception
classes. Both our plain and our DFlash server, on the shipped demo pair (float32)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the OpenAI client (a dev extra) is missing")

from reference_engine.demo import demo_prompts  # noqa: E402

MAX_TOKENS = 24
PROMPTS = [row["prompt"] for row in demo_prompts()[:3]]
MESSAGES = [{"role": "user", "content": "def parse(text):"}]


@pytest.fixture(scope="module", params=["plain", "dflash"])
def client(request, demo_plain_server, demo_dflash_server) -> openai.OpenAI:
    server = demo_plain_server if request.param == "plain" else demo_dflash_server
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_name(client) -> None:
    assert [m.id for m in client.models.list()] == ["demo"]


def test_completions_streamed_non_streamed_and_usage_agree(client) -> None:
    for prompt in PROMPTS:
        full = client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = full.choices[0]
        assert full.usage.completion_tokens == MAX_TOKENS == len(choice.model_extra["token_ids"])
        assert choice.finish_reason == "length" and choice.text
        chunks = list(
            client.completions.create(
                model="demo",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
        assert (text, ids) == (choice.text, choice.model_extra["token_ids"])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_non_streamed_agree(client) -> None:
    full = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    message = full.choices[0].message
    assert message.role == "assistant" and full.usage.completion_tokens == MAX_TOKENS
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_logprobs_parse_in_both_apis(client) -> None:
    full = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8 and "".join(lp.tokens) == full.choices[0].text
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    none = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0
    )
    assert all(e.top_logprobs == [] for e in none.choices[0].logprobs.content)


def test_stop_strings_through_the_client(client) -> None:
    full = (
        client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
    )
    stop = full[10:14]
    cut = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    streamed = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_errors_map_to_the_clients_exceptions(client) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, echo=True)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, presence_penalty=3)


def test_penalties_are_honoured_not_ignored(client) -> None:
    plain = (
        client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
    )
    penalised = (
        client.completions.create(
            model="demo", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, frequency_penalty=2.0
        )
        .choices[0]
        .text
    )
    assert penalised != plain


def test_a_dflash_fallback_reports_its_reason_through_the_client(demo_dflash_server) -> None:
    client = openai.OpenAI(base_url=demo_dflash_server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1
    )
    assert chat.model_extra["spec_decode"]["fallback_reason"] == "logprobs"
    full = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    spec = full.model_extra["spec_decode"]
    assert spec["fallback_reason"] is None and sum(spec["acceptance_lengths"]) + 1 == 8

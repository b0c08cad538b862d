"""OpenAI request fields read as the OpenAI API (and vLLM) define them, at
`serving.protocol.parse_request`: each field's accepted forms give the same request as its
plainest form, so a field read the wrong way shows as a difference here, not as a server that
quietly does something else."""

from __future__ import annotations

import pytest

from reference_engine.serving.protocol import parse_request


def tokenize(text: str) -> list[int]:
    return [ord(c) % 200 for c in text]


def parsed(chat: bool = False, **body):
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hello")
    return parse_request(
        body, "m", tokenize, chat, apply_chat_template=lambda m: m[-1]["content"], vocab_size=256
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

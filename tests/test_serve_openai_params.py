"""Standard OpenAI parameters on our server: implemented (presence_penalty,
frequency_penalty, logit_bias; on a DFlash server through a recorded fallback to plain
decode, which is lossless) or refused with a clear 400 (echo, best_of > 1); an unknown model
is 404; chat top_logprobs=0 gives no alternatives; every DFlash response carries
spec_decode with its fallback reason."""

from __future__ import annotations

import httpx
import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.kernels import select
from reference_engine.runtime.state import TargetState

from .server_process import ServerProcess

MAX_TOKENS = 12
PROMPT = [200, 3, 8, 77, 150, 42]


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair):
    return tiny_pair("qwen3_5", block_size=8)


@pytest.fixture(scope="module")
def servers(pair_dirs):
    plain = ServerProcess("--model", str(pair_dirs[0]), "--dtype", "float64")
    dflash = ServerProcess(
        "--model", str(pair_dirs[0]), "--dflash-draft-model-path", str(pair_dirs[1]), "--dtype", "float64"
    )
    yield plain, dflash
    plain.stop()
    dflash.stop()


@pytest.fixture(scope="module")
def target(pair_dirs):
    return load_target(pair_dirs[0], dtype=torch.float64)


def complete(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    body.setdefault("max_tokens", MAX_TOKENS)
    body.setdefault("temperature", 0)
    return httpx.post(url + path, json=body, timeout=60)


def next_logits(target, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after `ids`: one forward over the whole sequence in a
    fresh state (no engine, no cache reuse)."""
    state = TargetState(target.config, 1, len(ids) + 1, torch.float64)
    out = target(
        torch.tensor([ids]),
        torch.arange(len(ids))[None],
        torch.tensor([0]),
        state,
        kv_len=len(ids),
        last_only=True,
        ops=select("exact", torch.device("cpu"), torch.float64),
    )
    return out.logits[0, -1]  # [vocab]


def penalised_greedy(
    target, prompt: list[int], presence: float, frequency: float, bias: dict[int, float]
) -> list[int]:
    """OpenAI's definition, step by step: logit[t] - presence * (t generated) - frequency *
    (times t generated) + bias[t], argmax with the lowest id on a tie."""
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        score = next_logits(target, prompt + out).clone()
        for t in set(out):
            score[t] -= presence + frequency * out.count(t)
        for t, b in bias.items():
            score[t] += b
        best = score.max()
        out.append(int((score == best).nonzero()[0, 0]))
    return out


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"17": 3.0}},
    ],
)
def test_penalties_follow_the_openai_definition_on_plain_and_dflash(servers, target, params: dict) -> None:
    plain, dflash = servers
    greedy = complete(plain.url, prompt=PROMPT).json()["choices"][0]["token_ids"]
    bias = {int(k): v for k, v in params.get("logit_bias", {}).items()}
    expected = penalised_greedy(
        target, PROMPT, params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0), bias
    )
    assert penalised_greedy(target, PROMPT, 0.0, 0.0, {}) == greedy  # the reference holds
    assert expected != greedy  # the parameters matter for this prompt
    for server in (plain, dflash):
        body = complete(server.url, prompt=PROMPT, **params).json()
        assert body["choices"][0]["token_ids"] == expected, (server.url, params)
    spec = complete(dflash.url, prompt=PROMPT, **params).json()["spec_decode"]
    assert spec["fallback_reason"] == "penalties" and spec["steps"] == 0


def test_logit_bias_forces_and_bans_tokens(servers) -> None:
    plain, dflash = servers
    for server in (plain, dflash):
        forced = complete(server.url, prompt=PROMPT, logit_bias={"33": 100}).json()
        assert forced["choices"][0]["token_ids"] == [33] * MAX_TOKENS
        greedy = complete(server.url, prompt=PROMPT).json()["choices"][0]["token_ids"]
        banned = complete(server.url, prompt=PROMPT, logit_bias={str(greedy[0]): -100}).json()
        assert greedy[0] not in banned["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ],
)
def test_what_is_not_implemented_or_invalid_is_a_clear_400(servers, body: dict, param: str) -> None:
    r = complete(servers[1].url, prompt=PROMPT, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


def test_echo_false_and_best_of_one_are_fine(servers) -> None:
    r = complete(servers[1].url, prompt=PROMPT, echo=False, best_of=1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_an_unknown_model_is_404(servers, path: str, body: dict) -> None:
    r = complete(servers[0].url, path, model="no-such-model", **body)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "no-such-model" in error["message"]
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("top", [0, 2])
def test_chat_top_logprobs_gives_exactly_that_many_alternatives(servers, top: int) -> None:
    for server in servers:
        body = complete(
            server.url,
            "/v1/chat/completions",
            logprobs=True,
            top_logprobs=top,
            messages=[{"role": "user", "content": "hi"}],
        ).json()
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == MAX_TOKENS
        assert all(len(entry["top_logprobs"]) == top for entry in content)
        assert all(entry["logprob"] <= 0 for entry in content)


def test_every_dflash_response_carries_spec_decode_with_its_fallback_reason(servers) -> None:
    dflash = servers[1]
    assert complete(dflash.url, prompt=PROMPT).json()["spec_decode"]["fallback_reason"] is None
    body = complete(dflash.url, prompt=PROMPT, logprobs=1).json()
    assert body["spec_decode"]["fallback_reason"] == "logprobs"
    chat = complete(
        dflash.url,
        "/v1/chat/completions",
        logprobs=True,
        top_logprobs=1,
        messages=[{"role": "user", "content": "hi"}],
    ).json()
    assert chat["spec_decode"]["fallback_reason"] == "logprobs"
    short = complete(dflash.url, prompt=PROMPT, max_tokens=1).json()  # done in prefill
    assert short["spec_decode"]["steps"] == 0


LOGPROB_CASES = {
    "greedy": {},
    "penalised": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"5": 2.0, "9": -1.0}},
    "sampled": {"temperature": 1.3, "seed": 7},
}


@pytest.mark.parametrize("case", sorted(LOGPROB_CASES))
def test_completion_logprobs_are_the_log_softmax_of_the_scores_each_token_was_chosen_from(
    servers, target, case: str
) -> None:
    """Each token's logprob and its top alternatives equal log_softmax of the scores it was
    chosen from (the target's logits after the penalties and the bias, before the temperature),
    computed here from full forwards: the chosen token's own value (not the best one's: sampled
    tokens are often not the best), the top 3 by value in descending order, the chosen token
    among them when it is not."""
    options = LOGPROB_CASES[case]
    bias = {int(t): b for t, b in options.get("logit_bias", {}).items()}
    for server in servers:
        choice = complete(server.url, prompt=PROMPT, logprobs=3, **options).json()["choices"][0]
        ids, logprobs = choice["token_ids"], choice["logprobs"]
        assert logprobs["token_ids"] == ids
        not_best = 0
        for i, token in enumerate(ids):
            score = next_logits(target, PROMPT + ids[:i]).clone()
            for t in set(ids[:i]):
                score[t] -= options.get("presence_penalty", 0.0) + options.get(
                    "frequency_penalty", 0.0
                ) * ids[:i].count(t)
            for t, b in bias.items():
                score[t] += b
            want = torch.log_softmax(score.double(), dim=-1)
            assert logprobs["token_logprobs"][i] == pytest.approx(float(want[token]), abs=1e-9), (case, i)
            listed = [(e["token_id"], e["logprob"]) for e in logprobs["top_token_logprobs"][i]]
            top = want.topk(3).indices.tolist()
            assert [t for t, _ in listed] == sorted(set(top) | {token}, key=lambda t: -float(want[t])), (
                case,
                i,
            )
            assert all(lp == pytest.approx(float(want[t]), abs=1e-9) for t, lp in listed), (case, i)
            not_best += token != top[0]
        if case == "sampled":
            assert not_best > 0, (
                "no sampled token was other than the best: the chosen-token check saw nothing"
            )


def test_chat_logprobs_give_the_chosen_tokens_own_value_and_rank_the_alternatives(servers) -> None:
    """Sampled chat tokens: each `logprob` is the chosen token's own (equal to its entry among
    the alternatives when listed there), and the alternatives come best first."""
    for server in servers:
        body = complete(
            server.url,
            "/v1/chat/completions",
            logprobs=True,
            top_logprobs=10,
            temperature=0.5,
            seed=11,
            messages=[{"role": "user", "content": "hi"}],
        ).json()
        listed_not_first = 0
        for entry in body["choices"][0]["logprobs"]["content"]:
            values = [alt["logprob"] for alt in entry["top_logprobs"]]
            assert values == sorted(values, reverse=True)
            own = [alt["logprob"] for alt in entry["top_logprobs"] if alt["token_id"] == entry["token_id"]]
            if own:
                assert entry["logprob"] == own[0]
                listed_not_first += entry["token_id"] != entry["top_logprobs"][0]["token_id"]
        assert listed_not_first > 0, "no sampled token was listed below the best: the check saw nothing"

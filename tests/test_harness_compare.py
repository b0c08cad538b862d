"""The HTTP comparison compares like with like (harness/compare.py): ids with ids, else text
with text, locating a text difference as a token with the tokenizer; it never claims ids it
did not have, never counts an error as a comparison, and its markdown survives any text.
Every field an answer reports must agree (ids and text, length, finish_reason, the prompt);
a reply that is not an answer, or no usable prompt, is a named error, never a pass; every
concurrency level sends every prompt to the candidate, and the baseline answers once."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gates.lying_server import Reply, send_answer
from harness.client import Endpoint
from harness.compare import ComparePolicy, Divergence, PromptResult, compare, context_bucket, verdict
from harness.compare_io import exit_status, markdown, verdict_line
from harness.server_kind import KNOWN, probe
from harness.tokens import TextTokenizer
from harness.workloads import Prompt
from reference_engine.demo import DEMO_TARGET

from .completion_stub import Stub, completion
from .openai_stub import serve as serve_text_only

TEXT = "import os\nimport sys\n\n\ndef main(argv=None):\n    return 0\n"
PROMPTS = [Prompt(text="a"), Prompt(text="b"), Prompt(text="c")]
CHAT = [Prompt(messages=({"role": "user", "content": "hi"},))]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


def serve_ids(ids: list[int], tokenizer: TextTokenizer) -> tuple[ThreadingHTTPServer, str]:
    """A server like ours: token ids and text in every choice."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = ids[: body["max_tokens"]]
            choice = {
                "index": 0,
                "text": tokenizer.decode(out),
                "token_ids": out,
                "finish_reason": "length",
                "prompt_token_ids": [1, 2],
            }
            send_answer(self, body, {"choices": [choice]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def run(base: Endpoint, cand: Endpoint, max_tokens: int = 64):
    return asyncio.run(compare(base, cand, PROMPTS, max_tokens, 2, ComparePolicy("strict")))


def test_text_is_compared_with_text_when_the_baseline_offers_no_ids(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    base, base_url = serve_text_only(lambda p, n: [tokenizer.decode([t]) for t in ids[:n]])
    cand, cand_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(
            Endpoint(base_url, server=KNOWN["openai"], tokenizer=tokenizer),
            Endpoint(cand_url, server=KNOWN["ours"], tokenizer=tokenizer),
        )
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["verdict"] == "pass" and summary["exact"] == 3, summary
    assert summary["compared"] == "text" and summary["compared_text"] == 3
    assert summary["compared_ids"] == 0
    assert all(r.compared == "text" and r.compared_tokens == len(ids) for r in results)
    assert "0 by token ids, 3 by text" in markdown(results, summary)


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_a_text_difference_is_located_as_the_first_differing_token(tokenizer, with_tokenizer: bool) -> None:
    ids = tokenizer.encode(TEXT)
    other = tokenizer.encode("import os\nimport re\n\n\ndef main(argv=None):\n    return 0\n")
    at = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    base, base_url = serve_text_only(lambda p, n: [tokenizer.decode([t]) for t in ids[:n]])
    cand, cand_url = serve_ids(other, tokenizer)
    tok = tokenizer if with_tokenizer else None
    try:
        results, summary = run(
            Endpoint(base_url, server=KNOWN["openai"], tokenizer=tok),
            Endpoint(cand_url, server=KNOWN["ours"], tokenizer=tok),
        )
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["verdict"] == "fail" and summary["mismatches"] == 3
    first = results[0].divergences[0]
    assert first.char_position == TEXT.index("sys")
    if with_tokenizer:
        assert (first.position, first.baseline_token, first.candidate_token) == (at, ids[at], other[at])
        assert first.baseline_text == tokenizer.decode([ids[at]])
    else:
        assert first.position is None and first.baseline_text.startswith("sys")


def test_ids_are_compared_when_both_sides_offer_them(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    a, a_url = serve_ids(ids, tokenizer)
    b, b_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(Endpoint(a_url), Endpoint(b_url))
    finally:
        a.shutdown()
        b.shutdown()
    assert summary["compared"] == "ids" and summary["compared_ids"] == 3
    assert summary["verdict"] == "pass"


def test_errors_are_not_comparisons_and_no_ids_are_claimed(tokenizer) -> None:
    """The text-only server refuses vLLM's fields: every request fails with 422."""
    ids = tokenizer.encode(TEXT)
    base, base_url = serve_text_only(lambda p, n: ["x"] * n)
    cand, cand_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(Endpoint(base_url, server=KNOWN["vllm"]), Endpoint(cand_url))
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["errors"] == 3 and summary["exact"] == 0 and summary["verdict"] == "fail"
    assert summary["compared"] == "none" and summary["compared_ids"] == 0
    assert all(r.compared == "none" and "422" in r.error for r in results)
    text = markdown(results, summary)
    assert "compared 0 (0 by token ids, 0 by text), errors 3" in text
    assert verdict(results, ComparePolicy("tie-tolerant"))["verdict"] == "fail"


def test_markdown_quotes_any_text_without_breaking_the_table() -> None:
    nasty = "a|b\n`c``\r\td"
    result = PromptResult(
        0, False, 3, [Divergence(3, 7, 8, nasty, "|", 0.5, "mismatch")], error=None, compared="ids"
    )
    failed = PromptResult(1, False, 0, error="HTTP 422: {\n 'detail': 'x|y'\n}")
    text = markdown([result, failed], verdict([result, failed], ComparePolicy()))
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert all(line.endswith("|") for line in rows)
    header = rows[0].count("|")
    table = rows[: next(i for i, r in enumerate(rows) if r.startswith("| prompt | c | context |"))]
    for line in table:
        assert len(re.findall(r"(?<!\\)\|", line)) == header, line
    assert "\r" not in text and "\t" not in text
    per_prompt = [r for r in rows if r.startswith("| `#1` |")][0]
    assert len(re.findall(r"(?<!\\)\|", per_prompt)) == 6


def test_markdown_names_each_prompt_by_its_line_in_its_file_not_its_place_in_the_shuffle() -> None:
    # the seeded order put line 7 of the file first and line 2 second
    shuffled = [
        PromptResult(0, False, 3, [Divergence(3, 7, 8, "x", "y", 0.5, "mismatch")], compared="ids"),
        PromptResult(1, True, 0, compared="ids"),
    ]
    shuffled[0].source, shuffled[1].source = "prompts.jsonl:7", "prompts.jsonl:2"
    rows = [line for line in markdown(shuffled, verdict(shuffled, ComparePolicy())).splitlines()]
    divergence = next(r for r in rows if "| mismatch |" in r)
    assert divergence.startswith("| `prompts.jsonl:7` | 1 |")
    per_prompt = rows[rows.index("| prompt | c | context | compared | result |") + 2 :]
    assert [r.split(" | ")[0] for r in per_prompt if r] == ["| `prompts.jsonl:7`", "| `prompts.jsonl:2`"]


# ------------------------------------------------------------------ every field must agree
def against(base_answer, cand_answer, prompts=None, policy=None, levels=1, stream=True, kind=None):
    """Compare two scripted servers: `*_answer(path, body) -> completion`; `kind`: both
    servers' ServerKind (None: ours)."""
    with Stub(base_answer) as base, Stub(cand_answer) as cand:
        results, summary = asyncio.run(
            compare(
                Endpoint(base.url, server=kind),
                Endpoint(cand.url, server=kind),
                prompts or [Prompt(token_ids=(5, 6))],
                8,
                levels,
                policy or ComparePolicy(),
                stream=stream,
            )
        )
    return results, summary


def near_tie_logprobs(ids: list[int]) -> dict:
    """Logprobs of `ids` with every position all but tied (margin 0.01) with the id after it."""
    return {
        "token_ids": ids,
        "tokens": [f"<{t}>" for t in ids],
        "top_token_logprobs": [
            [{"token_id": t, "logprob": -1.0}, {"token_id": t + 1, "logprob": -1.01}] for t in ids
        ],
    }


def near_tie_baseline(ids: list[int]):
    """The baseline's answer, with every position all but tied (margin 0.01)."""

    def answer(path: str, body: dict) -> dict:
        data = completion(ids, prompt_tokens=2)
        data["choices"][0]["logprobs"] = near_tie_logprobs(ids)
        return data

    return answer


@pytest.mark.parametrize("stream", [True, False])
def test_the_right_ids_with_the_wrong_text_fail(stream: bool) -> None:
    results, summary = against(
        lambda p, b: completion([1, 2, 3], "abc"), lambda p, b: completion([1, 2, 3], "abX"), stream=stream
    )
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "text", summary
    assert results[0].divergences[0].char_position == 2


def test_other_ids_with_the_same_text_fail_even_at_a_near_tie() -> None:
    policy = ComparePolicy(max_tie_rate=1.0)
    _, summary = against(
        near_tie_baseline([1, 2, 3]), lambda p, b: completion([1, 9, 3], "<1><2><3>"), policy=policy
    )
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "ids_text", summary


def near_tie_chat_baseline(ids: list[int], tied: int):
    """A chat baseline whose answer is all but tied at position `tied` (margin 0.01; the
    runner-up of token t is t + 1) and clear everywhere else."""

    def answer(path: str, body: dict) -> dict:
        data = completion(ids, chat=True)
        content = []
        for k, t in enumerate(ids):
            margin = 0.01 if k == tied else 3.0
            tops = [
                {"token": f"<{t}>", "token_id": t, "logprob": -1.0},
                {"token": f"<{t + 1}>", "token_id": t + 1, "logprob": -1.0 - margin},
            ]
            content.append({"token": f"<{t}>", "token_id": t, "logprob": -1.0, "top_logprobs": tops})
        data["choices"][0]["logprobs"] = {"content": content}
        return data

    return answer


TIE_TOLERANT = ComparePolicy(max_tie_rate=1.0)  # any number of ties passes


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_after_a_tie_that_cannot_be_resumed_are_unchecked_never_a_pass(stream: bool) -> None:
    """A chat prompt cannot be extended by token ids, so the comparison stops at its first
    tie; a candidate that goes anywhere after it (here 9 for 4) must not pass on tokens
    never compared."""
    results, summary = against(
        near_tie_chat_baseline([1, 2, 3, 4], tied=1),
        lambda p, b: completion([1, 3, 3, 9], chat=True),
        CHAT,
        policy=TIE_TOLERANT,
        stream=stream,
    )
    assert [(d.position, d.kind) for d in results[0].divergences] == [(1, "tie")]
    assert results[0].unchecked == "from position 2 on: a chat prompt cannot be extended by token ids"
    assert summary["verdict"] == "fail" and summary["reason"] == "unchecked", summary
    assert summary["unchecked"] == 1 and summary["by_concurrency"]["1"]["unchecked"] == 1
    assert summary["first_unchecked"] == results[0].unchecked
    line = verdict_line(results, summary)
    assert line.startswith("fail: unchecked: 1 of 1 comparisons not compared in full at a tie"), line
    assert exit_status(summary) == 1


def tied_chat_run(tied: int, candidate: list[int]):
    """compare() of one chat prompt, max_tokens 3: the baseline [1, 2, 3] with a near tie at
    position `tied`, the candidate `candidate`; (results, summary)."""
    with (
        Stub(near_tie_chat_baseline([1, 2, 3], tied=tied)) as base,
        Stub(lambda p, b: completion(candidate, chat=True)) as cand,
    ):
        return asyncio.run(compare(Endpoint(base.url), Endpoint(cand.url), CHAT, 3, 1, TIE_TOLERANT))


def test_a_tie_at_the_last_position_leaves_nothing_unchecked() -> None:
    results, summary = tied_chat_run(2, [1, 2, 4])
    assert [(d.position, d.kind) for d in results[0].divergences] == [(2, "tie")]
    assert results[0].unchecked is None and summary["verdict"] == "pass", summary


def test_tokens_after_the_last_tie_max_divergences_allows_are_unchecked() -> None:
    """Each tie is resumed from until --max-divergences; what follows the last is unchecked."""
    policy = ComparePolicy(max_tie_rate=1.0, max_divergences=1)
    results, summary = against(
        near_tie_baseline([1, 2, 3]), lambda p, b: completion([1, 3, 3], prompt_tokens=2), policy=policy
    )
    assert results[0].unchecked == "from position 2 on: --max-divergences 1 reached"
    assert summary["reason"] == "unchecked", summary


def resumable(ids: list[int], logprobs: bool = False, text=None):
    """A completions server that goes on from where a resumed prompt (5, 6, then output ids)
    left off: ids[settled:], all but tied everywhere (margin 0.01, runner-up t + 1) with
    `logprobs`, listed by id with no `tokens` list (as some servers send them); `text(ids)`
    the text of an answer (default: `<t>` per token)."""

    def answer(path: str, body: dict) -> dict:
        out = ids[len(body["prompt"]) - 2 :][: body["max_tokens"]]
        data = completion(out, None if text is None else text(out), prompt_tokens=len(body["prompt"]))
        if logprobs and body.get("logprobs"):
            data["choices"][0]["logprobs"] = {
                "token_ids": out,
                "top_token_logprobs": [
                    [{"token_id": t, "logprob": -1.0}, {"token_id": t + 1, "logprob": -1.01}] for t in out
                ],
            }
        return data

    return answer


def compare_resumable(base_answer, cand_answer, tokenizer=None):
    with Stub(base_answer) as base, Stub(cand_answer) as cand:
        return asyncio.run(
            compare(
                Endpoint(base.url, tokenizer=tokenizer),
                Endpoint(cand.url),
                [Prompt(token_ids=(5, 6))],
                4,
                1,
                TIE_TOLERANT,
            )
        )


def test_the_text_over_the_agreed_ids_is_compared_without_the_baselines_token_texts(tokenizer) -> None:
    """A baseline whose logprobs carry ids but no `tokens` list cannot say where the agreed
    ids' text ends in its text. The candidate's text there must still be checked: decoded by
    the tokenizer when one is given, else the comparison says it is unchecked, never a
    pass; a tie after a wrong prefix text would otherwise vouch for it."""
    base_ids = tokenizer.encode("import os\nimport sys\n")[:4]
    cand_ids = base_ids[:2] + [base_ids[2] + 1] + base_ids[3:]  # the runner-up at position 2
    baseline = resumable(base_ids, logprobs=True, text=tokenizer.decode)

    def wrong_prefix(ids: list[int]) -> str:  # the first answer's first character changed
        text = tokenizer.decode(ids)
        return "X" + text[1:] if len(ids) == len(cand_ids) else text

    honest, lying = resumable(cand_ids, text=tokenizer.decode), resumable(cand_ids, text=wrong_prefix)
    results, summary = compare_resumable(baseline, honest, tokenizer)
    assert [(d.position, d.kind) for d in results[0].divergences] == [(2, "tie")]
    assert summary["verdict"] == "pass" and results[0].unchecked is None, summary
    results, summary = compare_resumable(baseline, lying, tokenizer)
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "text", summary
    results, summary = compare_resumable(baseline, lying)  # no tokenizer: nothing tells the text
    assert [(d.position, d.kind) for d in results[0].divergences] == [(2, "tie")]
    assert results[0].divergences[0].prefix_unchecked
    assert results[0].unchecked == (
        "the text of positions 0-1, before the tie at 2: neither the baseline's logprobs (token "
        "texts that join to its text) nor a --tokenizer (a decode that begins it) tell that text"
    )
    assert summary["verdict"] == "fail" and summary["reason"] == "unchecked", summary


def test_token_texts_that_do_not_join_to_the_text_do_not_stand_for_it(tokenizer) -> None:
    """Token texts of the baseline's logprobs that are no prefix of its text (a character
    split over two tokens reads as U+FFFD in each) tell nothing of the candidate's text
    before a tie: the tokenizer's decode is used, else the comparison is unchecked."""
    base_ids = tokenizer.encode("import os\nimport sys\n")[:4]
    cand_ids = base_ids[:2] + [base_ids[2] + 1] + base_ids[3:]  # the runner-up at position 2
    plain = resumable(base_ids, logprobs=True, text=tokenizer.decode)

    def baseline(path: str, body: dict) -> dict:
        data = plain(path, body)
        if "logprobs" in data["choices"][0]:
            data["choices"][0]["logprobs"]["tokens"] = ["\ufffd"] * len(data["choices"][0]["token_ids"])
        return data

    def wrong_prefix(ids: list[int]) -> str:
        text = tokenizer.decode(ids)
        return "X" + text[1:] if len(ids) == len(cand_ids) else text

    lying = resumable(cand_ids, text=wrong_prefix)
    _, summary = compare_resumable(baseline, lying, tokenizer)
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "text", summary
    results, summary = compare_resumable(baseline, lying)
    assert results[0].divergences[0].prefix_unchecked
    assert summary["verdict"] == "fail" and summary["reason"] == "unchecked", summary


@pytest.mark.parametrize(("token", "kind"), [(3, "tie"), (7, "mismatch")])
def test_a_near_tie_is_a_tie_only_when_the_candidate_took_the_runner_up(token: int, kind: str) -> None:
    results, _ = against(
        near_tie_baseline([1, 2, 3]), lambda p, b: completion([1, token, 3], prompt_tokens=2)
    )
    assert (results[0].divergences[0].what, results[0].divergences[0].kind) == ("token", kind)


def text_listed_near_tie_baseline(ids: list[int]):
    """As near_tie_baseline, with the alternatives listed by text only (OpenAI's and vLLM's
    completions `top_logprobs`): the runner-up of token t is t + 1."""

    def answer(path: str, body: dict) -> dict:
        data = completion(ids, prompt_tokens=2)
        data["choices"][0]["logprobs"] = {
            "tokens": [f"<{t}>" for t in ids],
            "top_logprobs": [{f"<{t}>": -1.0, f"<{t + 1}>": -1.01} for t in ids],
        }
        return data

    return answer


@pytest.mark.parametrize(("token", "kind"), [(3, "tie"), (7, "mismatch"), (2, "mismatch")])
def test_alternatives_listed_by_text_make_a_tie_only_of_a_listed_runner_up(token: int, kind: str) -> None:
    """The candidate's text after the agreed prefix must start with a runner-up's text: any
    other token at a near-tie was a tie before (a lie that passed). Token 2 is the baseline's
    own text, under another id here only because the stub writes it so: not a runner-up."""
    text = "".join(f"<{t}>" for t in (1, token, 3))
    results, _ = against(
        text_listed_near_tie_baseline([1, 2, 3]),
        lambda p, b: completion([1, token + 100 * (token == 2), 3], text, prompt_tokens=2),
    )
    d = results[0].divergences[0]
    assert (d.position, d.kind) == (1, kind), d


@pytest.mark.parametrize("cand_ids", [[1, 2], [1, 2, 3, 4]], ids=["short", "long"])
def test_one_token_short_or_long_is_a_mismatch_never_a_tie(cand_ids: list[int]) -> None:
    policy = ComparePolicy(max_tie_rate=1.0)  # ties would pass
    results, summary = against(
        near_tie_baseline([1, 2, 3]), lambda p, b: completion(cand_ids, prompt_tokens=2), policy=policy
    )
    d = results[0].divergences[0]
    assert summary["verdict"] == "fail" and d.kind == "mismatch"
    assert (d.what, d.position) == ("length", min(len(cand_ids), 3))


def test_another_finish_reason_is_a_mismatch() -> None:
    _, summary = against(lambda p, b: completion([1, 2]), lambda p, b: completion([1, 2], finish="stop"))
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "finish_reason"


def chat_reply(ids: list[int], text: str | None = None, **message):
    """A chat server's answer: `message` fields besides the content (reasoning, tool calls)."""

    def answer(path: str, body: dict) -> dict:
        data = completion(ids, text, chat=True)
        data["choices"][0]["message"].update(message)
        return data

    return answer


LOOKUP = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("base_fields", "cand_fields", "what"),
    [
        ({}, {"reasoning_content": "Let me think."}, "reasoning"),
        ({"reasoning_content": "think"}, {"reasoning_content": "thinx"}, "reasoning"),
        ({"reasoning": "think"}, {}, "reasoning"),
        ({}, {"tool_calls": [LOOKUP]}, "tool_calls"),
        (
            {"tool_calls": [LOOKUP]},
            {"tool_calls": [{**LOOKUP, "function": {"name": "lookup", "arguments": "{1}"}}]},
            "tool_calls",
        ),
    ],
    ids=["reasoning added", "reasoning changed", "reasoning dropped", "tool call added", "tool call changed"],
)
def test_a_chat_reply_with_other_reasoning_or_tool_calls_fails(
    base_fields: dict, cand_fields: dict, what: str, stream: bool
) -> None:
    results, summary = against(
        chat_reply([4, 5], **base_fields), chat_reply([4, 5], **cand_fields), CHAT, stream=stream
    )
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == what, summary


@pytest.mark.parametrize("stream", [True, False])
def test_absent_null_and_empty_reasoning_and_tool_calls_agree_and_call_ids_are_not_compared(
    stream: bool,
) -> None:
    base = chat_reply([4, 5], reasoning_content=None, tool_calls=[LOOKUP])
    cand = chat_reply([4, 5], reasoning_content="", reasoning=None, tool_calls=[{**LOOKUP, "id": "call_2"}])
    _, summary = against(base, cand, CHAT, stream=stream)
    assert summary["verdict"] == "pass", summary
    _, summary = against(chat_reply([4, 5]), chat_reply([4, 5], tool_calls=[]), CHAT, stream=stream)
    assert summary["verdict"] == "pass", summary


def test_one_reasoning_text_under_either_name_agrees_and_another_text_does_not() -> None:
    """Servers name the same reasoning `reasoning_content` or `reasoning` (vLLM's newer name,
    some send both): the text is compared, not the name. Whole replies: the scripted stream
    writes `reasoning_content` alone."""
    base = chat_reply([4, 5], reasoning_content="think")
    for cand, want in (
        (chat_reply([4, 5], reasoning="think"), "pass"),
        (chat_reply([4, 5], reasoning_content="think", reasoning="think"), "pass"),
        (chat_reply([4, 5], reasoning="thinx"), "fail"),
        (chat_reply([4, 5], reasoning_content="think", reasoning="other"), "fail"),
    ):
        _, summary = against(base, cand, CHAT, stream=False)
        assert summary["verdict"] == want, summary


def test_other_ids_with_the_same_content_and_other_reasoning_are_a_token_divergence() -> None:
    """The ids cover the reasoning too: another token inside it, with the content the same, is
    not ids that disagree with the text."""
    _, summary = against(
        chat_reply([3, 4, 5], "ok", reasoning_content="ab"),
        chat_reply([3, 4, 6], "ok", reasoning_content="aX"),
        CHAT,
    )
    assert summary["first_mismatch"] == "token", summary


def test_a_candidate_that_saw_another_prompt_fails() -> None:
    _, summary = against(
        lambda p, b: completion([1, 2], prompt_tokens=2), lambda p, b: completion([1, 2], prompt_tokens=3)
    )
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "prompt"


def test_text_answers_differing_only_in_the_usage_count_are_a_length_mismatch() -> None:
    _, summary = against(
        lambda p, b: completion(None, "ab", completion_tokens=2),
        lambda p, b: completion(None, "ab", completion_tokens=3),
        kind=KNOWN["openai"],  # a server that returns no token ids: text is all there is
    )
    assert summary["compared"] == "text" and summary["first_mismatch"] == "length"


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_a_server_whose_kind_returns_ids_and_sends_none_is_an_error(side: str) -> None:
    """Without the ids the comparison would be of text alone, where another token sequence
    with the same text passes: a side whose kind promises ids must send them."""
    with_ids, without = (lambda p, b: completion([1, 2])), (lambda p, b: completion(None, "ab"))
    answers = (without, with_ids) if side == "baseline" else (with_ids, without)
    _, summary = against(*answers)
    assert summary["verdict"] == "fail" and summary["error"] == "missing_ids"
    assert summary["error_message"].startswith(f"the {side}'s answer carries no token ids")
    _, summary = against(*answers, kind=KNOWN["openai"])  # a kind that returns none
    assert summary["error"] is None


@pytest.mark.parametrize(
    ("reply", "name"),
    [
        (Reply(200, b'{"choices": []}'), "empty_choices"),
        (Reply(200, b'{"choices": [{"text": "a'), "malformed_body"),
        (Reply(500, b'{"error": "boom"}'), "http_500"),
        (Reply(200, b'{"error": {"message": "boom"}}'), "error_object"),
    ],
)
def test_a_reply_that_is_not_an_answer_is_a_named_error(reply: Reply, name: str) -> None:
    results, summary = against(lambda p, b: completion([1, 2]), lambda p, b: reply, stream=False)
    assert summary["verdict"] == "fail" and summary["error"] == summary["reason"] == name
    assert results[0].error_name == name and results[0].error.startswith("candidate: ")


def test_no_usable_prompt_is_an_error_never_a_pass() -> None:
    results, summary = asyncio.run(
        compare(
            Endpoint("http://127.0.0.1:9"),
            Endpoint("http://127.0.0.1:9"),
            [Prompt(text=""), Prompt(messages=()), Prompt(token_ids=())],
            8,
            1,
            ComparePolicy(),
        )
    )
    assert results == [] and summary["verdict"] == "fail"
    assert summary["error"] == "no_usable_prompts" and summary["unusable"] == 3


def refuses_token_id_prompts(path: str, body: dict) -> dict | Reply:
    """A server that answers text prompts and refuses a prompt of token ids with a 400."""
    if isinstance(body.get("prompt"), list):
        return Reply(400, b'{"error": {"message": "prompt must be a string"}}')
    return completion([1, 2])


def test_token_id_prompts_a_probed_candidate_refuses_fail_the_run_and_never_vanish(tokenizer) -> None:
    """A candidate that refuses token-id prompts at the probe takes text only; its token-id
    prompts cannot be sent, and the run fails `unsent`, counting them, rather than passing on
    the prompts the candidate chose to take. With a tokenizer they go as their text."""
    ids_prompt = Prompt(token_ids=(5, 6), source="prompts.jsonl:4")
    with Stub(lambda p, b: completion([1, 2])) as base, Stub(refuses_token_id_prompts) as cand:
        kind = probe(cand.url).kind
        assert kind.name == "openai" and not kind.prompt_ids, kind
        for tokenizer_ in (None, tokenizer):
            results, summary = asyncio.run(
                compare(
                    Endpoint(base.url),
                    Endpoint(cand.url, server=kind, tokenizer=tokenizer_),
                    PROMPTS + [ids_prompt],
                    8,
                    1,
                    ComparePolicy(),
                )
            )
            if tokenizer_ is None:
                assert summary["verdict"] == "fail" and summary["reason"] == "unsent", summary
                assert summary["error"] is None and summary["exact"] == summary["prompts"] == 3
                assert summary["unsent"] == 1 and summary["unsent_reasons"] == [
                    f"prompts.jsonl:4: token ids, and {cand.url} takes text only (give --tokenizer)"
                ]
                assert exit_status(summary) == 1
                assert verdict_line(results, summary).startswith("fail: unsent: 1 prompts never sent")
                assert "Prompts not sent (a server would not take them)" in markdown(results, summary)
            else:
                assert summary["verdict"] == "pass" and summary["exact"] == summary["prompts"] == 4
                assert summary["unsent"] == 0
        assert cand.bodies[-1]["prompt"] == tokenizer.decode([5, 6])  # the ids went as their text


def test_only_unsent_prompts_are_no_usable_prompts(tokenizer) -> None:
    """Every prompt unsent: nothing was compared, the error `no_usable_prompts`, naming why."""
    with Stub(refuses_token_id_prompts) as cand:
        kind = probe(cand.url).kind
        _, summary = asyncio.run(
            compare(
                Endpoint(cand.url),
                Endpoint(cand.url, server=kind),
                [Prompt(token_ids=(5, 6))],
                8,
                1,
                ComparePolicy(),
            )
        )
    assert summary["error"] == "no_usable_prompts" and summary["unsent"] == 1
    assert summary["error_message"].startswith("no usable prompt (#0: token ids, and ")


def test_chat_prompts_are_compared_over_chat_completions() -> None:
    answer = lambda path, body: completion([4, 5], chat=path.endswith("/chat/completions"))  # noqa: E731
    with Stub(answer) as base, Stub(answer) as cand:
        results, summary = asyncio.run(
            compare(
                Endpoint(base.url),
                Endpoint(cand.url),
                [Prompt(messages=({"role": "user", "content": "hi"},))],
                8,
                1,
                ComparePolicy(),
            )
        )
        assert base.paths == cand.paths == ["/v1/chat/completions"]
        assert base.bodies[0]["top_logprobs"] == 2 and cand.bodies[0]["stream"] is True
    assert summary["verdict"] == "pass" and results[0].endpoint == "chat"
    assert summary["compared"] == "ids"


# ------------------------------------------------------------------ concurrency and context
def test_each_level_sends_every_prompt_to_the_candidate_and_the_baseline_answers_once() -> None:
    prompts = [Prompt(text="p" * (i + 1)) for i in range(8)]

    def answer(path: str, body: dict) -> dict:
        return completion([1, 2, 3], prompt_tokens=len(body["prompt"]))

    with Stub(answer) as base, Stub(answer, delay=0.05) as cand:
        results, summary = asyncio.run(
            compare(Endpoint(base.url), Endpoint(cand.url), prompts, 8, [1, 4], ComparePolicy())
        )
        assert len(base.bodies) == 8 and len(cand.bodies) == 16
        assert cand.arrivals[:8] == [1] * 8 and cand.most == 4  # closed loop at each level
    assert summary["verdict"] == "pass" and summary["levels"] == [1, 4]
    assert {c: v["prompts"] for c, v in summary["by_concurrency"].items()} == {"1": 8, "4": 8}
    assert [r.concurrency for r in results] == [1] * 8 + [4] * 8


def test_comparisons_are_counted_per_context_bucket() -> None:
    assert [context_bucket(n) for n in (None, 20, 256, 257, 1448, 5000, 9000)] == [
        "unknown",
        "~128",
        "~128",
        "~512",
        "~512",
        "~4096",
        ">8192",
    ]
    prompts = [Prompt(token_ids=tuple(range(n))) for n in (100, 600, 3000)]
    # the server's usage.prompt_tokens counts when given, else the prompt's ids
    _, summary = against(
        lambda p, b: completion(
            [1], prompt_tokens=len(b["prompt"]) + 1000 if len(b["prompt"]) == 100 else None
        ),
        lambda p, b: completion(
            [1], prompt_tokens=len(b["prompt"]) + 1000 if len(b["prompt"]) == 100 else None
        ),
        prompts=prompts,
    )
    assert {b: v["prompts"] for b, v in summary["by_context"].items()} == {"~512": 2, "~4096": 1}


def test_markdown_has_a_table_per_level_and_per_context() -> None:
    prompts = [Prompt(token_ids=tuple(range(n))) for n in (10, 600)]
    results, summary = against(
        lambda p, b: completion([1]), lambda p, b: completion([1]), prompts=prompts, levels=[1, 2]
    )
    text = markdown(results, summary)
    assert "| concurrency | prompts | exact |" in text and "| 2 | 2 | 2 |" in text
    assert "| context | prompts | exact |" in text and "| ~512 | 2 | 2 |" in text


def test_the_tie_rate_is_judged_at_each_concurrency_not_pooled() -> None:
    """max_tie_rate holds at every level: ties at half the prompts of concurrency 1 fail the
    run, though pooled with a clean concurrency 8 they are a quarter of all prompts."""
    tie = Divergence(3, 5, 6, "<5>", "<6>", 0.001, "tie")
    results = [
        PromptResult(i, exact=not tied, compared_tokens=8, divergences=[tie] if tied else [], concurrency=c)
        for c in (1, 8)
        for i in range(4)
        for tied in [c == 1 and i < 2]
    ]
    summary = verdict(results, ComparePolicy(max_tie_rate=0.3))
    assert summary["tie_rate"] == 0.25 and summary["by_concurrency"]["1"]["tie_rate"] == 0.5
    assert (summary["verdict"], summary["reason"]) == ("fail", "ties")
    assert verdict(results, ComparePolicy(max_tie_rate=0.5))["verdict"] == "pass"


@pytest.mark.parametrize(
    ("base_text", "cand_text", "what"),
    [("ab\n", "ab", "length"), ("ab", "ab ", "length"), (" ab", "ab", "text"), ("a b", "a  b", "text")],
    ids=["newline dropped", "space added", "leading space dropped", "space doubled"],
)
def test_texts_that_differ_only_in_whitespace_differ(base_text: str, cand_text: str, what: str) -> None:
    """Compared by text (no ids), a space or a newline is a character like any other: no
    trimming or collapsing makes two texts the same."""
    _, summary = against(
        lambda p, b: completion(None, base_text, completion_tokens=2),
        lambda p, b: completion(None, cand_text, completion_tokens=2),
        kind=KNOWN["openai"],
    )
    assert summary["compared"] == "text" and summary["verdict"] == "fail", summary
    assert summary["first_mismatch"] == what, summary


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("cand_text", ["<1><2>\n", "<1><2> ", " <1><2>"], ids=["newline", "space", "leading"])
def test_the_right_ids_with_whitespace_added_to_the_text_fail(cand_text: str, stream: bool) -> None:
    _, summary = against(
        lambda p, b: completion([1, 2]), lambda p, b: completion([1, 2], cand_text), stream=stream
    )
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "text", summary


@pytest.mark.parametrize(("runner_up", "kind"), [(-1.125, "mismatch"), (-1.0625, "tie")])
def test_a_margin_equal_to_the_tie_threshold_is_no_tie(runner_up: float, kind: str) -> None:
    """A tie is a margin below the threshold: a margin of exactly the threshold is a mismatch
    (both margins are exact in binary, so the comparison is not a rounding question)."""

    def baseline(path: str, body: dict) -> dict:
        ids = [1, 2, 3]
        data = completion(ids, prompt_tokens=2)
        data["choices"][0]["logprobs"] = {
            "token_ids": ids,
            "tokens": [f"<{t}>" for t in ids],
            "top_token_logprobs": [
                [{"token_id": t, "logprob": -1.0}, {"token_id": t + 1, "logprob": runner_up}] for t in ids
            ],
        }
        return data

    policy = ComparePolicy(tie_threshold=0.125, max_tie_rate=1.0)
    results, _ = against(baseline, lambda p, b: completion([1, 3, 3], prompt_tokens=2), policy=policy)
    d = results[0].divergences[0]
    assert (d.position, d.what, d.kind) == (1, "token", kind), d
    assert d.margin == -1.0 - runner_up


def test_a_candidate_that_echoes_another_prompt_than_the_one_sent_fails() -> None:
    """The baseline echoes no prompt ids, the candidate echoes ids of the right count that are
    not the prompt sent: the candidate answered another prompt."""

    def echoing(path: str, body: dict) -> dict:
        data = completion([1, 2], prompt_tokens=2)
        data["choices"][0]["prompt_token_ids"] = [5, 7]
        return data

    _, summary = against(lambda p, b: completion([1, 2], prompt_tokens=2), echoing, stream=False)
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "prompt", summary


def test_two_servers_that_echo_other_prompt_ids_for_one_text_prompt_fail() -> None:
    """A text prompt has no ids to hold an echo against, so the two echoes are held against
    each other: the same count of other ids is another prompt."""

    def echoing(prompt_ids: list[int]):
        def answer(path: str, body: dict) -> dict:
            data = completion([1, 2], prompt_tokens=2)
            data["choices"][0]["prompt_token_ids"] = prompt_ids
            return data

        return answer

    _, summary = against(echoing([5, 6]), echoing([5, 7]), prompts=[Prompt(text="a")], stream=False)
    assert summary["verdict"] == "fail" and summary["first_mismatch"] == "prompt", summary


def test_a_text_cut_short_is_located_at_the_first_token_it_lacks(tokenizer) -> None:
    """Compared by text with a tokenizer, a candidate whose text is a strict prefix of the
    baseline's diverges at the token after its last one, as a length mismatch."""
    from harness.answer import Answer
    from harness.divergence import compare_texts

    ids = tokenizer.encode(TEXT)
    short = tokenizer.decode(ids[:5])
    assert tokenizer.encode(short) == ids[:5]
    d = compare_texts(Answer(TEXT, None, "length"), Answer(short, None, "length"), tokenizer, 3, 0.1)
    assert (d.position, d.what, d.kind, d.char_position) == (3 + 5, "length", "mismatch", len(short))
    assert (d.baseline_token, d.candidate_token, d.candidate_text) == (ids[5], -1, "(end)")


def test_the_agreed_text_before_a_character_split_over_two_tokens_is_known_from_the_tokenizer(
    tokenizer,
) -> None:
    """The demo tokenizer spells `é` as two byte tokens: the agreed ids up to the first of
    them decode to `h` and a U+FFFD, which stands for no text of the baseline's. The agreed
    text is then `h`, so the candidate's text over the agreed ids is compared."""
    from harness.answer import Answer
    from harness.divergence import agreed_text, ids_round

    ids = tokenizer.encode("héllo")
    assert tokenizer.decode(ids[:2]) == "h\ufffd"
    base = Answer("héllo", ids, "length")
    assert agreed_text(base, 2, tokenizer) == "h"
    cand = Answer("h" + tokenizer.decode([ids[2] + 1]), ids[:2] + [ids[2] + 1], "length")
    divergence, agreed = ids_round(base, cand, 0, 0.1, tokenizer)
    assert agreed == 2 and (divergence.position, divergence.what) == (2, "token")
    assert not divergence.prefix_unchecked


def test_after_a_tie_the_comparison_resumes_for_the_tokens_max_tokens_leaves() -> None:
    """A tie at output position 1 of 4 settles positions 0 and 1 (the baseline's token
    there): both servers are asked for the 2 tokens left, from the prompt, the agreed token
    and the baseline's, and what they answer is compared at positions 2 and 3 (the text
    before the tie stays unchecked here: these logprobs carry no token texts)."""
    with Stub(resumable([1, 2, 3, 4], logprobs=True)) as base, Stub(resumable([1, 3, 3, 4])) as cand:
        results, summary = asyncio.run(
            compare(Endpoint(base.url), Endpoint(cand.url), [Prompt(token_ids=(5, 6))], 4, 1, TIE_TOLERANT)
        )
    asked = [([5, 6], 4), ([5, 6, 1, 2], 2)]
    assert [(b["prompt"], b["max_tokens"]) for b in cand.bodies] == asked
    assert [(b["prompt"], b["max_tokens"]) for b in base.bodies] == asked
    assert [(d.position, d.kind) for d in results[0].divergences] == [(1, "tie")]
    assert results[0].compared_tokens == 3
    assert (summary["ties"], summary["mismatches"]) == (1, 0), summary


def test_a_mismatch_after_a_tie_is_located_at_its_output_position() -> None:
    """Positions after a resumed tie count from the start of the output, not of the round."""
    with Stub(resumable([1, 2, 3, 4], logprobs=True)) as base, Stub(resumable([1, 3, 3, 9])) as cand:
        results, summary = asyncio.run(
            compare(Endpoint(base.url), Endpoint(cand.url), [Prompt(token_ids=(5, 6))], 4, 1, TIE_TOLERANT)
        )
    got = [(d.position, d.kind, d.baseline_token, d.candidate_token) for d in results[0].divergences]
    assert got == [(1, "tie", 2, 3), (3, "mismatch", 4, 9)]
    assert results[0].compared_tokens == 2 and summary["reason"] == "mismatch", summary


def test_a_tie_one_before_the_last_position_leaves_the_last_unchecked() -> None:
    """With max_tokens 3, a tie at position 1 that cannot be resumed (a chat prompt) leaves
    position 2 never compared: the candidate may have written anything there."""
    results, summary = tied_chat_run(1, [1, 3, 9])
    assert [(d.position, d.kind) for d in results[0].divergences] == [(1, "tie")]
    assert results[0].unchecked == "from position 2 on: a chat prompt cannot be extended by token ids"
    assert summary["verdict"] == "fail" and summary["reason"] == "unchecked", summary


def test_a_comparison_is_bucketed_by_the_baselines_prompt_count() -> None:
    """The baseline is the reference: its usage's prompt count places the comparison, not the
    count of a candidate that saw another prompt."""
    results, _ = against(
        lambda p, b: completion([1, 2], prompt_tokens=200),
        lambda p, b: completion([1, 2], prompt_tokens=300),
    )
    assert (results[0].prompt_tokens, results[0].context) == (200, "~128")

"""Gate: `harness compare` fails on candidates that lie in ways the registered lies
(gates/faults.py) do not cover, each run over real HTTP on loopback against an honest toy
server, whole and streamed where the lie applies:

- a lie only under some requests: only where no logprobs are asked (the candidate is never
  asked for them), only with another request in flight (caught at a level that batches,
  named per level), only for chat or token-id prompts, only after the first few requests;
- a text that differs only in trailing whitespace or unicode normalisation;
- a stream whose chunks are reordered, whose ids move between chunks, whose final usage
  names other counts, or whose `[DONE]` comes before its finish_reason;
- an answer that ignores max_tokens, ends early with `stop`, finishes with another reason,
  echoes another prompt or volunteers logprobs naming other ids;
- a chat reply whose tool call has other arguments, name or type, or none, or that
  sends another reasoning text under the second field name beside the right one, or leaves
  out a second field the baseline fills with another text;
- an HTTP 200 whose body is an error.

What a real client never sees is not a difference: events after `data: [DONE]`, and one
reasoning text under the other field name. The toy model is greedy and deterministic: each
token follows from the last three, a chat reply reasons in one token and may call a tool in
another, and every reply reports its token ids, usage and (when asked) logprobs.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness.answer import ERRORS, error_class

from .lying_server import Lie, LyingServer, Reply, send_reply, write_events

THINK, CALL = 3, 4  # the toy's reasoning token and tool-call token
MAX_TOKENS = 8
PROMPTS = [
    {"prompt": "The cache holds the keys"},
    {"prompt": "A draft model proposes a block"},
    {"messages": [{"role": "user", "content": "What is a key-value cache?"}]},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"}]},
    {"prompt": [11, 23, 5, 42, 7]},
]


def piece(token: int) -> str:
    return " " + "abcdefghijklmnopqrstuvwxyz"[token % 26] * (1 + token % 3)


def encode(text: str) -> list[int]:
    return [10 + sum(map(ord, word)) % 40 for word in text.split()] or [10]


def generate(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Greedy decoding of the toy model: it stops (EOS) after 3-9 tokens, by the prompt."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        if len(out) == 3 + len(prompt) % 7:
            return out, "stop"
        seq.append(10 + (sum(seq[-3:]) * 7 + len(seq)) % 40)
        out.append(seq[-1])
    return out, "length"


class ToyServer:
    """An honest OpenAI-compatible server of the toy model on loopback: completions (text or
    token-id prompts) and chat, whole or streamed a token a chunk (with a running usage when
    asked), token ids in every choice, prompt ids echoed, logprobs when asked. It refuses
    requests that are not greedy or carry no max_tokens, and keeps every request body.
    `both_reasoning_fields`: a chat reply also carries `reasoning`, another text."""

    def __init__(self, both_reasoning_fields: bool = False) -> None:
        self.bodies: list[dict] = []
        self.both_reasoning_fields = both_reasoning_fields
        toy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                models = {"data": [{"id": "toy", "owned_by": "reference_engine"}]}
                send_reply(self, Reply(200, json.dumps(models).encode()))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                toy.bodies.append(body)
                send_reply(self, toy.answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def answer(self, body: dict) -> Reply:
        if body.get("temperature") != 0 or not isinstance(body.get("max_tokens"), int):
            return Reply(400, b'{"error": {"message": "greedy requests with max_tokens only"}}')
        chat = "messages" in body
        if chat:
            prompt = encode(" ".join(f"{m['role']}: {m.get('content')}" for m in body["messages"]))
        else:
            prompt = list(body["prompt"]) if isinstance(body["prompt"], list) else encode(body["prompt"])
        generated, finish = generate(prompt, body["max_tokens"])
        last = str(body["messages"][-1].get("content")) if chat else ""
        thought = f"think {len(prompt)}" if chat else None
        call = {
            "id": f"call_{random.randrange(10**6)}",  # drawn per request, as servers do
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        # each generated token: (id, content piece, reasoning piece, tool call)
        tokens = [(THINK, "", thought, None)] if chat else []
        tokens += [(t, piece(t), None, None) for t in generated]
        tokens += [(CALL, "", None, call)] if "weather" in last else []
        ids = [t for t, *_ in tokens]
        text = "".join(p for _, p, _, _ in tokens)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        head = {"id": "cmpl-toy", "object": "chat.completion" if chat else "text_completion", "model": "toy"}
        logprobs = self.logprobs(tokens, chat) if body.get("logprobs") else None
        if not body.get("stream"):
            choice: dict = {"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": logprobs}
            if chat:
                message = {"role": "assistant", "content": text, "reasoning_content": thought}
                if self.both_reasoning_fields:
                    message["reasoning"] = f"{thought} aloud"
                if "weather" in last:
                    message["tool_calls"] = [call]
                choice["message"] = message
            else:
                choice["text"], choice["prompt_token_ids"] = text, prompt
            return Reply(200, json.dumps({**head, "choices": [choice], "usage": usage}).encode())
        options = body.get("stream_options") or {}
        events: list = []
        if chat:
            events.append(
                {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            )
        for k, (t, text_piece, thought_piece, call_piece) in enumerate(tokens):
            choice = {"index": 0, "token_ids": [t], "finish_reason": finish if k == len(tokens) - 1 else None}
            if chat:
                delta: dict = {"content": text_piece} if text_piece else {}
                if thought_piece:
                    delta["reasoning_content"] = thought_piece
                    if self.both_reasoning_fields:
                        delta["reasoning"] = f"{thought_piece} aloud"
                if call_piece:
                    delta["tool_calls"] = [{"index": 0, **call_piece}]
                choice["delta"] = delta
            else:
                choice["text"] = text_piece
            event = {**head, "choices": [choice]}
            if options.get("continuous_usage_stats"):
                event["usage"] = {**usage, "completion_tokens": k + 1, "total_tokens": len(prompt) + k + 1}
            events.append(event)
        if not tokens:
            events.append({**head, "choices": [{"index": 0, "text": "", "finish_reason": finish}]})
        if options.get("include_usage"):
            events.append({**head, "choices": [], "usage": usage})
        return Reply(200, write_events(events + ["[DONE]"]), "text/event-stream")

    @staticmethod
    def logprobs(tokens: list[tuple], chat: bool) -> dict:
        """Each token far ahead of the next best (id + 1): no position is a near tie."""
        tops = [[{"token_id": t, "logprob": -0.1}, {"token_id": t + 1, "logprob": -2.1}] for t, *_ in tokens]
        if chat:
            return {
                "content": [
                    {
                        "token": p,
                        "token_id": t,
                        "logprob": -0.1,
                        "top_logprobs": [{**e, "token": piece(e["token_id"])} for e in top],
                    }
                    for (t, p, _, _), top in zip(tokens, tops)
                ]
            }
        return {
            "tokens": [p for _, p, _, _ in tokens],
            "token_ids": [t for t, *_ in tokens],
            "token_logprobs": [-0.1] * len(tokens),
            "top_token_logprobs": tops,
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def toy():
    server = ToyServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("toy") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def harness_compare(baseline: str, candidate: str, prompts: Path, out: Path, *extra: str):
    """`python -m harness compare`, in this process: (exit status, summary, stderr)."""
    from harness.__main__ import main

    args = ["compare", "--baseline", baseline, "--candidate", candidate, "--prompts", str(prompts)]
    args += ["--max-tokens", str(MAX_TOKENS), "--concurrency", "1", "--out", str(out)]
    if "--server-kind" not in extra:
        args += ["--server-kind", "ours"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(args + list(extra))
    summary = json.loads((out / "compare_summary.json").read_text())
    return code, summary, err.getvalue()


def form_flag(form: str) -> str:
    return "--stream" if form == "stream" else "--no-stream"


def assert_fails_as(code: int, summary: dict, err: str, expect: tuple[str, ...]) -> None:
    """A non-zero exit named as one of `expect` ("mismatch:text", "inconsistent_answer")."""
    reason = summary["reason"]
    named = {reason, f"{reason}:{summary['first_mismatch']}"}
    assert summary["verdict"] == "fail" and named & set(expect), (named, err)
    assert code == (ERRORS[error_class(reason)][0] if summary["error"] else 1), (code, reason)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {reason}: " if summary["error"] else f"fail: {reason}: "), last
    assert "Traceback" not in err


# ------------------------------------------------------------------ the honest reference
@pytest.mark.parametrize("form", ["stream", "whole"])
def test_an_honest_proxy_of_the_toy_server_passes_and_the_candidate_is_asked_as_documented(
    toy, prompts_file, tmp_path, form: str
) -> None:
    """Every prompt exact by ids; the candidate is asked greedily, in the form asked for, and
    never for logprobs (a candidate asked for them may leave its speculative path)."""
    upstream, before = ToyServer(), len(toy.bodies)
    try:
        with LyingServer(upstream.url, None) as proxy:
            code, summary, err = harness_compare(toy.url, proxy.url, prompts_file, tmp_path, form_flag(form))
    finally:
        upstream.close()
    assert code == 0 and summary["exact"] == summary["prompts"] == len(PROMPTS), err
    assert summary["compared"] == "ids" and err.strip().splitlines()[-1].startswith("pass: ")
    assert len(upstream.bodies) == len(PROMPTS)
    for body in upstream.bodies:
        assert "logprobs" not in body and "top_logprobs" not in body, body
        assert bool(body.get("stream")) == (form == "stream") and body["temperature"] == 0, body
    assert all(body.get("logprobs") for body in toy.bodies[before:]), "the baseline is asked for logprobs"


# ------------------------------------------------------------------ lies on what is generated
def trailing_space(answer) -> None:
    answer.text += " "


def decomposed_umlaut(answer) -> None:
    """The same letters in another unicode normalisation (NFD, a + combining diaeresis)."""
    answer.text = answer.text.replace("a", "a\u0308") if "a" in answer.text else answer.text + "a\u0308"


def finish_abort(answer) -> None:
    answer.finish_reason = "abort"


def empty_stop(answer) -> None:
    answer.text, answer.token_ids, answer.finish_reason = "", [], "stop"
    if answer.usage is not None:
        answer.usage = {**answer.usage, "completion_tokens": 0}


def more_tokens(body: dict) -> dict:
    body["max_tokens"] += 3
    return body


def reversed_prompt_echo(data: dict) -> dict:
    for choice in data["choices"]:
        if choice.get("prompt_token_ids"):
            choice["prompt_token_ids"] = choice["prompt_token_ids"][::-1]
    return data


def volunteered_logprobs(data: dict) -> dict:
    for choice in data["choices"]:
        choice["logprobs"] = {"token_ids": [t + 1 for t in choice.get("token_ids") or []]}
    return data


def vllm_error_body(data: dict) -> dict:
    return {"object": "error", "message": "the engine failed", "type": "InternalServerError", "code": 500}


def error_beside_choices(data: dict) -> dict:
    return {**data, "error": {"message": "the engine failed half way"}}


def _calls(data: dict):
    for choice in data["choices"]:
        yield from (choice.get("message") or {}).get("tool_calls") or []


def other_arguments(data: dict) -> dict:
    for call in _calls(data):
        call["function"]["arguments"] = '{"city": "Rome"}'
    return data


def other_function(data: dict) -> dict:
    for call in _calls(data):
        call["function"]["name"] = "get_time"
    return data


def other_call_type(data: dict) -> dict:
    for call in _calls(data):
        call["type"] = "custom"
    return data


def no_tool_calls(data: dict) -> dict:
    for choice in data["choices"]:
        (choice.get("message") or {}).pop("tool_calls", None)
    return data


# ------------------------------------------------------------------ lies on a stream's events
def _token_events(events: list) -> list[int]:
    return [
        i
        for i, e in enumerate(events)
        if isinstance(e, dict) and any(c.get("token_ids") for c in e.get("choices") or [])
    ]


def _copy(events: list) -> list:
    return json.loads(json.dumps(events))


def swap_first_chunks(events: list) -> list:
    """The first two token chunks in the other order, running counts kept in step."""
    out, at = _copy(events), _token_events(events)
    first, second = at[0], at[1]
    out[first]["choices"], out[second]["choices"] = out[second]["choices"], out[first]["choices"]
    return out


def swap_first_ids(events: list) -> list:
    """The first two chunks' token ids swapped, their texts left where they were."""
    out, at = _copy(events), _token_events(events)
    a, b = (out[i]["choices"][0] for i in at[:2])
    a["token_ids"], b["token_ids"] = b["token_ids"], a["token_ids"]
    return out


def _final_usage(events: list, name: str) -> list:
    out = _copy(events)
    for event in out:
        if isinstance(event, dict) and event.get("usage") and not event.get("choices"):
            event["usage"][name] += 1
    return out


def final_prompt_count(events: list) -> list:
    return _final_usage(events, "prompt_tokens")


def final_completion_count(events: list) -> list:
    return _final_usage(events, "completion_tokens")


def done_before_finish(events: list) -> list:
    """`data: [DONE]` before the chunk that carries the finish_reason."""
    last = _token_events(events)[-1]
    rest = [e for i, e in enumerate(events) if i != last and e != "[DONE]"]
    return rest + ["[DONE]", events[last]]


def _second_reasoning(holder: dict) -> None:
    if holder.get("reasoning_content"):
        holder["reasoning"] = holder["reasoning_content"] + " twice"


def second_reasoning_body(data: dict) -> dict:
    """The reasoning text left as it is, and another under `reasoning` beside it."""
    for choice in data["choices"]:
        _second_reasoning(choice.get("message") or {})
    return data


def second_reasoning_events(events: list) -> list:
    out = _copy(events)
    for event in out:
        for choice in event.get("choices") or [] if isinstance(event, dict) else []:
            _second_reasoning(choice.get("delta") or {})
    return out


# name -> (lie, what harness compare must name it)
LIES = {
    "trailing_whitespace": Lie("a space after the text", ("mismatch:text",), answer=trailing_space),
    "unicode_normalisation": Lie(
        "the text in another unicode normalisation", ("mismatch:text",), answer=decomposed_umlaut
    ),
    "finish_abort": Lie("finish_reason abort", ("mismatch:finish_reason",), answer=finish_abort),
    "empty_stop": Lie("nothing generated, finish_reason stop", ("mismatch:length",), answer=empty_stop),
    "ignores_max_tokens": Lie(
        "max_tokens ignored", ("mismatch:length", "mismatch:finish_reason"), request=more_tokens
    ),
    "reversed_prompt_echo": Lie("another prompt echoed", ("mismatch:prompt",), body=reversed_prompt_echo),
    "volunteered_logprobs": Lie(
        "logprobs naming other ids", ("inconsistent_answer",), body=volunteered_logprobs
    ),
    "vllm_error_body": Lie(
        "HTTP 200 with an error body, no choices", ("malformed_body",), body=vllm_error_body
    ),
    "error_beside_choices": Lie(
        "HTTP 200 with an error beside the choices", ("error_object",), body=error_beside_choices
    ),
    "other_tool_arguments": Lie(
        "a tool call's other arguments", ("mismatch:tool_calls",), body=other_arguments
    ),
    "other_tool_function": Lie("a tool call's other function", ("mismatch:tool_calls",), body=other_function),
    "other_tool_type": Lie("a tool call's other type", ("mismatch:tool_calls",), body=other_call_type),
    "tool_call_dropped": Lie("the tool call left out", ("mismatch:tool_calls",), body=no_tool_calls),
    "chunks_reordered": Lie("two token chunks reordered", ("mismatch:token",), events=swap_first_chunks),
    "ids_moved_between_chunks": Lie("two chunks' ids swapped", ("mismatch:ids_text",), events=swap_first_ids),
    "final_prompt_count": Lie(
        "the final usage's prompt count", ("mismatch:prompt",), events=final_prompt_count
    ),
    "final_completion_count": Lie(
        "the final usage's completion count", ("inconsistent_answer",), events=final_completion_count
    ),
    "done_before_finish": Lie(
        "[DONE] before the finish_reason", ("truncated_stream",), events=done_before_finish
    ),
    "second_reasoning_text": Lie(
        "another reasoning text under `reasoning` beside the right `reasoning_content`",
        ("mismatch:reasoning",),
        body=second_reasoning_body,
        events=second_reasoning_events,
    ),
}
CASES = [(name, form) for name in LIES for form in LIES[name].forms]


@pytest.mark.parametrize(("lie", "form"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_the_gate_fails_on_a_candidate_that_lies(toy, prompts_file, tmp_path, lie: str, form: str) -> None:
    with LyingServer(toy.url, LIES[lie]) as liar:
        code, summary, err = harness_compare(toy.url, liar.url, prompts_file, tmp_path, form_flag(form))
    assert_fails_as(code, summary, err, LIES[lie].expect)


# ------------------------------------------------------------------ lies under some requests only
_request = threading.local()  # the request a LyingServer thread is answering


def change_last_id(answer) -> None:
    """The right text behind another last token id (usage in step)."""
    if answer.token_ids:
        answer.token_ids = answer.token_ids[:-1] + [answer.token_ids[-1] + 1]


def lying_when(decide) -> Lie:
    """A lie (`change_last_id`) told only where `decide(body)` says so, the request otherwise
    forwarded as it came."""

    def request(body: dict) -> dict:
        _request.lies = decide(body)
        return body

    def answer(edit) -> None:
        if _request.lies:
            change_last_id(edit)

    return Lie("a lie under some requests only", ("mismatch:ids_text",), request=request, answer=answer)


@pytest.mark.parametrize("form", ["stream", "whole"])
def test_a_candidate_honest_only_when_asked_for_logprobs_fails(
    toy, prompts_file, tmp_path, form: str
) -> None:
    """The gate asks only the baseline for logprobs, so the candidate is seen on the path a
    client takes without them."""
    liar_lie = lying_when(lambda body: not body.get("logprobs"))
    with LyingServer(toy.url, liar_lie) as liar:
        code, summary, err = harness_compare(toy.url, liar.url, prompts_file, tmp_path, form_flag(form))
    assert_fails_as(code, summary, err, ("mismatch:ids_text",))
    assert summary["mismatches"] == len(PROMPTS), summary


@pytest.mark.parametrize(
    ("kind", "source_line"),
    [("chat", 3), ("ids", 5), ("text", 1)],
)
def test_a_candidate_lying_for_one_kind_of_prompt_only_fails_on_that_prompt(
    toy, prompts_file, tmp_path, kind: str, source_line: int
) -> None:
    def kind_of(body: dict) -> str:
        return "chat" if "messages" in body else "ids" if isinstance(body["prompt"], list) else "text"

    with LyingServer(toy.url, lying_when(lambda body: kind_of(body) == kind)) as liar:
        code, summary, err = harness_compare(toy.url, liar.url, prompts_file, tmp_path)
    assert_fails_as(code, summary, err, ("mismatch:ids_text",))
    rows = [json.loads(line) for line in (tmp_path / "compare.jsonl").read_text().splitlines()]
    differ = {r["source"]: r["prompt"] for r in rows if r["divergences"]}
    assert f"{prompts_file}:{source_line}" in differ, differ
    named = {"messages": "chat", "token_ids": "ids", "text": "text"}
    assert {named[next(iter(prompt))] for prompt in differ.values()} == {kind}, differ


def test_a_candidate_honest_for_its_first_requests_only_fails(toy, prompts_file, tmp_path) -> None:
    seen = []
    lock = threading.Lock()

    def after_three(body: dict) -> bool:
        with lock:
            seen.append(body)
            return len(seen) > 3

    with LyingServer(toy.url, lying_when(after_three)) as liar:
        code, summary, err = harness_compare(toy.url, liar.url, prompts_file, tmp_path)
    assert_fails_as(code, summary, err, ("mismatch:ids_text",))
    assert summary["mismatches"] == len(PROMPTS) - 3 and summary["exact"] == 3, summary


def test_a_candidate_that_lies_only_under_concurrent_load_fails_at_that_level(
    toy, prompts_file, tmp_path
) -> None:
    """Every prompt at each level: alone at c=1 the candidate is honest, with other requests
    in flight it is not, and the summary says at which level the answers differ."""
    lock, in_flight = threading.Lock(), [0]

    def arrive(body: dict) -> dict:
        with lock:
            in_flight[0] += 1
            _request.lies = in_flight[0] > 1
        time.sleep(0.1)  # held long enough for the requests of one level to meet
        return body

    def leave(reply: Reply, previous) -> Reply:
        with lock:
            in_flight[0] -= 1
        return reply

    def answer(edit) -> None:
        if _request.lies:
            change_last_id(edit)

    crowded = Lie("a lie under load", ("mismatch:ids_text",), request=arrive, answer=answer, reply=leave)
    with LyingServer(toy.url, crowded) as liar:
        code, summary, err = harness_compare(
            toy.url, liar.url, prompts_file, tmp_path, "--concurrency", "1,4"
        )
    assert_fails_as(code, summary, err, ("mismatch:ids_text",))
    levels = summary["by_concurrency"]
    assert levels["1"]["exact"] == len(PROMPTS) and levels["1"]["mismatches"] == 0, levels
    assert levels["4"]["mismatches"] > 0, levels
    assert "at c=4" in err.strip().splitlines()[-1]


# ------------------------------------------------------------------ what a client never sees
def events_after_done(events: list) -> list:
    """A token chunk repeated after `data: [DONE]`: a client stops reading at [DONE]."""
    return events + [events[_token_events(events)[0]]]


def reasoning_renamed(data: dict) -> dict:
    for choice in data["choices"]:
        message = choice.get("message") or {}
        if "reasoning_content" in message:
            message["reasoning"] = message.pop("reasoning_content")
    return data


@pytest.mark.parametrize(
    ("lie", "form"),
    [
        (Lie("after [DONE]", (), events=events_after_done), "stream"),
        (Lie("renamed", (), body=reasoning_renamed), "whole"),
    ],
    ids=["events-after-done", "reasoning-under-the-other-name"],
)
def test_what_a_client_never_reads_differently_is_no_difference(
    toy, prompts_file, tmp_path, lie: Lie, form: str
) -> None:
    with LyingServer(toy.url, lie) as proxy:
        code, summary, err = harness_compare(toy.url, proxy.url, prompts_file, tmp_path, form_flag(form))
    assert code == 0 and summary["exact"] == len(PROMPTS), err


# ------------------------------------------------------------------ a baseline's two reasoning texts
def one_reasoning_field(data: dict) -> dict:
    for choice in data["choices"]:
        (choice.get("message") or {}).pop("reasoning", None)
    return data


def test_a_candidate_that_drops_a_reasoning_field_the_baseline_fills_differently_fails(
    prompts_file, tmp_path
) -> None:
    """docs/harness-compare.md: where a side sends both reasoning fields with different texts,
    each field is compared as its own; the candidate's missing `reasoning` cannot then agree
    with the baseline's own text there."""
    toy = ToyServer(both_reasoning_fields=True)
    try:
        with LyingServer(toy.url, Lie("one field", (), body=one_reasoning_field)) as liar:
            code, summary, err = harness_compare(toy.url, liar.url, prompts_file, tmp_path, "--no-stream")
    finally:
        toy.close()
    assert_fails_as(code, summary, err, ("mismatch:reasoning",))

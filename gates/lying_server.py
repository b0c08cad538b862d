"""A lying candidate, for the HTTP gate's own tests: a real HTTP server on loopback that
forwards every request to an honest server and applies one named lie (`LIES` in
gates/faults.py) to what goes there or comes back. `harness compare` against it must fail
with a named verdict; without a lie it is the honest server and must pass.

A lie edits one or more of: the request as forwarded (`request`), the generated answer
(`answer`: text, token ids, finish_reason, usage, whole or streamed alike), a whole reply's
JSON (`body`), a stream's events (`events`, the `[DONE]` marker included as a string), or the
raw reply (`reply`, given the previous honest reply of the same path and form, whole or
streamed). A lie may also answer a request itself instead of forwarding it (`refuse`) and
edit what GET requests return (`get`: what the server says about itself, which the
harness's probe reads); otherwise GET requests pass untouched. `args` are the `harness
compare` arguments a lie is run with (a lie to the probe needs `--server-kind auto`).

    with LyingServer(honest.url, LIES["one_token_short"], tokenizer) as liar:
        ...  # harness compare --candidate liar.url
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from harness.sse import event_data


@dataclass
class Answer:
    """What the honest server generated, for a lie to edit in place."""

    text: str
    token_ids: list[int] | None
    finish_reason: str | None
    usage: dict | None
    prompt_token_ids: list[int] | None = None  # echoed (whole completions only)
    decode: Callable[[list[int]], str] | None = None  # the model's detokenizer, when given
    reasoning: str | None = None  # chat only: reasoning_content
    tool_calls: list[dict] | None = None  # chat only: as a whole message carries them


@dataclass(frozen=True)
class Reply:
    status: int
    content: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class Lie:
    description: str
    expect: tuple[str, ...]  # the verdict reasons harness compare may name ("mismatch:length")
    request: Callable[[dict], dict] | None = None
    answer: Callable[[Answer], None] | None = None
    body: Callable[[dict], dict | bytes] | None = None
    events: Callable[[list], list] | None = None
    reply: Callable[[Reply, Reply | None], Reply] | None = None
    refuse: Callable[[dict], Reply | None] | None = None  # a reply instead of forwarding (None: forward)
    get: Callable[[str, Reply], Reply] | None = None  # (path, honest reply) -> the reply to a GET
    args: tuple[str, ...] = ()  # harness compare arguments to run it with

    @property
    def forms(self) -> tuple[str, ...]:
        """The reply forms it lies in: `whole`, `stream` or both."""
        both = self.request or self.answer or self.reply or self.refuse
        return tuple(f for f, hook in (("whole", self.body), ("stream", self.events)) if both or hook)


# ------------------------------------------------------------------ reading and writing replies
def parse_events(content: bytes) -> list:
    """A stream's events (split as a client splits them, harness/sse.py): dicts, and strings
    for what is not JSON ([DONE])."""
    out = []
    for data in event_data(content):
        try:
            out.append(json.loads(data))
        except ValueError:
            out.append(data)
    return out


def write_events(events: list) -> bytes:
    """Each event as one `data:` line and a blank line; an event given as a tuple is sent as
    one `data:` line per item, all in one event (no blank line between them)."""

    def data(e) -> str:
        return e if isinstance(e, str) else json.dumps(e)

    return "".join(
        "".join(f"data: {data(item)}\n" for item in (e if isinstance(e, tuple) else (e,))) + "\n"
        for e in events
    ).encode()


def fold(events: list, chat: bool) -> Answer:
    """A stream's events as one answer."""
    answer = Answer("", None, None, None)
    for event in events:
        if not isinstance(event, dict):
            continue
        if event.get("usage") is not None:
            answer.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") if chat else choice.get("text")
            answer.text += piece or ""
            if chat and delta.get("reasoning_content"):
                answer.reasoning = (answer.reasoning or "") + delta["reasoning_content"]
            if chat and delta.get("tool_calls"):
                answer.tool_calls = (answer.tool_calls or []) + delta["tool_calls"]
            if choice.get("token_ids") is not None:
                answer.token_ids = (answer.token_ids or []) + list(choice["token_ids"])
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    return answer


def unfold(answer: Answer, events: list, chat: bool) -> list:
    """One answer as a stream: one chunk with every token, a usage chunk, [DONE]."""
    first = next((e for e in events if isinstance(e, dict)), {})
    head = {k: v for k, v in first.items() if k not in ("choices", "usage")}
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": answer.finish_reason}
    if chat:
        choice["delta"] = {"role": "assistant", "content": answer.text}
        if answer.reasoning is not None:
            choice["delta"]["reasoning_content"] = answer.reasoning
        if answer.tool_calls is not None:
            # a stream's calls keep the index they came with; a whole message's get their place
            choice["delta"]["tool_calls"] = [{"index": k, **c} for k, c in enumerate(answer.tool_calls)]
    else:
        choice["text"] = answer.text
    if answer.token_ids is not None:
        choice["token_ids"] = answer.token_ids
    out = [{**head, "choices": [choice]}]
    if answer.usage is not None:
        out.append({**head, "choices": [], "usage": answer.usage})
    return out + ["[DONE]"]


def edit_whole(
    data: dict, chat: bool, edit: Callable[[Answer], None], decode: Callable[[list[int]], str] | None
) -> dict:
    """Apply an answer edit to a whole reply's only choice."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return data
    choice = choices[0]
    message = choice.get("message") or {}
    answer = Answer(
        message["content"] if chat else choice["text"],
        choice.get("token_ids"),
        choice.get("finish_reason"),
        data.get("usage"),
        choice.get("prompt_token_ids"),
        decode,
        message.get("reasoning_content"),
        message.get("tool_calls"),
    )
    edit(answer)
    if chat:
        message["content"] = answer.text
        for key, value in (("reasoning_content", answer.reasoning), ("tool_calls", answer.tool_calls)):
            if value is not None or key in message:
                message[key] = value
    else:
        choice["text"] = answer.text
        choice["prompt_token_ids"] = answer.prompt_token_ids
    choice["token_ids"], choice["finish_reason"] = answer.token_ids, answer.finish_reason
    data["usage"] = answer.usage
    return data


def send_reply(handler: BaseHTTPRequestHandler, reply: Reply) -> None:
    handler.send_response(reply.status)
    handler.send_header("Content-Type", reply.content_type)
    handler.send_header("Content-Length", str(len(reply.content)))
    handler.end_headers()
    handler.wfile.write(reply.content)


def send_answer(handler: BaseHTTPRequestHandler, request: dict, data: dict) -> None:
    """Send the whole completion `data`, or as a stream when the request asked for one (for
    scripted servers)."""
    if not request.get("stream"):
        send_reply(handler, Reply(200, json.dumps(data).encode()))
        return
    choice = data["choices"][0]
    chat = "message" in choice
    message = choice.get("message") or {}
    answer = Answer(
        message["content"] if chat else choice["text"],
        choice.get("token_ids"),
        choice.get("finish_reason"),
        data.get("usage"),
        reasoning=message.get("reasoning_content"),
        tool_calls=message.get("tool_calls"),
    )
    send_reply(handler, Reply(200, write_events(unfold(answer, [data], chat)), "text/event-stream"))


# ------------------------------------------------------------------ the server
class LyingServer:
    """Forwards to `upstream`, lying with `lie` (None: honest)."""

    def __init__(self, upstream: str, lie: Lie | None, tokenizer=None) -> None:
        self.upstream, self.lie = upstream.rstrip("/"), lie
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.previous: dict[tuple, Reply] = {}  # (path, streamed) -> the last honest reply
        self.lock = threading.Lock()
        self.client = httpx.Client(timeout=120)
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                r = liar.client.get(liar.upstream + self.path)
                reply = Reply(r.status_code, r.content, r.headers.get("content-type", "application/json"))
                if liar.lie is not None and liar.lie.get is not None:
                    reply = liar.lie.get(self.path, reply)
                send_reply(self, reply)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                send_reply(self, liar.answer(self.path, body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def answer(self, path: str, body: dict) -> Reply:
        lie = self.lie
        refused = lie.refuse(body) if lie is not None and lie.refuse is not None else None
        if refused is not None:
            return refused
        if lie is not None and lie.request is not None:
            body = lie.request(json.loads(json.dumps(body)))
        r = self.client.post(self.upstream + path, json=body)
        honest = Reply(r.status_code, r.content, r.headers.get("content-type", "application/json"))
        with self.lock:
            form = (path, bool(body.get("stream")))
            previous, self.previous[form] = self.previous.get(form), honest
        if lie is None:
            return honest
        reply = honest
        chat = path.endswith("/chat/completions")
        if r.status_code == 200 and body.get("stream"):
            events = parse_events(r.content)
            if lie.answer is not None:
                answer = fold(events, chat)
                answer.decode = self.decode
                lie.answer(answer)
                events = unfold(answer, events, chat)
            if lie.events is not None:
                events = lie.events(events)
            reply = Reply(200, write_events(events), "text/event-stream")
        elif r.status_code == 200:
            data = r.json()
            if lie.answer is not None:
                data = edit_whole(data, chat, lie.answer, self.decode)
            if lie.body is not None:
                data = lie.body(data)
            reply = Reply(200, data if isinstance(data, bytes) else json.dumps(data).encode())
        if lie.reply is not None:
            reply = lie.reply(reply, previous)
        return reply

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def __enter__(self) -> LyingServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ lies (registered in faults.py)
def _consistent(answer: Answer) -> None:
    """Keep the text and the usage in step with the token ids (a careful liar)."""
    if answer.decode is not None and answer.token_ids is not None:
        answer.text = answer.decode(answer.token_ids)
    if answer.usage is not None and answer.token_ids is not None:
        answer.usage = {**answer.usage, "completion_tokens": len(answer.token_ids)}


def change_text(answer: Answer) -> None:
    text = answer.text or " "
    k = len(text) // 2
    answer.text = text[:k] + ("x" if text[k] != "x" else "y") + text[k + 1 :]


def change_first_id(answer: Answer) -> None:
    if answer.token_ids:
        answer.token_ids = [answer.token_ids[0] + 1] + answer.token_ids[1:]


def change_reasoning(answer: Answer) -> None:
    """A chat reply's reasoning text changed by one character, or added where it had none
    (completions carry none: left as they are)."""
    text = answer.reasoning
    if text:
        k = len(text) // 2
        answer.reasoning = text[:k] + ("x" if text[k] != "x" else "y") + text[k + 1 :]
    else:
        answer.reasoning = "Let me think."


def add_tool_call(answer: Answer) -> None:
    """A tool call added to a chat reply (completions carry none: left as they are)."""
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    answer.tool_calls = (answer.tool_calls or []) + [call]


def withhold_ids(answer: Answer) -> None:
    """Another first token id behind the same text, the ids and the usage withheld (what is
    left to compare is the text alone)."""
    change_first_id(answer)
    answer.token_ids, answer.usage = None, None


def other_first_token(answer: Answer) -> None:
    """Another first token, far from the honest one (text and usage agree)."""
    if answer.token_ids:
        answer.token_ids = [answer.token_ids[0] ^ 0x55] + answer.token_ids[1:]
        _consistent(answer)


def drop_last_token(answer: Answer) -> None:
    if answer.token_ids:
        answer.token_ids = answer.token_ids[:-1]
        _consistent(answer)
    else:
        answer.text = answer.text[:-1]


def repeat_last_token(answer: Answer) -> None:
    if answer.token_ids:
        answer.token_ids = answer.token_ids + answer.token_ids[-1:]
        _consistent(answer)
    else:
        answer.text += answer.text[-1:] or "x"


def flip_finish_reason(answer: Answer) -> None:
    answer.finish_reason = "stop" if answer.finish_reason == "length" else "length"


def usage_one_more(answer: Answer) -> None:
    n = len(answer.token_ids) if answer.token_ids is not None else 0
    answer.usage = {**(answer.usage or {}), "completion_tokens": n + 1}


def prompt_one_more(answer: Answer) -> None:
    usage = answer.usage or {}
    answer.usage = {**usage, "prompt_tokens": (usage.get("prompt_tokens") or 0) + 1}
    if answer.prompt_token_ids is not None:
        answer.prompt_token_ids = answer.prompt_token_ids + answer.prompt_token_ids[-1:]


def other_prompt(body: dict) -> dict:
    if "messages" in body:
        body["messages"][-1]["content"] = "Also: " + str(body["messages"][-1].get("content"))
    elif isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][1:] if len(body["prompt"]) > 1 else body["prompt"] * 2
    else:
        body["prompt"] = "Also: " + body["prompt"]
    return body


def empty_choices_body(data: dict) -> dict:
    return {**data, "choices": []}


def empty_choices_events(events: list) -> list:
    return [{**e, "choices": []} if isinstance(e, dict) else e for e in events]


def error_body(data: dict) -> dict:
    return {"error": {"message": "the engine failed", "type": "server_error", "code": 500}}


def error_events(events: list) -> list:
    content = [i for i, e in enumerate(events) if isinstance(e, dict) and e.get("choices")]
    at = content[-1] if content else 0
    return events[:at] + [error_body({})] + events[at + 1 :]


def two_choices_body(data: dict) -> dict:
    choices = data.get("choices") or []
    return {**data, "choices": choices + [{**c, "index": 1} for c in choices]}


def two_choices_events(events: list) -> list:
    return [two_choices_body(e) if isinstance(e, dict) and e.get("choices") else e for e in events]


def split_choices_events(events: list) -> list:
    """Every token chunk after the first moved to choice index 1: the honest tokens, in order,
    sent as two choices of which the one asked for is cut short."""
    content = _content_events(events)
    out = list(events)
    for at in content[1:]:
        out[at] = {**out[at], "choices": [{**c, "index": 1} for c in out[at]["choices"]]}
    return out


def null_text_body(data: dict) -> dict:
    for choice in data.get("choices") or []:
        for holder, key in (
            (choice.get("message"), "content"),
            (choice.get("delta"), "content"),
            (choice, "text"),
        ):
            if isinstance(holder, dict) and key in holder:
                holder[key] = 7 if key == "content" else None
                break
    return data


def null_text_events(events: list) -> list:
    return [null_text_body(e) if isinstance(e, dict) else e for e in events]


def _content_events(events: list) -> list[int]:
    return [
        i
        for i, e in enumerate(events)
        if isinstance(e, dict)
        and any(
            c.get("token_ids") or c.get("text") or (c.get("delta") or {}).get("content")
            for c in e.get("choices") or []
        )
    ]


def duplicate_chunk(events: list) -> list:
    content = _content_events(events)
    at = content[0] if content else 0
    return events[: at + 1] + events[at:]


def drop_chunk(events: list) -> list:
    content = _content_events(events)
    if len(content) < 2:
        return events
    return events[: content[0]] + events[content[0] + 1 :]


def tokens_after_finish(events: list) -> list:
    content = _content_events(events)
    if not content:
        return events
    extra = json.loads(json.dumps(events[content[-1]]))
    for choice in extra["choices"]:
        choice["finish_reason"] = None
    return events[: content[-1] + 1] + [extra] + events[content[-1] + 1 :]


def usage_a_chunk_late(events: list) -> list:
    """Each token chunk's running usage (continuous_usage_stats) is the count before its own
    tokens; the final usage chunk stays right."""
    out, before = [], 0
    for event in events:
        running = event.get("usage") if isinstance(event, dict) and event.get("choices") else None
        if running is not None and running.get("completion_tokens") is not None:
            event = json.loads(json.dumps(event))
            event["usage"]["completion_tokens"], before = before, running["completion_tokens"]
        out.append(event)
    return out


def two_chunks_in_one_event(events: list) -> list:
    """The first two token chunks as two `data:` lines of one event: a client joins them into
    one data text, which is not JSON."""
    content = _content_events(events)
    if len(content) < 2:
        return events
    first, second = content[:2]
    joined = (events[first], events[second])
    return events[:first] + [joined] + events[first + 1 : second] + events[second + 1 :]


def cut_body(data: dict) -> bytes:
    text = json.dumps(data).encode()
    return text[: len(text) // 2]


def cut_stream(events: list) -> list:
    """End the stream before the event that carries the finish_reason (and no [DONE])."""
    at = next(
        (
            i
            for i, e in enumerate(events)
            if isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices") or [])
        ),
        len(events),
    )
    return events[:at]


def refuse_token_id_prompts(body: dict) -> Reply | None:
    """HTTP 400 for a completions prompt of token ids, as a server that takes text only."""
    if isinstance(body.get("prompt"), list):
        return Reply(400, json.dumps({"error": {"message": "prompt must be a string"}}).encode())
    return None


def hide_server_kind(path: str, reply: Reply) -> Reply:
    """Say nothing about what the server is: no owner in /v1/models, no /metrics (the probe
    then takes it for a plain OpenAI server and asks whether it takes token-id prompts)."""
    if path.startswith("/metrics"):
        return Reply(404, b'{"detail": "Not Found"}')
    if path.startswith("/v1/models") and reply.status == 200:
        data = json.loads(reply.content)
        for model in data.get("data") or []:
            model["owned_by"] = "organization-owner"
        return Reply(200, json.dumps(data).encode())
    return reply


def not_json(reply: Reply, previous: Reply | None) -> Reply:
    return Reply(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")


def http_500(reply: Reply, previous: Reply | None) -> Reply:
    return Reply(500, json.dumps(error_body({})).encode())


def stale_answer(reply: Reply, previous: Reply | None) -> Reply:
    """The answer to the request before (as a batch slot mix-up would give)."""
    return previous if previous is not None else reply

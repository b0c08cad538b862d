"""One greedy answer from an OpenAI-compatible server, read strictly: what it generated (the
text, the token ids when the server reports them, the finish_reason, the usage counts; in a
chat reply also the reasoning text and the tool calls) or the named reason why the reply is
not an answer.

`harness compare` reads every reply through here, whole (`/v1/completions` or
`/v1/chat/completions` JSON) or streamed (SSE, assembled chunk by chunk). A reply that is not
an answer raises `AnswerError` with one of these names, never a Python exception of another
kind; each class has its own exit status (see `ERRORS`):

    http_NNN             the server answered HTTP NNN instead of 200 (class http_error)
    connection_error     no connection, or it broke before a reply
    timeout              no reply within the timeout
    malformed_body       not JSON, or not an answer's shape: no `choices` list, a choice that
                         is not an object, text that is not a string, ids that are not
                         integers, more than the one choice asked for (in a stream also
                         chunks of an index other than 0: a second choice), a body or stream cut
                         mid-way, tokens after the finish_reason, another finish_reason
                         after the first, token ids in some chunks only, an answer without
                         a finish_reason
    empty_choices        `choices: []` (in a stream: no event carried a choice)
    error_object         HTTP 200 with an `error` object (in a stream: an error event)
    truncated_stream     a stream that ended before a finish_reason
    inconsistent_answer  the answer contradicts itself: usage.completion_tokens is not the
                         number of token ids (a stream's running count: the ids up to and
                         including its chunk), usage.prompt_tokens is not the number of
                         echoed prompt ids, logprobs name other token ids than the answer
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from .client import REASONING_FIELDS, Endpoint
from .sse import event_data, server_error

# error class -> (exit status of `harness compare`, what it means); 0 is a pass, 1 a
# difference between the answers, 2 bad arguments
ERRORS: dict[str, tuple[int, str]] = {
    "no_usable_prompts": (3, "nothing to compare"),
    "http_error": (4, "http_NNN: a server answered HTTP NNN"),
    "connection_error": (5, "a server could not be reached"),
    "timeout": (6, "no reply within --timeout"),
    "malformed_body": (7, "not JSON, or not an answer's shape"),
    "empty_choices": (8, "HTTP 200 with choices: []"),
    "error_object": (9, "HTTP 200 with an error object (or an error event in a stream)"),
    "truncated_stream": (10, "a stream ended before its finish_reason"),
    "inconsistent_answer": (11, "an answer contradicts itself (usage counts, logprob ids)"),
    "missing_ids": (12, "a server whose kind returns token ids sent an answer without them"),
    "resume_conflict": (
        13,
        "--resume of a folder whose rows were compared against other servers or settings",
    ),
}


def error_class(name: str) -> str:
    """`http_500` -> `http_error`; every other name is its own class."""
    return "http_error" if name.startswith("http_") else name


class AnswerError(Exception):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


@dataclass(frozen=True)
class Ask:
    """One request: a completion of `prompt` (text or token ids) or a chat reply to
    `messages`, at most `max_tokens` tokens, greedy."""

    max_tokens: int
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def key(self) -> str:
        return json.dumps([self.max_tokens, self.prompt, self.messages], sort_keys=True)


@dataclass
class Answer:
    text: str
    ids: list[int] | None  # the generated token ids, when the server reports them
    finish_reason: str
    completion_tokens: int | None = None  # usage, when reported
    prompt_tokens: int | None = None
    prompt_ids: list[int] | None = None  # the prompt's token ids, when echoed
    logprobs: dict | None = None  # as the server sent them (asked of the baseline only)
    # chat only: each REASONING_FIELDS field's text, absent when the server sent none, null
    # or "" (the three read the same)
    reasoning: dict[str, str] = field(default_factory=dict)
    # chat only: the reasoning a client reads, the first non-empty REASONING_FIELDS field of
    # each message or delta, joined (a stream that sends a piece under one name and the next
    # under the other reads as both pieces)
    reasoning_seen: str = ""
    # chat only: the tool calls in order, each {"type", "name", "arguments"} (a stream's
    # pieces joined); [] for none, null or absent. The call ids are left out: servers draw
    # them at random per request
    tool_calls: list[dict] = field(default_factory=list)

    def generated(self) -> tuple:
        """Everything generated as text: content, reasoning (as a client reads it, and by
        field) and tool calls."""
        return self.text, self.reasoning_seen, self.reasoning, self.tool_calls


def takes_ids(endpoint: Endpoint) -> bool:
    """Whether token-id prompts can be sent (as ids, or decoded by the tokenizer)."""
    return endpoint.accepts.prompt_ids or endpoint.tokenizer is not None


def request_body(endpoint: Endpoint, ask: Ask, logprobs: bool, stream: bool) -> dict:
    body: dict = {"max_tokens": ask.max_tokens, "temperature": 0, **endpoint.accepts.extras(ignore_eos=False)}
    if ask.chat:
        body["messages"] = list(ask.messages)
    elif isinstance(ask.prompt, tuple) and not endpoint.accepts.prompt_ids:
        if endpoint.tokenizer is None:
            raise ValueError(
                f"{endpoint.base_url} ({endpoint.accepts.name}) takes no token-id "
                "prompts: give text prompts or --tokenizer"
            )
        body["prompt"] = endpoint.tokenizer.decode(list(ask.prompt))
    else:
        body["prompt"] = list(ask.prompt) if isinstance(ask.prompt, tuple) else ask.prompt
    if endpoint.model:
        body["model"] = endpoint.model
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": 2} if ask.chat else {"logprobs": 2})
    if stream:  # with a running count where the server keeps one (each chunk's is checked)
        body.update(stream=True, stream_options=endpoint.accepts.stream_options())
    return body


async def ask_server(
    client: httpx.AsyncClient, endpoint: Endpoint, ask: Ask, logprobs: bool, stream: bool
) -> Answer:
    """Send one request and read the reply; raises AnswerError when it is not an answer."""
    path = "/v1/chat/completions" if ask.chat else "/v1/completions"
    body = request_body(endpoint, ask, logprobs, stream)
    url = endpoint.base_url.rstrip("/") + path
    try:  # the client's timeout bounds each wait for a byte and the whole reply
        r = await asyncio.wait_for(
            client.post(url, json=body, headers=endpoint.headers()), client.timeout.read
        )
    except (httpx.TimeoutException, asyncio.TimeoutError):
        raise AnswerError("timeout", f"no reply within {client.timeout.read} s") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        name = "truncated_stream" if stream else "malformed_body"
        raise AnswerError(name, f"the reply was cut short ({exc})") from None
    except httpx.HTTPError as exc:
        raise AnswerError("connection_error", f"{type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise AnswerError(f"http_{r.status_code}", f"HTTP {r.status_code}: {r.text[:200]!r}")
    try:
        return read_stream(r.content, ask.chat) if stream else read_whole(r.content, ask.chat)
    except (LookupError, TypeError, ValueError, AttributeError) as exc:  # a shape not foreseen
        raise AnswerError("malformed_body", f"unreadable ({type(exc).__name__}: {exc})") from None


def read_whole(content: bytes, chat: bool) -> Answer:
    """A whole (non-streamed) completion or chat completion."""
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        raise AnswerError("malformed_body", f"not JSON: {content[:120]!r}") from None
    if not isinstance(data, dict):
        raise AnswerError("malformed_body", f"a JSON {type(data).__name__}, not an object")
    _no_error(data, "an error object with HTTP 200")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise AnswerError("malformed_body", f"no choices list (keys: {sorted(data)[:8]})")
    if not choices:
        raise AnswerError("empty_choices", "HTTP 200 with choices: []")
    choice = _one_choice(choices, "the body")
    reasoning: dict[str, str] = {}
    tool_calls: dict[int, dict] = {}
    if chat:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise AnswerError("malformed_body", "a chat choice without a message object")
        text = _text(message.get("content"), "message.content", none_ok=True)
        reasoning = _reasoning(message, "message")
        _tool_calls(message.get("tool_calls"), "message.tool_calls", tool_calls)
    else:
        text = _text(choice.get("text"), "choice text")
    ids = _ids(choice.get("token_ids"), "token_ids")
    logprobs = choice.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, dict):
        raise AnswerError("malformed_body", "logprobs is not an object")
    finish = choice.get("finish_reason")
    if not isinstance(finish, str) or not finish:
        raise AnswerError("malformed_body", f"finish_reason {finish!r}, not a reason")
    completion, prompt = _usage(data.get("usage"))
    prompt_ids = _ids(choice.get("prompt_token_ids", data.get("prompt_token_ids")), "prompt_token_ids")
    logprob_ids = _logprob_ids(logprobs)
    if ids is None:
        ids = logprob_ids
    elif logprob_ids is not None and logprob_ids != ids:
        raise AnswerError(
            "inconsistent_answer", f"logprobs name token ids {logprob_ids[:8]}..., the answer {ids[:8]}..."
        )
    answer = Answer(text, ids, finish, completion, prompt, prompt_ids, logprobs)
    answer.reasoning, answer.tool_calls = reasoning, _joined_calls(tool_calls)
    answer.reasoning_seen = _seen(reasoning)
    return _consistent(answer)


def read_stream(body: bytes | str, chat: bool) -> Answer:
    """A streamed answer: its events (split as a real SSE client splits them, sse.py) up to
    `data: [DONE]` (a stream that ends after its finish_reason without [DONE], as plain
    OpenAI servers do, is whole)."""
    events, datas, done = [], event_data(body), False
    for data in datas:
        if data.strip() == "[DONE]":  # padded with spaces: still the end
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            raise AnswerError("malformed_body", f"event {len(events)} is not JSON: {data[:120]!r}") from None
        if not isinstance(event, dict):
            raise AnswerError("malformed_body", f"event {len(events)} is not an object")
        _no_error(event, "an error event in the stream")
        events.append(event)
    if not datas:
        raise AnswerError("malformed_body", f"not an event stream (no event ended): {body[:120]!r}")
    pieces, ids, finish = [], [], None
    reasoning: dict[str, list[str]] = {}  # field -> its pieces
    seen: list[str] = []  # each delta's reasoning as a client reads it
    tool_calls: dict[int, dict] = {}  # index -> the call's pieces so far
    with_ids = without_ids = False
    completion = prompt = None
    chosen = 0
    for n, event in enumerate(events):
        if event.get("usage") is not None:
            completion, prompt = _usage(event["usage"])
        choices = event.get("choices", [] if "usage" in event else None)
        if not isinstance(choices, list):
            raise AnswerError("malformed_body", f"event {n} has no choices list")
        if not choices:
            continue
        chosen += 1
        choice = _one_choice(choices, f"event {n}")
        if chat:
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise AnswerError("malformed_body", f"event {n}: delta is not an object")
            piece = _text(delta.get("content"), f"event {n} delta.content", none_ok=True)
            thought = _reasoning(delta, f"event {n} delta")
            called = _tool_calls(delta.get("tool_calls"), f"event {n} delta.tool_calls", tool_calls)
        else:
            piece = _text(choice.get("text"), f"event {n} text")
            thought, called = {}, False
        chunk_ids = _ids(choice.get("token_ids"), f"event {n} token_ids")
        if finish is not None and (piece or chunk_ids or thought or called):
            raise AnswerError(
                "malformed_body", f"event {n} carries tokens after the finish_reason {finish!r}"
            )
        for name, text in thought.items():
            reasoning.setdefault(name, []).append(text)
        seen.append(_seen(thought))
        if chunk_ids is not None:
            with_ids = True
            ids += chunk_ids
            running = event.get("usage")
            if running is not None and completion is not None and completion != len(ids):
                raise AnswerError(
                    "inconsistent_answer",
                    f"event {n}: usage.completion_tokens is {completion} after {len(ids)} token ids "
                    "(a running count includes its own chunk's tokens)",
                )
        elif piece or thought or called:
            without_ids = True
        pieces.append(piece)
        reason = choice.get("finish_reason")
        if reason is not None and reason != finish:  # the same one again, with no token: fine
            if finish is not None:
                raise AnswerError(
                    "malformed_body", f"event {n}: a second finish_reason {reason!r} after {finish!r}"
                )
            if not isinstance(reason, str) or not reason:
                raise AnswerError("malformed_body", f"event {n}: finish_reason {reason!r}")
            finish = reason
    if not chosen:
        raise AnswerError("empty_choices", f"no event of the stream ({len(events)}) carried a choice")
    if finish is None:
        raise AnswerError(
            "truncated_stream",
            "no finish_reason before [DONE]"
            if done
            else f"the stream ended before a finish_reason, after {len(pieces)} chunks",
        )
    if with_ids and without_ids:
        raise AnswerError("malformed_body", "token_ids in some chunks only")
    answer = Answer("".join(pieces), ids if with_ids else None, finish, completion, prompt)
    answer.reasoning = {name: "".join(parts) for name, parts in reasoning.items()}
    answer.reasoning_seen = "".join(seen)
    answer.tool_calls = _joined_calls(tool_calls)
    return _consistent(answer)


def _no_error(data: dict, what: str) -> None:
    error = server_error(data)
    if error is not None:
        raise AnswerError("error_object", f"{what}: {str(error)[:200]}")


def _one_choice(choices: list, where: str) -> dict:
    if len(choices) > 1:
        raise AnswerError("malformed_body", f"{where}: {len(choices)} choices where one was asked for")
    if not isinstance(choices[0], dict):
        raise AnswerError("malformed_body", f"{where}: a choice that is not an object")
    index = choices[0].get("index", 0)
    if index != 0 or isinstance(index, bool):
        # the one choice asked for is choice 0: a chunk of another index is a second choice
        raise AnswerError(
            "malformed_body", f"{where}: a choice of index {index!r} where one (0) was asked for"
        )
    return choices[0]


def _text(value, what: str, none_ok: bool = False) -> str:
    if value is None and none_ok:
        return ""
    if not isinstance(value, str):
        raise AnswerError("malformed_body", f"{what} is {value!r}, not a string")
    return value


def _seen(texts: dict[str, str]) -> str:
    """The reasoning a client reads of one message or delta: its first non-empty field."""
    return next((texts[name] for name in REASONING_FIELDS if texts.get(name)), "")


def _reasoning(message: dict, where: str) -> dict[str, str]:
    """The reasoning texts of a chat message or delta, by field; none, null and "" left out."""
    out = {}
    for name in REASONING_FIELDS:
        text = _text(message.get(name), f"{where}.{name}", none_ok=True)
        if text:
            out[name] = text
    return out


def _tool_calls(value, what: str, calls: dict[int, dict]) -> bool:
    """Add a message's or delta's tool calls (OpenAI's shape: `index`, `type`,
    `function.name`, `function.arguments`) to `calls` by index, joining a stream's pieces of
    one call; True when it carried any. A whole message's calls are indexed by their place."""
    if value is None:
        return False
    if not isinstance(value, list):
        raise AnswerError("malformed_body", f"{what} is {str(value)[:80]}, not a list")
    for k, call in enumerate(value):
        if not isinstance(call, dict):
            raise AnswerError("malformed_body", f"{what}[{k}] is not an object")
        index = call.get("index", k)
        if not isinstance(index, int) or isinstance(index, bool):
            raise AnswerError("malformed_body", f"{what}[{k}].index is {index!r}, not an integer")
        function = call.get("function") or {}
        if not isinstance(function, dict):
            raise AnswerError("malformed_body", f"{what}[{k}].function is not an object")
        joined = calls.setdefault(index, {"type": None, "name": "", "arguments": ""})
        kind = _text(call.get("type"), f"{what}[{k}].type", none_ok=True)
        joined["type"] = joined["type"] or kind or None
        for part in ("name", "arguments"):
            joined[part] += _text(function.get(part), f"{what}[{k}].function.{part}", none_ok=True)
    return bool(value)


def _joined_calls(calls: dict[int, dict]) -> list[dict]:
    """The tool calls in index order (a missing type is OpenAI's only one, "function")."""
    return [{**calls[i], "type": calls[i]["type"] or "function"} for i in sorted(calls)]


def _ids(value, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise AnswerError("malformed_body", f"{what} is not a list of integers: {str(value)[:80]}")
    return list(value)


def _usage(value) -> tuple[int | None, int | None]:
    """(completion_tokens, prompt_tokens), each None when not reported."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise AnswerError("malformed_body", f"usage is {str(value)[:80]}, not an object")
    counts = []
    for name in ("completion_tokens", "prompt_tokens"):
        count = value.get(name)
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
            raise AnswerError("malformed_body", f"usage.{name} is {count!r}, not a count")
        counts.append(count)
    return counts[0], counts[1]


def _logprob_ids(logprobs: dict | None) -> list[int] | None:
    """The generated ids as the logprobs name them (completions `token_ids`, chat
    `content[i].token_id`), when they do."""
    if not logprobs:
        return None
    if "content" in logprobs:
        content = logprobs.get("content") or []
        ids = [e.get("token_id") if isinstance(e, dict) else None for e in content]
        return ids if ids and all(isinstance(t, int) for t in ids) else None
    return _ids(logprobs.get("token_ids"), "logprobs.token_ids")


def _consistent(answer: Answer) -> Answer:
    if (
        answer.ids is not None
        and answer.completion_tokens is not None
        and answer.completion_tokens != len(answer.ids)
    ):
        raise AnswerError(
            "inconsistent_answer",
            f"usage.completion_tokens is {answer.completion_tokens} for {len(answer.ids)} token ids",
        )
    if (
        answer.prompt_ids is not None
        and answer.prompt_tokens is not None
        and answer.prompt_tokens != len(answer.prompt_ids)
    ):
        raise AnswerError(
            "inconsistent_answer",
            f"usage.prompt_tokens is {answer.prompt_tokens} for {len(answer.prompt_ids)} prompt ids",
        )
    return answer


# ------------------------------------------------------------------ the baseline's logprobs
def _positions(answer: Answer) -> list[list[tuple[int | None, str | None, float]]] | None:
    """Per generated position, the alternatives the logprobs list: (id, text, logprob)."""
    logprobs = answer.logprobs or {}
    if "content" in logprobs:  # chat
        out = []
        for entry in logprobs.get("content") or []:
            tops = (entry.get("top_logprobs") or []) if isinstance(entry, dict) else []
            out.append(
                [
                    (e.get("token_id"), e.get("token"), e["logprob"])
                    for e in tops
                    if isinstance(e, dict) and isinstance(e.get("logprob"), (int, float))
                ]
            )
        return out
    by_id, by_text = logprobs.get("top_token_logprobs"), logprobs.get("top_logprobs")
    if isinstance(by_id, list) and by_id:
        out = []
        for n, entries in enumerate(by_id):
            entries = [
                e for e in entries or [] if isinstance(e, dict) and isinstance(e.get("logprob"), (int, float))
            ]
            top = by_text[n] if isinstance(by_text, list) and n < len(by_text) else None
            names = list(top) if isinstance(top, dict) and len(top) == len(entries) else []
            out.append(
                [
                    (e.get("token_id"), names[k] if names else None, e["logprob"])
                    for k, e in enumerate(entries)
                ]
            )
        return out
    if isinstance(by_text, list) and by_text:
        return [
            [(None, t, lp) for t, lp in top.items() if isinstance(lp, (int, float))]
            if isinstance(top, dict)
            else []
            for top in by_text
        ]
    return None


def margin(answer: Answer, position: int) -> float | None:
    """The baseline's top-1 minus top-2 logprob at one generated position."""
    positions = _positions(answer)
    if not positions or position >= len(positions):
        return None
    values = sorted((lp for _, _, lp in positions[position]), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def listed_ids(answer: Answer, position: int) -> set[int] | None:
    """The token ids of the alternatives listed at one position (None: listed by text only)."""
    positions = _positions(answer)
    if not positions or position >= len(positions) or not positions[position]:
        return None
    ids = {i for i, _, _ in positions[position]}
    return None if None in ids else ids


def listed_texts(answer: Answer, position: int) -> set[str]:
    """The texts of the alternatives listed at one position (those that name one)."""
    positions = _positions(answer)
    if not positions or position >= len(positions):
        return set()
    return {t for _, t, _ in positions[position] if t is not None}


def token_texts(answer: Answer, position: int) -> dict[int, str]:
    """Token id -> text at one position, as far as the logprobs tell."""
    out = {}
    pieces = token_pieces(answer)
    if answer.ids and pieces and position < min(len(pieces), len(answer.ids)):
        out[answer.ids[position]] = pieces[position]
    positions = _positions(answer) or []
    if position < len(positions):
        out.update({i: t for i, t, _ in positions[position] if i is not None and t is not None})
    return out


def token_pieces(answer: Answer) -> list[str] | None:
    """The text of each generated token, from the logprobs (completions `tokens`, chat
    `content[i].token`)."""
    logprobs = answer.logprobs or {}
    if "content" in logprobs:
        pieces = [e.get("token") if isinstance(e, dict) else None for e in logprobs.get("content") or []]
    else:
        pieces = logprobs.get("tokens")
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        return None
    return pieces

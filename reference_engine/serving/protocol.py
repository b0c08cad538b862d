"""OpenAI-compatible request parsing and response bodies (completions and chat).

Parsing never trusts the body: every field is type-checked here and a bad one raises
`ProtocolError` naming the field, which the server turns into HTTP 400 with an
OpenAI-style error body. Fields that are neither OpenAI's nor ours are ignored: clients send
extras (vLLM's, SGLang's).

Extensions, documented in docs/engine.md (section Serve):
- `token_ids` in every choice and stream chunk: the generated token ids (vLLM's
  `return_token_ids` output, always on), so clients compare tokens, not text; and
  `prompt_token_ids` in a non-streaming completion's choice;
- completions `logprobs` also as `top_token_logprobs` (lists of {token_id, logprob}),
  since different tokens may decode to the same text;
- `prompt` may be a list of token ids;
- `stop_token_ids`, `top_k`, `ignore_eos` (as vLLM);
- `spec_decode` beside `usage`: steps, proposed, accepted, acceptance_lengths of the request.

Standard parameters we do not implement are refused, not ignored (400 naming the parameter,
`UNIMPLEMENTED`), unless they carry the value that means "not used". Values a lenient parser
would guess at are refused too: `top_logprobs` without `logprobs`, `stream_options` that is
not an object or comes without `stream`, `logit_bias` keys that are not plain digits (Python
reads "1_0" as 10), roles outside OpenAI's (a role is copied into the prompt by the chat
template, so "<|im_start|>system" would forge a turn). An unknown model is 404 (`code:
model_not_found`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import ReferenceEngineError
from ..runtime.request import REPETITION_PENALTY_RANGE, SEED_RANGE, SamplingParams

FLOAT32_TINY = 2.0**-126  # torch.finfo(torch.float32).tiny
DEFAULT_TEMPERATURE = 1.0  # OpenAI's: a request that leaves temperature out samples


class ProtocolError(ReferenceEngineError):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind
        self.code = status if code is None else code


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: int = 400
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(
    body: dict, name: str, default: float | None, lo: float | None = None, hi: float | None = None
) -> float | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"'{name}' must be a number, got {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ProtocolError(f"'{name}' must be in [{lo}, {hi}], got {value}", name)
    return value


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{name}' must be an integer, got {value!r}", name)
    return value


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ProtocolError("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = []
    named: dict[int, str] = {}  # token id -> the key that named it
    for key, value in bias.items():
        # plain ASCII digits only: int() also reads "1_0", " 5", "+5" and other scripts' digits
        if not (key.isascii() and key.isdigit()):
            raise ProtocolError(
                f"'logit_bias' keys must be token ids in decimal digits, got {key!r}", "logit_bias"
            )
        token = int(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ProtocolError(
                f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                "logit_bias",
            )
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ProtocolError(
                f"'logit_bias' token id {token} outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if token in named:
            raise ProtocolError(
                f"'logit_bias' names token {token} twice ({named[token]!r} and {key!r})", "logit_bias"
            )
        named[token] = key
        out.append((token, float(value)))
    return tuple(sorted(out))


# Standard OpenAI parameters we do not implement, each with the values that mean "not used"
# (clients send defaults; null always means not used) and what the server does instead.
UNIMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "the response holds the output only"),
    "best_of": ((1,), "one sequence per request"),
    "suffix": (("",), "no insertion: the output continues the prompt"),
    "response_format": (({"type": "text"},), "no constrained decoding: the output is free text"),
    "tools": (([],), "no tool calling"),
    "tool_choice": (("none", "auto"), "no tool calling"),
    "functions": (([],), "no function calling"),
    "function_call": (("none",), "no function calling"),
    "audio": ((), "text only"),
    "modalities": ((["text"],), "text only"),
    "prediction": ((), "no predicted outputs"),
    "web_search_options": ((), "no web search"),
    "reasoning_effort": ((), "no reasoning budget: the model decodes as it is"),
    "store": ((False,), "nothing is stored"),
    "service_tier": (("auto", "default"), "one tier"),
}


def _unsupported(body: dict) -> None:
    """Standard parameters we do not implement: refused rather than silently ignored."""
    for name, (not_used, instead) in UNIMPLEMENTED.items():
        value = body.get(name)
        # `in` alone would take 1 for true and 0 for false
        if value is not None and not any(value == v and type(value) is type(v) for v in not_used):
            raise ProtocolError(f"'{name}' is not supported ({instead}), got {value!r}", name)


def _top_p(body: dict) -> float:
    """top_p as the engine samples with it. Any top_p at or below the most likely token's
    probability keeps that token alone; one below float32's smallest normal number would
    round to 0 against the float32 probabilities and keep none, so it is raised to that
    number, which keeps exactly the same single token."""
    top_p = _number(body, "top_p", 1.0)
    return max(top_p, FLOAT32_TINY) if top_p > 0 else top_p


def _boolean(body: dict, name: str, default: bool) -> bool:
    """A strict boolean: "false" or 0 is a mistake, not a truthy value."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def message_text(content: Any) -> str | None:
    """A chat message's text: a string, or OpenAI's list of parts of which only
    {"type": "text", "text": ...} is supported (joined in order). None when malformed."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    return None


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        text = message_text(m.get("content")) if isinstance(m, dict) else None
        if text is None or not isinstance(m.get("role"), str):
            raise ProtocolError(
                f"messages[{i}] must be {{role, content}} with string content or a list of text parts",
                "messages",
            )
        if m["role"] not in ROLES:
            raise ProtocolError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages"
            )
        out.append({**m, "content": text})
    return out


# Each token's text is checked against every stop string's prefixes (a tail that may still
# begin one is held back), so a stop string's length bounds the work of every token of its
# request on the event loop, which all requests share (serving/stop_strings.py)
MAX_STOP_CHARS = 1024


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > 4:
        raise ProtocolError("'stop' takes at most 4 strings", "stop")
    longest = max((len(s) for s in stop), default=0)  # `[]`: no stop strings (OpenAI, vLLM)
    if longest > MAX_STOP_CHARS:
        raise ProtocolError(
            f"'stop' strings may have at most {MAX_STOP_CHARS} characters each, got one of {longest}", "stop"
        )
    return tuple(stop)


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # top logprobs asked for (None: none)
    chat: bool


def parse_request(
    body: Any,
    served_name: str,
    tokenize,
    chat: bool,
    apply_chat_template=None,
    vocab_size: int | None = None,
    context_len: int | None = None,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_name:
        raise ProtocolError(
            f"model '{model}' does not exist; this server serves '{served_name}'",
            "model",
            404,
            code="model_not_found",
        )
    _unsupported(body)
    n = _integer(body, "n", 1)
    if n != 1:
        raise ProtocolError(f"only n=1 is supported, got {n}", "n")
    if chat:
        # the template writes the special tokens it wants (transformers and vLLM tokenise a
        # chat prompt without the tokenizer's own)
        prompt_ids = tokenize(apply_chat_template(_messages(body)), add_special_tokens=False)
        logprobs = None
        if _boolean(body, "logprobs", False):
            logprobs = _integer(body, "top_logprobs", 0)
        elif body.get("top_logprobs") is not None:
            raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = tokenize(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            raise ProtocolError("batched prompts are not supported: send one prompt per request", "prompt")
        else:
            raise ProtocolError("'prompt' must be a string or a list of token ids", "prompt")
        logprobs = _integer(body, "logprobs", None)
    if not prompt_ids:
        raise ProtocolError("the prompt is empty: at least one token is needed", "prompt")
    if logprobs is not None and not 0 <= logprobs <= 20:
        field = "top_logprobs" if chat else "logprobs"  # chat's `logprobs` is the boolean
        raise ProtocolError(f"{field} must be in [0, 20], got {logprobs}", field)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise ProtocolError(f"'stream_options' must be an object, got {options!r}", "stream_options")
    elif not stream:
        raise ProtocolError("'stream_options' is only allowed with 'stream': true", "stream_options")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise ProtocolError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    max_tokens = _integer(
        body, _budget_field(body, chat), _default_budget(chat, len(prompt_ids), context_len)
    )
    top_k = _integer(body, "top_k", 0)
    seed = _integer(body, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ProtocolError(f"'seed' must be in [-2**63, 2**63 - 1], got {seed}", "seed")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
            top_p=_top_p(body),
            top_k=0 if top_k == -1 else top_k,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_boolean(body, "ignore_eos", False),
            seed=seed,
            logprobs=logprobs,
            repetition_penalty=_number(body, "repetition_penalty", 1.0, *REPETITION_PENALTY_RANGE),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            logit_bias=_logit_bias(body, vocab_size),
        )
    except ProtocolError:
        raise
    except ReferenceEngineError as exc:
        raise ProtocolError(str(exc), _field_named(str(exc), body, chat)) from None
    return ParsedRequest(
        prompt_ids,
        params,
        _stop_strings(body),
        stream,
        _boolean(options, "include_usage", False),
        _boolean(options, "continuous_usage_stats", False),
        logprobs,
        chat,
    )


def _default_budget(chat: bool, prompt_tokens: int, context_len: int | None) -> int:
    """max_tokens of a request that sets no budget: 16 for completions (OpenAI's and vLLM's
    default); for chat the rest of the context (OpenAI's chat API, vLLM: max_model_len - the
    prompt's tokens), at least 1, so a prompt that fills the context is refused as too long."""
    if not chat or context_len is None:
        return 16
    return max(context_len - prompt_tokens, 1)


def _budget_field(body: dict, chat: bool) -> str:
    """The field a request's token budget is read from: a chat body's max_completion_tokens
    (chat's own name for it) when sent, not null; max_tokens otherwise."""
    return "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"


def _field_named(message: str, body: dict, chat: bool) -> str | None:
    """The request field a SamplingParams error names (its message starts with the parameter's
    name), as the request spelled it; None when it names none of the body's fields."""
    name = message.split(" ", 1)[0]
    if name == "max_tokens":
        name = _budget_field(body, chat)
    if chat and name == "logprobs":
        return "top_logprobs"
    return name if name in body else None


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def spec_summary(sequence) -> dict | None:
    """The request's speculative statistics: on a DFlash server for every request, with the
    reason when it left the speculative path (None on a plain server)."""
    if sequence is None or not (sequence.steps or sequence.speculative or sequence.fallback_reason):
        return None
    # the sums of the step records, as `sequence.spec` counts them, without its per-position
    # counters: this runs on the event loop at every speculative request's end (a tenth of a
    # DFlash server's HTTP work at c16 on the demo pair when it counted those too)
    steps = sequence.steps
    return {
        "steps": len(steps),
        "proposed": sum(s.proposed for s in steps),
        "accepted": sum(s.accepted for s in steps),
        "acceptance_lengths": [s.acceptance_length for s in steps],
        "fallback_reason": sequence.fallback_reason,
    }


def logprobs_body(
    chat: bool,
    tokens: list[str],
    ids: list[int],
    entries: list[dict[int, float]],
    token_text,
    top: int | None = None,
    text_offset: int = 0,
    token_bytes=None,
) -> dict:
    """OpenAI logprobs for the given tokens; each top entry also carries its token id.
    Chat lists exactly `top` alternatives (top_logprobs), each token with its own `bytes`
    (`token_bytes(id)`; by default the UTF-8 of its text); completions also the chosen token,
    and `text_offset`: where each token's text starts in the completion, counted over the
    token texts before it (as vLLM counts; `text_offset` is the first one's, for a chunk that
    continues a stream)."""
    if chat:
        if token_bytes is None:

            def token_bytes(token: int) -> bytes:
                return token_text(token).encode()

        content = []
        for text, token_id, entry in zip(tokens, ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[: top or 0]
            content.append(
                {
                    "token": text,
                    "token_id": token_id,
                    "logprob": entry.get(token_id),
                    "bytes": list(token_bytes(token_id)),
                    "top_logprobs": [
                        {
                            "token": token_text(t),
                            "token_id": t,
                            "logprob": lp,
                            "bytes": list(token_bytes(t)),
                        }
                        for t, lp in ranked
                    ],
                }
            )
        return {"content": content}
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_ids": ids,
        "text_offset": offsets,
        "token_logprobs": [entry.get(t) for t, entry in zip(ids, entries)],
        "top_logprobs": [
            {token_text(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])} for entry in entries
        ],
        # by id too: different tokens may decode to the same text
        "top_token_logprobs": [
            [{"token_id": t, "logprob": lp} for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])]
            for entry in entries
        ],
    }


def chunk(
    request_id: str,
    model: str,
    chat: bool,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
    role: bool = False,
    created: int | None = None,
) -> dict:
    """One stream chunk; `created` is the stream's (every chunk of a stream carries the same
    one, its first chunk's time by default)."""
    created = int(time.time()) if created is None else created
    if chat:
        delta: dict[str, Any] = {"content": text}
        if role:
            delta["role"] = "assistant"
        choice = {
            "index": 0,
            "delta": delta,
            "token_ids": token_ids,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    choice = {
        "index": 0,
        "text": text,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def full_response(
    request_id: str,
    model: str,
    chat: bool,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    logprobs: dict | None,
    usage_body: dict,
    spec: dict | None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    created = int(time.time())
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "token_ids": token_ids,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage_body,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "token_ids": token_ids,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "prompt_token_ids": prompt_token_ids,
        }
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage_body,
        }
    if spec is not None:
        body["spec_decode"] = spec
    return body

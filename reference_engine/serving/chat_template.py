"""Chat templates from checkpoints, rendered as untrusted code.

A checkpoint carries a Jinja template (`chat_template.jinja`, or `tokenizer_config.json`'s)
that runs on every chat request. A checkpoint is not trusted, so the template renders in
Jinja's immutable sandbox: no access to Python internals (`__class__`, `__globals__`, ...),
no mutation of the objects passed in. A template that tries, or that fails for any other
reason (including the `raise_exception(...)` Hugging Face templates call for unsupported
roles, and a Python error such as a division by zero inside the template), fails the request
with HTTP 400, never the server.

The environment is the one Hugging Face's `apply_chat_template` renders in (and so vLLM's and
SGLang's): blocks trimmed (`trim_blocks`, `lstrip_blocks`), `{% break %}` and `{% continue %}`,
a `tojson` that neither escapes HTML nor sorts keys, and `strftime_now`; the variables are the
messages, `add_generation_prompt` (true), `tools` and `documents` (none: the server takes no
tools), and the tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`,
`sep_token`, `pad_token`, `cls_token`, `mask_token`, those tokenizer_config.json names). A
template that relies on any of them gives the same prompt here as there, so the two servers of
a comparison get the same tokens. The rendered prompt is tokenised without the tokenizer's own
special tokens (its post-processor's BOS): the template writes the ones it wants, as
transformers and vLLM tokenise a chat prompt.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CheckpointError
from .protocol import ProtocolError

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), each
# a variable of the template when the tokenizer has it
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: JSON as `json.dumps` writes it (Jinja's own escapes <, >, &
    and ' for HTML, and sorts keys)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Today's date or time in `format` (Llama 3.x templates print the date)."""
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str):
    """The template ready to render; CheckpointError when it does not even parse."""
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise CheckpointError(f"the checkpoint's chat template does not parse: {exc}") from None


def template_special_tokens(config: dict, legacy_map: dict | None = None) -> dict[str, str]:
    """The named special tokens a template sees, as transformers reads them: from
    tokenizer_config.json (`config`), a string or an added token's {"content": ...}; a name
    it lacks is taken from a special_tokens_map.json (`legacy_map`) when there is one. A
    value of another kind is a CheckpointError naming it."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if value is None and legacy_map:
            value = legacy_map.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise CheckpointError(f"the tokenizer's {name} is not a token: {value!r}")
        tokens[name] = value
    return tokens


def render_chat_template(template, messages: list[dict], special_tokens: dict[str, str] | None = None) -> str:
    """The prompt text of `messages`, rendered with the variables transformers'
    apply_chat_template gives a template (`special_tokens`: `template_special_tokens`)."""
    try:
        return template.render(
            **(special_tokens or {}),
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
        )
    except Exception as exc:  # TemplateError, SecurityError, and whatever the template's own code raises
        raise ProtocolError(
            f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from None

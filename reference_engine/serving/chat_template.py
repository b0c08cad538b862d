"""Chat templates from checkpoints, rendered as untrusted code.

A checkpoint's `tokenizer_config.json` carries a Jinja template that runs on every chat
request. A checkpoint is not trusted, so the template renders in Jinja's immutable sandbox:
no access to Python internals (`__class__`, `__globals__`, ...), no mutation of the objects
passed in. A template that tries, or that fails for any other reason (including the
`raise_exception(...)` Hugging Face templates call for unsupported roles, and a Python error
such as a division by zero inside the template), fails the request with HTTP 400, never the
server.
"""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CheckpointError
from .protocol import ProtocolError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment()
    env.globals["raise_exception"] = _raise_exception
    return env


def compile_chat_template(source: str):
    """The template ready to render; CheckpointError when it does not even parse."""
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise CheckpointError(f"the checkpoint's chat template does not parse: {exc}") from None


def render_chat_template(template, messages: list[dict]) -> str:
    try:
        return template.render(messages=messages, add_generation_prompt=True)
    except Exception as exc:  # TemplateError, SecurityError, and whatever the template's own code raises
        raise ProtocolError(
            f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from None

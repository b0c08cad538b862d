"""The served model: target, draft, tokenizer, engine and metrics behind the HTTP routes."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..runtime.engine import Engine
from ..runtime.tensor_parallel import TensorParallel
from ..tokenizer import CHAT_TEMPLATE, TokenBytes, load_tokenizer
from .async_engine import AsyncEngine, MakeOracle, ThreadEngine
from .chat_template import compile_chat_template, render_chat_template, template_special_tokens
from .engine_build import EngineInfo, build_engine, engine_loop_mode
from .engine_process import EngineProcess, ProcessEngine
from .followers import LeadingEngine
from .lifecycle import Lifecycle
from .limits import BodyLimits, MiB, decode_json
from .metrics import ServerMetrics
from .protocol import DEFAULT_TEMPERATURE, ParsedRequest, ProtocolError, new_id, parse_request

if TYPE_CHECKING:
    from .args import ServeArgs

log = logging.getLogger(__name__)


class Server:
    """Tokenizer, engine and metrics behind the HTTP routes (app.py); the engine loop,
    draining and shutdown are its `lifecycle` (lifecycle.py). The engine runs on a thread of
    this process (`engine`) or in a process of its own (`spawned`)."""

    def __init__(self, args: ServeArgs) -> None:
        self.loop_mode = engine_loop_mode(args)
        self.engine: Engine | None = None
        self.spawned: EngineProcess | None = None
        self.tp: TensorParallel | None = None
        self.make_oracle: MakeOracle | None = None
        if self.loop_mode == "thread":
            self.engine, self.tp, self.make_oracle = build_engine(args)
            self.info = EngineInfo.of(self.engine)
        else:
            self.spawned = EngineProcess(args)
            self.info = self.spawned.info
        self.tokenizer = load_tokenizer(args.model)
        self.token_bytes = TokenBytes(self.tokenizer)  # chat logprobs' `bytes`
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())
        # the special tokens, which `detokenize` (decode, skipping them) drops wherever they stand
        self.skipped_ids = frozenset(
            i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special
        )
        self.chat_template = compile_chat_template(_chat_template(Path(args.model)))
        self.template_tokens = _template_tokens(Path(args.model))
        self.limits = BodyLimits(max_bytes=int(args.max_body_mb * MiB))
        self.name = args.served_model_name or Path(args.model).name
        self.api_key = args.api_key
        self.api_key_scope = args.api_key_scope
        self.metrics = ServerMetrics(args.metrics_names)
        self.lifecycle = Lifecycle(self._start_runner, args.shutdown_grace)
        self._request_numbers = itertools.count(1)  # the last part of each request id
        self._told_default_temperature = False
        self.oracle_acceptance = args.oracle_acceptance

    def _start_runner(self) -> AsyncEngine:
        if self.spawned is not None:
            return ProcessEngine(self.spawned, self.metrics.on_step)
        engine = self.engine if self.tp is None else LeadingEngine(self.engine)
        return ThreadEngine(engine, self.metrics.on_step, self.make_oracle)

    def new_request_id(self, chat: bool) -> str:
        return f"{new_id(chat)}-{next(self._request_numbers)}"

    def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """A request body as the engine takes it (ProtocolError: 400, 404). Slow for a large
        body: the routes call it off the event loop (past app.INLINE_PARSE_BYTES)."""
        body = decode_json(raw, self.limits)
        if isinstance(body, dict) and body.get("temperature") is None and not self._told_default_temperature:
            # said once: a benchmark client that leaves temperature out (vLLM's bench serve
            # does) measures sampling here, not the greedy decode it may think it measures
            self._told_default_temperature = True
            log.warning(
                "a request without 'temperature' samples at %s (OpenAI's default); send "
                "temperature 0 for greedy decode (said once)",
                DEFAULT_TEMPERATURE,
            )
        return parse_request(
            body,
            self.name,
            self.tokenize,
            chat,
            self.apply_chat_template,
            self.info.vocab_size,
            self.info.context_len,
        )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; `add_special_tokens`: with what the tokenizer's post-processor adds
        (a completion's prompt; a chat prompt's template writes its own)."""
        # no token is longer than the vocabulary's longest, so a text too long for the
        # context is refused without tokenising it
        fewest = len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes
        if fewest >= self.info.context_len:
            raise ProtocolError(
                f"the prompt has at least {fewest} tokens but the context holds {self.info.context_len}",
                "prompt",
            )
        # encode_batch releases the GIL, unlike encode
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat_template(self.chat_template, messages, self.template_tokens)


def _template_tokens(model_dir: Path) -> dict[str, str]:
    """The tokenizer's named special tokens for the chat template (tokenizer_config.json's,
    then a legacy special_tokens_map.json's); a file that is not a JSON object is a
    CheckpointError naming it."""
    files = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = model_dir / name
        try:
            raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} is not a JSON object")
        files.append(raw)
    return template_special_tokens(*files)


def _chat_template(model_dir: Path) -> str:
    """The checkpoint's chat template, found as transformers finds it: `chat_template.jinja`
    when the folder has one (it takes priority), else tokenizer_config.json's `chat_template`,
    a string or a list of named templates (the one named "default"); else ChatML, the
    documented default for tiny models. A file that is not UTF-8 (or not JSON) is a
    CheckpointError naming it."""
    jinja = model_dir / "chat_template.jinja"
    config = model_dir / "tokenizer_config.json"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        if not config.is_file():
            return CHAT_TEMPLATE
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        where = jinja if jinja.is_file() else config
        raise CheckpointError(f"cannot read the chat template in {where}: {exc}") from None
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if (
                isinstance(entry, dict)
                and entry.get("name") == "default"
                and isinstance(entry.get("template"), str)
            ):
                return entry["template"]
    return CHAT_TEMPLATE

"""The served model: target, draft, tokenizer, engine and metrics behind the HTTP routes."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint import load_draft, load_target
from ..engine_args import resolve_device, resolve_dtype
from ..errors import ReferenceEngineError
from ..kernels import default_numerics
from ..runtime.engine import Engine, EngineConfig
from ..runtime.oracle import OracleProposer
from ..runtime.tensor_parallel import (
    init_tensor_parallel,
    rank_device,
    share_with_draft,
)
from ..tokenizer import CHAT_TEMPLATE, load_tokenizer
from .async_engine import AsyncEngine
from .chat_template import compile_chat_template, render_chat_template
from .followers import LeadingEngine
from .lifecycle import Lifecycle
from .limits import BodyLimits, MiB, decode_json
from .metrics import ServerMetrics
from .protocol import DEFAULT_TEMPERATURE, ParsedRequest, ProtocolError, new_id, parse_request

if TYPE_CHECKING:
    from .args import ServeArgs

log = logging.getLogger(__name__)


class Server:
    """Model, tokenizer, engine and metrics behind the HTTP routes (app.py); the engine
    thread, draining and shutdown are its `lifecycle` (lifecycle.py)."""

    def __init__(self, args: ServeArgs) -> None:
        device = resolve_device(args.device)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        dtype = resolve_dtype(args.dtype, args.model, device)
        numerics = args.numerics or default_numerics(device, dtype)
        # above one rank, rank 0 serves and the others follow its engine (followers.py)
        self.tp = init_tensor_parallel(args.tensor_parallel_size, device, numerics, "serve")
        device = rank_device(device, self.tp)
        target = load_target(args.model, dtype=dtype, device=device, tensor_parallel=self.tp)
        draft = None
        if args.draft:
            draft = load_draft(args.draft, target)
            if self.tp is not None:
                share_with_draft(draft, self.tp)
        elif args.block_size is not None:
            raise ReferenceEngineError("--block-size needs --dflash-draft-model-path")
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            commit_strategy=args.commit_strategy,
            max_waiting=args.max_waiting,
            numerics=args.numerics,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization,
            verify_width=args.verify_width,
            measure_step_costs=args.measure_step_costs,
            prefill_chunk=args.prefill_chunk,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_cell_tokens=args.kv_cell_tokens,
        )
        self.engine = Engine(target, draft, config)  # validates the pair and the options
        self.tokenizer = load_tokenizer(args.model)
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())
        self.chat_template = compile_chat_template(_chat_template(Path(args.model)))
        self.limits = BodyLimits(max_bytes=int(args.max_body_mb * MiB))
        self.name = args.served_model_name or Path(args.model).name
        self.api_key = args.api_key
        self.api_key_scope = args.api_key_scope
        self.metrics = ServerMetrics(args.metrics_names)
        self.lifecycle = Lifecycle(self._start_runner, args.shutdown_grace)
        self._request_numbers = itertools.count(1)  # the last part of each request id
        self._told_default_temperature = False
        self.oracle_acceptance = args.oracle_acceptance
        if self.oracle_acceptance is not None:
            if draft is None:
                raise ReferenceEngineError("--oracle-acceptance needs --dflash-draft-model-path")
            OracleProposer.for_mean_acceptance(
                [], self.oracle_acceptance, self.engine.block_size, target.config.vocab_size
            )

    def make_oracle(self, params) -> OracleProposer | None:
        if self.oracle_acceptance is None or not params.greedy:
            return None
        return OracleProposer.for_mean_acceptance(
            [],
            self.oracle_acceptance,
            self.engine.block_size,
            self.engine.target.config.vocab_size,
            forced=True,
        )

    def _start_runner(self) -> AsyncEngine:
        engine = self.engine if self.tp is None else LeadingEngine(self.engine)
        return AsyncEngine(engine, self.metrics.on_step, self.make_oracle)

    def new_request_id(self, chat: bool) -> str:
        return f"{new_id(chat)}-{next(self._request_numbers)}"

    def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """A request body as the engine takes it (ProtocolError: 400, 404). Slow for a large
        body: the routes call it off the event loop."""
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
            self.engine.target.config.vocab_size,
        )

    def tokenize(self, text: str) -> list[int]:
        # no token is longer than the vocabulary's longest, so a text too long for the
        # context is refused without tokenising it
        fewest = len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes
        if fewest >= self.engine.context_len:
            raise ProtocolError(
                f"the prompt has at least {fewest} tokens but the context holds {self.engine.context_len}",
                "prompt",
            )
        return self.tokenizer.encode_batch([text])[0].ids  # releases the GIL, unlike encode

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat_template(self.chat_template, messages)


def _chat_template(model_dir: Path) -> str:
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return CHAT_TEMPLATE  # ChatML, documented default for tiny models

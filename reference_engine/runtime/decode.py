"""One request on one slot: prefill and plain greedy decode, the bare reference loop.

The engine (engine.py) shares `stop_ids` and `context_length` with this loop, so both end
an output at exactly the same token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, RequestError
from ..kernels import TORCH, Kernels, select
from ..models import CausalLM
from .request import SamplingParams, new_generator, validate_prompt
from .sampling import greedy, probabilities, sample
from .state import TargetState

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop id, included in output_ids) or "length"
    acceptance_lengths: list[int] = field(default_factory=list)  # speculative only


def context_length(model: CausalLM, max_model_len: int | None = None) -> int:
    """The context a request may fill: `max_model_len`, at most the target's positions (the
    default). A length past them is refused, as vLLM refuses it: the model was not trained
    there, and cutting it without a word would break what the user asked for."""
    limit = model.config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError(
            f"max_model_len {max_model_len} is past the target's max_position_embeddings "
            f"({limit}): give --max-model-len {limit} or less"
        )
    return limit if max_model_len is None else max_model_len


def stop_ids(model: CausalLM, params: SamplingParams) -> frozenset[int]:
    eos = () if params.ignore_eos else model.config.eos_token_ids
    return frozenset((*eos, *params.stop_token_ids))


def new_state(model: CausalLM, max_len: int, num_slots: int = 1) -> TargetState:
    weight = model.model.embed_tokens.weight
    return TargetState(model.config, num_slots, max_len, weight.dtype, weight.device)


@torch.inference_mode()
def prefill(
    model: CausalLM,
    state: TargetState,
    slot: int,
    prompt_ids: list[int],
    capture_layers: tuple[int, ...] = (),
    chunk_size: int | None = None,
    ops: Kernels = TORCH,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the prompt into a fresh slot. Returns (last-position logits [vocab], features
    [len(prompt), n * hidden] or None). Long prompts run in chunks of `chunk_size`."""
    device = state.device
    state.reset(slot)
    slots = torch.tensor([slot], device=device)
    chunk = chunk_size or len(prompt_ids)
    features = []
    logits = None
    for start in range(0, len(prompt_ids), chunk):
        ids = prompt_ids[start : start + chunk]
        end = start + len(ids)
        out = model(
            torch.tensor([ids], device=device),
            torch.arange(start, end, device=device)[None],
            slots,
            state,
            kv_len=end,
            capture_layers=capture_layers,
            last_only=True,
            ops=ops,
        )
        logits = out.logits[0, -1]
        if out.features is not None:
            features.append(out.features[0])
        state.lengths[slot] = end
    return logits, (torch.cat(features) if features else None)


@torch.inference_mode()
def decode_step(
    model: CausalLM, state: TargetState, slot: int, token: int, ops: Kernels = TORCH
) -> torch.Tensor:
    """Append one token to the slot; returns the next-token logits [vocab]."""
    device = state.device
    pos = state.lengths[slot]
    out = model(
        torch.tensor([[token]], device=device),
        torch.tensor([[pos]], device=device),
        torch.tensor([slot], device=device),
        state,
        kv_len=pos + 1,
        ops=ops,
    )
    state.lengths[slot] = pos + 1
    return out.logits[0, -1]


def first_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one position's logits [vocab]: greedy, or sampled."""
    if params.greedy:
        return int(greedy(logits))
    probs = probabilities(logits, params.temperature, params.top_k, params.top_p)
    return int(sample(probs, generator))


def generate_plain(
    model: CausalLM,
    prompt_ids: list[int],
    params: SamplingParams,
    max_model_len: int | None = None,
    chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    numerics: str | None = None,
) -> GenerationResult:
    """Plain decode, one token per forward: greedy (argmax, lowest id on a tie) at
    temperature 0, else sampling with `generator` (without one: a generator seeded with
    `params.seed` as the engine seeds a request's, or torch's global one when the request
    names no seed). Stops on EOS, stop ids, max_tokens.
    `numerics`: the kernels (reference_engine.kernels; None: the device's default).

    The stop token, when one ends the output, is the last entry of `output_ids`.
    """
    if params.repetition_penalty != 1.0 or params.logprobs is not None:
        raise RequestError(
            "generate_plain is the bare reference loop: repetition_penalty and "
            "logprobs are served by the engine (reference_engine.runtime.engine)"
        )
    context = context_length(model, max_model_len)
    validate_prompt(prompt_ids, model.config.vocab_size, context, params.max_tokens)
    stops = stop_ids(model, params)
    state = new_state(model, len(prompt_ids) + params.max_tokens)
    weight = model.model.embed_tokens.weight
    ops = select(numerics, weight.device, weight.dtype)
    if generator is None and params.seed is not None and not params.greedy:
        generator = new_generator(weight.device, params.seed)
    logits, _ = prefill(model, state, 0, prompt_ids, chunk_size=chunk_size, ops=ops)
    output: list[int] = []
    while True:
        token = first_token(logits, params, generator)  # the one host sync per step
        output.append(token)
        if token in stops:
            return GenerationResult(output, FINISH_STOP)
        if len(output) == params.max_tokens:
            return GenerationResult(output, FINISH_LENGTH)
        logits = decode_step(model, state, 0, token, ops)

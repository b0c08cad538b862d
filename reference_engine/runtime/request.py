"""What a caller asks for: prompt checks and sampling parameters, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real

import torch

from ..errors import RequestError

# What the sampling arithmetic can carry. Below GREEDY_BELOW a temperature is greedy (as
# vLLM treats it): logits / T would overflow float32 to inf and the softmax to NaN. The
# repetition penalty divides or multiplies logits, so it is bounded both ways.
GREEDY_BELOW = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a torch generator's seed (int64, as vLLM)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. temperature 0 (or below GREEDY_BELOW) means greedy
    (lowest id wins a tie)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top logprobs per output token (plain decode reports them)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already seen (plain decode)
    # OpenAI's, on generated tokens only (penalties.py; plain decode)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias) pairs

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k"):
            if not _integer(getattr(self, name)):
                raise RequestError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)):
                raise RequestError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and _number(pair[1])
            for pair in self.logit_bias
        ):
            raise RequestError(f"logit_bias needs (token id, number) pairs, got {list(self.logit_bias)[:5]}")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be positive, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.temperature):
            raise RequestError(f"temperature must be finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.logprobs is not None and not (_integer(self.logprobs) and 0 <= self.logprobs <= 20):
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise RequestError(
                f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        bad_bias = [
            (t, b) for t, b in self.logit_bias if not _integer(t) or t < 0 or not -100.0 <= b <= 100.0
        ]
        if bad_bias:
            raise RequestError(
                f"logit_bias needs non-negative token ids and biases in [-100, 100], got {bad_bias[:5]}"
            )
        named = [t for t, _ in self.logit_bias]
        twice = sorted({t for t in named if named.count(t) > 1})
        if twice:
            raise RequestError(f"logit_bias names token(s) {twice[:5]} more than once")
        if self.seed is not None and not (
            _integer(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise RequestError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed}")
        bad = [t for t in self.stop_token_ids if not _integer(t) or t < 0]
        if bad:
            raise RequestError(f"stop_token_ids must be non-negative integers, got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        """Presence or frequency penalty or a logit bias (plain decode only)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that needs the logits on the host: the device argmax will do."""
        return self.greedy and self.logprobs is None and self.repetition_penalty == 1.0 and not self.penalised


def _integer(value) -> bool:
    """An int that is not a bool (True and False are ints to Python, not to a request)."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate_prompt(prompt_ids: list[int], vocab_size: int, context_len: int, max_tokens: int) -> None:
    """Reject prompts the model cannot run: empty, out-of-vocabulary, or past the context."""
    if len(prompt_ids) == 0:
        raise RequestError("the prompt is empty: at least one token is needed")
    bad = [t for t in prompt_ids if not (_integer(t) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= context_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {context_len}; "
            "at least one position must be left for output"
        )
    if len(prompt_ids) + max_tokens > context_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
            f"{len(prompt_ids) + max_tokens} exceeds the context of {context_len} tokens"
        )


def validate_request(
    prompt_ids: list[int], params: SamplingParams, vocab_size: int, context_len: int, with_oracle: bool
) -> None:
    """Reject what the engine cannot serve, before it takes the request."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
    validate_prompt(prompt_ids, vocab_size, context_len, params.max_tokens)
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        raise RequestError(f"logit_bias token id(s) {outside[:5]} outside the vocabulary [0, {vocab_size})")
    if with_oracle and not params.greedy:
        raise RequestError("the oracle proposer is greedy-only (temperature 0)")


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A request's own generator: seeded, or from fresh entropy (the global one untouched)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
        return generator
    try:
        generator.manual_seed(seed)
    except (RuntimeError, OverflowError) as exc:
        raise RequestError(f"seed {seed} is outside the generator's range: {exc}") from None
    return generator


def _number(value) -> bool:
    """A real number that is not a bool (a string or None is not one)."""
    return isinstance(value, Real) and not isinstance(value, bool)

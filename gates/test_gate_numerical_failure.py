"""Gates for a request whose next-token distribution is not finite (a NaN among its logits, a
+inf, or -inf throughout: a numerically broken model or kernel). It must end in error after
exactly the tokens it would have produced before that point, and no request beside it may
notice, on every path: a plain engine, a DFlash engine of one step a turn, a DFlash engine in
turns of several steps (whose later steps start from the failed row's bonus), and a DFlash
engine beside a sampled request. Speculative == plain greedy cannot see this class: plain
decode fails the same way, or crashes the same way.

The failure is placed by the model alone: every logits row computed after token X (a token
of the request's own output that no other request reads or produces) is spoiled, in whatever
forward computes it (a prefill, a decode step, a verify block, a captured graph), so a
proposal X in another request's block spoils only logits past its own rejection. The
reference is the same engine and requests without the spoil.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from reference_engine.models import CausalLM
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, require_block
from .faults import planted

BLOCK = 8
LENGTH = 24
SPOILED_ID = 7  # the vocabulary entry a spoil of one entry writes


def _one_entry(value: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def spoil(logits: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
        entry = torch.arange(logits.shape[-1], device=logits.device) == SPOILED_ID
        return logits.masked_fill(hit & entry, value)

    return spoil


SPOILS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "a NaN entry": _one_entry(float("nan")),
    "a +inf entry": _one_entry(float("inf")),
    "-inf throughout": lambda logits, hit: logits.masked_fill(hit, float("-inf")),
}
# name -> (speculative, steps per turn, a sampled neighbour)
PATHS = {
    "plain engine": (False, 1, False),
    "DFlash engine": (True, 1, False),
    "DFlash engine, turns of three steps": (True, 3, False),
    "DFlash engine beside a sampled request": (True, 1, True),
}


@contextmanager
def spoiled_after(target: CausalLM, token: int, spoil: Callable) -> Iterator[None]:
    """Every logits row `target` computes at a position whose input is `token` is spoiled by
    `spoil` (logits [b, T, vocab], hit [b, T, 1] -> logits): device operations only, so a
    CUDA graph captured inside the block spoils its rows too."""
    owner = type(target)
    forward = owner.forward
    own = "forward" in vars(owner)  # else inherited: put back by deleting the override

    def spoiled(self, input_ids, positions, slots, state, kv_len, *args, **kwargs):
        out = forward(self, input_ids, positions, slots, state, kv_len, *args, **kwargs)
        if self is not target:
            return out
        ids = input_ids
        if out.logits.shape[1] != ids.shape[1]:  # each row's last real token alone
            valid = kwargs.get("valid_len")
            ids = ids[:, -1:] if valid is None else ids.gather(1, (valid - 1)[:, None])
        return dataclasses.replace(out, logits=spoil(out.logits, (ids == token)[..., None]))

    owner.forward = spoiled
    try:
        yield
    finally:
        if own:
            owner.forward = forward
        else:
            del owner.forward


def requests_for(pair: Pair, sampled: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(max_tokens=LENGTH, ignore_eos=True)
    prompts = [list(p) for p in pair.prompts[:3]]
    requests = {"failing": (prompts[0], greedy)}
    for i, prompt in enumerate(prompts[1:], 1):
        requests[f"neighbour {i}"] = (prompt, greedy)
    if sampled:
        requests["sampled neighbour"] = (
            prompts[-1],
            SamplingParams(max_tokens=LENGTH, ignore_eos=True, temperature=0.8, seed=3),
        )
    return requests


def run(pair: Pair, path: str, requests: dict) -> dict[str, tuple[list[int], str, str | None]]:
    speculative, steps, _ = PATHS[path]
    config = EngineConfig(
        max_num_seqs=len(requests),
        block_size=BLOCK if speculative else None,
        steps_per_turn=steps,
        numerics=pair.numerics,
    )
    engine = Engine(pair.target, pair.draft if speculative else None, config)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    return {
        rid: (seq.output_ids, seq.finish_reason, seq.error)
        for rid in requests
        for seq in [engine.collect(rid)]
    }


def failing_token(requests: dict, clean: dict) -> int:
    """Where the failing request's output is spoiled: the index of a token of its clean output
    that neither its prompt nor its tokens before it, nor any other request, read or produce."""
    prompt = requests["failing"][0]
    out = clean["failing"][0]
    others = {t for rid, (ids, _) in requests.items() if rid != "failing" for t in ids + clean[rid][0]}
    own = (i for i in range(2, len(out) - 2) if out[i] not in others and out[i] not in prompt + out[:i])
    at = next(own, None)
    if at is None:
        pytest.skip("no token of the failing request's output is its own")
    return at


def check_numerical_failure(pair: Pair, paths=tuple(PATHS), spoils=tuple(SPOILS)) -> None:
    for path in paths:
        requests = requests_for(pair, sampled=PATHS[path][2])
        clean = run(pair, path, requests)
        at = failing_token(requests, clean)
        token = clean["failing"][0][at]
        for name in spoils:
            with spoiled_after(pair.target, token, SPOILS[name]):
                got = run(pair, path, requests)
            output, reason, error = got["failing"]
            assert (output, reason) == (clean["failing"][0][: at + 1], "error") and "not finite" in (
                error or ""
            ), (
                f"{pair.name}, {path}, {name} after token {token} (output index {at}): the failing "
                f"request gave {output} ({reason}: {error}); it fails after {clean['failing'][0][: at + 1]}"
            )
            for rid, want in clean.items():
                if rid != "failing":
                    assert got[rid] == want, (
                        f"{pair.name}, {path}, {name}: {rid} beside the failing request gave "
                        f"{got[rid]}, without the failure {want}"
                    )


def test_a_request_whose_logits_are_not_finite_fails_alone_on_every_path(pair: Pair) -> None:
    require_block(pair, BLOCK)
    check_numerical_failure(pair)


def test_the_numerical_failure_gate_catches_greedy_taking_an_infinite_maximum(pair: Pair) -> None:
    require_block(pair, BLOCK)
    for spoil in ("a +inf entry", "-inf throughout"):
        with (
            planted("greedy_takes_an_infinite_maximum"),
            pytest.raises(AssertionError, match="the failing request gave"),
        ):
            check_numerical_failure(pair, paths=("plain engine",), spoils=(spoil,))


def test_the_numerical_failure_gate_catches_a_failed_rows_bonus_drafted_as_a_token(pair: Pair) -> None:
    require_block(pair, BLOCK)
    if pair.target.model.embed_tokens.weight.is_cuda:
        pytest.skip("an out-of-range embedding index is a device assert on the GPU: it ends the process")
    with planted("failed_bonus_drafts_as_a_token"), pytest.raises(AssertionError, match="gave"):
        check_numerical_failure(pair, paths=("DFlash engine, turns of three steps",), spoils=("a NaN entry",))


# the faults of this gate's class
CATCHES = ("greedy_takes_an_infinite_maximum", "failed_bonus_drafts_as_a_token")

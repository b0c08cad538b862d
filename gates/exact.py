"""Checks for the exact-numerics gates (gates/test_exact_gpu.py): plain greedy with its logits,
a recorder of the verify logits of a speculative engine, and a divergence report that tells
a near-tie from a real difference by the plain run's top-2 logit margin.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from reference_engine.kernels import Kernels, select
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import new_state
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.speculative_step import SpeculativeStep


def model_ops(model: CausalLM, numerics: str | None) -> Kernels:
    weight = model.model.embed_tokens.weight
    return select(numerics, weight.device, weight.dtype)


@torch.inference_mode()
def plain_with_logits(
    target: CausalLM, prompt: list[int], max_tokens: int, ops: Kernels, prefill_chunk: int = 512
) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decode of one request alone (EOS ignored), prefilled in chunks of
    `prefill_chunk`. Returns (output ids, logits [max_tokens, vocab]): row k chose token k."""
    device = target.model.embed_tokens.weight.device
    state = new_state(target, len(prompt) + max_tokens)
    slots = torch.tensor([0], device=device)
    for start in range(0, len(prompt), prefill_chunk):
        ids = prompt[start : start + prefill_chunk]
        end = start + len(ids)
        out = target(
            torch.tensor([ids], device=device),
            torch.arange(start, end, device=device)[None],
            slots,
            state,
            end,
            last_only=True,
            ops=ops,
        )
        state.lengths[0] = end
    rows, tokens = [], []
    logits = out.logits[0, -1]
    for k in range(max_tokens):
        rows.append(logits)
        token = int(ops.greedy(logits))
        tokens.append(token)
        if k + 1 == max_tokens:
            break
        pos = state.lengths[0]
        logits = target(
            torch.tensor([[token]], device=device),
            torch.tensor([[pos]], device=device),
            slots,
            state,
            pos + 1,
            ops=ops,
        ).logits[0, -1]
        state.lengths[0] = pos + 1
    return tokens, torch.stack(rows)


@dataclass(frozen=True)
class Divergence:
    request: str
    position: int  # output index of the first differing token
    expected: int
    got: int
    margin: float  # the plain run's top-1 minus top-2 logit there


def divergences(
    references: dict[str, list[int]], logits: dict[str, torch.Tensor], outputs: dict[str, list[int]]
) -> list[Divergence]:
    found = []
    for rid, want in references.items():
        got = outputs.get(rid)
        if got is None:  # the engine lost the request: a divergence at its first output
            found.append(Divergence(rid, 0, want[0] if want else -1, -1, float("nan")))
            continue
        for k, (a, b) in enumerate(zip(want, got)):
            if a != b:
                top = logits[rid][k].float().topk(2).values
                found.append(Divergence(rid, k, a, b, float(top[0] - top[1])))
                break
        else:
            if len(want) != len(got):
                found.append(Divergence(rid, min(len(want), len(got)), -1, -1, float("nan")))
    return found


def describe(found: list[Divergence], total: int) -> str:
    lines = [f"{len(found)} of {total} requests differ from plain greedy:"]
    lines += [
        f"  {d.request}: first at output {d.position}: plain {d.expected}, got {d.got}, "
        f"plain top-2 margin {d.margin:.4g}{' (a near-tie)' if d.margin < 0.1 else ''}"
        for d in found
    ]
    return "\n".join(lines)


class VerifyLogitCheck:
    """Wraps an engine's speculative step: for every verified block slot j whose input prefix
    (anchor and block tokens 1..j) equals the plain continuation, the slot's verify logits must
    equal, bitwise, the logits plain decode produced for the same output position."""

    def __init__(
        self,
        engine: Engine,
        prompts: dict[str, list[int]],
        references: dict[str, list[int]],
        logits: dict[str, torch.Tensor],
    ) -> None:
        self.prompts, self.references, self.logits = prompts, references, logits
        self.compared = 0
        self.mismatches: list[str] = []
        step = engine.speculative_step
        correct = step.verify

        def verify(rows, block, record=True):
            out = correct(rows, block, record)
            self._check(rows, block, out.logits)
            return out

        step.verify = verify

    def _check(self, rows, block: torch.Tensor, verify_logits: torch.Tensor) -> None:
        # where each row's block sits and what it drafted, as the device has them: a turn's
        # later steps are laid out there, and the host learns them at the turn's end
        tokens, starts, n = block.tolist(), rows.positions[:, 0].tolist(), rows.n_t.tolist()
        left = rows.remaining_t.tolist()
        for i, seq in enumerate(rows.seqs):
            if left[i] <= 0:  # a row past its max_tokens, run on to its turn's end: nothing read
                continue
            ref, plain = self.references[seq.request_id], self.logits[seq.request_id]
            first = starts[i] - len(self.prompts[seq.request_id])  # output index of the anchor
            for j in range(n[i] + 1):
                k = first + j + 1  # the output index slot j's logits choose
                if k >= len(ref) or tokens[i][: j + 1] != ref[first : first + j + 1]:
                    break
                self.compared += 1
                if not torch.equal(verify_logits[i, j], plain[k]):
                    diff = (verify_logits[i, j].double() - plain[k].double()).abs().max().item()
                    self.mismatches.append(
                        f"{seq.request_id} output {k} (block slot {j}): max |diff| {diff:.3g}"
                    )

    def assert_bitwise(self) -> None:
        assert self.compared > 0, "no verify position was compared"
        assert not self.mismatches, (
            f"{len(self.mismatches)} of {self.compared} verified "
            "positions differ from plain decode's logits: " + "; ".join(self.mismatches[:5])
        )


def run_engine(
    target: CausalLM,
    draft: DFlashDraft | None,
    prompts: dict[str, list[int]],
    max_tokens: int,
    config: EngineConfig,
    arrivals: dict[str, int] | None = None,
    oracles: dict | None = None,
    check: tuple | None = None,
) -> dict[str, list[int]]:
    """Run requests through one engine; request r joins at step arrivals[r] (default 0).
    `check` = (prompts, references, logits): verify logits are checked bitwise."""
    engine = Engine(target, draft, config)
    checker = VerifyLogitCheck(engine, *check) if check is not None else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending = sorted(prompts, key=lambda r: (arrivals or {}).get(r, 0))
    step = 0
    while pending or engine.has_unfinished():
        while pending and (arrivals or {}).get(pending[0], 0) <= step:
            rid = pending.pop(0)
            engine.add_request(rid, prompts[rid], params, oracle=(oracles or {}).get(rid))
        engine.step()
        step += 1
    outputs = {rid: engine.collect(rid).output_ids for rid in prompts}
    if checker is not None:
        checker.assert_bitwise()
    return outputs


@contextmanager
def verify_with(**kernels) -> Iterator[None]:
    """Test-only fault: the verify forward runs eagerly with some kernels swapped (e.g. the
    vendor matmul), every other forward with the engine's own (graphs included)."""
    correct = SpeculativeStep.verify

    def verify(self, rows, block, record=True):
        runner = self.runner
        own, graphs = runner.ops, runner.graphs
        runner.ops, runner.graphs = replace(own, **kernels), None
        try:
            return correct(self, rows, block, record)
        finally:
            runner.ops, runner.graphs = own, graphs

    SpeculativeStep.verify = verify
    try:
        yield
    finally:
        SpeculativeStep.verify = correct

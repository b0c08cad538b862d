"""The gates' checks, as functions: each raises AssertionError with a readable diagnosis.

Gate tests call them on a correct engine; the planted-fault tests call the same functions
on an engine with a deliberate fault and assert that they raise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from reference_engine.kernels import select
from reference_engine.models import CausalLM
from reference_engine.models.dflash import DFlashDraft
from reference_engine.runtime.decode import GenerationResult, generate_plain, new_state, prefill
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.model_runner import ModelRunner
from reference_engine.runtime.one_request import SpecResult, generate_speculative
from reference_engine.runtime.oracle import OracleProposer
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.state import TargetState


@dataclass(frozen=True)
class Pair:
    name: str
    target: CausalLM
    draft: DFlashDraft
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int | None = None  # a user's pair: tokens per prompt (a real workload)
    numerics: str | None = None  # kernels of the engine under test (None: the device's)


def require_block(pair: Pair, block_size: int) -> None:
    """Skip a block size the pair's draft was not built for (a user's checkpoints)."""
    import pytest

    if block_size > pair.draft.config.block_size:
        pytest.skip(f"{pair.name}: the draft supports block sizes up to {pair.draft.config.block_size}")


def state_tolerance(pair: Pair) -> float:
    """Absolute state tolerance per dtype; bfloat16 state is not compared (verify and
    decode kernels round differently there: the lossless gate and its margins judge it)."""
    import pytest

    dtype = pair.target.model.embed_tokens.weight.dtype
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 1e-3
    pytest.skip(f"state equality is checked in float64 and float32, not {dtype}")


def top2_margin(target: CausalLM, ids: list[int], numerics: str | None = None) -> float:
    """The target's top-1 minus top-2 logit for the token after `ids` (a tie is ~0)."""
    state = new_state(target, len(ids) + 1)
    weight = target.model.embed_tokens.weight
    logits, _ = prefill(target, state, 0, ids, ops=select(numerics, weight.device, weight.dtype))
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def divergence(
    target: CausalLM,
    prompt: Sequence[int],
    expected: list[int],
    got: list[int],
    numerics: str | None = None,
) -> str:
    i = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if i is None:
        return f"lengths differ: plain {len(expected)} tokens, speculative {len(got)}"
    margin = top2_margin(target, list(prompt) + expected[:i], numerics)
    return (
        f"first divergence at output position {i}: plain {expected[i]}, speculative {got[i]} "
        f"(target top-2 logit margin there {margin:.3g}; a tie is ~0, a bug is not)"
    )


def assert_lossless(
    pair: Pair,
    prompt: Sequence[int],
    params: SamplingParams,
    options: EngineConfig,
    schedule: Sequence[int] | None = None,
    reference: GenerationResult | None = None,
    continuation: Sequence[int] | None = None,
) -> SpecResult:
    """Speculative output (real draft, or the oracle following `schedule` over
    `continuation`, by default the reference output) equals plain greedy decode token for
    token, with the same finish reason."""
    target = pair.target
    ref = reference or generate_plain(target, list(prompt), params, numerics=pair.numerics)
    oracle = None
    if schedule is not None:
        truth = ref.output_ids if continuation is None else continuation
        oracle = OracleProposer(truth, schedule, target.config.vocab_size)
    try:
        got = generate_speculative(
            target, pair.draft, list(prompt), params, replace(options, numerics=pair.numerics), oracle=oracle
        )
    except (RuntimeError, IndexError) as exc:
        raise AssertionError(
            f"{pair.name}, B={options.block_size}, {options.commit_strategy}: speculative "
            f"output != plain greedy: the speculative run failed ({type(exc).__name__}: {exc})"
        ) from exc
    if got.output_ids != ref.output_ids or got.finish_reason != ref.finish_reason:
        where = (
            divergence(target, prompt, ref.output_ids, got.output_ids, pair.numerics)
            if got.output_ids != ref.output_ids
            else f"the same tokens, finish reason plain {ref.finish_reason!r}, "
            f"speculative {got.finish_reason!r}"
        )
        raise AssertionError(
            f"{pair.name}, B={options.block_size}, {options.commit_strategy}, prompt of "
            f"{len(prompt)} tokens: speculative output != plain greedy; {where}"
        )
    return got


def assert_forced_acceptance(
    pair: Pair, prompt: Sequence[int], options: EngineConfig, schedule: Sequence[int]
) -> SpecResult:
    """With the oracle forcing `schedule`, output is lossless and the recorded acceptance
    lengths are exactly schedule + 1 (max_tokens chosen so no step is cut)."""
    max_tokens = 1 + sum(k + 1 for k in schedule)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = assert_lossless(pair, prompt, params, options, schedule)
    expected = [k + 1 for k in schedule]
    if got.acceptance_lengths != expected:
        raise AssertionError(f"acceptance lengths {got.acceptance_lengths} != scheduled {expected}")
    return got


# ------------------------------------------------------------------ state equality
StateSnapshot = dict[str, torch.Tensor]


def snapshot(state: TargetState, length: int, slot: int = 0) -> StateSnapshot:
    """The slot's state that determines everything after `length` committed tokens."""
    out: StateSnapshot = {}
    for i in range(state.config.num_hidden_layers):
        if state.k_cache[i] is not None:
            out[f"layer{i}.k"] = state.k_cache[i][slot, :length].clone()
            out[f"layer{i}.v"] = state.v_cache[i][slot, :length].clone()
        if state.conv[i] is not None:
            out[f"layer{i}.conv"] = state.conv[i][slot].clone()
            out[f"layer{i}.recurrent"] = state.recurrent[i][slot].clone()
    return out


def plain_states(target: CausalLM, prompt: Sequence[int], output: list[int]) -> dict[int, StateSnapshot]:
    """Plain decode's state at every committed length, prompt included."""
    from reference_engine.runtime.decode import decode_step

    state = new_state(target, len(prompt) + len(output))
    prefill(target, state, 0, list(prompt))
    states = {len(prompt): snapshot(state, len(prompt))}
    for token in output[:-1]:
        decode_step(target, state, 0, token)
        states[state.lengths[0]] = snapshot(state, state.lengths[0])
    return states


def speculative_states(
    pair: Pair,
    prompt: Sequence[int],
    params: SamplingParams,
    options: EngineConfig,
    schedule: Sequence[int] | None,
    reference: GenerationResult,
) -> dict[int, StateSnapshot]:
    states: dict[int, StateSnapshot] = {}

    def record(state: TargetState, length: int) -> None:
        states[length] = snapshot(state, length)

    oracle = None
    if schedule is not None:
        oracle = OracleProposer(reference.output_ids, schedule, pair.target.config.vocab_size)
    generate_speculative(
        pair.target, pair.draft, list(prompt), params, options, oracle=oracle, on_commit=record
    )
    return states


def assert_states_close(
    expected: dict[int, StateSnapshot], got: dict[int, StateSnapshot], atol: float, what: str
) -> int:
    """Every committed length in `got` has a state within atol of `expected`'s; returns
    how many lengths were compared."""
    if not got:
        raise AssertionError(f"{what}: no commit was observed")
    for length, snap in got.items():
        if length not in expected:
            raise AssertionError(f"{what}: committed length {length} never reached by the reference")
        for name, tensor in snap.items():
            ref = expected[length][name]
            err = (tensor.double() - ref.double()).abs().max().item() if tensor.numel() else 0.0
            if not err <= atol:
                raise AssertionError(
                    f"{what}: at committed length {length}, {name} differs by {err:.3g} (tolerance {atol:g})"
                )
    return len(got)


# ------------------------------------------------------------------ the batched engine
@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_step: int  # the engine step before which it is added
    schedule: tuple[int, ...] | None = None  # oracle acceptance schedule, or the real draft


def run_engine(
    engine,
    requests: Sequence[EngineRequest],
    references: dict[str, list[int]],
    abort: dict[str, int] | None = None,
) -> dict[str, list[int]]:
    """Feed requests at their arrival steps, stream until done; returns each request's
    streamed tokens. `abort` maps request id -> the step at which it is aborted."""
    from reference_engine.runtime.oracle import OracleProposer

    pending = sorted(requests, key=lambda r: r.arrival_step)
    streamed: dict[str, list[int]] = {r.request_id: [] for r in requests}
    abort = dict(abort or {})
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            oracle = None
            if r.schedule is not None:
                oracle = OracleProposer(references[r.request_id], r.schedule, engine.target.config.vocab_size)
            engine.add_request(r.request_id, list(r.prompt), r.params, oracle=oracle)
        for request_id, at in list(abort.items()):
            if at == step:
                engine.abort(request_id)
                del abort[request_id]
        for out in engine.step():
            streamed[out.request_id].extend(out.new_token_ids)
        step += 1
        if step > 100000:
            raise AssertionError("engine made no progress in 100000 steps")
    return streamed


def assert_batch_equivalent(
    streamed: dict[str, list[int]], references: dict[str, list[int]], what: str, skip: Sequence[str] = ()
) -> None:
    for request_id, expected in references.items():
        if request_id in skip:
            continue
        if request_id not in streamed:
            raise AssertionError(
                f"{what}: request {request_id} streamed nothing (it is not among the outputs)"
            )
        got = streamed[request_id]
        if got != expected:
            i = next(
                (j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(got), len(expected))
            )
            raise AssertionError(
                f"{what}: request {request_id} differs from plain greedy alone at output "
                f"position {i}: expected {expected[i : i + 3]}..., got {got[i : i + 3]}..."
            )


# ------------------------------------------------------------------ padding within a pooled cache
# A captured prefill pads a chunk to its token bucket and writes the padding's keys and values;
# on a pooled KV cache those rows must stay inside the cells the request holds. The mix:
# (prompt tokens, max_tokens, arrival step). "x" holds the first cell and ends at once; "c",
# admitted with it, holds the cells after it and decodes on; "b" then takes the first cell
# again and arrives with "d", whose first chunk falls in a larger token bucket than b's. A
# batched prefill that pads b to d's bucket writes past b's cell into c's prompt.
PADDING_MIX = {"x": (4, 2, 0), "c": (60, 40, 0), "b": (4, 2, 3), "d": (60, 10, 3)}
PADDING_CELL = 16  # tokens a cell
PADDING_POOL = 256  # tokens: 16 cells
PADDING_MAX_LEN = 128


def padding_mix_prompts(source: Sequence[int]) -> dict[str, list[int]]:
    """The mix's prompts, each a different stretch of `source` (cycled to length)."""
    source = list(source)
    return {
        rid: [source[(i * 7 + k) % len(source)] for k in range(n)]
        for i, (rid, (n, _, _)) in enumerate(PADDING_MIX.items())
    }


def run_padding_mix(
    target: CausalLM, draft: DFlashDraft | None, prompts: dict[str, list[int]], numerics: str | None = None
) -> dict[str, list[int]]:
    """Run PADDING_MIX on a pooled engine (CUDA graphs where the device has them); returns
    each request's output. Raises AssertionError when the engine did not place the requests as
    the mix means (b back in the first cell, c's run right after it, b and d admitted in one
    step): the run would then not exercise padding next to a live request."""
    from reference_engine.runtime.engine import Engine

    config = EngineConfig(
        max_num_seqs=4,
        block_size=8 if draft is not None else None,
        commit_strategy="per_token",
        max_model_len=PADDING_MAX_LEN,
        kv_cache_tokens=PADDING_POOL,
        kv_cell_tokens=PADDING_CELL,
        numerics=numerics,
    )
    engine = Engine(target, draft, config)
    requests = [
        EngineRequest(rid, tuple(prompts[rid]), SamplingParams(max_tokens=m, ignore_eos=True), at)
        for rid, (_, m, at) in PADDING_MIX.items()
    ]
    placed: dict[str, tuple[int, int]] = {}  # request -> (its first cell, the step that admitted it)
    admit = engine.scheduler.admit

    def admitted():
        seqs = admit()
        for seq in seqs:
            placed[seq.request_id] = (seq.cell, engine.steps)
        return seqs

    engine.scheduler.admit = admitted
    outputs = run_engine(engine, requests, {})
    cell = {rid: at for rid, (at, _) in placed.items()}
    admitted = {rid: when for rid, (_, when) in placed.items()}
    assert cell.get("b") == cell.get("x") == 0 and cell.get("c") == 1, f"cells {cell}: not the mix's layout"
    assert admitted.get("b") == admitted.get("d") and admitted["b"] > admitted["c"], f"admitted at {admitted}"
    return outputs


@contextmanager
def recorded_verifies(engine: Engine) -> Iterator[list]:
    """Every verify `engine` runs inside the block, in order: (each row's request id, None for
    a padding row; its block; positions; logits). ModelRunner.verify is put back as it was
    (a planted fault's, inside `planted`), not as a monkeypatch would put it back at
    teardown, after the fault is gone."""
    seen: list[tuple[list[str | None], torch.Tensor, torch.Tensor, torch.Tensor]] = []
    verify = ModelRunner.verify

    def recording(self, block, positions, slots, valid, kv_len, *args, **kwargs):
        out = verify(self, block, positions, slots, valid, kv_len, *args, **kwargs)
        owner = {seq.slot: rid for rid, seq in engine.scheduler.active.items()}
        rows = [owner.get(s) for s in slots.tolist()]
        seen.append((rows, block.clone(), positions.clone(), out.logits.detach().clone()))
        return out

    ModelRunner.verify = recording
    try:
        yield seen
    finally:
        ModelRunner.verify = verify


def verify_gaps(
    seen: list, sequences: dict[str, list[int]], reference: dict[str, dict], tolerance: float
) -> tuple[int, list[str]]:
    """Compare each recorded verify's logits (`recorded_verifies`) with plain decode's at the
    same position (`reference[request][position]`), over each row's own tokens (up to a
    rejected draft token or padding) of `sequences` (prompt + output). Returns (positions
    compared, the ones further apart than `tolerance`, described)."""
    compared, worst = 0, []
    for rows, block, positions, logits in seen:
        for r, name in enumerate(rows):
            if name is None:
                continue  # a padding row
            ids = sequences[name]
            for j in range(block.shape[1]):
                p = int(positions[r, j])
                if p >= len(ids) - 1 or block[r, : j + 1].tolist() != ids[p - j : p + 1]:
                    break  # past the request's own tokens: a rejected draft token or padding
                gap = float((logits[r, j] - reference[name][p]).abs().max())
                compared += 1
                if gap > tolerance:
                    worst.append(f"request {name} position {p} (block slot {j}): max |diff| {gap:.3g}")
    return compared, worst

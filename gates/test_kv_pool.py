"""Gate: a pooled KV cache (reference_engine/runtime/kv_pool.py) changes no output. A mix of
long and short requests runs on a pool too small to hold them all at once: requests wait
for cells with slots free, finished requests' cells are taken again by others, and every
request's output, plain and DFlash, equals plain greedy decode alone; the pool holds fewer
tokens than slots x the longest room, and after every step no two live requests hold one cell.
A request arriving at a freed gap one cell shorter than its run is placed after it, and a
request whose run is the whole pool is admitted. Planted faults: an allocator that starts a
run in the middle of the run before it (two live requests write the same rows), caught as
output != plain greedy; one that fills a gap one cell short (live requests share a cell);
one that never hands out the pool's last cell."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams

from .checks import Pair, padding_mix_prompts, require_block, run_padding_mix
from .faults import FAULTS, planted

# prefill_padding_past_cells shows only where prefills are captured: gates/test_exact_gpu.py
CATCHES = ("kv_pool_overlapping_runs", "kv_pool_gap_one_cell_short", "kv_pool_last_cell_unused")
BLOCK = 8
CELL = 8  # tokens a cell
POOL = 128  # tokens: 16 cells, about two of the long requests at once
MAX_MODEL_LEN = 96
# (prompt tokens, max_tokens): rooms of 5 to 10 cells, one block included
MIX = ((5, 20), (40, 10), (9, 30), (60, 8), (3, 24), (25, 12))


@dataclass
class PoolRun:
    outputs: dict[str, list[int]]
    waited: int = 0  # steps that left a request waiting for cells while a slot was free
    reused: set[int] = field(default_factory=set)  # cells two requests held one after the other
    shared: set[tuple[int, str, str]] = field(default_factory=set)  # (cell, request, request) held at once
    outside: set[tuple[int, str]] = field(default_factory=set)  # (cell, request) past the pool's end
    pool_tokens: int = 0  # rows of one layer's pool
    slot_tokens: int = 0  # what the unpooled cache would hold: slots x room


def requests(pair: Pair) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(31)
    vocab = pair.target.config.vocab_size - 16
    return {
        f"r{i}": ([rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=m, ignore_eos=True))
        for i, (n, m) in enumerate(MIX)
    }


def run_pooled(pair: Pair, speculative: bool) -> PoolRun:
    config = EngineConfig(
        max_num_seqs=4,
        block_size=BLOCK if speculative else None,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=POOL,
        kv_cell_tokens=CELL,
        numerics=pair.numerics,
    )
    engine = Engine(pair.target, pair.draft if speculative else None, config)
    wanted = requests(pair)
    run = PoolRun({rid: [] for rid in wanted})
    run.pool_tokens = engine.pool.rows
    run.slot_tokens = config.max_num_seqs * (engine.context_len + engine.block_size)
    for rid, (ids, params) in wanted.items():
        engine.add_request(rid, ids, params)
    holders: dict[int, str] = {}  # cell -> the last request whose run held it
    while engine.has_unfinished():
        for out in engine.step():
            run.outputs[out.request_id].extend(out.new_token_ids)
        scheduler = engine.scheduler
        if scheduler.waiting and scheduler.free_slots:
            run.waited += 1
        now: dict[int, str] = {}  # cell -> the live request that holds it
        for seq in scheduler.active.values():
            for cell in range(seq.cell, seq.cell + engine.cells_needed(seq)):
                if cell in now:
                    run.shared.add((cell, now[cell], seq.request_id))
                if cell >= scheduler.cells.cells:
                    run.outside.add((cell, seq.request_id))
                now[cell] = seq.request_id
                if holders.get(cell, seq.request_id) != seq.request_id:
                    run.reused.add(cell)
                holders[cell] = seq.request_id
    return run


_plain: dict[str, dict[str, list[int]]] = {}


def plain_outputs(pair: Pair) -> dict[str, list[int]]:
    if pair.name not in _plain:
        wanted = requests(pair).items()
        _plain[pair.name] = {rid: generate_plain(pair.target, ids, p).output_ids for rid, (ids, p) in wanted}
    return _plain[pair.name]


def assert_pooled_equals_plain(pair: Pair, speculative: bool) -> PoolRun:
    run = run_pooled(pair, speculative)
    mode = "DFlash" if speculative else "plain"
    # no two live requests ever hold one cell, and no run reaches past the pool
    assert not run.shared, (
        f"{pair.name}: {mode}: live requests share cells of the pooled KV cache: {sorted(run.shared)[:4]}"
    )
    assert not run.outside, (
        f"{pair.name}: {mode}: runs past the end of the pooled KV cache: {sorted(run.outside)[:4]}"
    )
    for rid, want in plain_outputs(pair).items():
        assert run.outputs[rid] == want, f"{pair.name}: {mode} on a pooled KV cache != plain greedy for {rid}"
    return run


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_a_pooled_cache_changes_no_output_for_a_mix_of_long_and_short_requests(pair: Pair, mode: str) -> None:
    require_block(pair, BLOCK)
    run = assert_pooled_equals_plain(pair, mode == "dflash")
    assert run.waited > 0, "the pool never made a request wait: the gate does not exercise it"
    assert run.reused, "no cell was held by two requests in turn: the gate does not exercise reuse"
    assert run.pool_tokens < run.slot_tokens


def test_an_allocator_that_overlaps_runs_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("kv_pool_overlapping_runs"), pytest.raises(AssertionError, match="pooled KV cache"):
        assert_pooled_equals_plain(pair, False)


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_a_request_back_in_a_freed_cell_beside_a_live_one_changes_no_output(pair: Pair, mode: str) -> None:
    """The mix the GPU tier runs under CUDA graphs (gates/checks.py PADDING_MIX): a short
    request takes a freed cell right before a live request's run, admitted in one step with a
    request of a larger prefill bucket. Here, without graphs, it checks the placement the GPU
    gate relies on and that every output equals plain greedy alone."""
    require_block(pair, 8)
    prompts = padding_mix_prompts(pair.prompts[-1])
    got = run_padding_mix(pair.target, pair.draft if mode == "dflash" else None, prompts, pair.numerics)
    for rid, ids in prompts.items():
        params = SamplingParams(max_tokens=len(got[rid]) or 1, ignore_eos=True)
        want = generate_plain(pair.target, ids, params).output_ids
        assert got[rid] == want, f"{pair.name}: {mode} {rid} on a pooled KV cache != plain greedy"


def test_the_padding_fault_groups_first_chunks_across_token_buckets() -> None:
    """prefill_padding_past_cells (planted by the GPU gate) groups a pooled cache's first
    chunks as if there were no pool: a 5-token chunk shares a group with a 60-token one."""
    from types import SimpleNamespace

    from reference_engine.runtime.model_runner import ModelRunner

    graphs = SimpleNamespace(prefill_buckets=(16, 32, 64), prefill_fits=lambda rows, longest: True)
    graphs.token_bucket = lambda n: next(t for t in graphs.prefill_buckets if t >= n)
    runner = SimpleNamespace(graphs=graphs, state=SimpleNamespace(pool=object()))
    assert ModelRunner.prefill_groups(runner, [5, 60]) == [[0], [1]]
    with planted("prefill_padding_past_cells"):
        assert ModelRunner.prefill_groups(runner, [5, 60]) == [[0, 1]]
    assert runner.state.pool is not None
    assert "pad" in FAULTS["prefill_padding_past_cells"].description


# a freed gap one cell shorter than the next request's run: "a" (2 cells) and "b" (6 cells)
# are admitted together, "a" ends, and "c" (3 cells) arrives while "b" runs on
GAP = {"a": (5, 3), "b": (9, 30), "c": (9, 7)}  # (prompt tokens, max_tokens)


def assert_a_gap_too_short_is_skipped(pair: Pair) -> None:
    config = EngineConfig(
        max_num_seqs=4,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=POOL,
        kv_cell_tokens=CELL,
    )
    engine = Engine(pair.target, pair.draft, replace(config, numerics=pair.numerics))
    rng = random.Random(7)
    vocab = pair.target.config.vocab_size - 16
    wanted = {
        rid: ([rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=m, ignore_eos=True))
        for rid, (n, m) in GAP.items()
    }
    for rid in ("a", "b"):
        engine.add_request(rid, *wanted[rid])
    held: dict[str, tuple[int, int]] = {}
    outputs = {rid: [] for rid in wanted}
    while engine.has_unfinished():
        if "c" not in held and "a" in held and not engine.scheduler.known.get("a"):
            engine.add_request("c", *wanted["c"])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        now: dict[int, str] = {}
        for seq in engine.scheduler.active.values():
            held.setdefault(seq.request_id, (seq.cell, engine.cells_needed(seq)))
            for cell in range(seq.cell, seq.cell + engine.cells_needed(seq)):
                assert cell not in now, (
                    f"{pair.name}: live requests {now[cell]} and {seq.request_id} share cell {cell} of "
                    f"the pooled KV cache (runs {held})"
                )
                now[cell] = seq.request_id
    # the layout the check needs: c's run is one cell longer than the gap a left before b
    assert held["a"][0] == 0 and held["b"][0] == held["a"][1] and held["c"][1] == held["a"][1] + 1, held
    for rid, (ids, params) in wanted.items():
        want = generate_plain(pair.target, ids, params).output_ids
        assert outputs[rid] == want, f"{pair.name}: {rid} on a pooled KV cache != plain greedy"


def test_a_freed_gap_too_short_for_a_run_is_skipped(pair: Pair) -> None:
    require_block(pair, BLOCK)
    assert_a_gap_too_short_is_skipped(pair)


def test_an_allocator_that_fills_a_gap_one_cell_short_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("kv_pool_gap_one_cell_short"), pytest.raises(AssertionError, match="share cell"):
        assert_a_gap_too_short_is_skipped(pair)


def assert_a_run_of_the_whole_pool_is_admitted(pair: Pair) -> None:
    """A request whose run needs every cell of the pool is admitted and finishes (a pool that
    never hands out its last cell would keep it waiting for ever)."""
    config = EngineConfig(
        max_num_seqs=2,
        block_size=BLOCK,
        max_model_len=POOL - BLOCK,
        kv_cache_tokens=POOL,
        kv_cell_tokens=CELL,
    )
    engine = Engine(pair.target, pair.draft, replace(config, numerics=pair.numerics))
    rng = random.Random(11)
    ids = [rng.randrange(pair.target.config.vocab_size - 16) for _ in range(20)]
    params = SamplingParams(max_tokens=POOL - BLOCK - 20, ignore_eos=True)
    engine.add_request("whole", ids, params)
    assert engine.cells_needed(engine.get("whole")) == POOL // CELL, (
        "the request does not need the whole pool"
    )
    for _ in range(4 * POOL):
        if not engine.has_unfinished():
            break
        engine.step()
    else:
        raise AssertionError(
            f"{pair.name}: a request whose run is the whole pooled KV cache was never admitted"
        )
    want = generate_plain(pair.target, ids, params).output_ids
    assert engine.collect("whole").output_ids == want, (
        f"{pair.name}: the whole pool's request != plain greedy"
    )


def test_a_run_of_the_whole_pool_is_admitted(pair: Pair) -> None:
    require_block(pair, BLOCK)
    assert_a_run_of_the_whole_pool_is_admitted(pair)


def test_an_allocator_that_never_hands_out_the_last_cell_is_caught(pair: Pair) -> None:
    require_block(pair, BLOCK)
    with planted("kv_pool_last_cell_unused"), pytest.raises(AssertionError, match="never admitted"):
        assert_a_run_of_the_whole_pool_is_admitted(pair)

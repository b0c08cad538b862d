"""The pooled KV cache (reference_engine/runtime/kv_pool.py): runs of cells, the overlapping
view the kernels address, the engine's admission by cells, its errors, and the memory plan."""

from __future__ import annotations

import pytest
import torch

from reference_engine.errors import ConfigError, RequestError
from reference_engine.runtime.kv_pool import CellAllocator, PoolLayout
from reference_engine.runtime.memory import GiB, StateCost, plan_memory


def test_runs_are_first_fit_consecutive_and_freed_whole() -> None:
    cells = CellAllocator(10)
    assert cells.allocate(4) == 0 and cells.allocate(3) == 4 and cells.allocate(4) is None
    assert cells.free_cells == 3 and cells.largest_free_run == 3
    cells.free(0)
    assert cells.allocate(2) == 0  # the first hole that fits
    assert cells.allocate(3) == 7  # the 2 cells left at the start are too few
    assert cells.largest_free_run == 2 and cells.free_cells == 2
    with pytest.raises(RuntimeError, match="does not start a live run"):
        cells.free(1)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_lowest_free_run_that_fits_as_a_cell_map_finds_it(seed: int) -> None:
    """Random allocations and frees against a map of every cell: each allocation starts at
    the lowest cell from which `count` cells are free (a hole of exactly `count` included,
    and the run that ends at the last cell), None only when there is none; the free count and
    the largest free run are the map's."""
    import random

    rng = random.Random(seed)
    total = 24
    cells, used = CellAllocator(total), [False] * total
    live: dict[int, int] = {}
    for _ in range(300):
        if live and rng.random() < 0.45:
            first = rng.choice(sorted(live))
            cells.free(first)
            for c in range(first, first + live.pop(first)):
                used[c] = False
        else:
            count = rng.randint(1, 8)
            fits = [s for s in range(total - count + 1) if not any(used[s : s + count])]
            got = cells.allocate(count)
            assert got == (fits[0] if fits else None), (count, used)
            if got is not None:
                live[got] = count
                for c in range(got, got + count):
                    used[c] = True
        assert cells.free_cells == used.count(False)
        runs = "".join("." if not u else "x" for u in used).split("x")
        assert cells.largest_free_run == max(len(r) for r in runs)


def test_a_row_of_the_view_starts_at_its_cell_and_the_spare_row_after_every_cell() -> None:
    layout = PoolLayout(cells=4, cell_tokens=8, room=20)
    assert layout.rows == 4 * 8 + 20 and layout.spare_cell == 4
    cache = layout.cache(2, 3, torch.float32, torch.device("cpu"))
    pool = cache._base
    assert cache.shape == (5, 20, 2, 3) and pool.shape == (52, 2, 3)
    rows, positions = torch.tensor([1, 4]), torch.tensor([[0, 19], [0, 19]])
    cache[rows[:, None], positions] = torch.arange(1.0, 5.0).view(2, 2, 1, 1).expand(2, 2, 2, 3)
    assert pool[8, 0, 0] == 1 and pool[8 + 19, 1, 2] == 2  # row 1: cell 1 onwards
    assert pool[32, 0, 0] == 3 and pool[32 + 19, 0, 0] == 4  # the spare row: past the 4 cells
    assert torch.equal(cache.index_select(0, torch.tensor([1]))[0, 19], pool[27])


def test_a_pool_must_hold_one_request_of_the_full_room() -> None:
    with pytest.raises(ConfigError, match="does not hold one request of the full room"):
        PoolLayout.for_tokens(100, 16, 120)
    assert PoolLayout.for_tokens(100, 16, 100).cells == 7  # whole cells: 112 tokens
    with pytest.raises(ConfigError, match="kv_cell_tokens must be positive"):
        PoolLayout.for_tokens(100, 0, 10)


def test_a_pool_of_exactly_one_room_is_accepted_and_a_cell_of_no_tokens_is_named() -> None:
    """The pool need only hold one request of the full room: C x S equal to the room is
    enough. A layout built directly with cells of 0 tokens is refused for that reason, not
    for the pool's size."""
    assert PoolLayout(cells=4, cell_tokens=8, room=32).rows == 64
    with pytest.raises(ConfigError, match="does not hold one request"):
        PoolLayout(cells=4, cell_tokens=8, room=33)
    with pytest.raises(ConfigError, match="kv_cell_tokens must be positive, got 0"):
        PoolLayout(cells=4, cell_tokens=0, room=32)


def test_the_engine_admits_by_cells_and_any_request_of_the_context_fits_the_pool(tiny_checkpoint) -> None:
    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams

    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    config = EngineConfig(max_num_seqs=3, max_model_len=40, kv_cache_tokens=48, kv_cell_tokens=8)
    engine = Engine(target, None, config)
    assert engine.pool.cells == 6 and engine.state.k_cache[0].shape[:2] == (7, 40)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(rid, [3] * 10, long)  # 10 + 20 + 0 tokens: 4 cells each
    engine.step()
    assert [s.request_id for s in engine.scheduler.active.values()] == ["a"]
    assert len(engine.scheduler.free_slots) == 2 and [s.request_id for s in engine.scheduler.waiting] == ["b"]
    assert engine.state.cell_of.tolist() == [0, 6, 6]  # unplaced slots sit on the spare row
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.cells.free_cells == 6
    # the longest request the context admits (40 tokens: 5 cells) fits the empty pool; a pool
    # smaller than the room is refused at start, so no request waits for ever
    engine.add_request("c", [3] * 30, SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.cells_needed(engine.get("c")) == 5
    with pytest.raises(RequestError, match="exceeds the context of 40 tokens"):
        engine.add_request("d", [3] * 30, SamplingParams(max_tokens=25))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ConfigError, match="does not hold one request of the full room"):
        Engine(target, None, EngineConfig(max_model_len=40, kv_cache_tokens=32, kv_cell_tokens=8))


def test_a_request_waiting_for_cells_is_not_passed_by_a_later_smaller_one(tiny_checkpoint) -> None:
    """Admission is first come, first served: a request whose run of cells is not free yet
    holds the queue, so a stream of small requests cannot starve a large one."""
    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams

    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    config = EngineConfig(max_num_seqs=3, max_model_len=40, kv_cache_tokens=48, kv_cell_tokens=8)
    engine = Engine(target, None, config)
    engine.add_request("a", [3] * 10, SamplingParams(max_tokens=20, ignore_eos=True))  # 4 of 6 cells
    engine.step()
    engine.add_request("big", [3] * 30, SamplingParams(max_tokens=10, ignore_eos=True))  # 5 cells
    engine.add_request("small", [3] * 4, SamplingParams(max_tokens=4, ignore_eos=True))  # 1 cell
    order = []
    while engine.has_unfinished():
        engine.step()
        for rid in ("big", "small"):
            if rid not in order and engine.get(rid).slot is not None:
                order.append(rid)
        if "small" in order:
            assert "big" in order, "small was admitted while big waited for its cells"
    assert order == ["big", "small"]


def test_the_memory_plan_counts_the_pool_not_slots_times_the_room() -> None:
    cost = StateCost(per_token=128 * 1024, per_slot=1000)
    args = dict(total=100 * GiB, utilization=0.9, weights=16 * GiB, activations=2 * GiB, cost=cost)
    pooled = plan_memory(**args, slots=65, room=32784, max_num_seqs=64, max_model_len=32768, pool_rows=300000)
    assert pooled.state == 65 * 1000 + 300000 * 128 * 1024
    assert "a pooled KV cache of 300000 tokens for 65 slots" in pooled.describe()
    with pytest.raises(ConfigError) as info:
        plan_memory(**args, slots=65, room=32784, max_num_seqs=64, max_model_len=32768, pool_rows=10**6)
    message = str(info.value)
    assert "a pooled KV cache of 1000000 tokens" in message and "lower --kv-cache-tokens" in message
    fit = (pooled.budget - 65 * 1000) // (128 * 1024)
    assert f"at most {fit - 32784} fits" in message and "\n" not in message


def test_a_pooled_state_of_exactly_the_budget_fits() -> None:
    """A pooled KV cache whose state is exactly the budget is accepted; one row more is
    refused."""
    cost = StateCost(per_token=1024, per_slot=0)
    args = dict(total=100 * GiB, utilization=1.0, weights=16 * GiB, activations=2 * GiB, cost=cost)
    rows = 82 * GiB // 1024
    exact = plan_memory(**args, slots=4, room=48, max_num_seqs=3, max_model_len=32, pool_rows=rows)
    assert exact.state == exact.budget == 82 * GiB
    with pytest.raises(ConfigError, match="lower --kv-cache-tokens"):
        plan_memory(**args, slots=4, room=48, max_num_seqs=3, max_model_len=32, pool_rows=rows + 1)


def test_the_kv_cache_usage_is_the_share_of_cells_held_and_is_exported(tiny_checkpoint) -> None:
    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams
    from reference_engine.serving.async_engine import EngineTotals
    from reference_engine.serving.metrics import ServerMetrics

    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    config = EngineConfig(max_num_seqs=3, max_model_len=40, kv_cache_tokens=64, kv_cell_tokens=8)
    pooled = Engine(target, None, config)
    slots = Engine(target, None, EngineConfig(max_num_seqs=4, max_model_len=40))
    for engine in (pooled, slots):
        engine.add_request("a", [3] * 10, SamplingParams(max_tokens=20, ignore_eos=True))  # 4 cells
        engine.step()
    assert pooled.kv_cache_usage() == 4 / 8 and slots.kv_cache_usage() == 1 / 4
    page, _ = ServerMetrics().render(EngineTotals.of(pooled))
    assert b"dflash:kv_cache_usage_perc 0.5" in page


def test_a_request_holds_the_cells_its_padded_prefill_writes_and_batches_keep_their_buckets(
    tiny_checkpoint,
) -> None:
    """A captured prefill pads a chunk to its token bucket and writes the padding's rows: a
    request's run covers its last chunk's bucket, and a batched first prefill only groups
    chunks of one bucket (a short row padded to a long row's bucket would write past its
    run)."""
    from types import SimpleNamespace

    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.graphs import padded_end
    from reference_engine.runtime.model_runner import ModelRunner
    from reference_engine.runtime.request import SamplingParams

    assert padded_end(20, 64, 200) == 32 and padded_end(64, 64, 200) == 64 and padded_end(70, 64, 200) == 80
    assert padded_end(130, 64, 140) == 130  # the last chunk's bucket (16) would pass the room: eager
    target = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    pool = dict(kv_cache_tokens=200, kv_cell_tokens=4)
    config = EngineConfig(max_num_seqs=3, max_model_len=100, prefill_chunk=64, **pool)
    engine = Engine(target, None, config)
    engine.add_request("a", [3] * 17, SamplingParams(max_tokens=1))
    assert engine.cells_needed(engine.get("a")) == 8  # 17 tokens padded to 32, past 17 + 1
    graphs = SimpleNamespace(prefill_buckets=(16, 32, 64), prefill_fits=lambda rows, longest: True)
    graphs.token_bucket = lambda n: next(t for t in graphs.prefill_buckets if t >= n)
    runner = SimpleNamespace(graphs=graphs, state=engine.state)
    assert ModelRunner.prefill_groups(runner, [5, 20, 30, 10, 12]) == [[0], [1, 2], [3, 4]]
    runner.state = SimpleNamespace(pool=None)  # without a pool one group pads them all
    assert ModelRunner.prefill_groups(runner, [5, 20, 30, 10, 12]) == [[0, 1, 2, 3, 4]]


def test_batched_prefill_groups_first_chunks_by_their_own_lengths() -> None:
    """A pooled cache holds a prompt's cells up to its own first chunk's bucket
    (`Engine.cells_needed`), so the grouping that decides each row's padding must see each
    first chunk's own length, not the chunk size: a short prompt grouped as a full chunk
    would be padded past its cells into the next request's."""
    from types import SimpleNamespace

    from reference_engine.runtime.prefill import Prefill
    from reference_engine.runtime.request import SamplingParams
    from reference_engine.runtime.sequence import Sequence

    seen: list[list[int]] = []

    def groups(lengths: list[int]) -> list[list[int]]:
        seen.append(list(lengths))
        return [[i] for i in range(len(lengths))]

    runner = SimpleNamespace(captured=True, prefill_groups=groups, prefill_batch=lambda chunks: None)
    prefill = Prefill(runner, None, None, chunk=64)
    seqs = []
    for i, (n, done) in enumerate([(17, 0), (200, 0), (64, 0), (90, 64)]):
        seq = Sequence(f"r{i}", [3] * n, SamplingParams(max_tokens=4), frozenset(), 0.0, False, slot=i)
        seq.prefilled = done
        seqs.append(seq)
    rest = prefill.batched(seqs, outputs=None)
    assert seen == [[17, 64, 64]]  # the first chunks only, each its own length
    # the later chunk, then the first chunks no captured prefill took
    assert [s.request_id for s in rest] == ["r3", "r0", "r1", "r2"]

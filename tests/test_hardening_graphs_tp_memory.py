"""Contracts of the runtime's fixed-shape and sizing pieces, on tiny CPU shapes:

- CUDA-graph bookkeeping (runtime/graphs.py): token and batch buckets at their edges, the
  smallest bucket a batch replays in, padding rows per (rows, width), the shared logits
  buffers, the static inputs a capture starts from, and the order of a step's replays
  (verify, accept, the next draft's inputs and its head). Stand-in graphs record their
  replays, as in test_graphs.py; the captures themselves run in the GPU tier.
- tensor parallelism (runtime/tensor_parallel.py): the query and KV heads each rank keeps,
  what a sharded target carries over, and the launch checks of a group.
- the pooled KV cache's layout (runtime/kv_pool.py) and the memory plan (runtime/memory.py):
  the cache's dtype and device, the activation peak, and the numbers that the start-up line
  and the refusals name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reference_engine.bench.shapes import TARGET_SHAPES
from reference_engine.checkpoint import load_target
from reference_engine.config import TargetConfig
from reference_engine.errors import ConfigError, RequestError
from reference_engine.models import expected_shapes
from reference_engine.runtime.forwards import DraftHidden, Logits, Proposals, StepInputs, Verified
from reference_engine.runtime.graphs import (
    EngineGraphs,
    SharedLogits,
    _Graph,
    packed_inputs,
    padded_end,
    prefill_shapes,
    token_buckets,
)
from reference_engine.runtime.kv_pool import PoolLayout
from reference_engine.runtime.memory import GiB, MemoryPlan, StateCost, plan_memory
from reference_engine.runtime.tensor_parallel import (
    Shard,
    TensorParallel,
    attention_heads,
    init_tensor_parallel,
    shard_plan,
    shard_target,
    sharded_config,
)

PAD = 9


# ----------------------------------------------------------------------------- graphs
class Recorded:
    """Stands in for a captured graph: replay() logs its name, and a verify's stand-in
    writes each row's slot and valid length into its tokens."""

    def __init__(self, name: str, log: list[str], inputs: StepInputs | None = None, outputs=None) -> None:
        self.name, self.log, self.inputs, self.outputs = name, log, inputs, outputs

    def replay(self) -> None:
        self.log.append(self.name)
        if isinstance(self.outputs, Verified):
            self.outputs.tokens.copy_(self.inputs.slots * 10 + self.inputs.valid)


def bare_graphs(buckets: tuple[int, ...], block_size: int = 4) -> EngineGraphs:
    """An EngineGraphs with no graph captured yet, on the CPU, its spare slot PAD."""
    g = EngineGraphs.__new__(EngineGraphs)
    g.pad_slot, g.device, g.buckets, g.block_size = PAD, torch.device("cpu"), buckets, block_size
    g._paddings = {}
    g.decode_graphs, g.draft_graphs, g.draft_head_graphs = {}, {}, {}
    g.verify_graphs, g.commit_graphs, g.accept_graphs, g.ahead_graphs = {}, {}, {}, {}
    g.prefill_graphs = {}
    g.verified = g.accepted = g.drafted = None
    g.remaining = None
    g.draft = None  # an eager draft head would fail: every head here must replay
    return g


def add_verify(g: EngineGraphs, bucket: int, width: int, log: list[str]) -> StepInputs:
    inputs = g.static_inputs(bucket, width)
    outputs = Verified(
        logits=torch.zeros(bucket, width, 3), features=None, tokens=torch.zeros(bucket, dtype=torch.int64)
    )
    g.verify_graphs[bucket, width] = _Graph(
        Recorded(f"verify {bucket}x{width}", log, inputs, outputs), inputs, outputs
    )
    return inputs


def add_draft(g: EngineGraphs, bucket: int, widths: tuple[int, ...], log: list[str]) -> StepInputs:
    """The bucket's draft graph and the head graph of each verify width."""
    B = g.block_size
    inputs = g.static_inputs(bucket, B)
    hidden = DraftHidden(torch.zeros(bucket, B, 2))
    g.draft_graphs[bucket, B] = _Graph(Recorded(f"draft {bucket}", log), inputs, hidden)
    for w in widths:
        out = Proposals(torch.zeros(bucket, w, 3), torch.full((bucket, w), bucket, dtype=torch.int64))
        g.draft_head_graphs[bucket, w] = _Graph(Recorded(f"head {bucket}x{w}", log), inputs, out)
    return inputs


def block(rows: int, width: int) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(rows * width).view(rows, width) + 1
    return ids, ids + 100, torch.arange(rows), torch.full((rows,), width)


def test_a_token_bucket_of_exactly_the_slots_room_is_kept() -> None:
    """No prefill bucket reaches past the slot's room; one that ends exactly at it fits."""
    assert token_buckets(512, 128) == (16, 32, 64, 128)
    assert token_buckets(512, 127) == (16, 32, 64)
    assert token_buckets(64, 64) == (16, 32, 64)


def test_a_last_chunk_padded_to_exactly_the_room_writes_up_to_the_room() -> None:
    """A last chunk whose bucket ends exactly at the slot's room is padded to it (a captured
    prefill runs it); one position less of room and it runs eagerly, unpadded."""
    assert padded_end(130, 64, 144) == 144  # 2 tokens at 128, bucket 16: 128 + 16 = 144
    assert padded_end(130, 64, 143) == 130
    assert padded_end(5, 64, 16) == 16


def test_a_chunk_larger_than_the_batch_budget_raises_the_budget_to_one_chunk() -> None:
    """The (rows, tokens) buckets hold at most max(PREFILL_BATCH_TOKENS, chunk) tokens: with a
    chunk of 4096, four rows of 1024 tokens (4096 in all) are a bucket, eight are not."""
    shapes = prefill_shapes((1, 2, 4, 8), (16, 1024, 4096), 4096)
    assert (4, 1024) in shapes and (8, 1024) not in shapes
    assert (8, 16) in shapes and (1, 4096) in shapes and (2, 4096) not in shapes


def test_shared_logits_follow_the_vocabulary_and_dtype_of_the_logits_they_hold() -> None:
    """A bucket's buffer is remade when the logits it holds come over another vocabulary or
    in another dtype: the held copy has the logits' shape, dtype and values."""
    shared = SharedLogits(capacity=3)
    shared.hold(torch.randn(2, 3, 5))
    wider = torch.randn(2, 2, 7)
    held = shared.hold(wider)
    assert held.shape == (2, 2, 7) and torch.equal(held, wider)
    assert shared.buffers[2].shape == (6, 7)
    double = torch.randn(2, 3, 7, dtype=torch.float64)
    held = shared.hold(double)
    assert held.dtype == torch.float64 and torch.equal(held, double)


def test_the_static_inputs_of_a_capture_are_rows_on_the_spare_slot_with_every_token_valid() -> None:
    """A capture starts from ids 0, positions 0..width-1, every row on the spare slot and
    valid for the whole width, all views of one packed buffer."""
    g = bare_graphs((2,))
    x = g.static_inputs(2, 3)
    assert x.ids.tolist() == [[0, 0, 0]] * 2 and x.positions.tolist() == [[0, 1, 2]] * 2
    assert x.slots.tolist() == [PAD, PAD] and x.valid.tolist() == [3, 3]
    assert x.packed.shape == (2 * 2 * 3 + 2 * 2,) and x.packed.dtype == torch.int64
    again = packed_inputs(x.packed, 2, 3)
    assert torch.equal(again.valid, x.valid) and again.ids.data_ptr() == x.packed.data_ptr()


def test_a_batch_replays_in_the_smallest_bucket_that_holds_it() -> None:
    """Of buckets 1, 2, 4 and 8, a batch of 3 rows replays in 4, of 2 in 2, of 8 in 8, and
    the step's verify is kept under that bucket (the key its commit replays by)."""
    log: list[str] = []
    g = bare_graphs((1, 2, 4, 8))
    for b in g.buckets:
        add_verify(g, b, 3, log)
    for rows, bucket in ((3, 4), (2, 2), (8, 8), (1, 1)):
        out = g.verify(*block(rows, 3))
        assert log[-1] == f"verify {bucket}x3" and g.verified == (bucket, 3)
        assert out.tokens.tolist() == [10 * r + 3 for r in range(rows)]


def test_padding_rows_are_made_for_each_width_of_a_bucket() -> None:
    """Two verify widths of one bucket, each with one padding row: each replay's padding row
    has its own width's positions, on the spare slot with one valid token."""
    log: list[str] = []
    g = bare_graphs((4,))
    wide, narrow = add_verify(g, 4, 3, log), add_verify(g, 4, 2, log)
    g.verify(*block(3, 3))
    g.verify(*block(3, 2))
    assert log == ["verify 4x3", "verify 4x2"]
    assert wide.positions[3].tolist() == [0, 1, 2] and narrow.positions[3].tolist() == [0, 1]
    assert narrow.slots.tolist() == [0, 1, 2, PAD] and narrow.valid.tolist() == [2, 2, 2, 1]


def test_the_token_bucket_of_a_chunk_is_the_smallest_that_holds_it() -> None:
    """A chunk of exactly a bucket's tokens takes that bucket; longer than every bucket: None."""
    g = bare_graphs((1,))
    g.prefill_buckets = (16, 32, 64)
    assert [g.token_bucket(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert g.token_bucket(65) is None


def test_a_prefill_chunk_whose_bucket_ends_exactly_at_the_slots_end_replays() -> None:
    """A chunk of 10 tokens at position 32 of a slot of 48 positions fits the bucket of 16
    exactly (its padding writes up to the slot's last position): it replays, padded."""
    log: list[str] = []
    g = bare_graphs((1,))
    g.state = type("State", (), {"max_len": 48})()
    inputs = g.static_inputs(1, 16)
    logits = Logits(torch.arange(4.0)[None])
    g.prefill_graphs = {(1, 16): _Graph(Recorded("prefill", log), inputs, logits)}
    out = g.prefill([(list(range(1, 11)), 32, 5)])
    assert log == ["prefill"] and out.logits.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert inputs.positions.tolist() == [list(range(32, 48))] and inputs.valid.tolist() == [10]
    assert inputs.ids.tolist() == [[*range(1, 11), *[0] * 6]] and inputs.slots.tolist() == [5]
    assert g.prefill([(list(range(1, 11)), 33, 5)]) is None  # one past the end: eager


def test_the_draft_head_replays_for_the_bucket_the_draft_replayed_in() -> None:
    """A draft of 3 rows replays in bucket 4, and its head at the verify width is bucket 4's
    head graph (not an eager head): the proposals are that graph's first 3 rows."""
    log: list[str] = []
    g = bare_graphs((2, 4))
    add_draft(g, 2, (1, 3), log)
    add_draft(g, 4, (1, 3), log)
    ids, positions, slots, valid = block(3, 4)
    proposals = g.propose(ids, positions, slots, valid, width=3)
    assert log == ["draft 4", "head 4x3"] and g.drafted == 4
    assert proposals.tokens.shape == (3, 3) and proposals.tokens.eq(4).all()


def step_graphs(log: list[str]) -> EngineGraphs:
    """Bucket 4 of a block of 4: a verify of width 3, its accept and the next draft's inputs
    queued behind the accept, the draft and its head at width 2."""
    g = bare_graphs((4,))
    verify = add_verify(g, 4, 3, log)
    add_draft(g, 4, (2,), log)
    table = torch.zeros(4, 5, dtype=torch.int64)
    g.accept_graphs[4, 3] = _Graph(Recorded("accept", log), verify, table)
    g.ahead_graphs[4, 3] = _Graph(Recorded("ahead", log), verify, None)
    g.remaining = torch.ones(4, dtype=torch.int64)
    return g


def test_the_next_draft_replays_ahead_only_after_this_steps_accept_replayed() -> None:
    """propose_ahead runs right after a replayed accept: the queued inputs, the bucket's draft
    and its head, with each row's tokens left written for the queued inputs to read. Before
    any accept, and after a later verify whose accept did not replay, it replays nothing."""
    log: list[str] = []
    g = step_graphs(log)
    remaining = torch.tensor([5, 6, 7])
    assert g.propose_ahead(remaining, 2) is None
    g.verify(*block(3, 3))
    table = g.accept(3)
    assert table.shape == (3, 5)
    inputs, proposals = g.propose_ahead(remaining, 2)
    assert log == ["verify 4x3", "accept", "ahead", "draft 4", "head 4x2"]
    assert g.remaining.tolist() == [5, 6, 7, 1] and inputs.ids.shape == (3, 4)
    assert proposals.tokens.shape == (3, 2)
    g.verify(*block(3, 3))  # the next step's verify, its accept not replayed (eager)
    assert g.propose_ahead(remaining, 2) is None
    assert log[-1] == "verify 4x3"


def test_an_eager_verify_leaves_no_accept_to_replay() -> None:
    """A verify that ran eagerly (no graph of its width) is not followed by the captured
    accept of an earlier verify."""
    log: list[str] = []
    g = step_graphs(log)
    g.verify(*block(3, 3))
    g.verify(*block(3, 2))  # no graph of width 2: eager
    assert g.accept(3) is None and log == ["verify 4x3"]


# ----------------------------------------------------------------------------- tensor parallelism
def test_more_kv_heads_than_ranks_split_evenly_and_fewer_are_copied_by_query_group() -> None:
    """Qwen3.5-4B's 16 query and 4 KV heads: over 2 ranks each keeps 8 query and 2 KV heads;
    over 8 ranks each keeps 2 query heads and the one KV head they read (ranks 2r and 2r+1
    share KV head r)."""
    config = TargetConfig.from_hf(TARGET_SHAPES["qwen3.5-4b"])
    assert [attention_heads(config, TensorParallel(r, 2, "exact")) for r in range(2)] == [
        ((0, 8), (0, 2)),
        ((8, 8), (2, 2)),
    ]
    assert [attention_heads(config, TensorParallel(r, 8, "exact"))[1] for r in range(8)] == [
        (r // 2, 1) for r in range(8)
    ]
    shapes = expected_shapes(config)
    name = next(n for n in shapes if n.endswith("self_attn.k_proj.weight"))
    plan = shard_plan(config, shapes, TensorParallel(1, 2, "exact"))
    assert plan[name] == Shard(0, ((2 * config.head_dim, 2 * config.head_dim),))
    assert sharded_config(config, TensorParallel(1, 2, "exact")).num_key_value_heads == 2


def test_a_group_with_an_unknown_numerics_is_refused() -> None:
    """The numerics decide how the reductions add; an unknown one is refused by name."""
    with pytest.raises(ValueError, match="numerics must be one of exact, fast, got 'loose'"):
        TensorParallel(0, 2, "loose")


def test_a_size_below_one_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size of 0 is refused as a size, not as a group of the wrong number of processes."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RequestError, match="--tensor-parallel-size must be at least 1, got 0"):
        init_tensor_parallel(0, torch.device("cpu"), "exact", "generate")


def test_more_processes_than_the_size_fail_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started four processes for a size of 2: refused, naming both numbers and the
    launch line, before any process group is joined."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RequestError) as info:
        init_tensor_parallel(2, torch.device("cpu"), "exact", "serve")
    message = str(info.value)
    assert "--tensor-parallel-size 2 needs 2 processes" in message and "a group of 4" in message
    assert "torchrun --nproc-per-node 2 -m reference_engine.serve" in message and "\n" not in message


def test_a_rank_without_a_local_rank_takes_the_gpu_of_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without LOCAL_RANK a rank's GPU is the one of its RANK: rank 1 on a host with one
    visible GPU has none of its own, and is told so with both numbers."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RequestError, match=r"local rank 1 has no GPU of its own \(1 visible here\)"):
        init_tensor_parallel(2, torch.device("cuda"), "exact", "generate")


def test_a_sharded_target_keeps_its_source_and_is_not_sharded_again(qwen3_checkpoint) -> None:
    """shard_target carries the checkpoint's path over to the rank's model, and refuses a
    model that is already one rank's slice (its tensors would be cut twice)."""
    whole = load_target(qwen3_checkpoint, dtype=torch.float32)
    tp = TensorParallel(0, 2, "exact")
    sharded = shard_target(whole, tp)
    assert sharded.source_path == whole.source_path and sharded.tensor_parallel is tp
    with pytest.raises(ValueError, match="the target is already sharded"):
        shard_target(sharded, tp)


# ----------------------------------------------------------------------------- KV pool and memory
def test_a_pools_cache_is_made_in_the_dtype_and_on_the_device_asked_for() -> None:
    """One layer's pool: zeros of the asked dtype on the asked device (the meta device here,
    which allocates nothing), viewed as [C + 1, L, heads, dim] over C x S + L rows."""
    layout = PoolLayout(cells=3, cell_tokens=4, room=8)
    cache = layout.cache(2, 5, torch.bfloat16, torch.device("meta"))
    assert cache.device.type == "meta" and cache.dtype == torch.bfloat16
    assert cache.shape == (4, 8, 2, 5) and cache.stride() == (4 * 10, 10, 5, 1)
    assert cache._base.shape == (3 * 4 + 8, 2, 5)
    cpu = layout.cache(1, 1, torch.float64, torch.device("cpu"))
    assert cpu.dtype == torch.float64 and not cpu._base.any()


def budget_plan(**overrides) -> MemoryPlan:
    """A card of 100 GiB at F = 1, 16 GiB of weights and 2 of activations: 82 GiB of budget."""
    args = {
        "total": 100 * GiB,
        "utilization": 1.0,
        "weights": 16 * GiB,
        "activations": 2 * GiB,
        "cost": StateCost(per_token=1024, per_slot=0),
        "slots": 4,
        "room": 2**20,
        "max_num_seqs": 3,
        "max_model_len": 2**20 - 16,
    }
    return plan_memory(**{**args, **overrides})


def test_the_start_up_line_names_the_states_size_and_the_budgets_terms() -> None:
    """describe(): the state's own size (4 slots x 2^20 tokens x 1 KiB = 4 GiB), then the
    budget and each term it is made of."""
    line = budget_plan().describe()
    assert line == (
        "memory: state 4.00 GiB reserved (4 slots x 1048576 tokens x 1024 B/token + 0 B/slot) of a "
        "budget of 82.00 GiB = 1 x 100.00 GiB - weights 16.00 GiB - activations 2.00 GiB"
    )


def test_the_no_memory_refusal_names_the_share_of_the_device() -> None:
    """F x total is worked out in the message: 0.15 x 100 GiB = 15 GiB, less than the weights."""
    with pytest.raises(ConfigError) as info:
        budget_plan(utilization=0.15)
    assert (
        "no memory left for the state: 0.15 x 100.00 GiB of device memory = 15.00 GiB, but the "
        "weights take 16.00 GiB and the activations 2.00 GiB"
    ) in str(info.value)


def test_the_refusal_counts_the_states_slots_spare_slot_included() -> None:
    """The state has one slot more than max_num_seqs (the CUDA graphs' spare slot): the budget's
    tokens are spread over the state's slots, and the message says so, beside what the user
    asked for."""
    with pytest.raises(ConfigError) as info:
        budget_plan(slots=17, max_num_seqs=16, room=2**23 + 16, max_model_len=2**23)
    message = str(info.value)
    fit = 82 * GiB // 1024
    assert f"holds {fit} tokens over 17 slots" in message
    assert "max_num_seqs 16 x max_model_len 8388608" in message and str(17 * (2**23 + 16)) in message


def test_the_activation_peak_is_what_the_largest_forwards_allocate_past_their_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """activation_peak builds a throwaway state of `rows` slots, each of a prefill's tokens and
    one block, on the target's device, and reports the peak allocated while the forwards
    run less what was allocated once that state existed."""
    import reference_engine.runtime.memory as memory

    allocated = {"now": 100, "peak": 100}
    built: list[tuple] = []

    def build(slots: int, room: int, device: torch.device) -> list:
        built.append((slots, room, device))
        allocated["now"] += 4000  # the state
        return ["state", "draft state"]

    def forwards(target, draft, ops, state, draft_state, rows, block_size, prefill_tokens, record) -> None:
        assert (state, draft_state, rows, block_size, prefill_tokens) == ("state", "draft state", 3, 8, 64)
        allocated["peak"] = allocated["now"] + 250

    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["peak"])
    monkeypatch.setattr(memory, "largest_forwards", forwards)
    device = torch.device("meta")
    target = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.empty(1, device=device)))
    )
    peak = memory.activation_peak(
        target, None, None, build, rows=3, block_size=8, prefill_tokens=64, record=None
    )
    assert peak == 250 and built == [(3, 64 + 8, device)]

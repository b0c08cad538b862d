"""CUDA-graph bookkeeping (reference_engine/runtime/graphs.py) without a GPU: buckets, the
replay path's copying of a batch into its bucket's static inputs with padding rows on the
spare slot, and prefill chunks padded to their token bucket (run through the real prefill
body on the CPU, whose outputs must equal the eager engine's). A stand-in graph computes its
outputs from the static inputs when replayed, as a captured one would. The captures
themselves run in the GPU tier (gates/test_exact_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from reference_engine.runtime.forwards import Logits, StepInputs, Verified
from reference_engine.runtime.graphs import (
    EngineGraphs,
    SharedLogits,
    _Graph,
    buckets_up_to,
    packed_inputs,
    prefill_shapes,
    token_buckets,
)

PAD = 9


class Recomputing:
    """Stands in for a captured verify: replay() recomputes the outputs from the inputs (its
    "tokens" encode each row's ids, slot and valid length, its "logits" echo the positions)."""

    def __init__(self, inputs: StepInputs, outputs: Verified) -> None:
        self.inputs, self.outputs = inputs, outputs

    def replay(self) -> None:
        x = self.inputs
        self.outputs.tokens.copy_(x.ids[:, -1] * 100 + x.slots * 10 + x.valid)
        self.outputs.logits.copy_(x.positions)


def graphs_with(bucket: int, width: int) -> EngineGraphs:
    g = EngineGraphs.__new__(EngineGraphs)
    g.pad_slot, g.device, g.buckets = PAD, torch.device("cpu"), (bucket,)
    g._paddings = {}
    packed = torch.full((2 * bucket * width + 2 * bucket,), -1, dtype=torch.int64)
    inputs = packed_inputs(packed, bucket, width)
    outputs = Verified(
        logits=torch.zeros(bucket, width, dtype=torch.int64),
        features=None,
        tokens=torch.zeros(bucket, dtype=torch.int64),
    )
    g.verify_graphs = {(bucket, width): _Graph(Recomputing(inputs, outputs), inputs, outputs)}
    g.decode_graphs, g.draft_graphs = {}, {}
    return g


def test_buckets_cover_every_batch_size_up_to_the_slots() -> None:
    assert buckets_up_to(16) == (1, 2, 4, 8, 16)
    assert buckets_up_to(12) == (1, 2, 4, 8, 12)
    assert buckets_up_to(1) == (1,)


def test_a_batch_replays_in_its_bucket_with_padding_rows_on_the_spare_slot() -> None:
    g = graphs_with(bucket=4, width=3)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    positions = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    out = g.verify(ids, positions, torch.tensor([0, 2, 5]), torch.tensor([3, 2, 1]))
    assert out.tokens.tolist() == [303, 622, 951]  # only the batch's rows come back
    assert out.logits.tolist() == positions.tolist()
    inputs = g.verify_graphs[4, 3].inputs
    assert inputs.ids.tolist() == [*ids.tolist(), [0, 0, 0]]
    assert inputs.positions.tolist() == [*positions.tolist(), [0, 1, 2]]
    assert inputs.slots.tolist() == [0, 2, 5, PAD] and inputs.valid.tolist() == [3, 2, 1, 1]
    # a smaller batch next, its positions a slice of wider blocks (not contiguous): the rows
    # it leaves become padding again
    wider = torch.tensor([[40, 41, 42, 43, 44]])
    out = g.verify(ids[:1], wider[:, :3], torch.tensor([4]), torch.tensor([3]))
    assert out.tokens.tolist() == [343] and out.logits.tolist() == [[40, 41, 42]]
    assert inputs.slots.tolist() == [4, PAD, PAD, PAD] and inputs.valid.tolist() == [3, 1, 1, 1]
    assert inputs.ids[1:].eq(0).all() and inputs.positions[1:].tolist() == [[0, 1, 2]] * 3
    # a full bucket: no padding
    four = torch.arange(12).view(4, 3)
    g.verify(four, four + 100, torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 3]))
    assert inputs.ids.tolist() == four.tolist() and inputs.positions.tolist() == (four + 100).tolist()
    assert inputs.slots.tolist() == [1, 2, 3, 4] and inputs.valid.tolist() == [1, 2, 3, 3]


def test_a_decode_replay_writes_ids_positions_and_slots_and_leaves_valid_as_captured() -> None:
    g = graphs_with(bucket=4, width=1)
    g.decode_graphs, g.verify_graphs = g.verify_graphs, {}
    inputs = g.decode_graphs[4, 1].inputs
    out = g.decode(torch.tensor([[7], [8]]), torch.tensor([[30], [31]]), torch.tensor([2, 3]))
    assert out.tokens.tolist() == [700 + 20 - 1, 800 + 30 - 1]  # valid: as the buffer held it
    assert inputs.ids.tolist() == [[7], [8], [0], [0]] and inputs.positions.tolist() == [[30], [31], [0], [0]]
    assert inputs.slots.tolist() == [2, 3, PAD, PAD] and inputs.valid.tolist() == [-1] * 4


def test_each_captured_verify_width_replays_its_own_graph_and_commit() -> None:
    g = graphs_with(bucket=4, width=3)
    narrow = graphs_with(bucket=4, width=2)
    g.verify_graphs.update(narrow.verify_graphs)
    wide, short = with_commit(g, 4, 3), with_commit(narrow, 4, 2)
    g.commit_graphs.update(narrow.commit_graphs)
    ids = torch.ones(2, 2, dtype=torch.int64)
    out = g.verify(ids, ids, torch.tensor([0, 1]), torch.tensor([2, 1]))
    assert out.tokens.tolist() == [102, 111] and g.verified == (4, 2)
    assert g.commit(torch.tensor([1, 2]))
    assert (short.replays, wide.replays) == (1, 0)


def test_the_verify_widths_of_a_bucket_share_one_logits_buffer() -> None:
    """Each width's logits are a copy in the first rows x (W + 1) rows of the bucket's buffer:
    the values come through, a narrower width's view aliases the wider's, and buckets and
    blocks wider than the buffer are told apart."""
    shared = SharedLogits(capacity=4)
    wide = torch.randn(2, 4, 5)
    held = shared.hold(wide)
    assert torch.equal(held, wide) and held.data_ptr() != wide.data_ptr()
    narrow = torch.randn(2, 2, 5)
    held_narrow = shared.hold(narrow)
    assert torch.equal(held_narrow, narrow) and held_narrow.data_ptr() == held.data_ptr()
    assert torch.equal(held.reshape(8, 5)[:4], narrow.reshape(4, 5))  # the wide view sees it
    other = shared.hold(torch.randn(1, 3, 5))  # another bucket: a buffer of its own
    assert other.data_ptr() != held.data_ptr() and set(shared.buffers) == {1, 2}
    assert shared.buffers[2].shape == (8, 5)
    with pytest.raises(ValueError, match="a block of 5 tokens in logits buffers of 4"):
        shared.hold(torch.randn(2, 5, 5))


def test_shapes_without_a_graph_run_eagerly() -> None:
    g = graphs_with(bucket=4, width=3)
    ids = torch.zeros(2, 2, dtype=torch.int64)  # a last block shorter than B
    assert g.verify(ids, ids, torch.tensor([0, 1]), torch.tensor([2, 2])) is None
    assert g.decode(ids[:, :1], ids[:, :1], torch.tensor([0, 1])) is None  # none captured
    big = torch.zeros(9, 3, dtype=torch.int64)  # more rows than the largest bucket
    assert g.verify(big, big, torch.zeros(9, dtype=torch.int64), torch.ones(9)) is None


class Counting:
    """Stands in for a captured commit: counts replays and keeps what it was given."""

    def __init__(self, inputs: StepInputs) -> None:
        self.inputs, self.replays, self.seen = inputs, 0, []

    def replay(self) -> None:
        self.replays += 1
        self.seen.append(self.inputs.processed.tolist())


def with_commit(g: EngineGraphs, bucket: int, width: int = 3) -> Counting:
    verify = g.verify_graphs[bucket, width].inputs
    inputs = StepInputs(
        verify.ids,
        verify.positions,
        verify.slots,
        verify.valid,
        processed=torch.zeros(bucket, dtype=torch.int64),
    )
    counting = Counting(inputs)
    g.commit_graphs = {(bucket, width): _Graph(counting, inputs, None)}
    g.verified = None
    return counting


def test_the_commit_replays_only_after_its_buckets_verify_replayed() -> None:
    g = graphs_with(bucket=4, width=3)
    commit = with_commit(g, 4)
    ids = torch.ones(3, 3, dtype=torch.int64)
    assert not g.commit(torch.tensor([1, 2, 3]))  # no verify yet
    g.verify(ids, ids, torch.tensor([0, 1, 2]), torch.tensor([3, 3, 3]))
    assert g.commit(torch.tensor([1, 2, 3]))
    assert commit.seen == [[1, 2, 3, 1]]  # the padding row keeps its anchor only
    assert not g.commit(torch.tensor([1, 2, 3]))  # once per verify
    short = torch.ones(3, 2, dtype=torch.int64)  # an eager verify (no graph of this width)
    assert g.verify(short, short, torch.tensor([0, 1, 2]), torch.tensor([2, 2, 2])) is None
    assert not g.commit(torch.tensor([1, 1, 1])) and commit.replays == 1


def test_a_replaced_commit_phase_runs_eagerly() -> None:
    """A planted fault replaces a phase method after the capture: the step must run it, so
    the captured commit (the reference methods) is not replayed."""
    from gates.faults import planted
    from reference_engine.runtime.model_runner import ModelRunner
    from reference_engine.runtime.speculative_step import SpeculativeStep

    g = graphs_with(bucket=4, width=3)
    commit = with_commit(g, 4)
    step = SpeculativeStep.__new__(SpeculativeStep)
    step.runner = ModelRunner.__new__(ModelRunner)
    step.runner.graphs = g
    ids = torch.ones(2, 3, dtype=torch.int64)
    for fault, replays in (
        (None, 1),
        ("feature_off_by_one", 1),
        ("skip_state_rollback", 1),
        ("skip_length_rollback", 2),
    ):
        with planted(fault):
            g.verify(ids, ids, torch.tensor([0, 1]), torch.tensor([3, 3]))
            step.commit_replayed(torch.tensor([2, 3]))
        assert commit.replays == replays, fault  # processed is computed before the commit
        assert g.verified is None


def test_prefill_buckets_double_up_to_the_chunk_and_fit_the_slot() -> None:
    assert token_buckets(512, 10_000) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(100, 10_000) == (16, 32, 64, 100)
    assert token_buckets(16, 10_000) == (16,)
    assert token_buckets(8, 10_000) == (8,)
    assert token_buckets(512, 200) == (16, 32, 64, 128)  # no bucket reaches past the slot


def test_batched_prefill_buckets_hold_a_bounded_number_of_tokens() -> None:
    shapes = prefill_shapes((1, 2, 4, 8, 16), (16, 32, 64, 128, 256, 512), 512)
    assert (1, 512) in shapes and (4, 512) in shapes and (8, 512) not in shapes
    assert (16, 128) in shapes and (16, 256) not in shapes
    assert all(r * t <= 2048 for r, t in shapes)
    long = prefill_shapes((1, 2), (16, 1024, 4096), 4096)  # one chunk is the budget
    assert (2, 1024) in long and (1, 4096) in long and (2, 4096) not in long


class Eager:
    """Stands in for a captured prefill: replay() runs the real body on the static inputs."""

    def __init__(self, graphs: EngineGraphs, rows: int, tokens: int) -> None:
        self.graphs, self.replays = graphs, []
        self.inputs = graphs._prefill_inputs(rows, tokens)
        self.outputs = Logits(torch.zeros(rows, graphs.target.config.vocab_size, dtype=graphs.state.dtype))

    def replay(self) -> None:
        x = self.inputs
        self.replays.append(tuple(zip(x.positions[:, 0].tolist(), x.valid.tolist(), x.slots.tolist())))
        self.outputs.logits.copy_(self.graphs._prefill_body(x).logits)


def prefill_graphs(engine, chunk: int, pad_slot: int) -> dict[tuple[int, int], Eager]:
    """Give a CPU engine prefill graphs (stand-ins running the real body) for `chunk`, with
    padding rows on `pad_slot` (a slot no request of the test takes)."""
    g = EngineGraphs.__new__(EngineGraphs)
    g.target, g.draft, g.state, g.draft_state = (
        engine.target,
        engine.draft,
        engine.state,
        engine.draft_state,
    )
    g.ops, g.pad_slot, g.device = engine.ops, pad_slot, engine.device
    g.capture_layers, g.raw_last_layer = engine.runner.capture_layers, engine.runner.raw_last_layer
    g.buckets = buckets_up_to(engine.config.max_num_seqs)
    g.decode_graphs, g.draft_graphs, g.verify_graphs = {}, {}, {}
    g.prefill_buckets = token_buckets(chunk, engine.state.max_len)
    stand_ins = {s: Eager(g, *s) for s in prefill_shapes(g.buckets, g.prefill_buckets, chunk)}
    g.prefill_graphs = {s: _Graph(e, e.inputs, e.outputs) for s, e in stand_ins.items()}
    engine.runner.graphs = g
    return stand_ins


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_prefill_padded_to_its_bucket_changes_no_output(family: str, tiny_pair) -> None:
    """First chunks batched into one bucket (a padding row on a free slot), a later chunk
    alone; chunks padded to 32 or 16 tokens (the Gated DeltaNet and conv states skip the
    padding, the logits are each chunk's last token's, the padded cache and draft-context
    rows are overwritten before they are read): the same tokens, and the same accepted
    counts (the draft's context is right), as the eager engine."""
    from reference_engine.checkpoint import load_draft, load_target
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams

    target_dir, draft_dir = tiny_pair(family, block_size=4)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    prompts = {
        "a": [5, 9, 3, 77, 12],
        "b": [(7 * i + 3) % 500 for i in range(40)],
        "c": [(11 * i + 1) % 500 for i in range(32)],
    }
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, prefill_chunk=32, max_model_len=60)
    runs, replays = {}, None
    for padded in (False, True):
        for spec in (None, draft):
            engine = Engine(target, spec, config)
            if padded:
                stand_ins = prefill_graphs(engine, 32, pad_slot=3)
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, params)
            while engine.has_unfinished():
                engine.step()
            runs[padded, spec is None] = {
                rid: (engine.get(rid).output_ids, [s.accepted for s in engine.get(rid).steps])
                for rid in prompts
            }
            if padded and spec is not None:
                replays = sorted(r for e in stand_ins.values() for r in e.replays)
    assert runs[True, True] == runs[False, True]  # plain
    assert runs[True, False] == runs[False, False]  # DFlash
    assert {rid: out for rid, (out, _) in runs[False, False].items()} == {
        rid: out for rid, (out, _) in runs[False, True].items()
    }
    # rows of (start, valid, slot): the three first chunks and a padding row in (4, 32),
    # then b's last 8 tokens alone in (1, 16)
    assert replays == [((0, 5, 0), (0, 32, 1), (0, 32, 2), (0, 1, 3)), ((32, 8, 1),)]


def test_a_batched_prefill_that_raises_fails_only_the_request_that_raises_alone(qwen3_5_checkpoint) -> None:
    """The batch's rows are reset and retried one by one: the row that raises again fails,
    the others give what they give without it."""
    from reference_engine.checkpoint import load_target
    from reference_engine.runtime.decode import generate_plain
    from reference_engine.runtime.engine import Engine, EngineConfig
    from reference_engine.runtime.request import SamplingParams

    target = load_target(qwen3_5_checkpoint, dtype=torch.float64)
    prompts = {"a": [5, 9, 3, 77, 12], "bad": [13, 4, 4], "c": [40, 8, 1, 2, 3, 4]}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(target, None, EngineConfig(max_num_seqs=4, prefill_chunk=16))
    stand_ins = prefill_graphs(engine, 16, pad_slot=3)
    for e in stand_ins.values():
        correct = e.replay
        e.replay = lambda correct=correct, e=e: (
            (_ for _ in ()).throw(RuntimeError("bad row")) if (e.inputs.ids[:, 0] == 13).any() else correct()
        )
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    bad = engine.get("bad")
    assert bad.finish_reason == "error" and "bad row" in bad.error
    for rid in ("a", "c"):
        assert engine.get(rid).output_ids == generate_plain(target, prompts[rid], params).output_ids
    # the batch and the bad row alone raised; a and c ran alone
    assert {s: len(e.replays) for s, e in stand_ins.items() if e.replays} == {(1, 16): 2}


def test_a_prefill_chunk_near_the_slots_end_runs_eagerly() -> None:
    g = EngineGraphs.__new__(EngineGraphs)
    g.state = type("State", (), {"max_len": 40})()
    g.prefill_graphs = {(1, 16): None, (1, 32): None, (2, 16): None}
    assert g.prefill([(list(range(10)), 30, 0)]) is None  # 30 + 16 > 40
    assert g.prefill([(list(range(10)), 0, 0), (list(range(3)), 30, 1)]) is None
    assert not g.prefill_fits(3, 16) and not g.prefill_fits(2, 17) and g.prefill_fits(1, 17)


def test_inputs_that_do_not_fill_the_graphs_buffer_are_refused() -> None:
    """One concatenation writes the packed buffer, and it would resize its output rather than
    refuse: a batch whose positions are not as wide as its ids is refused by name."""
    g = graphs_with(bucket=4, width=3)
    ids = torch.ones(2, 3, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"inputs of \[\(2, 3\), \(2, 2\), \(2,\), \(2,\)\] for a graph of 4 x 3"
    ):
        g.verify(ids, ids[:, :2], torch.tensor([0, 1]), torch.tensor([3, 3]))
    assert g.verify_graphs[4, 3].inputs.packed.shape == (2 * 4 * 3 + 2 * 4,)

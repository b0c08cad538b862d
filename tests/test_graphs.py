"""CUDA-graph bookkeeping (reference_engine/runtime/graphs.py) without a GPU: buckets, and the
replay path's copying of a batch into its bucket's static inputs with padding rows on the
spare slot. A stand-in graph computes its outputs from the static inputs when replayed, as a
captured one would. The captures themselves run in the GPU tier (gates/test_exact_gpu.py)."""

from __future__ import annotations

import torch

from reference_engine.runtime.graphs import EngineGraphs, _Graph, buckets_up_to

PAD = 9


class Recomputing:
    """Stands in for a captured graph: replay() recomputes the outputs from the inputs."""

    def __init__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        self.inputs, self.outputs = inputs, outputs

    def replay(self) -> None:
        x = self.inputs
        self.outputs["tokens"].copy_(x["ids"][:, -1] * 100 + x["slots"] * 10 + x["valid"])
        self.outputs["positions"].copy_(x["positions"])


def graphs_with(bucket: int, width: int) -> EngineGraphs:
    g = EngineGraphs.__new__(EngineGraphs)
    g.pad_slot, g.device, g.buckets = PAD, torch.device("cpu"), (bucket,)
    inputs = {"ids": torch.zeros(bucket, width, dtype=torch.int64),
              "positions": torch.zeros(bucket, width, dtype=torch.int64),
              "slots": torch.zeros(bucket, dtype=torch.int64),
              "valid": torch.zeros(bucket, dtype=torch.int64)}
    outputs = {"tokens": torch.zeros(bucket, dtype=torch.int64),
               "positions": torch.zeros(bucket, width, dtype=torch.int64)}
    g.verify_graphs = {bucket: _Graph(Recomputing(inputs, outputs), inputs, outputs)}
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
    assert out["tokens"].tolist() == [303, 622, 951]  # only the batch's rows come back
    inputs = g.verify_graphs[4].inputs
    assert inputs["slots"].tolist() == [0, 2, 5, PAD]
    assert inputs["positions"][3].tolist() == [0, 1, 2] and inputs["valid"][3] == 1
    # a smaller batch next: the rows it leaves become padding again
    out = g.verify(ids[:1], positions[:1], torch.tensor([4]), torch.tensor([3]))
    assert out["tokens"].tolist() == [343]
    assert inputs["slots"].tolist() == [4, PAD, PAD, PAD]


def test_shapes_without_a_graph_run_eagerly() -> None:
    g = graphs_with(bucket=4, width=3)
    ids = torch.zeros(2, 2, dtype=torch.int64)  # a last block shorter than B
    assert g.verify(ids, ids, torch.tensor([0, 1]), torch.tensor([2, 2])) is None
    assert g.decode(ids[:, :1], ids[:, :1], torch.tensor([0, 1])) is None  # none captured
    big = torch.zeros(9, 3, dtype=torch.int64)  # more rows than the largest bucket
    assert g.verify(big, big, torch.zeros(9, dtype=torch.int64), torch.ones(9)) is None


class Counting:
    """Stands in for a captured commit: counts replays and keeps what it was given."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs, self.replays, self.seen = inputs, 0, []

    def replay(self) -> None:
        self.replays += 1
        self.seen.append(self.inputs["processed"].tolist())


def with_commit(g: EngineGraphs, bucket: int) -> Counting:
    inputs = {**g.verify_graphs[bucket].inputs,
              "processed": torch.zeros(bucket, dtype=torch.int64)}
    counting = Counting(inputs)
    g.commit_graphs = {bucket: _Graph(counting, inputs, {})}
    g.verified_bucket = None
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
    from reference_engine.runtime.speculate import SpeculativeStep

    g = graphs_with(bucket=4, width=3)
    commit = with_commit(g, 4)
    step = SpeculativeStep.__new__(SpeculativeStep)
    step.graphs = g
    ids = torch.ones(2, 3, dtype=torch.int64)
    for fault, replays in ((None, 1), ("feature_off_by_one", 1), ("skip_state_rollback", 1),
                           ("skip_length_rollback", 2)):
        with planted(fault):
            g.verify(ids, ids, torch.tensor([0, 1]), torch.tensor([3, 3]))
            step.commit_replayed(torch.tensor([2, 3]))
        assert commit.replays == replays, fault  # processed is computed before the commit
        assert g.verified_bucket is None

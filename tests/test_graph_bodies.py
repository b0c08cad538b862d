"""The forwards the engine captures as CUDA graphs (runtime/graphs.py), run eagerly on the
CPU: every prefill, decode, draft and verify body at every bucket, and the speculative step's
commit body, for each family and draft kind and commit strategy. Only a GPU captures them, so
without this a body whose calls no longer fit the models' (a DFlash2 draft's anchors, a
verify's record) would first fail there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime import engine as engine_module
from reference_engine.runtime import model_runner
from reference_engine.runtime.commit import verify_record
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.graphs import EngineGraphs, _Graph

TinyPair = Callable[..., tuple[Path, Path]]


class EagerGraphs(EngineGraphs):
    """Runs each body once where EngineGraphs captures it, and keeps what it returned."""

    def _capture(self, rows, width, body, inputs=None) -> _Graph:
        inputs = inputs or self.static_inputs(rows, width)
        with torch.no_grad():
            return _Graph(None, inputs, body(inputs))

    def step_seconds(self, repeats: int = 3) -> dict:
        return {}  # nothing was captured to time: the engine keeps its flat costs


@pytest.mark.parametrize(
    ("arch", "draft_arch", "strategy"),
    [
        ("qwen3", "dflash", "replay"),
        ("qwen3_5", "dflash", "per_token"),
        ("qwen3_5", "dflash", "recompute"),
        ("qwen3_5", "dflash", "replay"),
        ("qwen3_5", "dflash2", "per_token"),
        ("qwen3", "dflash2", "replay"),
    ],
)
def test_every_captured_body_runs_eagerly(
    tiny_pair: TinyPair, arch: str, draft_arch: str, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine wires its graphs as on a GPU (pad slot, widths, record, layers), with the
    capture replaced by one eager run of each body."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # no CUDA here
    monkeypatch.setattr(engine_module, "graphs_possible", lambda *args: True)
    monkeypatch.setattr(model_runner, "EngineGraphs", EagerGraphs)
    target_dir, draft_dir = tiny_pair(arch, block_size=8, draft_arch=draft_arch)
    target = load_target(target_dir, dtype=torch.float64)
    draft = load_draft(draft_dir, target)
    config = EngineConfig(max_num_seqs=4, max_model_len=64, commit_strategy=strategy, prefill_chunk=16)
    engine = Engine(target, draft, config)
    graphs = engine.runner.graphs
    assert isinstance(graphs, EagerGraphs) and graphs.pad_slot == 4  # the spare slot past the requests'
    assert graphs.record == verify_record(strategy, target)
    vocab = target.config.vocab_size
    widths = {w + 1 for w in graphs.verify_widths}
    assert len(widths) > 1 and set(graphs.verify_graphs) == {(b, w) for b in graphs.buckets for w in widths}
    for (rows, _), g in graphs.decode_graphs.items():
        assert g.outputs.logits.shape == (rows, vocab)
    hidden = target.config.hidden_size
    for (rows, block), g in graphs.draft_graphs.items():
        assert g.outputs.hidden.shape == (rows, block, hidden)  # the layers; heads by width
        full = graphs.draft_head_graphs[rows, block - 1].outputs
        for width in (w for w in graphs.verify_widths if w > 0):
            head = graphs.draft_head_graphs[rows, width].outputs
            # DFlash: logits and tokens; DFlash2 adds the candidates and the edges
            assert (head.candidates is None) == (draft_arch == "dflash")
            assert head.tokens.shape == (rows, width) and head.logits.shape == (rows, width, vocab)
            assert head.logits.untyped_storage().data_ptr() == full.logits.untyped_storage().data_ptr()
    for (rows, width), g in graphs.verify_graphs.items():
        assert g.outputs.logits.shape == (rows, width, vocab)
        # every width of a bucket writes the bucket's one logits buffer (SharedLogits)
        shared = graphs.verify_logits.buffers[rows].untyped_storage().data_ptr()
        assert g.outputs.logits.untyped_storage().data_ptr() == shared
    for (rows, _), g in graphs.prefill_graphs.items():
        assert g.outputs.logits.shape == (rows, vocab)
    assert set(graphs.commit_graphs) == set(graphs.verify_graphs)  # the speculative commit

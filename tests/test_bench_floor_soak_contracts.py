"""Contracts of the benchmark's floors, the soak and the draft-acceptance script, checked on
tiny models, hand-made configurations and a fake clock.

The weight-streaming floor (`reference_engine/bench/floor.py`): a Gated DeltaNet layer's
cache is one [requests x value heads x key dim, value dim] float32 state per request, even for
a bfloat16 model, and an attention layer's is a key and a value per position in the model's
dtype; every product of a floor writes into a buffer of its own exact shape (all of a step's
rows, the prefill's LM head over the last row only); a dense model's floor reports no experts;
the prefill floor's time is the median of its repeats in milliseconds, and its attention
arithmetic counts only the attention layers of a hybrid model.

The soak (`reference_engine/bench/soak.py`): exactly `--requests` requests arrive (a burst
cut to the requests left), each asks
for 8 to `--max-tokens` tokens (both ends allowed), every step is counted; a step that raises
is recorded as an error and fails the soak; a mismatch in the last token is still a mismatch;
`--model` without `--draft` is refused, and so are `--max-tokens` or `--prompt-len` below 8.

The draft table (`reference_engine/bench/drafts.py`) prints each part's own milliseconds.

`scripts/eval_demo_drafts.py` evaluates, by default, every held-out prompt at block sizes 4,
8 and 16 for 128 float32 tokens, and reports mismatches out of the number of prompts; a
block size below 2 and a prompts file missing or not in JSON lines are refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference_engine.bench import drafts, floor, soak
from reference_engine.checkpoint import load_target
from reference_engine.demo import DEMO_DRAFT, demo_prompts
from reference_engine.runtime.engine import Engine

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eval_demo_drafts.py"


def hybrid_model(dtype: torch.dtype) -> SimpleNamespace:
    """What cache_matrices reads of a model: a Gated DeltaNet layer whose key and value head
    dims differ, and a grouped-query attention layer."""
    config = SimpleNamespace(
        layer_types=("linear_attention", "full_attention"),
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        num_key_value_heads=2,
        num_attention_heads=4,
        head_dim=8,
        sliding_window=None,
    )
    embed = SimpleNamespace(weight=torch.zeros(1, 1, dtype=dtype))
    return SimpleNamespace(config=config, model=SimpleNamespace(embed_tokens=embed))


def test_a_gated_deltanet_state_is_read_in_float32_and_attention_keys_in_the_model_dtype() -> None:
    state, kv = floor.cache_matrices(hybrid_model(torch.bfloat16), requests=3, context=10)
    assert state.shape == (3 * 4 * 8, 16) and state.dtype == torch.float32
    assert kv.shape == (2 * 3 * 10, 2 * 8) and kv.dtype == torch.bfloat16


def test_every_floor_product_writes_a_buffer_of_its_exact_shape(tiny_checkpoint) -> None:
    """A product into a buffer of the wrong shape makes torch resize it with a warning: the
    decode floor multiplies all `rows` rows, the prefill floor's LM head the last row only."""
    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        floor.weight_streaming_floor(model, repeats=1, rows=3, context=4)
        floor.prefill_compute_floor(model, 6, repeats=1)


def test_a_dense_floor_reports_no_experts_even_when_given_a_count(tiny_checkpoint) -> None:
    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    assert floor.weight_streaming_floor(model, repeats=1, experts_per_layer=3.0).experts_per_layer is None


def test_the_prefill_floor_is_the_median_of_its_repeats_in_milliseconds(tiny_checkpoint, monkeypatch) -> None:
    """A fake clock: a warm-up, then repeats of 1, 1 and 10 ms."""
    ticks = iter([0.0, 0.5, 1.0, 1.001, 2.0, 2.001, 3.0, 3.010])
    monkeypatch.setattr(floor, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    model = load_target(tiny_checkpoint("qwen3"), dtype=torch.float32)
    got = floor.prefill_compute_floor(model, 4, repeats=3)
    assert (got.ms_median, got.ms_min, got.ms_max) == pytest.approx((1.0, 1.0, 10.0))


def test_the_prefill_floor_counts_attention_only_over_a_hybrid_models_attention_layers(
    tiny_checkpoint,
) -> None:
    model = load_target(tiny_checkpoint("qwen3_5"), dtype=torch.float32)
    c = model.config
    tokens = 12
    every = floor.streamed_weights(model)
    products = sum(2.0 * tokens * w.numel() for w in every if w.shape[0] != c.vocab_size)
    products += sum(2.0 * w.numel() for w in every if w.shape[0] == c.vocab_size)
    attention_layers = sum(k == "full_attention" for k in c.layer_types)
    assert 0 < attention_layers < c.num_hidden_layers
    attention = attention_layers * 2.0 * tokens * tokens * c.num_attention_heads * c.head_dim
    assert floor.prefill_compute_floor(model, tokens, repeats=1).flops == products + attention


def soak_argv(tiny_pair, out: Path, *extra: str) -> list[str]:
    target, draft = tiny_pair("qwen3_5", block_size=8)
    argv = ["--model", str(target), "--draft", str(draft), "--device", "cpu", "--dtype", "float64"]
    return argv + ["--concurrency", "3", "--prompt-len", "12", "--out", str(out), *extra]


def test_a_soak_takes_exactly_its_requests_into_free_slots_and_counts_every_step(
    tiny_pair, tmp_path: Path, monkeypatch
) -> None:
    """With `--max-tokens 8` every request asks for 8 tokens (the range 8 to 8); requests
    arrive only into free slots (running plus waiting never past the concurrency); each loop
    steps the engine once and records the batch size it stepped."""
    add, taken = Engine.add_request, []

    def add_request(self: Engine, *args, **kwargs) -> None:
        add(self, *args, **kwargs)
        if self.draft is not None:  # the engine under soak, not the plain reference
            taken.append(len(self.scheduler.active) + len(self.scheduler.waiting))

    monkeypatch.setattr(Engine, "add_request", add_request)
    out = tmp_path / "soak.json"
    argv = soak_argv(tiny_pair, out, "--requests", "12", "--max-tokens", "8", "--abort-share", "0")
    assert soak.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["arrived"] == result["finished"] == 12 and result["aborted"] == 0
    assert result["output_tokens"] == 12 * 8
    assert len(taken) == 12 and max(taken) <= 3
    assert result["steps"] == sum(result["batch_sizes"].values()) > 0


def test_a_step_that_raises_is_an_error_and_fails_the_soak(tiny_pair, tmp_path: Path, monkeypatch) -> None:
    step = Engine.step

    def failing_step(self: Engine) -> None:
        if self.draft is not None:  # the speculative engine under soak, not the plain reference
            raise RuntimeError("step broke")
        step(self)

    monkeypatch.setattr(Engine, "step", failing_step)
    out = tmp_path / "soak.json"
    assert soak.main(soak_argv(tiny_pair, out, "--requests", "2", "--max-tokens", "8")) == 1
    result = json.loads(out.read_text())
    (error,) = result["errors"]
    assert "RuntimeError: step broke" in error and result["steps"] == 0


def soak_engine() -> SimpleNamespace:
    """What soak.summary reads of an engine: a CPU engine without graphs, two slots."""
    return SimpleNamespace(
        device="cpu",
        runner=SimpleNamespace(captured=False),
        numerics="exact",
        config=SimpleNamespace(max_num_seqs=2),
        stats=lambda: {"spec": {"mean_acceptance_length": 1.0}},
    )


def test_a_soak_output_differing_only_in_its_last_token_is_a_mismatch() -> None:
    engine = soak_engine()
    run = soak.Soak(finished={"a": ([1], 3, [4, 5, 6]), "b": ([2], 2, [7, 8])}, seconds=1.0)
    got = soak.summary(run, {"a": [4, 5, 9], "b": [7, 8]}, engine)
    assert got["mismatches"] == {"a": 2}


def test_a_soaks_throughput_is_its_finished_tokens_over_its_seconds() -> None:
    engine = soak_engine()
    run = soak.Soak(finished={"a": ([1], 3, [4, 5, 6])}, seconds=4.0, output_tokens=10)
    assert soak.summary(run, {"a": [4, 5, 6]}, engine)["output_tokens_per_s"] == 2.5
    assert soak.summary(soak.Soak(), {}, engine)["output_tokens_per_s"] == 0.0


def test_a_soak_of_a_model_without_a_draft_is_refused(tiny_checkpoint, capsys) -> None:
    assert soak.main(["--model", str(tiny_checkpoint("qwen3")), "--device", "cpu"]) == 2
    assert "--model needs --draft" in capsys.readouterr().err


def test_the_draft_parts_table_prints_each_parts_own_milliseconds(capsys) -> None:
    row = {"mode": "dflash", "draft": "dflash2", "numerics": "exact", "concurrency": 1}
    row |= {"ms_draft": 10.0, "n_draft": 5, "ms_conv": 1.0, "n_conv": 5, "ms_selector": 3.0, "n_selector": 5}
    drafts.print_drafts([row])
    assert "exact | 1 | 10.0 | 0.20 | 30.0 | 0.60" in capsys.readouterr().out


def test_the_acceptance_script_evaluates_every_prompt_at_block_sizes_4_8_16_for_128_float32_tokens(
    monkeypatch, capsys
) -> None:
    script = load_script()
    calls = []

    def evaluate(target, draft, prompts, block_sizes, max_tokens):
        calls.append((next(target.parameters()).dtype, prompts, block_sizes, max_tokens))
        row = {"mean_acceptance_length": 1.0, "acceptance_rate": 0.0, "mismatched_requests": 0}
        return {B: row for B in block_sizes}

    monkeypatch.setattr(script, "evaluate", evaluate)
    assert script.main([str(DEMO_DRAFT)]) == 0
    prompts = [row["prompt_ids"] for row in demo_prompts()]
    assert calls == [(torch.float32, prompts, (4, 8, 16), 128)]
    assert f"0 of {len(prompts)} requests differ from plain" in capsys.readouterr().out


def test_a_soak_refuses_max_tokens_or_a_prompt_len_below_eight_in_one_line(capsys) -> None:
    for flag in ("--max-tokens", "--prompt-len"):
        assert soak.main([flag, "5", "--device", "cpu"]) == 2
        assert capsys.readouterr().err == f"error: {flag} must be at least 8, got 5\n"


def load_script():
    spec = importlib.util.spec_from_file_location("eval_demo_drafts", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("text", [None, "not json\n"], ids=["missing", "not-json-lines"])
def test_a_prompts_file_missing_or_not_json_lines_is_refused_in_one_line(
    text: str | None, tmp_path: Path, capsys
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    if text is not None:
        prompts.write_text(text)
    assert load_script().main([str(DEMO_DRAFT), "--prompts", str(prompts), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_demo_drafts.py: ") and err.count("\n") == 1


def test_a_block_size_below_two_is_refused_before_any_evaluation(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        load_script().main([str(DEMO_DRAFT), "--block-sizes", "1,8", "--max-tokens", "2"])
    assert exit.value.code == 2
    assert "--block-sizes must each be at least 2, got '1,8'" in capsys.readouterr().err


def test_a_soak_of_one_request_takes_exactly_one_though_its_first_burst_is_larger(
    tiny_pair, tmp_path: Path
) -> None:
    """Seed 4 draws a first burst of 4 into 4 free slots: the request limit cuts it to 1."""
    out = tmp_path / "soak.json"
    argv = soak_argv(tiny_pair, out, "--requests", "1", "--max-tokens", "8", "--seed", "4")
    assert soak.main([*argv, "--concurrency", "4"]) == 0
    assert json.loads(out.read_text())["arrived"] == 1

"""The entry points' options (engine_args.py, serving/args.py, serving/server.py,
serving/engine_build.py, generate.py, demo.py, errors.py), where the existing tests leave room:

- `--device auto` is the GPU when torch sees one (and the server's engine then steps in a
  process of its own), the CPU otherwise; an explicit `--engine-loop` wins over the device, and
  `--engine-loop process` at two ranks is refused naming both flags.
- `--dtype auto` keeps a full-precision checkpoint's own dtype (float64 or float32) on the CPU
  too: only a half-precision checkpoint moves to float32 there; a wrapper's `text_config`
  names the dtype only where the top level names none.
- `serve` refuses at start, with one `error:` line and exit status 2, a
  `--gpu-memory-utilization` outside (0, 1] (on the CPU too, where it is otherwise ignored)
  and other engine options out of range; 1 itself is taken.
- a `--block-size` larger than the draft's is refused by `serve` and `generate` alike, and the
  draft's own is taken.
- every engine option `serve` offers reaches the engine it builds, as given.
- `generate` with a draft and no `--block-size` runs the draft's block with the `replay` commit,
  reports them, and prints plain greedy decode's tokens; `--dtype` reaches the loaded target,
  `--numerics` the plain loop and the speculative engine; `--top-k 1` sampling is greedy.
- `demo_prompts` reads one prompt a line and skips blank lines; the demo pair's paths hold a
  target, both drafts and the prompts.
- refusals in one line, never a cut or a traceback: a `--max-model-len` past the target's
  max_position_embeddings is refused naming the flag (vLLM refuses it; it was cut to the
  positions without a word), a tokenizer.json the tokenizers library cannot read ends
  `generate` and `serve` with one error line, and a config whose `text_config` is not an
  object is no trouble for `--dtype auto`.

The tiny dense Qwen3 pair of block size 4 (`served_pair`), on the CPU; no server listens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference_engine import generate as generate_module
from reference_engine.demo import DEMO_DRAFT, DEMO_DRAFT2, DEMO_PROMPTS, DEMO_TARGET, demo_prompts
from reference_engine.engine_args import ENGINE_OPTIONS, resolve_device, resolve_dtype
from reference_engine.errors import ConfigError, ReferenceEngineError, exit_with
from reference_engine.generate import GenerateArgs
from reference_engine.generate import main as generate_main
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.engine_build import build_engine, engine_loop_mode
from reference_engine.serving.lifecycle import Lifecycle
from reference_engine.serving.server import main as serve_main
from tests.test_engine_args import GIVEN

PROMPT = "3,17,101,44,9"


def serve(*argv: str) -> ServeArgs:
    return ServeArgs.parse(["--model", "m", *argv])


def start_serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str):
    """(exit status, stdout, stderr) of `serve`'s main with `argv`; one that gets as far as
    listening fails the test instead."""

    def listen(self, config) -> None:
        raise AssertionError(f"serve started listening with {argv}")

    monkeypatch.setattr(Lifecycle, "serve", listen)
    code = serve_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = generate_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, err
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def greedy(capsys: pytest.CaptureFixture[str], target: str, *argv: str) -> dict:
    code, out, err = run_generate(
        capsys,
        "--model",
        target,
        "--prompt-ids",
        PROMPT,
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
        *argv,
    )
    assert code == 0, err
    return json.loads(out)


# ------------------------------------------------------------------ --device and the engine loop
def test_device_auto_is_the_gpu_when_there_is_one_and_the_server_then_steps_in_a_process(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert serve().device == "auto"
    assert GenerateArgs.parse(["--model", "m", "--prompt-ids", "1", "--max-tokens", "1"]).device == "auto"
    assert engine_loop_mode(serve()) == "process"
    assert engine_loop_mode(serve("--engine-loop", "thread")) == "thread"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert engine_loop_mode(serve()) == "thread"
    assert engine_loop_mode(serve("--engine-loop", "process")) == "process"


def test_an_engine_process_at_two_ranks_is_refused_naming_both_flags() -> None:
    with pytest.raises(
        ReferenceEngineError,
        match=r"--engine-loop process runs one rank; with --tensor-parallel-size 2 use --engine-loop thread",
    ):
        engine_loop_mode(serve("--engine-loop", "process", "--tensor-parallel-size", "2"))
    assert engine_loop_mode(serve("--engine-loop", "auto", "--tensor-parallel-size", "2")) == "thread"


# ------------------------------------------------------------------ --dtype auto
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(("named", "expected"), [("float64", torch.float64), ("float32", torch.float32)])
def test_dtype_auto_keeps_a_full_precision_checkpoints_own_dtype_on_every_device(
    tmp_path: Path, capsys, device: str, named: str, expected: torch.dtype
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": named}))
    assert resolve_dtype("auto", str(tmp_path), torch.device(device)) == expected
    assert capsys.readouterr().err == ""


def test_dtype_auto_reads_a_wrappers_text_config_only_when_the_top_level_names_none(tmp_path: Path) -> None:
    config = {"torch_dtype": "float32", "text_config": {"torch_dtype": "bfloat16"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", str(tmp_path), torch.device("cuda")) == torch.float32
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert resolve_dtype("auto", str(tmp_path), torch.device("cuda")) == torch.bfloat16


# ------------------------------------------------------------------ values serve refuses at start
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization: gpu_memory_utilization must be in (0, 1], got 1.5",
        ),
        (
            ["--gpu-memory-utilization", "0"],
            "--gpu-memory-utilization: gpu_memory_utilization must be in (0, 1], got 0.0",
        ),
        (
            ["--gpu-memory-utilization", "-0.5"],
            "--gpu-memory-utilization: gpu_memory_utilization must be in (0, 1], got -0.5",
        ),
        (
            ["--gpu-memory-utilization", "nan"],
            "--gpu-memory-utilization: gpu_memory_utilization must be in (0, 1], got nan",
        ),
        (["--max-num-seqs", "0"], "--max-num-seqs: max_num_seqs must be positive, got 0"),
        (
            ["--prefill-chunk", "64", "--max-num-batched-tokens", "32"],
            "--max-num-batched-tokens: max_num_batched_tokens must be at least",
        ),
        (["--max-model-len", "1"], "--max-model-len: max_model_len must be >= 2, got 1"),
        (["--steps-per-turn", "0"], "--steps-per-turn: steps_per_turn must be >= 1, got 0"),
    ],
    ids=[
        "share-above-1",
        "share-0",
        "share-negative",
        "share-nan",
        "no-slots",
        "budget",
        "context-1",
        "turn-0",
    ],
)
def test_serve_refuses_an_engine_option_out_of_range_at_start_with_one_line(
    served_pair, capsys, monkeypatch, argv: list[str], message: str
) -> None:
    """One line naming the flag the user gave, then what is wrong with its value."""
    target, _ = served_pair
    one_error_line(*start_serve(monkeypatch, capsys, "--model", target, "--device", "cpu", *argv), message)


def test_a_memory_share_of_exactly_1_is_taken(served_pair) -> None:
    target, _ = served_pair
    engine, _, _ = build_engine(serve("--model", target, "--device", "cpu", "--gpu-memory-utilization", "1"))
    assert engine.config.gpu_memory_utilization == 1.0


# ------------------------------------------------------------------ the draft's block size
def test_a_block_size_past_the_drafts_is_refused_by_serve_and_generate_and_the_drafts_own_is_taken(
    served_pair, capsys
) -> None:
    target, draft = served_pair  # the draft's block size is 4
    with pytest.raises(ReferenceEngineError, match=r"block size 5 is larger than the draft supports \(4\)"):
        build_engine(serve("--model", target, "--draft", draft, "--device", "cpu", "--block-size", "5"))
    engine, _, _ = build_engine(
        serve("--model", target, "--draft", draft, "--device", "cpu", "--block-size", "4")
    )
    assert engine.block_size == 4
    argv = ["--model", target, "--draft", draft, "--prompt-ids", PROMPT, "--max-tokens", "4"]
    one_error_line(
        *run_generate(capsys, *argv, "--block-size", "5"),
        "block size 5 is larger than the draft supports (4)",
    )
    code, out, err = run_generate(capsys, *argv, "--block-size", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["block_size"] == 4


# ------------------------------------------------------------------ serve's options reach its engine
# every engine option serve offers, given a value other than its default (tests/test_engine_args.py's;
# checkpoint_every is the engine benchmark's alone), the block size below the draft's 4 and the
# numerics other than the default
SERVED = {**{k: v for k, v in GIVEN.items() if k != "checkpoint_every"}, "block_size": 3, "numerics": "fast"}


def test_every_engine_option_serve_is_given_reaches_the_engine_it_builds(served_pair) -> None:
    target, draft = served_pair
    argv = ["--model", target, "--dflash-draft-model-path", draft, "--device", "cpu", "--max-waiting", "5"]
    for name, value in SERVED.items():
        flag = ENGINE_OPTIONS[name].flags[0]
        argv += [flag] if value is True else [flag, str(value)]
    engine, tp, oracle = build_engine(ServeArgs.parse(argv))
    assert {name: getattr(engine.config, name) for name in SERVED} == SERVED
    assert (engine.config.max_waiting, engine.block_size, engine.context_len) == (5, 3, 300)
    assert (engine.numerics, tp, oracle) == ("fast", None, None)


# ------------------------------------------------------------------ generate
def test_generate_with_a_draft_runs_the_drafts_block_with_replay_and_prints_plain_greedys_tokens(
    served_pair, capsys
) -> None:
    target, draft = served_pair
    plain = greedy(capsys, target)
    spec = greedy(capsys, target, "--draft", draft)
    assert spec["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 8
    assert (spec["block_size"], spec["commit_strategy"]) == (4, "replay")
    assert sum(spec["acceptance_lengths"]) + 1 == 8 and max(spec["acceptance_lengths"]) <= 4
    assert spec["finish_reason"] == plain["finish_reason"] == "length"
    assert "block_size" not in plain and "acceptance_lengths" not in plain


def test_generate_hands_its_dtype_and_numerics_to_the_model_the_loop_and_the_engine(
    served_pair, capsys, monkeypatch
) -> None:
    target, draft = served_pair
    seen: dict[str, object] = {}

    def recording(name: str, original):
        def wrapped(*args, **kwargs):
            seen[name] = (args, kwargs)
            return original(*args, **kwargs)

        return wrapped

    for name in ("load_target", "generate_plain", "generate_speculative"):
        monkeypatch.setattr(generate_module, name, recording(name, getattr(generate_module, name)))
    plain = greedy(capsys, target, "--dtype", "float64", "--numerics", "fast", "--max-model-len", "64")
    assert seen["load_target"][1]["dtype"] == torch.float64
    assert seen["generate_plain"][1]["numerics"] == "fast"
    assert seen["generate_plain"][1]["max_model_len"] == 64
    spec = greedy(capsys, target, "--draft", draft, "--dtype", "float64", "--numerics", "fast")
    config = seen["generate_speculative"][0][4]
    assert (config.numerics, config.block_size, config.max_model_len) == ("fast", 4, None)
    assert spec["output_ids"] == plain["output_ids"]


def test_generate_sampling_with_top_k_1_gives_the_greedy_tokens(served_pair, capsys) -> None:
    target, draft = served_pair
    expected = greedy(capsys, target)["output_ids"]
    sampled = ("--temperature", "1.5", "--seed", "3")
    assert greedy(capsys, target, *sampled, "--top-k", "1")["output_ids"] == expected
    assert greedy(capsys, target, *sampled, "--top-k", "1", "--draft", draft)["output_ids"] == expected
    assert greedy(capsys, target, *sampled)["output_ids"] != expected  # the cut is what makes it greedy


# ------------------------------------------------------------------ the demo pair
def test_demo_prompts_reads_one_prompt_a_line_and_skips_blank_lines(tmp_path: Path) -> None:
    rows = [
        {"file": "a.py", "prompt": "x", "prompt_ids": [1, 2]},
        {"file": "b.py", "prompt": "y", "prompt_ids": [3]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n" + json.dumps(rows[0]) + "\n   \n\n" + json.dumps(rows[1]) + "\n\n")
    assert demo_prompts(path) == rows


def test_the_demo_pair_paths_hold_a_target_both_drafts_and_the_prompts() -> None:
    architectures = {}
    for folder in (DEMO_TARGET, DEMO_DRAFT, DEMO_DRAFT2):
        architectures[folder.name] = json.loads((folder / "config.json").read_text())["architectures"]
    assert architectures[DEMO_DRAFT.name] == ["DFlashDraftModel"]
    assert architectures[DEMO_DRAFT2.name] == ["DFlash2DraftModel"]
    assert "DraftModel" not in architectures[DEMO_TARGET.name][0]
    prompts = demo_prompts()
    assert prompts == demo_prompts(DEMO_PROMPTS) and len(prompts) >= 32
    assert all(row["prompt"] and row["prompt_ids"] for row in prompts)


# ------------------------------------------------------------------ refusals in one line
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_max_model_len_past_the_targets_positions_is_refused(served_pair, capsys, command: str) -> None:
    target, _ = served_pair
    if command == "generate":
        code, out, err = run_generate(
            capsys,
            "--model",
            target,
            "--prompt-ids",
            PROMPT,
            "--max-tokens",
            "2",
            "--max-model-len",
            "100000",
        )
        one_error_line(code, out, err, "--max-model-len")
    else:
        with pytest.raises(ReferenceEngineError, match="max_model_len|max-model-len"):
            build_engine(serve("--model", target, "--device", "cpu", "--max-model-len", "100000"))


def broken_tokenizer(copy_checkpoint, target: str) -> Path:
    path = copy_checkpoint(Path(target))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_generate_refuses_a_tokenizer_it_cannot_read_with_one_line(
    served_pair, copy_checkpoint, capsys
) -> None:
    path = broken_tokenizer(copy_checkpoint, served_pair[0])
    code, out, err = run_generate(capsys, "--model", str(path), "--prompt", "hello", "--max-tokens", "2")
    one_error_line(code, out, err, "tokenizer.json")


def test_serve_refuses_a_tokenizer_it_cannot_read_with_one_line(
    served_pair, copy_checkpoint, capsys, monkeypatch
) -> None:
    path = broken_tokenizer(copy_checkpoint, served_pair[0])
    one_error_line(
        *start_serve(monkeypatch, capsys, "--model", str(path), "--device", "cpu"), "tokenizer.json"
    )


def test_dtype_auto_on_a_text_config_that_is_not_an_object_is_no_traceback(
    served_pair, copy_checkpoint, capsys
) -> None:
    path = copy_checkpoint(Path(served_pair[0]))
    config = json.loads((path / "config.json").read_text())
    del config["torch_dtype"]
    (path / "config.json").write_text(json.dumps({**config, "text_config": "qwen3"}))
    code, out, err = run_generate(capsys, "--model", str(path), "--prompt-ids", PROMPT, "--max-tokens", "2")
    assert code == 0 and "Traceback" not in err, err  # the loader ignores the field; so does auto


def test_errors_are_printed_as_one_line_with_status_2(capsys) -> None:
    assert exit_with(ConfigError("max_num_seqs must be positive, got 0")) == 2
    assert capsys.readouterr() == ("", "error: max_num_seqs must be positive, got 0\n")

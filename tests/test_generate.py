"""The generate command line: JSON and plain-text output for text and token-id prompts, and
bad input reported as one `error:` line with exit code 2 and no traceback.

The main cases run as a user runs them, in a subprocess (about 4 s each, mostly importing
torch; started together in the background, `cli_runs`); the rest call `main(argv)`
in-process, where an escaping exception fails the test just as a traceback would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.generate import main
from reference_engine.runtime.decode import generate_plain
from reference_engine.runtime.request import SamplingParams
from reference_engine.tokenizer import load_tokenizer

from .together import Results, together

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_TEXT = "The quick brown fox jumps over"
PROMPT_IDS = [17, 301, 5, 88, 260, 42, 7]

CopyCheckpoint = Callable[[Path], Path]


def generate_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "reference_engine.generate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def main_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `main(args)`."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def in_process(path: Path, prompt_ids: list[int], **params: object) -> list[int]:
    model = load_target(path, dtype=torch.float64)
    return generate_plain(model, prompt_ids, SamplingParams(**params)).output_ids


BAD_REQUESTS = [
    (
        ["--prompt-ids", "1,2,3,4,5,6", "--max-model-len", "6"],
        "the prompt has 6 tokens but the context holds 6",
    ),
    (["--prompt-ids", ""], "the prompt is empty"),
    (["--prompt-ids", "1,512,3"], "prompt token id(s) [512] outside the vocabulary [0, 512)"),
    (["--prompt-ids", "1,2", "--max-tokens", "0"], "max_tokens must be positive, got 0"),
    (["--prompt-ids", "1,2", "--device", "nonsense"], "nonsense"),
]
BAD_REQUEST_IDS = ["prompt-fills-context", "empty-ids", "id-past-vocab", "max-tokens-zero", "unknown-device"]


@pytest.fixture(scope="module")
def missing_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("missing") / "no-such-model"


@pytest.fixture(scope="module")
def cli_runs(
    request: pytest.FixtureRequest, qwen3_checkpoint: Path, qwen3_5_checkpoint: Path, missing_model: Path
) -> Results:
    """This module's subprocess runs, side by side in the background (tests/together.py)."""
    qwen3 = str(qwen3_checkpoint)
    jobs = {
        "test_json_output_for_a_text_prompt": (
            "--model",
            qwen3,
            "--prompt",
            PROMPT_TEXT,
            "--max-tokens",
            "10",
            "--dtype",
            "float64",
            "--ignore-eos",
            "--json",
        ),
        "test_json_output_for_token_ids_equals_generate_plain": (
            "--model",
            str(qwen3_5_checkpoint),
            "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)),
            "--max-tokens",
            "12",
            "--dtype",
            "float64",
            "--ignore-eos",
            "--json",
        ),
        "test_plain_text_mode_prints_the_decoded_text": (
            "--model",
            qwen3,
            "--prompt",
            PROMPT_TEXT,
            "--max-tokens",
            "6",
            "--dtype",
            "float64",
            "--ignore-eos",
        ),
        **{
            f"test_bad_request_is_one_error_line_with_exit_code_2[{name}]": (
                "--model",
                qwen3,
                "--max-tokens",
                "4",
                *args,
            )
            for name, (args, _) in zip(BAD_REQUEST_IDS, BAD_REQUESTS)
        },
        "test_missing_model_directory_is_one_error_line_with_exit_code_2": (
            "--model",
            str(missing_model),
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "4",
        ),
    }
    return together(request, {name: partial(generate_cli, *args) for name, args in jobs.items()})


# ----------------------------------------------------------------------------- output
def test_json_output_for_a_text_prompt(
    qwen3_checkpoint: Path, cli_runs: Results, request: pytest.FixtureRequest
) -> None:
    path = qwen3_checkpoint
    done = cli_runs[request.node.name]
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    tokenizer = load_tokenizer(path)
    assert out["prompt_ids"] == tokenizer.encode(PROMPT_TEXT).ids
    ids = out["output_ids"]
    assert isinstance(ids, list) and len(ids) == 10
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    assert isinstance(out["text"], str)
    assert out["text"] == tokenizer.decode(ids)
    assert out["finish_reason"] == "length"
    assert ids == in_process(path, out["prompt_ids"], max_tokens=10, ignore_eos=True)


def test_json_output_for_token_ids_equals_generate_plain(
    qwen3_5_checkpoint: Path, cli_runs: Results, request: pytest.FixtureRequest
) -> None:
    done = cli_runs[request.node.name]
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["prompt_ids"] == PROMPT_IDS
    assert out["output_ids"] == in_process(qwen3_5_checkpoint, PROMPT_IDS, max_tokens=12, ignore_eos=True)
    assert out["text"] == load_tokenizer(qwen3_5_checkpoint).decode(out["output_ids"])


def test_stop_ids_end_the_output_with_the_stop_token(
    qwen3_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = in_process(qwen3_checkpoint, PROMPT_IDS, max_tokens=12, ignore_eos=True)
    k = next(k for k in range(2, 12) if reference[k] not in reference[:k])
    code, stdout, stderr = main_in_process(
        capsys,
        "--model",
        str(qwen3_checkpoint),
        "--prompt-ids",
        ",".join(map(str, PROMPT_IDS)),
        "--max-tokens",
        "12",
        "--dtype",
        "float64",
        "--stop-ids",
        f"{reference[k]},9999",
        "--json",
    )
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["output_ids"] == reference[: k + 1]
    assert out["finish_reason"] == "stop"


def test_plain_text_mode_prints_the_decoded_text(
    qwen3_checkpoint: Path, cli_runs: Results, request: pytest.FixtureRequest
) -> None:
    done = cli_runs[request.node.name]
    assert done.returncode == 0, done.stderr
    tokenizer = load_tokenizer(qwen3_checkpoint)
    ids = in_process(qwen3_checkpoint, tokenizer.encode(PROMPT_TEXT).ids, max_tokens=6, ignore_eos=True)
    assert done.stdout == tokenizer.decode(ids) + "\n"


def test_without_a_tokenizer_token_ids_still_work_and_plain_mode_prints_ids(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    (path / "tokenizer.json").unlink()
    ids = in_process(path, PROMPT_IDS, max_tokens=5, ignore_eos=True)
    args = (
        "--model",
        str(path),
        "--prompt-ids",
        ",".join(map(str, PROMPT_IDS)),
        "--max-tokens",
        "5",
        "--dtype",
        "float64",
        "--ignore-eos",
    )
    assert main_in_process(capsys, *args) == (0, " ".join(map(str, ids)) + "\n", "")
    code, stdout, stderr = main_in_process(capsys, *args, "--json")
    assert code == 0
    assert json.loads(stdout)["text"] is None

    code, stdout, stderr = main_in_process(
        capsys, "--model", str(path), "--prompt", "hi", "--max-tokens", "5"
    )
    assert code == 2 and stdout == ""
    assert stderr.startswith("error: ") and "no tokenizer.json" in stderr


# ----------------------------------------------------------------------------- bad input
def assert_one_error_line(code: int, stdout: str, stderr: str, message: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert stdout == ""
    assert stderr.startswith("error: ")
    assert stderr.count("\n") == 1, stderr
    assert message in stderr


@pytest.mark.parametrize(("args", "message"), BAD_REQUESTS, ids=BAD_REQUEST_IDS)
def test_bad_request_is_one_error_line_with_exit_code_2(
    cli_runs: Results, request: pytest.FixtureRequest, args: list[str], message: str
) -> None:
    done = cli_runs[request.node.name]  # generate --model <qwen3> --max-tokens 4 *args
    assert_one_error_line(done.returncode, done.stdout, done.stderr, message)


def test_missing_model_directory_is_one_error_line_with_exit_code_2(
    missing_model: Path, cli_runs: Results, request: pytest.FixtureRequest
) -> None:
    missing = missing_model
    done = cli_runs[request.node.name]
    assert_one_error_line(done.returncode, done.stdout, done.stderr, "no config.json")
    assert done.stderr == f"error: {missing}: no config.json (is this a model directory?)\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prompt-ids", "1,2,3", "--max-model-len", "5"],
            "prompt (3 tokens) + max_tokens (4) = 7 exceeds the context of 5 tokens",
        ),
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt-ids=-1,2"], "prompt token id(s) [-1] outside the vocabulary [0, 512)"),
        (["--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated integers, got '1,x,3'"),
        (["--prompt-ids", "1,,3"], "--prompt-ids must be comma-separated integers, got '1,,3'"),
        (["--prompt-ids", "1,2", "--stop-ids", "a"], "--stop-ids must be comma-separated"),
        (["--prompt-ids", "1,2", "--max-tokens", "-3"], "max_tokens must be positive, got -3"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    ],
    ids=[
        "output-past-context",
        "empty-text",
        "negative-id",
        "non-integer-id",
        "empty-id",
        "non-integer-stop-id",
        "max-tokens-negative",
        "negative-temperature",
        "zero-top-p",
    ],
)
def test_more_bad_requests_are_one_error_line_with_exit_code_2(
    qwen3_checkpoint: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    result = main_in_process(capsys, "--model", str(qwen3_checkpoint), "--max-tokens", "4", *args)
    assert_one_error_line(*result, message)


def test_checkpoint_errors_are_one_error_line_with_exit_code_2(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "mistral"}))
    result = main_in_process(capsys, "--model", str(path), "--prompt-ids", "1", "--max-tokens", "2")
    assert_one_error_line(*result, "unknown model_type 'mistral'")


def test_a_sampled_run_follows_its_seed(capsys: pytest.CaptureFixture[str], qwen3_checkpoint: Path) -> None:
    """--seed seeds the sampling: the same seed gives the same tokens, another seed others."""

    def sampled(seed: int) -> list[int]:
        args = ["--model", str(qwen3_checkpoint), "--prompt-ids", ",".join(map(str, PROMPT_IDS))]
        args += ["--max-tokens", "12", "--dtype", "float64", "--ignore-eos", "--json"]
        code, out, err = main_in_process(capsys, *args, "--temperature", "1.0", "--seed", str(seed))
        assert code == 0, err
        return json.loads(out)["output_ids"]

    first = sampled(5)
    assert sampled(5) == first
    assert sampled(6) != first and sampled(0) != first

"""The gate and the harness against a server we did not write: Hugging Face
`transformers serve` (transformers 5.x, installed from PyPI by `make setup`) serving the
shipped demo target in float32 on the CPU, offline.

It speaks plain OpenAI only: it refuses unknown fields with HTTP 422, takes text prompts
only, reports no token ids, sends usage at the end of a stream and no `data: [DONE]`. So the
harness must probe it, send no extensions, compare text with text and count tokens with the
model's tokenizer. Its greedy output equals our DFlash server's on the same weights (the
gate passes); against our server on other weights the gate fails and names the first
differing token.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from reference_engine.demo import DEMO_TARGET, demo_prompts
from tests.server_process import REPO, ServerProcess, free_port

NUM_PROMPTS = 6
MAX_TOKENS = 24


def transformers_command() -> list[str]:
    script = Path(sys.executable).parent / "transformers"
    found = str(script) if script.is_file() else shutil.which("transformers")
    if found is None:
        pytest.fail("the `transformers` command is missing: make setup installs it (dev extra)")
    return [found]


@pytest.fixture(scope="module")
def transformers_server():
    port = free_port()
    # one intra-op thread: on a small machine it shares the cores with our server
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            *transformers_command(),
            "serve",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            str(DEMO_TARGET),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited: {proc.stdout.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("transformers serve did not become healthy in 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("peer") / "prompts.jsonl"
    rows = demo_prompts()[:NUM_PROMPTS]
    path.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    return path


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def compare(baseline: str, candidate: str, prompts: Path, out: Path) -> tuple[int, dict, str]:
    done = harness(
        "compare",
        "--baseline",
        baseline,
        "--candidate",
        candidate,
        "--tokenizer",
        str(DEMO_TARGET),
        "--prompts",
        str(prompts),
        "--max-tokens",
        str(MAX_TOKENS),
        "--policy",
        "strict",
        "--out",
        str(out),
    )
    summary = json.loads((out / "compare_summary.json").read_text())
    return done.returncode, summary, done.stdout + done.stderr


def test_the_gate_passes_against_transformers_serve_on_the_same_weights(
    transformers_server, demo_dflash_server, prompts_file, tmp_path
) -> None:
    code, summary, log = compare(transformers_server, demo_dflash_server.url, prompts_file, tmp_path / "same")
    assert "server kind openai" in log and "server kind ours" in log, log
    assert code == 0, log
    assert summary["exact"] == summary["prompts"] == NUM_PROMPTS and summary["errors"] == 0
    assert summary["compared"] == "text" and summary["compared_text"] == NUM_PROMPTS
    report = (tmp_path / "same" / "compare.md").read_text()
    assert f"compared {NUM_PROMPTS} (0 by token ids, {NUM_PROMPTS} by text)" in report


@pytest.fixture(scope="module")
def other_weights_server(tmp_path_factory):
    """Our plain server on the demo target with one MLP's weights scaled: other weights."""
    path = tmp_path_factory.mktemp("other_weights") / "target"
    shutil.copytree(DEMO_TARGET, path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.5.mlp.down_proj.weight"
    tensors[name] = (tensors[name].float() * 1.5).to(tensors[name].dtype)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    server = ServerProcess("--model", str(path), "--dtype", "float32")
    yield server
    server.stop()


def test_the_gate_fails_against_a_server_with_other_weights(
    transformers_server, other_weights_server, prompts_file, tmp_path
) -> None:
    code, summary, log = compare(
        transformers_server, other_weights_server.url, prompts_file, tmp_path / "other"
    )
    assert code == 1, log
    assert summary["mismatches"] > 0 and summary["errors"] == 0
    assert "first divergence: position" in log
    rows = [json.loads(line) for line in (tmp_path / "other" / "compare.jsonl").open()]
    first = next(d for r in rows for d in r["divergences"])
    assert first["position"] is not None and first["baseline_token"] != first["candidate_token"]


def test_harness_bench_measures_transformers_serve(transformers_server, tmp_path) -> None:
    out = tmp_path / "bench"
    done = harness(
        "bench",
        "--base-url",
        transformers_server,
        "--tokenizer",
        str(DEMO_TARGET),
        "--builtin",
        "code",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--output-len",
        "16",
        "--warmup",
        "1",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(csv.DictReader((out / "summary.csv").open()))
    assert (row["completed"], row["failed"]) == ("4", "0"), row["errors"]
    assert row["count_source"] == "tokenizer" and row["server_kind"] == "openai"
    assert row["streams_without_done"] == "4" and float(row["output_tokens_per_s"]) > 0
    records = [json.loads(line) for line in (out / "requests.jsonl").open()]
    # the tokenizer's count of the streamed text equals the server's own usage total
    assert all(r["output_tokens"] == r["usage_completion_tokens"] for r in records)
    assert "| A | openai | tokenizer | 4 |" in (out / "report.md").read_text()

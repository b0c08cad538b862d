"""The server at --tensor-parallel-size 2 (reference_engine/serving/followers.py): two gloo
processes under torchrun, rank 0 serving HTTP and rank 1 following its engine step by step,
answer what one unsharded engine answers; SIGTERM ends both ranks cleanly."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from reference_engine.checkpoint import load_draft, load_target
from reference_engine.runtime.engine import Engine, EngineConfig
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving.followers import LeadingEngine

from .server_process import ServerProcess, free_port

BLOCK_SIZE = 4
MAX_TOKENS = 10
REQUESTS = {
    "greedy": ([5, 17, 33, 2], {"temperature": 0.0}),
    "greedy, another prompt": ([250, 3, 3, 61, 128, 9], {"temperature": 0.0}),
    "sampled with a seed": ([5, 17, 33, 2], {"temperature": 1.0, "top_p": 0.9, "seed": 7}),
}


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen3_5", block_size=BLOCK_SIZE)
    target = load_target(target_dir, dtype=torch.float64)
    return (target_dir, draft_dir), (target, load_draft(draft_dir, target))


def one_process(models, prompt_ids: list[int], options: dict) -> list[int]:
    """What one unsharded engine outputs for the request."""
    engine = Engine(*models, EngineConfig(block_size=BLOCK_SIZE))
    engine.add_request("r", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options))
    while engine.has_unfinished():
        engine.step()
    return engine.collect("r").output_ids


def complete(url: str, prompt_ids: list[int], options: dict) -> list[int]:
    body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "ignore_eos": True, **options}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def workers(launcher: int) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]


def test_two_ranks_answer_what_one_engine_answers_and_stop_on_sigterm(pair) -> None:
    (target_dir, draft_dir), models = pair
    launch = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    serve = ["-m", "reference_engine.serve", "--model", str(target_dir), "--dflash-draft-model-path"]
    serve += [str(draft_dir), "--device", "cpu", "--dtype", "float64", "--threads", "1"]
    server = ServerProcess(
        *launch, *serve, "--tensor-parallel-size", "2", module="torch.distributed.run", fresh=True
    )
    try:
        for what, (prompt_ids, options) in REQUESTS.items():
            assert complete(server.url, prompt_ids, options) == one_process(models, prompt_ids, options), what
        # without a seed rank 0 draws one and sends it (the test below); here: no hang
        assert len(complete(server.url, [5, 17, 33, 2], {"temperature": 1.0})) == MAX_TOKENS
        ranks = workers(server.proc.pid)
        assert len(ranks) == 2
        # torchrun passes SIGTERM to both ranks; rank 1 ignores it and stops at rank 0's stop
        # marker once rank 0 has drained (torchrun would kill a rank still there after 30 s)
        server.proc.send_signal(signal.SIGTERM)
        output, _ = server.proc.communicate(timeout=20)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)
        assert "followers.py" not in output, output  # no rank failed in the follower loop
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks did not stop within 20 s of SIGTERM")
    finally:
        server.stop(signal.SIGKILL)


def test_a_request_without_a_seed_is_sent_with_the_seed_rank_0_drew(pair) -> None:
    _, models = pair
    engine = LeadingEngine(Engine(*models, EngineConfig(block_size=BLOCK_SIZE)))
    engine.add_request("a", [5, 17, 33], SamplingParams(max_tokens=4, temperature=1.0))
    engine.add_request("b", [5, 17, 33], SamplingParams(max_tokens=4, temperature=0.0))
    (*_, seed), (*_, greedy_seed) = engine.calls
    assert engine.get("a").generator.initial_seed() == seed  # what the followers seed theirs with
    assert greedy_seed is None
    engine.abort("a")
    assert engine.calls[-1] == ("abort", "a")

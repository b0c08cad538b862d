"""The server's request path and the checkpoint loader, where the existing tests leave room:
- admission (serving/generation.py, metrics.py): a request the engine's queue refuses (429)
  or the engine refuses as invalid (400) never ran, so it is in neither the success nor the
  failure counters, and its prompt tokens are not counted;
- the engine process (serving/engine_process.py): an engine that cannot be built fails the
  server's start with the engine's own message, and a shutdown ends a process that does not
  stop by itself within its timeout by killing it;
- the loader (checkpoint/__init__.py): the shard index names the files that are read (a
  stale `model.safetensors` beside it is not), and a model is assembled from exactly its
  tensors, none missing, none extra; a shard index or config.json that is not a JSON object
  is a CheckpointError naming the file;
- chat's token budget: a chat request without one may use the rest of the context (OpenAI,
  vLLM), where completions default to 16 tokens."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from reference_engine.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    assemble_target,
    load_target,
    read_config,
    read_tensors,
)
from reference_engine.config import TargetConfig
from reference_engine.errors import CheckpointError, ReferenceEngineError, RequestError
from reference_engine.models import expected_shapes
from reference_engine.runtime.engine import EngineFullError
from reference_engine.serving.app import create_app
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.async_engine import EngineTotals
from reference_engine.serving.engine_process import EngineProcess, ProcessEngine
from reference_engine.serving.generation import Generation
from reference_engine.serving.protocol import ProtocolError
from reference_engine.serving.service import Server

from .test_serve_app import metrics_page, parsed_request, scripted_server
from .test_serve_engine_loop import ScriptedEngine
from .test_serve_metrics import value

TinyCheckpoint = Callable[..., Path]
CopyCheckpoint = Callable[[Path], Path]


# ----------------------------------------------------------------------------- admission
@pytest.mark.parametrize(
    "refusal, status, kind",
    [
        (EngineFullError("waiting queue full (0 requests); retry later"), 429, "rate_limit_error"),
        (RequestError("prompt token id(s) [9999] outside the vocabulary"), 400, "invalid_request_error"),
    ],
    ids=["queue full", "invalid"],
)
def test_a_request_the_engine_refuses_to_take_is_counted_nowhere(refusal, status: int, kind: str) -> None:
    """The engine does not take the request: the client gets 429 (its queue is full) or 400
    (the request is invalid) with the engine's message, and since the request never ran it
    is neither a success nor a failure, and its prompt tokens are not counted."""
    engine = ScriptedEngine()
    server = scripted_server(engine)

    async def scenario() -> None:
        starting = asyncio.create_task(Generation.start(server, parsed_request(prompt_ids=[0, 1, 2]), 0.0))
        await asyncio.sleep(0)
        engine.receive([("added", engine.sent[-1][1], refusal)], EngineTotals())
        with pytest.raises(ProtocolError) as caught:
            await starting
        assert (caught.value.status, caught.value.kind) == (status, kind)
        assert str(caught.value) == str(refusal)

    asyncio.run(scenario())
    page = metrics_page(server)
    assert value(page, "dflash:request_failure_total") == 0
    assert not [k for k, v in page.items() if k[0] == "dflash:request_success_total" and v]
    assert value(page, "dflash:prompt_tokens_total") == 0
    assert value(page, "dflash:e2e_request_latency_seconds_count") == 0


# ----------------------------------------------------------------------------- the engine process
def test_an_engine_that_cannot_be_built_fails_the_start_with_its_own_message(tmp_path: Path) -> None:
    """The engine process cannot build its engine (here: a model directory without
    config.json): the server's start fails with the engine's own message, the one a thread
    engine gives, and the process has ended."""
    args = ServeArgs.parse(["--model", str(tmp_path), "--device", "cpu", "--engine-loop", "process"])
    before = set(multiprocessing.active_children())
    with pytest.raises(ReferenceEngineError) as caught:
        EngineProcess(args)
    assert str(caught.value) == f"{tmp_path}: no config.json (is this a model directory?)"
    left = [p for p in multiprocessing.active_children() if p not in before and p.name == "engine"]
    assert not [p for p in left if p.is_alive()]


def test_a_shutdown_kills_an_engine_process_that_does_not_stop_in_time(caplog) -> None:
    """An engine process that does not end after its stop (stuck in a step) is killed once
    the shutdown's timeout has passed, so the server's exit never waits on it; the kill is
    logged with the timeout."""
    context = multiprocessing.get_context("spawn")
    server_end, engine_end = context.Pipe()
    stuck = context.Process(target=time.sleep, args=(60,), daemon=True)
    stuck.start()
    try:

        async def scenario() -> None:
            engine = ProcessEngine(SimpleNamespace(conn=server_end, process=stuck))
            started_s = time.monotonic()
            with caplog.at_level(logging.ERROR, logger="reference_engine.serving.engine_process"):
                engine.shutdown(timeout=0.3)
            assert time.monotonic() - started_s < 5
            assert not engine.alive

        asyncio.run(scenario())
        assert not stuck.is_alive() and stuck.exitcode == -signal.SIGKILL
        assert engine_end.recv() == ("stop",)
        assert "the engine process did not stop within 0.3 s: killed" in caplog.text
    finally:
        if stuck.is_alive():
            stuck.kill()
        stuck.join(5)


# ----------------------------------------------------------------------------- the loader
def test_the_index_names_the_files_read_and_a_stale_single_file_beside_it_is_not(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint
) -> None:
    """A directory holding both a shard index and a `model.safetensors` (left from an
    earlier save) loads the weights the index maps, as vLLM loads only the files its index
    names."""
    sharded = copy_checkpoint(tiny_checkpoint("qwen3", shards=3))
    stale = tiny_checkpoint("qwen3", seed=1)
    shutil.copy(stale / SINGLE_FILE, sharded / SINGLE_FILE)
    assert (sharded / INDEX_FILE).is_file()
    got = load_target(sharded).state_dict()
    want = load_target(tiny_checkpoint("qwen3")).state_dict()
    other = load_target(stale).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert not torch.equal(got["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_a_model_is_assembled_from_exactly_its_tensors(tiny_checkpoint: TinyCheckpoint) -> None:
    """`assemble_target` adopts the tensors as the parameters, with no random init: a tensor
    left out, or one the model does not have, is refused rather than leaving a parameter
    without values."""
    path = tiny_checkpoint("qwen3")
    config = TargetConfig.from_hf(read_config(path))
    tensors = read_tensors(path, expected_shapes(config), torch.float32, "cpu")
    model = assemble_target(config, dict(tensors), "cpu")
    assert not any(p.is_meta for p in model.parameters())
    missing = dict(tensors)
    del missing["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.norm\.weight"):
        assemble_target(config, missing, "cpu")
    extra = {**tensors, "model.extra.weight": torch.zeros(2)}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*model\.extra\.weight"):
        assemble_target(config, extra, "cpu")


@pytest.mark.parametrize("index", ['{"weight_map": {', "[]"], ids=["truncated", "not an object"])
def test_a_shard_index_that_is_not_a_json_object_is_a_checkpoint_error(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint, index: str
) -> None:
    """A truncated or malformed `model.safetensors.index.json` is a CheckpointError naming
    the file (the server then stops with one `error:` line), as an invalid config.json is."""
    path = copy_checkpoint(tiny_checkpoint("qwen3", shards=2))
    (path / INDEX_FILE).write_text(index)
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        load_target(path)


@pytest.mark.parametrize("config", ["[]", "null"])
def test_a_config_that_is_not_a_json_object_is_a_checkpoint_error(
    tiny_checkpoint: TinyCheckpoint, copy_checkpoint: CopyCheckpoint, config: str
) -> None:
    """config.json must hold a JSON object: valid JSON of another kind is refused as a
    CheckpointError naming the file, as JSON that does not parse is."""
    path = copy_checkpoint(tiny_checkpoint("qwen3"))
    (path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(path)


# ----------------------------------------------------------------------------- chat's token budget
def test_a_chat_request_without_a_token_budget_may_use_the_rest_of_the_context(
    tiny_checkpoint: TinyCheckpoint,
) -> None:
    """A chat request that sets neither max_tokens nor max_completion_tokens generates until
    a stop or the end of the context (vLLM's budget: max_model_len - prompt tokens), as
    OpenAI's chat API does; 16 is the completions API's default only."""
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--device", "cpu", "--max-model-len", "48"]
    with TestClient(create_app(Server(ServeArgs.parse(argv)))) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body)
        plain = client.post("/v1/completions", json={"prompt": "hi", "temperature": 0, "ignore_eos": True})
        long = {**body, "messages": [{"role": "user", "content": " hi" * 60}]}
        too_long = client.post("/v1/chat/completions", json=long)
    assert r.status_code == 200, r.text
    data = r.json()
    prompt, completion = data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"]
    assert prompt < 32
    assert completion == 48 - prompt and data["choices"][0]["finish_reason"] == "length"
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 16
    # a chat prompt that fills the context is refused as too long, not given a budget of 0
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]

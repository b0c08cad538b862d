"""The engine's options are defined once (reference_engine/engine_args.py): every command
that builds an engine offers them under the same flags, help and choices."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from reference_engine.bench import BenchArgs
from reference_engine.engine_args import (
    ENGINE_OPTIONS,
    add_engine_options,
    engine_config,
    resolve_device,
    resolve_dtype,
)
from reference_engine.errors import RequestError
from reference_engine.generate import GenerateArgs
from reference_engine.runtime.engine_config import EngineConfig
from reference_engine.serving.args import ServeArgs


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {"serve": ServeArgs.parser(), "bench": BenchArgs.parser(), "generate": GenerateArgs.parser()}


SHARED = {
    "serve": (
        "model",
        "draft",
        "block_size",
        "commit_strategy",
        "dtype",
        "device",
        "max_num_seqs",
        "max_model_len",
        "numerics",
        "enforce_eager",
        "gpu_memory_utilization",
        "prefill_chunk",
        "max_num_batched_tokens",
    ),
    "generate": (
        "model",
        "draft",
        "block_size",
        "commit_strategy",
        "dtype",
        "device",
        "max_model_len",
        "numerics",
    ),
    "bench": (
        "model",
        "draft",
        "block_size",
        "commit_strategy",
        "dtype",
        "device",
        "numerics",
        "enforce_eager",
        "gpu_memory_utilization",
    ),
}


@pytest.mark.parametrize("command", sorted(SHARED))
def test_every_command_takes_the_engine_options_under_their_one_definition(command) -> None:
    found = actions(parsers()[command])
    for name in SHARED[command]:
        option = ENGINE_OPTIONS[name]
        assert name in found, f"{command} lacks --{name.replace('_', '-')}"
        assert tuple(found[name].option_strings) == option.flags, (command, name)
        assert option.help in found[name].help, (command, name)


# a value other than the default for every engine option that names an EngineConfig field
GIVEN = {
    "block_size": 4,
    "commit_strategy": "per_token",
    "gpu_memory_utilization": 0.5,
    "max_num_seqs": 3,
    "max_model_len": 300,
    "prefill_chunk": 64,
    "max_num_batched_tokens": 96,
    "verify_width": "fixed",
    "measure_step_costs": True,
    "kv_cache_tokens": 4096,
    "kv_cell_tokens": 128,
    "checkpoint_every": 2,
    "numerics": "exact",
    "enforce_eager": True,
    "device_phase_times": True,  # the server's default is off (the engine's, on)
    "steps_per_turn": 3,
    "draft_span": "verify",
}


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_every_engine_option_a_command_offers_reaches_its_engine_config(command: str) -> None:
    """Each engine option that names an EngineConfig field, given to a command that builds
    an engine from its options, reaches the config as given (the engine benchmark sets its
    numerics, one of a list, itself)."""
    fields_named = {f.name for f in dataclasses.fields(EngineConfig)} & set(ENGINE_OPTIONS)
    assert fields_named == set(GIVEN)  # an option added later needs a value here
    found = actions(parsers()[command])
    own = {"bench": {"numerics"}}.get(command, set())
    offered = {name: value for name, value in GIVEN.items() if name in found and name not in own}
    assert len(offered) >= 10, sorted(offered)
    argv = ["--model", "m", "--draft", "d"]
    for name, value in offered.items():
        flag = ENGINE_OPTIONS[name].flags[0]
        argv += [flag] if value is True else [flag, str(value)]
    args = (ServeArgs if command == "serve" else BenchArgs).parse(argv)
    config = engine_config(args, **{name: None for name in own})  # what the command sets itself
    assert {name: getattr(config, name) for name in offered} == offered


def test_the_engine_config_carries_every_engine_option_a_command_was_given() -> None:
    """engine_config: `serve` and the engine benchmark build their EngineConfig from their
    parsed options, each option that names a field as given, the command's own settings on
    top; a field no option names keeps its default."""
    given = ["--commit-strategy", "per_token", "--verify-width", "fixed"]
    given += ["--kv-cache-tokens", "4096", "--kv-cell-tokens", "128", "--prefill-chunk", "64"]
    given += ["--max-num-batched-tokens", "96", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    serve = ServeArgs.parse(
        ["--model", "m", *given, "--max-num-seqs", "3", "--numerics", "exact", "--max-waiting", "7"]
    )
    config = engine_config(serve, max_waiting=serve.max_waiting)
    bench = BenchArgs.parse([*given, "--checkpoint-every", "2"])
    benched = engine_config(bench, max_num_seqs=16, max_model_len=300, numerics="exact")
    for built in (config, benched):
        assert (built.commit_strategy, built.verify_width, built.enforce_eager) == (
            "per_token",
            "fixed",
            True,
        )
        assert (built.kv_cache_tokens, built.kv_cell_tokens, built.prefill_chunk) == (4096, 128, 64)
        assert (built.max_num_batched_tokens, built.gpu_memory_utilization) == (96, 0.5)
    assert (config.max_num_seqs, config.max_waiting, config.numerics) == (3, 7, "exact")
    assert (benched.max_num_seqs, benched.max_model_len, benched.checkpoint_every) == (16, 300, 2)
    assert config.checkpoint_every is None and config.admission == "wait"  # serve has no option for them


def test_the_draft_answers_to_both_of_its_names_everywhere() -> None:
    for parser in parsers().values():
        for flag in ("--draft", "--dflash-draft-model-path"):
            ns, _ = parser.parse_known_args(
                ["--model", "m", flag, "d", "--max-tokens", "1", "--prompt-ids", "1"]
            )
            assert ns.draft == "d", flag


def test_an_unknown_engine_option_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['drafts'\]"):
        add_engine_options(argparse.ArgumentParser(), "drafts")


def test_device_auto_is_the_gpu_when_there_is_one() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(RequestError, match="unknown --device 'nonsense'"):
        resolve_device("nonsense")


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, "cuda", torch.bfloat16),
        ({"dtype": "float32"}, "cuda", torch.float32),  # transformers 5's name
        ({"text_config": {"torch_dtype": "bfloat16"}}, "cuda", torch.bfloat16),  # a wrapper
        ({"torch_dtype": "float16"}, "cuda", torch.float16),  # its own half, not bfloat16
        ({"torch_dtype": "bfloat16"}, "cpu", torch.float32),
        ({"torch_dtype": "float16"}, "cpu", torch.float32),
        ({}, "cpu", torch.float32),
    ],
)
def test_dtype_auto_is_the_checkpoints_own_and_float32_for_half_precision_on_the_cpu(
    tmp_path, capsys, config: dict, device: str, expected: torch.dtype
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", str(tmp_path), torch.device(device)) == expected
    half = config.get("torch_dtype")
    noted = f"runs the {half} checkpoint in float32 on the CPU" in capsys.readouterr().err
    assert noted == (device == "cpu" and half in ("bfloat16", "float16"))
    assert resolve_dtype("bfloat16", str(tmp_path), torch.device("cpu")) == torch.bfloat16


def test_options_left_out_give_the_engine_configs_defaults_and_vllms_memory_share() -> None:
    """A parser given none of the engine options builds the EngineConfig defaults (slots,
    commit strategy, prefill chunk, cell size), and --gpu-memory-utilization defaults to
    vLLM's 0.9 (docs/engine.md, Memory)."""
    parser = argparse.ArgumentParser()
    names = ("max_num_seqs", "commit_strategy", "prefill_chunk", "kv_cell_tokens", "gpu_memory_utilization")
    add_engine_options(parser, *names)
    built = engine_config(parser.parse_args([]))
    default = EngineConfig()
    for name in names[:-1]:
        assert getattr(built, name) == getattr(default, name), name
    assert built.gpu_memory_utilization == 0.9


def test_a_plain_override_sets_the_options_default() -> None:
    """add_engine_options(parser, "device", device="cuda"): a value that is not a dict of
    argparse keywords becomes the option's default, and the flag still wins."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser, "device", "max_num_seqs", device="cuda", max_num_seqs=3)
    assert vars(parser.parse_args([])) == {"device": "cuda", "max_num_seqs": 3}
    assert parser.parse_args(["--device", "cpu"]).device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_is_refused_where_there_is_none() -> None:
    with pytest.raises(RequestError, match="--device cuda:1 asked for, but no CUDA device is available"):
        resolve_device("cuda:1")
    assert resolve_device("cpu").type == "cpu"


def test_dtype_auto_refuses_a_checkpoint_dtype_it_does_not_run_and_prefers_torch_dtype(tmp_path) -> None:
    """A checkpoint naming a dtype outside DTYPES is a ConfigError asking for --dtype; a
    config naming both `torch_dtype` and transformers 5's `dtype` is read by `torch_dtype`."""
    from reference_engine.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    with pytest.raises(ConfigError, match="the checkpoint's dtype 'int8' is not one of .*; pass --dtype"):
        resolve_dtype("auto", str(tmp_path), torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "dtype": "float32"}))
    assert resolve_dtype("auto", str(tmp_path), torch.device("cuda")) == torch.bfloat16

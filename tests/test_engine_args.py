"""The engine's options are defined once (reference_engine/engine_args.py): every command
that builds an engine offers them under the same flags, help and choices."""

from __future__ import annotations

import argparse

import pytest

from reference_engine.bench import BenchArgs
from reference_engine.engine_args import ENGINE_OPTIONS, add_engine_options
from reference_engine.generate import GenerateArgs
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

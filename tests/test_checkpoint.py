"""Checkpoint reading and writing: layouts that must load to identical models, the make-tiny
command line, and bad checkpoints that must fail with a message naming the problem."""

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
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reference_engine.checkpoint import INDEX_FILE, SINGLE_FILE, load_target
from reference_engine.checkpoint.synthetic import make_tiny_target
from reference_engine.errors import CheckpointError, ConfigError
from reference_engine.models import CausalLM
from reference_engine.runtime.decode import new_state

from .together import Results, together

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327]

CopyCheckpoint = Callable[[Path], Path]
TinyCheckpoint = Callable[..., Path]


@torch.inference_mode()
def all_logits(model: CausalLM, ids: list[int] = PROMPT) -> torch.Tensor:
    """Logits at every prompt position from a fresh state. [len(ids), vocab]"""
    ids = [t % model.config.vocab_size for t in ids]
    state = new_state(model, len(ids))
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), state, len(ids))
    return out.logits[0]


def tensor_names(path: Path) -> list[str]:
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "reference_engine.checkpoint", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


# ----------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_sharded_checkpoint_loads_to_the_same_logits_as_single_file(
    tiny_checkpoint: TinyCheckpoint, arch: str
) -> None:
    single = tiny_checkpoint(arch)
    sharded = tiny_checkpoint(arch, shards=3)
    assert not (single / INDEX_FILE).exists()
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / SINGLE_FILE).exists()
    assert sorted(index["weight_map"]) == sorted(tensor_names(single))

    assert torch.equal(all_logits(load_target(single)), all_logits(load_target(sharded)))


def test_multimodal_wrapper_loads_to_the_same_logits_as_text_only_layout(
    qwen3_5_checkpoint: Path, qwen3_5_wrapper_checkpoint: Path
) -> None:
    text_only = load_target(qwen3_5_checkpoint)
    wrapped = load_target(qwen3_5_wrapper_checkpoint)
    assert wrapped.config == text_only.config
    assert torch.equal(all_logits(wrapped), all_logits(text_only))


def test_multimodal_wrapper_holds_language_model_mtp_and_visual_tensors(
    qwen3_5_wrapper_checkpoint: Path,
) -> None:
    raw = json.loads((qwen3_5_wrapper_checkpoint / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5"
    assert raw["text_config"]["model_type"] == "qwen3_5_text"
    names = tensor_names(qwen3_5_wrapper_checkpoint)
    assert "model.language_model.embed_tokens.weight" in names
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)


def test_loader_ignores_mtp_and_visual_tensors(qwen3_5_wrapper_checkpoint: Path) -> None:
    params = load_target(qwen3_5_wrapper_checkpoint).state_dict()
    assert "model.embed_tokens.weight" in params
    assert not any("mtp" in n or "visual" in n or "language_model" in n for n in params)


def test_bf16_checkpoint_loads_as_the_float32_weights_rounded_to_bf16(
    tiny_checkpoint: TinyCheckpoint,
) -> None:
    on_disk_bf16 = tiny_checkpoint("qwen3_5", dtype=torch.bfloat16)
    on_disk_fp32 = tiny_checkpoint("qwen3_5")
    with safe_open(str(on_disk_bf16 / SINGLE_FILE), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16

    from_bf16 = load_target(on_disk_bf16, dtype=torch.bfloat16)
    from_fp32 = load_target(on_disk_fp32, dtype=torch.bfloat16)
    assert from_bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(all_logits(from_bf16), all_logits(from_fp32))

    widened = load_target(on_disk_bf16, dtype=torch.float32).state_dict()
    rounded = load_target(on_disk_fp32, dtype=torch.float32).state_dict()
    for name, weight in widened.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, rounded[name].bfloat16().float()), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_load_target_returns_eval_model_in_the_requested_dtype_without_grad(
    qwen3_5_checkpoint: Path, dtype: torch.dtype
) -> None:
    model = load_target(qwen3_5_checkpoint, dtype=dtype)
    assert not model.training
    for name, param in model.named_parameters():
        assert param.dtype == dtype, name
        assert not param.requires_grad, name
        assert param.device.type == "cpu", name


def test_tied_checkpoint_has_no_lm_head_and_projects_with_the_embedding(
    qwen3_tied_checkpoint: Path,
) -> None:
    assert "lm_head.weight" not in tensor_names(qwen3_tied_checkpoint)
    model = load_target(qwen3_tied_checkpoint)
    assert model.config.tie_word_embeddings
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_tied_checkpoint_with_a_stored_lm_head_ignores_it(
    qwen3_tied_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_tied_checkpoint)
    tensors = load_file(str(path / SINGLE_FILE))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(path / SINGLE_FILE))
    expected = all_logits(load_target(qwen3_tied_checkpoint))
    assert torch.equal(all_logits(load_target(path)), expected)


def test_untied_checkpoint_uses_its_own_lm_head(qwen3_checkpoint: Path) -> None:
    model = load_target(qwen3_checkpoint)
    assert not model.config.tie_word_embeddings
    assert not torch.equal(model.lm_head_weight, model.model.embed_tokens.weight)


def test_same_seed_writes_identical_weights_and_another_seed_does_not(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    again = make_tiny_target(tmp_path / "again", arch="qwen3", seed=0)
    first = load_file(str(tiny_checkpoint("qwen3", seed=0) / SINGLE_FILE))
    second = load_file(str(again / SINGLE_FILE))
    other = load_file(str(tiny_checkpoint("qwen3", seed=1) / SINGLE_FILE))
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


# ----------------------------------------------------------------------------- make-tiny CLI
MAKE_TINY = [
    ("qwen3", [], "qwen3"),
    ("qwen3_5", ["--multimodal-wrapper", "--tie-word-embeddings"], "qwen3_5"),
]
MAKE_TINY_IDS = ["qwen3-flags0-qwen3", "qwen3_5-flags1-qwen3_5"]


def make_tiny(out: Path, arch: str, flags: list[str]) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "make-tiny",
        "--arch",
        arch,
        "--out",
        str(out),
        "--seed",
        "5",
        "--layers",
        "3",
        "--hidden",
        "96",
        "--vocab",
        "300",
        *flags,
    )


@pytest.fixture(scope="module")
def cli_runs(request, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """The make-tiny command lines below, side by side in the background (tests/together.py):
    name -> (the --out folder, the run)."""

    def tiny(name: str, arch: str, flags: list[str]):
        out = tmp_path_factory.mktemp(name) / "tiny"
        return out, make_tiny(out, arch, flags)

    def bad():
        out = tmp_path_factory.mktemp("bad")  # an empty folder
        return out, run_cli("make-tiny", "--arch", "qwen3", "--multimodal-wrapper", "--out", str(out))

    jobs = {
        f"test_make_tiny_cli_writes_a_loadable_checkpoint_with_tokenizer[{name}]": partial(
            tiny, name, *case[:2]
        )
        for name, case in zip(MAKE_TINY_IDS, MAKE_TINY)
    }
    jobs["test_make_tiny_cli_reports_bad_options_without_traceback"] = bad
    return together(request, jobs)


@pytest.mark.parametrize(("arch", "flags", "model_type"), MAKE_TINY, ids=MAKE_TINY_IDS)
def test_make_tiny_cli_writes_a_loadable_checkpoint_with_tokenizer(
    cli_runs: Results,
    request: pytest.FixtureRequest,
    tiny_checkpoint: TinyCheckpoint,
    arch: str,
    flags: list[str],
    model_type: str,
) -> None:
    out, done = cli_runs[request.node.name]  # make_tiny(out, arch, flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == model_type
    model = load_target(out)
    assert model.config.num_hidden_layers == 3
    assert model.config.hidden_size == 96
    assert model.config.vocab_size == 300
    assert model.config.tie_word_embeddings == ("--tie-word-embeddings" in flags)
    # the CLI writes what the Python API writes for the same options
    same = tiny_checkpoint(
        arch,
        seed=5,
        layers=3,
        hidden=96,
        vocab=300,
        tie_word_embeddings="--tie-word-embeddings" in flags,
        multimodal_wrapper="--multimodal-wrapper" in flags,
    )
    assert torch.equal(all_logits(model), all_logits(load_target(same)))


def test_make_tiny_cli_reports_bad_options_without_traceback(
    cli_runs: Results, request: pytest.FixtureRequest
) -> None:
    # make-tiny --arch qwen3 --multimodal-wrapper --out <out>
    out, done = cli_runs[request.node.name]
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "--multimodal-wrapper" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (out / "config.json").exists()


# ----------------------------------------------------------------------------- bad checkpoints
def test_missing_tensor_is_named_in_the_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    tensors = load_file(str(path / SINGLE_FILE))
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, str(path / SINGLE_FILE))
    pattern = r"missing tensor.*model\.layers\.2\.self_attn\.k_norm\.weight"
    with pytest.raises(CheckpointError, match=pattern):
        load_target(path)


def test_missing_lm_head_of_untied_checkpoint_is_named_in_the_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    tensors = load_file(str(path / SINGLE_FILE))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"missing tensor.*lm_head\.weight"):
        load_target(path)


def test_misshapen_tensor_error_names_tensor_expected_and_found_shape(
    qwen3_5_wrapper_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_5_wrapper_checkpoint)
    name = "model.language_model.layers.1.self_attn.o_proj.weight"
    tensors = load_file(str(path / SINGLE_FILE))
    expected = list(tensors[name].shape)
    tensors[name] = torch.zeros(expected[0], expected[1] + 8)
    save_file(tensors, str(path / SINGLE_FILE))
    with pytest.raises(CheckpointError) as info:
        load_target(path)
    message = str(info.value)
    assert name in message
    assert str(expected) in message
    assert str([expected[0], expected[1] + 8]) in message


def test_unexpected_tensor_is_named_in_the_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    tensors = load_file(str(path / SINGLE_FILE))
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.9\.mlp\.up_proj"):
        load_target(path)


def test_unknown_model_type_is_named_in_the_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    edit_config(path, lambda raw: raw.update(model_type="mistral"))
    with pytest.raises(ConfigError, match=r"unknown model_type 'mistral'"):
        load_target(path)


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (
            lambda raw: raw.update(num_attention_heads=3),
            r"num_attention_heads 3 is not a multiple of num_key_value_heads 2",
        ),
        (lambda raw: raw.update(hidden_size=-64), r"'hidden_size' must be a positive integer.*-64"),
        (
            lambda raw: raw.update(layer_types=["full_attention"] * 3),
            r"layer_types has 3 entries, expected num_hidden_layers = 4",
        ),
        (lambda raw: raw.pop("vocab_size"), r"required field 'vocab_size' is missing"),
    ],
    ids=["heads-not-multiple-of-kv-heads", "negative-hidden", "layer-types-length", "no-vocab"],
)
def test_config_field_out_of_range_is_rejected_with_its_value(
    qwen3_checkpoint: Path,
    copy_checkpoint: CopyCheckpoint,
    edit: Callable[[dict], None],
    pattern: str,
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    edit_config(path, edit)
    with pytest.raises(ConfigError, match=pattern):
        load_target(path)


def test_wrapper_text_config_field_out_of_range_is_rejected(
    qwen3_5_wrapper_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_5_wrapper_checkpoint)
    edit_config(path, lambda raw: raw["text_config"].update(linear_num_key_heads=0))
    with pytest.raises(ConfigError, match=r"'linear_num_key_heads' must be a positive integer"):
        load_target(path)


def test_missing_shard_listed_in_the_index_is_named_in_the_error(
    qwen3_sharded_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_sharded_checkpoint)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00003\.safetensors.*missing"):
        load_target(path)


def test_index_naming_a_shard_that_lacks_the_tensor_is_a_checkpoint_error(
    qwen3_sharded_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_sharded_checkpoint)
    index = json.loads((path / INDEX_FILE).read_text())
    name = "model.embed_tokens.weight"
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight"):
        load_target(path)


def test_directory_without_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_target(tmp_path)


def test_invalid_config_json_is_a_checkpoint_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_target(path)


def test_directory_without_weights_is_a_checkpoint_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    (path / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        load_target(path)


def test_truncated_safetensors_file_is_a_checkpoint_error(
    qwen3_checkpoint: Path, copy_checkpoint: CopyCheckpoint
) -> None:
    path = copy_checkpoint(qwen3_checkpoint)
    data = (path / SINGLE_FILE).read_bytes()
    (path / SINGLE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_target(path)

"""The five target families against transformers' own model classes (eager attention and
experts, float64 on the CPU) on tiny random checkpoints written by the project's writer, with
config fields at values the other parity checkpoints leave at one setting: attention biases
on Qwen3, Qwen3.5, Qwen3-MoE and Qwen3.5-MoE; a Llama head wider than hidden / heads; Llama's
default RoPE, the llama3 scaling spelled as transformers 5 writes it with other factors, and
a prompt that runs past original_max_position_embeddings; Qwen3.5's partial rotary factor
at another value, where each spelling puts it; layer kinds from full_attention_interval and
from an explicit layer_types; a top-1 routing with and without norm_topk_prob; a top-k of
every expert; dense layers by decoder_sparse_step alone or by mlp_only_layers alone; routing
ties between experts whose router rows are equal; and the MoE families' norm epsilon.

Each checkpoint runs once through transformers over the whole sequence, and through the
engine as a prefill followed by decode steps against its caches and recurrent states.
Also: the rope types Llama does not take are refused by name, and boolean bias fields are
read as JSON booleans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reference_engine.checkpoint import SINGLE_FILE, load_target, write_safetensors
from reference_engine.checkpoint.synthetic import make_tiny_target
from reference_engine.config import TargetConfig
from reference_engine.errors import ConfigError
from reference_engine.runtime.decode import decode_step, new_state

from .test_parity_transformers import REL_TOL, hf_class, relative_error

F64 = torch.float64
PROMPT = 12
DECODED = 6


def overrides(*pairs: tuple[str, Any]) -> dict[str, Any]:
    return {"config_overrides": pairs}


def transformers_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `ids`, one forward without a cache. Every
    tensor transformers' model has for the config is in the files (none left at its initial
    value): a field the writer and the engine both ignored would leave one out."""
    config = json.loads((path / "config.json").read_text())
    arch = config.get("text_config", config)["model_type"].removesuffix("_text")
    hf, info = hf_class(arch).from_pretrained(
        path,
        dtype=F64,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    hf.eval()
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def engine_logits(path: Path, ids: list[int], prompt: int = PROMPT) -> torch.Tensor:
    """The engine's logits at every position: a prefill over the first `prompt` tokens, then
    one decode step per remaining token through the slot's caches and states."""
    model = load_target(path, dtype=F64)
    state = new_state(model, len(ids))
    with torch.inference_mode():
        out = model(
            torch.tensor([ids[:prompt]]), torch.arange(prompt)[None], torch.tensor([0]), state, prompt
        )
        state.lengths[0] = prompt
        steps = [decode_step(model, state, 0, token) for token in ids[prompt:]]
    return torch.cat([out.logits[0], torch.stack(steps)])


def token_ids(path: Path, count: int, seed: int = 0) -> list[int]:
    vocab = TargetConfig.from_hf(json.loads((path / "config.json").read_text())).vocab_size
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_parity(path: Path, count: int = PROMPT + DECODED, prompt: int = PROMPT) -> None:
    ids = token_ids(path, count)
    expected = transformers_logits(path, ids)
    got = engine_logits(path, ids, prompt)
    assert got.shape == expected.shape
    err = relative_error(got, expected)
    assert err <= REL_TOL[F64], f"relative error {err:.3g} > {REL_TOL[F64]}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ----------------------------------------------------------------------------- attention and RoPE
# head_dim 16, theta 10000, original 64: wavelengths 6.3 (kept, under 64 / 4), 20 and 63
# (blended) and the rest divided by the factor
LLAMA3_V5 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

FIELDS = [
    # q, k, v and o biases (make_tiny_target's `bias`) on every family that reads attention_bias
    pytest.param("qwen3", dict(layers=2, bias=True), id="qwen3-attention_bias"),
    pytest.param("qwen3_5", dict(layers=2, bias=True), id="qwen3_5-attention_bias"),
    pytest.param("qwen3_moe", dict(layers=2, bias=True), id="qwen3_moe-attention_bias"),
    pytest.param("qwen3_5_moe", dict(layers=2, bias=True), id="qwen3_5_moe-attention_bias"),
    # heads of 32 dims while hidden / heads is 16, grouped queries
    pytest.param("llama", dict(layers=2, **overrides(("head_dim", 32))), id="llama-head_dim"),
    # no rope scaling at all: the plain theta frequencies
    pytest.param(
        "llama",
        dict(layers=2, **overrides(("rope_scaling", None), ("rope_theta", 300.0))),
        id="llama-default-rope",
    ),
    # llama3 scaling in rope_parameters (transformers 5's spelling), other factors
    pytest.param(
        "llama",
        dict(layers=2, **overrides(("rope_scaling", None), ("rope_parameters", LLAMA3_V5))),
        id="llama-llama3-rope_parameters",
    ),
    # half the head rotated, in rope_parameters and at the top level
    pytest.param(
        "qwen3_5",
        dict(
            layers=2,
            **overrides(
                (
                    "rope_parameters",
                    {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
                )
            ),
        ),
        id="qwen3_5-partial-half-rope_parameters",
    ),
    pytest.param(
        "qwen3_5",
        dict(
            layers=2,
            **overrides(
                ("rope_parameters", None),
                ("rope_theta", 100.0),
                ("partial_rotary_factor", 0.75),
            ),
        ),
        id="qwen3_5-partial-three-quarters-top-level",
    ),
    # layer kinds from full_attention_interval (layers 1 and 3 attend), and listed
    pytest.param(
        "qwen3_5",
        dict(layers=4, **overrides(("layer_types", None), ("full_attention_interval", 2))),
        id="qwen3_5-full_attention_interval",
    ),
    pytest.param(
        "qwen3_5_moe",
        dict(
            layers=3,
            **overrides(("layer_types", ["full_attention", "linear_attention", "full_attention"])),
        ),
        id="qwen3_5_moe-layer_types",
    ),
]


@pytest.mark.parametrize(("arch", "options"), FIELDS)
def test_targets_match_transformers_with_attention_and_rope_fields_the_parity_set_leaves_alone(
    arch: str, options: dict[str, Any], tmp_path: Path
) -> None:
    """Prefill and decode logits equal transformers' on checkpoints whose attention biases,
    head size, RoPE type and factors, partial rotary factor or layer kinds differ from the
    parity checkpoints', so a field read for one family and not another, a scale taken from
    hidden / heads, a RoPE formula or rotary width off, or layer kinds read wrongly shows."""
    assert_parity(make_tiny_target(tmp_path, arch, seed=11, **options))


def test_llama3_scaled_rope_matches_transformers_past_the_original_context(tmp_path: Path) -> None:
    """A prompt and decode steps reaching positions past original_max_position_embeddings
    (64) under llama3 scaling: the same logits as transformers at every position."""
    path = make_tiny_target(
        tmp_path,
        "llama",
        seed=12,
        layers=2,
        **overrides(("rope_scaling", None), ("rope_parameters", LLAMA3_V5)),
    )
    assert_parity(path, count=100, prompt=90)


# ----------------------------------------------------------------------------- experts
EXPERTS = [
    # top-1: the one weight is p (not renormalised) or exactly 1 (renormalised)
    pytest.param(
        "qwen3_moe",
        overrides(("num_experts_per_tok", 1), ("norm_topk_prob", False), ("mlp_only_layers", [])),
        id="qwen3_moe-top1-unnormalised",
    ),
    pytest.param(
        "qwen3_moe",
        overrides(("num_experts_per_tok", 1), ("norm_topk_prob", True), ("mlp_only_layers", [])),
        id="qwen3_moe-top1-renormalised",
    ),
    pytest.param("qwen3_5_moe", overrides(("num_experts_per_tok", 1)), id="qwen3_5_moe-top1"),
    # every expert chosen: unnormalised, the weights are the whole softmax
    pytest.param(
        "qwen3_moe",
        overrides(("num_experts", 4), ("num_experts_per_tok", 4), ("norm_topk_prob", False)),
        id="qwen3_moe-top-all",
    ),
    # dense layers 0, 1 and 3 by decoder_sparse_step 3 alone
    pytest.param(
        "qwen3_moe",
        overrides(("decoder_sparse_step", 3), ("mlp_only_layers", [])),
        id="qwen3_moe-decoder_sparse_step",
    ),
    # layer 0 dense by mlp_only_layers alone
    pytest.param("qwen3_moe", overrides(("mlp_only_layers", [0])), id="qwen3_moe-mlp_only_layers"),
    # an epsilon near the normed vectors' mean square, so that every norm's epsilon shows
    pytest.param("qwen3_moe", overrides(("rms_norm_eps", 0.5)), id="qwen3_moe-eps"),
]


@pytest.mark.parametrize(("arch", "options"), EXPERTS)
def test_moe_targets_match_transformers_with_routing_fields_the_parity_set_leaves_alone(
    arch: str, options: dict[str, Any], tmp_path: Path
) -> None:
    """Routing with one expert, with every expert, with and without norm_topk_prob, and the
    dense layers that decoder_sparse_step or mlp_only_layers leave: transformers' logits."""
    assert_parity(make_tiny_target(tmp_path, arch, seed=13, layers=4, **options))


@pytest.mark.parametrize(("arch", "top_k"), [("qwen3_moe", 3), ("qwen3_5_moe", 3), ("qwen3_moe", 1)], ids=str)
def test_routing_ties_between_equal_router_rows_pick_the_experts_transformers_picks(
    arch: str, top_k: int, tmp_path: Path
) -> None:
    """Router rows equal in pairs (experts 2j and 2j + 1), so that every token's k-th and
    (k+1)-th probabilities tie exactly and only the tie-break says which expert runs: the
    engine picks transformers' expert (torch.topk's choice, not the lowest id) and so gets
    its logits."""
    every_layer_moe = (("norm_topk_prob", False), ("mlp_only_layers", [])) if arch == "qwen3_moe" else ()
    path = make_tiny_target(
        tmp_path / "base",
        arch=arch,
        seed=14,
        layers=2,
        expert_layout="fused",
        config_overrides=(("num_experts_per_tok", top_k), *every_layer_moe),
    )
    tensors = load_file(path / SINGLE_FILE)
    for name, t in tensors.items():
        if name.endswith(".mlp.gate.weight"):
            t[1::2] = t[0::2]  # expert 2j + 1 routed exactly as expert 2j
    tied = tmp_path / "tied"
    write_safetensors(tied, tensors)
    for file in path.iterdir():
        if file.name != SINGLE_FILE:
            (tied / file.name).write_bytes(file.read_bytes())

    ids = token_ids(tied, PROMPT + DECODED)
    model = load_target(tied, dtype=F64)
    with torch.inference_mode():  # the router's probabilities for the token embeddings
        logits = torch.nn.functional.linear(
            model.embed(torch.tensor(ids)), model.model.layers[0].mlp.gate.weight
        )
    ranked = torch.softmax(logits, -1, dtype=torch.float32).sort(-1, descending=True).values
    assert bool((ranked[:, top_k - 1] == ranked[:, top_k]).all()), "the k-th choice is not a tie"
    assert_parity(tied)


# ----------------------------------------------------------------------------- config refusals
LLAMA_RAW = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
    ],
    ids=["linear", "dynamic-legacy-type", "yarn", "longrope"],
)
def test_llama_refuses_rope_types_other_than_llama3_by_name(rope: dict[str, Any]) -> None:
    """Llama takes the default RoPE and llama3 scaling only; a linear, dynamic (NTK), YaRN or
    LongRoPE scaling is refused with its name, not run as the plain frequencies."""
    name = next(iter(rope.values())).get("rope_type") or next(iter(rope.values()))["type"]
    with pytest.raises(ConfigError, match=rf"rope type '{name}' is not supported"):
        TargetConfig.from_hf({**LLAMA_RAW, **rope})


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_a_bias_flag_that_is_not_a_json_boolean_is_refused_naming_the_field(field: str) -> None:
    """attention_bias and mlp_bias are JSON booleans, read like tie_word_embeddings and
    norm_topk_prob: the string "false" is refused naming the field, not read as true."""
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_hf({**LLAMA_RAW, field: "false"})

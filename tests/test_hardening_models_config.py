"""The target families and the drafts against forward passes written out in this file from the
published architecture definitions (Hugging Face's modeling code for Qwen3, Qwen3.5, Qwen3-MoE,
Qwen3.5-MoE and Llama; z-lab's DFlash and DFlash2 drafts), one token, head and expert at a
time in float64 on tiny random models, with every field at a value that shows it: norm
epsilons far from 1e-6, norm weights away from 1 (or 0 for the (1 + w) norms), heads wider
than hidden / heads, grouped queries, partial and Llama-3-scaled RoPE, routing with and
without renormalisation, a gated shared expert. The speculative tests cannot see a wrong
model, since the draft and the plain decode share it; these compare it with an independent
computation. Also: what config parsing reads from a config.json, and what it refuses.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from reference_engine.config import DraftConfig, TargetConfig, published_target_layer_ids
from reference_engine.demo import DEMO_DIR
from reference_engine.errors import ConfigError
from reference_engine.models import build_draft, build_target
from reference_engine.models.dflash import DraftState
from reference_engine.runtime.decode import decode_step, new_state

F64 = torch.float64
PROMPT = 11
DECODED = 4
# the engine takes RoPE angles in float32 (as the published checkpoints were trained); the
# written-out models take them in float64, which moves logits by about 1e-6 at these positions
ATOL = 1e-5


# ----------------------------------------------------------------------------- weights
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn at random: linears ~ N(0, 1/fan_in), norm weights around 1
    (around 0 for the (1 + w) norms), so that a weight read for another shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=F64)
            if name.endswith("norm.weight"):
                base = 0.0 if bool((p == 0).all()) else 1.0
                p.copy_(base + 0.4 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.5 * noise)


# ----------------------------------------------------------------------------- the written-out layers
def rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), times w (Qwen3, Llama) or (1 + w) (Qwen3.5)."""
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + w) if offset else w)


def linear(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, bias: bool = False) -> torch.Tensor:
    """x W^T, plus the bias when the config gives the layer one."""
    out = x @ sd[f"{name}.weight"].T
    return out + sd[f"{name}.bias"] if bias else out


def swiglu(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, bias: bool = False) -> torch.Tensor:
    gate = linear(x, sd, f"{name}.gate_proj", bias)
    up = linear(x, sd, f"{name}.up_proj", bias)
    return linear(gate * torch.sigmoid(gate) * up, sd, f"{name}.down_proj", bias)


def llama3_frequency(inv: float, scaling: dict[str, float]) -> float:
    """Meta's Llama 3.1 rule for one frequency: short wavelengths kept, long ones divided by
    the factor, the band between blended linearly in original / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    if wavelength < original / high:
        return inv
    if wavelength > original / low:
        return inv / factor
    smooth = (original / wavelength - low) / (high - low)
    return (1 - smooth) * inv / factor + smooth * inv


def rope(
    x: torch.Tensor, positions: list[int], rotary_dim: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """Rotate-half RoPE over the first rotary_dim dims of each head; x: [T, heads, head_dim]."""
    half = rotary_dim // 2
    inv = [theta ** (-2 * i / rotary_dim) for i in range(half)]
    if scaling is not None:
        inv = [llama3_frequency(f, scaling) for f in inv]
    out = x.clone()
    for t, pos in enumerate(positions):
        for i in range(half):
            c, s = math.cos(pos * inv[i]), math.sin(pos * inv[i])
            a, b = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = a * c - b * s
            out[t, :, i + half] = b * c + a * s
    return out


def attend(
    q: torch.Tensor,  # [Tq, heads, d]
    k: torch.Tensor,  # [Tk, kv_heads, d]
    v: torch.Tensor,  # [Tk, kv_heads, d]
    q_pos: list[int],
    k_pos: list[int],
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Softmax attention, query head h reading key/value head h // (heads / kv_heads)."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    out = torch.zeros(q.shape[0], heads, v.shape[2], dtype=q.dtype)
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i, qp in enumerate(q_pos):
            keys = [
                j
                for j, kp in enumerate(k_pos)
                if (not causal or kp <= qp) and (window is None or abs(qp - kp) < window)
            ]
            scores = torch.stack([q[i, h] @ k[j, g] for j in keys]) / math.sqrt(d)
            weights = torch.softmax(scores, 0)
            out[i, h] = sum(w * v[j, g] for w, j in zip(weights, keys))
    return out


def attention_block(
    x: torch.Tensor,
    sd: dict[str, torch.Tensor],
    name: str,
    cfg: dict[str, Any],
    positions: list[int],
    causal: bool = True,
    window: int | None = None,
    context: torch.Tensor | None = None,
    context_positions: list[int] | None = None,
) -> torch.Tensor:
    """One attention sublayer: Qwen3's per-head q/k norms (none for Llama), Qwen3.5's query
    gate, RoPE over the rotary part, GQA. `context`: the DFlash draft's extra key/value rows
    (projected target features, before the block)."""
    heads, kv_heads, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    bias = cfg.get("attention_bias", False)
    T = x.shape[0]
    q = linear(x, sd, f"{name}.q_proj", bias).view(T, heads, -1)
    gate = None
    if cfg.get("gated"):
        q, gate = q[..., :d], q[..., d:].reshape(T, heads * d)
    rows = x if context is None else torch.cat([context, x])
    k = linear(rows, sd, f"{name}.k_proj", bias).view(rows.shape[0], kv_heads, d)
    v = linear(rows, sd, f"{name}.v_proj", bias).view(rows.shape[0], kv_heads, d)
    if cfg.get("qk_norm", True):
        offset = cfg.get("offset", False)
        q = rms(q, sd[f"{name}.q_norm.weight"], cfg["eps"], offset)
        k = rms(k, sd[f"{name}.k_norm.weight"], cfg["eps"], offset)
    k_positions = positions if context is None else [*context_positions, *positions]
    rotary = int(d * cfg.get("partial", 1.0))
    q = rope(q, positions, rotary, cfg["theta"], cfg.get("scaling"))
    k = rope(k, k_positions, rotary, cfg["theta"], cfg.get("scaling"))
    out = attend(q, k, v, positions, k_positions, causal, window).reshape(T, heads * d)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return linear(out, sd, f"{name}.o_proj", bias)


def gated_deltanet(
    x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, cfg: dict[str, Any]
) -> torch.Tensor:
    """Qwen3.5's Gated DeltaNet over a whole sequence from a zero state: a depthwise causal
    conv (left zero padding) and SiLU, q and k L2-normed per key head (q times k_dim^-0.5)
    and shared by consecutive value heads, g = -exp(A_log) * softplus(a + dt_bias), beta =
    sigmoid(b), the delta rule one token at a time, the gated RMSNorm, out_proj."""
    T = x.shape[0]
    kh, vh, kd, vd = cfg["k_heads"], cfg["v_heads"], cfg["k_dim"], cfg["v_dim"]
    mixed_in = linear(x, sd, f"{name}.in_proj_qkv")  # [T, conv_dim]
    w = sd[f"{name}.conv1d.weight"][:, 0]  # [conv_dim, kernel]
    kernel = w.shape[1]
    mixed = torch.zeros_like(mixed_in)
    for t in range(T):
        for j in range(kernel):
            src = t - (kernel - 1) + j
            if src >= 0:
                mixed[t] += w[:, j] * mixed_in[src]
    mixed = F.silu(mixed)
    q, k, v = mixed.split([kh * kd, kh * kd, vh * vd], -1)
    q, k, v = q.reshape(T, kh, kd), k.reshape(T, kh, kd), v.reshape(T, vh, vd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(kd)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a, b = linear(x, sd, f"{name}.in_proj_a"), linear(x, sd, f"{name}.in_proj_b")
    g = -sd[f"{name}.A_log"].exp() * F.softplus(a + sd[f"{name}.dt_bias"])
    beta = torch.sigmoid(b)
    z = linear(x, sd, f"{name}.in_proj_z").reshape(T, vh, vd)
    out = torch.zeros(T, vh, vd, dtype=x.dtype)
    for h in range(vh):
        key_head = h // (vh // kh)
        S = torch.zeros(kd, vd, dtype=x.dtype)
        for t in range(T):
            S = S * torch.exp(g[t, h])
            delta = (v[t, h] - S.T @ k[t, key_head]) * beta[t, h]
            S = S + torch.outer(k[t, key_head], delta)
            out[t, h] = S.T @ q[t, key_head]
    normed = rms(out, sd[f"{name}.norm.weight"], cfg["eps"]) * F.silu(z)
    return linear(normed.reshape(T, vh * vd), sd, f"{name}.out_proj")


def experts_block(
    x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, cfg: dict[str, Any]
) -> torch.Tensor:
    """Routed experts (softmax over all experts, the top k, renormalised when asked), each a
    SwiGLU whose fused gate_up rows are gate first; plus, with one, the shared expert times
    sigmoid(shared_expert_gate(x))."""
    gate_up, down = sd[f"{name}.experts.gate_up_proj"], sd[f"{name}.experts.down_proj"]
    inter = down.shape[-1]
    probs = torch.softmax(linear(x, sd, f"{name}.gate"), -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = sorted(range(probs.shape[1]), key=lambda e: -float(probs[t, e]))[: cfg["top_k"]]
        total = sum(float(probs[t, e]) for e in top)
        for e in top:
            weight = probs[t, e] / total if cfg["renormalise"] else probs[t, e]
            h = gate_up[e] @ x[t]
            gate, up = h[:inter], h[inter:]
            out[t] += weight * (down[e] @ (F.silu(gate) * up))
    if f"{name}.shared_expert_gate.weight" in sd:
        shared = swiglu(x, sd, f"{name}.shared_expert")
        out = out + torch.sigmoid(linear(x, sd, f"{name}.shared_expert_gate")) * shared
    return out


def reference_target(
    sd: dict[str, torch.Tensor], cfg: dict[str, Any], ids: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [T, vocab], each layer's output [T, hidden]) of the whole sequence."""
    T = len(ids)
    positions = list(range(T))
    offset = cfg.get("offset", False)
    x = sd["model.embed_tokens.weight"][ids]
    outputs = []
    for i, kind in enumerate(cfg["layer_types"]):
        name = f"model.layers.{i}"
        normed = rms(x, sd[f"{name}.input_layernorm.weight"], cfg["eps"], offset)
        if kind == "linear_attention":
            mixed = gated_deltanet(normed, sd, f"{name}.linear_attn", cfg)
        else:
            window = cfg.get("window") if kind == "sliding_attention" else None
            mixed = attention_block(normed, sd, f"{name}.self_attn", cfg, positions, window=window)
        x = x + mixed
        normed = rms(x, sd[f"{name}.post_attention_layernorm.weight"], cfg["eps"], offset)
        if i in cfg.get("moe_layers", ()):
            x = x + experts_block(normed, sd, f"{name}.mlp", cfg)
        else:
            x = x + swiglu(normed, sd, f"{name}.mlp", cfg["mlp_bias"])
        outputs.append(x)
    head = sd["model.embed_tokens.weight"] if cfg["tied"] else sd["lm_head.weight"]
    return rms(x, sd["model.norm.weight"], cfg["eps"], offset) @ head.T, outputs


# ----------------------------------------------------------------------------- targets
# the fields the tiny targets share (Llama's differ in layers and key heads)
SHARED = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 0.25,
}
QWEN3 = {
    "model_type": "qwen3",
    **SHARED,
    "rope_theta": 300.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "use_sliding_window": True,
    "sliding_window": 4,
    "max_window_layers": 1,
}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 0.25,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "mlp_bias": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}
QWEN3_5 = {
    "model_type": "qwen3_5_text",
    **SHARED,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50.0},
    "tie_word_embeddings": False,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 3,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    **SHARED,
    "rope_theta": 300.0,
    "tie_word_embeddings": False,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 12,
    "mlp_only_layers": [1],
}
QWEN3_5_MOE = {
    **{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 20,
}


def written_out_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """What the written-out forward reads of a config.json, with the defaults of the
    architectures' own configuration classes."""
    family = raw["model_type"]
    hybrid = family.startswith("qwen3_5")
    rope_params = raw.get("rope_parameters") or {}
    layers = raw["num_hidden_layers"]
    cfg: dict[str, Any] = {
        "heads": raw["num_attention_heads"],
        "kv_heads": raw["num_key_value_heads"],
        "head_dim": raw["head_dim"],
        "eps": raw["rms_norm_eps"],
        "theta": rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)),
        "offset": hybrid,
        "gated": hybrid,
        "partial": rope_params.get("partial_rotary_factor", 0.25 if hybrid else 1.0),
        "qk_norm": family != "llama",
        "tied": raw.get("tie_word_embeddings", False),
        "attention_bias": raw.get("attention_bias", False),
        "mlp_bias": family == "llama" and raw.get("mlp_bias", False),
    }
    if rope_params.get("rope_type") == "llama3":
        cfg["scaling"] = rope_params
    if hybrid:
        cfg["layer_types"] = raw["layer_types"]
        cfg.update(
            k_heads=raw["linear_num_key_heads"],
            v_heads=raw["linear_num_value_heads"],
            k_dim=raw["linear_key_head_dim"],
            v_dim=raw["linear_value_head_dim"],
        )
    elif raw.get("use_sliding_window"):
        start = raw["max_window_layers"]
        cfg["layer_types"] = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        cfg["window"] = raw["sliding_window"]
    else:
        cfg["layer_types"] = ["full_attention"] * layers
    if "num_experts" in raw:
        step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers", [])
        cfg["moe_layers"] = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        cfg["top_k"] = raw["num_experts_per_tok"]
        cfg["renormalise"] = family == "qwen3_5_moe_text" or raw.get("norm_topk_prob", False)
    return cfg


def random_target(raw: dict[str, Any], seed: int = 0):
    model = build_target(TargetConfig.from_hf(raw)).to(F64).eval()
    randomise(model, seed)
    return model


def token_ids(count: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_logits(model, ids: list[int], prompt: int = PROMPT) -> torch.Tensor:
    """The engine's logits at every position: one forward over the prompt, then one decode
    step per remaining token through the slot's caches and recurrent states."""
    state = new_state(model, len(ids))
    out = model(
        torch.tensor([ids[:prompt]]), torch.arange(prompt)[None], torch.tensor([0]), state, kv_len=prompt
    )
    state.lengths[0] = prompt
    steps = [decode_step(model, state, 0, token) for token in ids[prompt:]]
    return torch.cat([out.logits[0], torch.stack(steps)]) if steps else out.logits[0]


TARGETS = {
    "qwen3-gqa-sliding": QWEN3,
    "qwen3-tied-one-kv-head": {**QWEN3, "tie_word_embeddings": True, "num_key_value_heads": 1},
    "llama3-scaled-rope-attention-bias": LLAMA,
    "llama-mlp-bias-untied": {
        **LLAMA,
        "attention_bias": False,
        "mlp_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "rope_theta": 200.0,
    },
    "qwen3_5-hybrid": QWEN3_5,
    "qwen3_5-hybrid-half-rotary": {
        **QWEN3_5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.5},
        "layer_types": ["full_attention", "linear_attention"],
        "num_hidden_layers": 2,
    },
    "qwen3_moe-top2-unnormalised": QWEN3_MOE,
    "qwen3_moe-renormalised-sparse-step": {
        **QWEN3_MOE,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "decoder_sparse_step": 2,
    },
    "qwen3_5_moe-shared-expert": QWEN3_5_MOE,
}


@pytest.mark.parametrize("raw", list(TARGETS.values()), ids=list(TARGETS))
@torch.inference_mode()
def test_target_logits_at_every_prompt_position_and_decode_step_equal_the_written_out_model(
    raw: dict[str, Any],
) -> None:
    """A tiny random target of each family, parsed from its config.json, gives the logits of
    the architecture written out in this file, over a prompt and over decode steps that read
    its caches: the (1 + w) or w norms and their epsilon, per-head q/k norms, the query gate,
    grouped query heads, RoPE over the rotary part (Llama 3 scaled), sliding windows, the
    Gated DeltaNet, the routed and shared experts, biases, and a tied head."""
    model = random_target(raw)
    ids = token_ids(PROMPT + DECODED, raw["vocab_size"], seed=1)
    expected, _ = reference_target(model.state_dict(), written_out_fields(raw), ids)
    got = engine_logits(model, ids)
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err < ATOL, f"max |engine - written out| = {err:.3g}"


def captured_features(layers: tuple[int, ...], raw_last_layer: bool = False):
    """A random Qwen3 target's prompt forward capturing `layers`: (model, its state dict, the
    written-out forward's per-layer outputs, the captured features)."""
    model = random_target(QWEN3)
    ids = token_ids(PROMPT, QWEN3["vocab_size"], seed=2)
    sd = model.state_dict()
    _, outputs = reference_target(sd, written_out_fields(QWEN3), ids)
    state = new_state(model, PROMPT)
    with torch.inference_mode():
        out = model(
            torch.tensor([ids]),
            torch.arange(PROMPT)[None],
            torch.tensor([0]),
            state,
            kv_len=PROMPT,
            capture_layers=layers,
            raw_last_layer=raw_last_layer,
        )
    return model, sd, outputs, out.features


def test_captured_features_are_the_listed_layers_outputs_in_the_listed_order() -> None:
    """The context features a target hands its draft are the outputs of the layers the draft
    lists (z-lab's hidden_states[id + 1]: after layer id; for the last layer, below),
    concatenated in the draft's order, a repeated layer repeated."""
    model, sd, outputs, features = captured_features((1, 0, 1))
    expected = torch.cat([outputs[1], outputs[0], outputs[1]], -1)
    assert features is not None and features.shape == (1, PROMPT, 3 * QWEN3["hidden_size"])
    assert (features[0] - expected).abs().max().item() < ATOL


def test_a_draft_listing_the_targets_last_layer_gets_its_final_normed_output() -> None:
    """hidden_states[N] of an N-layer transformers model is its final-normed output
    (capture_outputs ties hidden_states[-1] to last_hidden_state), so the feature of layer
    N - 1 is model.norm of that layer's output (what z-lab's extract_context_feature reads)."""
    model, sd, outputs, features = captured_features((2, 0))
    last = rms(outputs[2], sd["model.norm.weight"], QWEN3["rms_norm_eps"])
    assert features is not None
    assert (features[0] - torch.cat([last, outputs[0]], -1)).abs().max().item() < ATOL


def test_a_draft_trained_on_the_raw_last_layer_gets_its_raw_output() -> None:
    """`raw_last_layer` (a draft config's `last_layer_feature: "raw"`) gives the last layer's
    output before the final norm; the other layers' features are the same either way."""
    model, sd, outputs, features = captured_features((2, 0), raw_last_layer=True)
    assert features is not None
    assert (features[0] - torch.cat([outputs[2], outputs[0]], -1)).abs().max().item() < ATOL


def test_a_draft_config_says_which_last_layer_feature_it_was_trained_on() -> None:
    """`dflash_config.last_layer_feature`: absent, null or "final_norm" (Hugging Face's
    reading), "raw"; anything else is refused naming the field. The shipped demo drafts say
    "raw"."""
    assert (
        "last_layer_feature" not in DFLASH["dflash_config"] and not DraftConfig.from_hf(DFLASH).raw_last_layer
    )
    for value, raw_last in ((None, False), ("final_norm", False), ("raw", True)):
        dflash = dict(DFLASH["dflash_config"])
        dflash["last_layer_feature"] = value
        assert DraftConfig.from_hf({**DFLASH, "dflash_config": dflash}).raw_last_layer is raw_last
    with pytest.raises(ConfigError, match="last_layer_feature"):
        DraftConfig.from_hf(
            {**DFLASH, "dflash_config": {**DFLASH["dflash_config"], "last_layer_feature": "normed"}}
        )
    for name in ("draft", "draft-dflash2"):
        raw = json.loads((DEMO_DIR / name / "config.json").read_text())
        assert DraftConfig.from_hf(raw).raw_last_layer, name


# ----------------------------------------------------------------------------- drafts
CONTEXT, BLOCK = 9, 5
DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 0.2,
    "rope_theta": 500.0,
    "max_position_embeddings": 64,
    "num_target_layers": 3,
    "layer_types": ["sliding_attention", "full_attention"],
    "use_sliding_window": True,
    "sliding_window": 3,
    "final_logit_softcapping": 3.0,
    "dflash_config": {
        "target_layer_ids": [2, 0],
        "mask_token_id": 5,
        "block_size": BLOCK,
        "output_multiplier": 0.7,
    },
}
DFLASH2 = {
    **DFLASH,
    "architectures": ["DFlash2DraftModel"],
    "layer_types": ["sliding_attention", "sliding_attention"],
    "is_causal": False,
    "dflash_config": {
        "target_layer_ids": [1, 2],
        "mask_token_id": 5,
        "block_size": BLOCK,
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "selector_rank": 4,
        "selector_top_k": 5,
        "output_multiplier": 0.7,
    },
}


def dynamic_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], x before the
    block's first token read as 0 (docs/dflash2.md)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(base.shape[0]):
            if i - t >= 0:
                weight = base[t] + delta[i, t].repeat_interleave(group)
                out[i] += weight * x[i - t]
    return out


def reference_draft(
    sd: dict[str, torch.Tensor], raw: dict[str, Any], features: torch.Tensor, embeds: torch.Tensor
) -> torch.Tensor:
    """z-lab's draft forward: the context is hidden_norm(fc(features)); each layer's block
    queries read the context's keys and values (k_norm, RoPE at the context positions) and the
    block's own; a layer is causal by `is_causal`, else when it slides; a sliding layer sees
    keys less than its window away (the window read as Qwen3Config reads it). DFlash2 wraps
    each sublayer in its convolution pair. Returns the block's final-normed hidden states
    [B, hidden]."""
    eps, C, B = raw["rms_norm_eps"], features.shape[0], embeds.shape[0]
    dflash2 = "DFlash2DraftModel" in raw["architectures"]
    rope_params = raw.get("rope_parameters") or {}
    cfg = {
        "heads": raw["num_attention_heads"],
        "kv_heads": raw["num_key_value_heads"],
        "head_dim": raw["head_dim"],
        "eps": eps,
        "theta": rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)),
        "scaling": rope_params if rope_params.get("rope_type") == "llama3" else None,
        "attention_bias": raw.get("attention_bias", False),
    }
    context = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    context_positions, positions = list(range(C)), list(range(C, C + B))
    group = raw["dflash_config"].get("conv_group_size", 1)
    x = embeds
    for i, kind in enumerate(raw["layer_types"]):
        name = f"layers.{i}"
        sliding = kind == "sliding_attention"
        causal = raw.get("is_causal", sliding)
        # the draft's config class is Qwen3Config, which drops sliding_window unless
        # use_sliding_window
        window = raw["sliding_window"] if sliding and raw.get("use_sliding_window") else None
        for part, norm, conv in (
            ("attention", "input_layernorm", "attention_conv"),
            ("mlp", "post_attention_layernorm", "mlp_conv"),
        ):
            h = rms(x, sd[f"{name}.{norm}.weight"], eps)
            if dflash2:  # both sides' dynamic weights come from the sublayer's normed input
                base = sd[f"{name}.{conv}.base_kernel"]
                delta = (h @ sd[f"{name}.{conv}.kernel_projection.weight"].T).view(B, 2, base.shape[1], -1)
                h = dynamic_conv(h, base[0], delta[:, 0], group)
            if part == "attention":
                h = attention_block(
                    h, sd, f"{name}.self_attn", cfg, positions, causal, window, context, context_positions
                )
            else:
                h = swiglu(h, sd, f"{name}.mlp")
            if dflash2:
                h = dynamic_conv(h, base[1], delta[:, 1], group)
            x = x + h
    return rms(x, sd["norm.weight"], eps)


def random_draft(raw: dict[str, Any], seed: int = 4):
    draft = build_draft(DraftConfig.from_hf(raw)).to(F64).eval()
    randomise(draft, seed)
    return draft


@torch.inference_mode()
def engine_block(draft, features: torch.Tensor, embeds: torch.Tensor, split: int) -> torch.Tensor:
    """The draft's block hidden states after the context was appended in two pieces (the
    engine appends the rows of each step's committed positions)."""
    C, B = features.shape[0], embeds.shape[0]
    state = DraftState(draft.config, 2, C + B, F64)
    slot = torch.tensor([1])
    for lo, hi in ((0, split), (split, C)):
        draft.append_context(features[None, lo:hi], torch.arange(lo, hi)[None], slot, state)
    return draft(embeds[None], torch.arange(C, C + B)[None], slot, state, C + B)[0]


DRAFTS = {
    "dflash-sliding-causal-then-full-bidirectional": DFLASH,
    "dflash-llama3-rope-attention-bias": {
        **{k: v for k, v in DFLASH.items() if k != "rope_theta"},
        "attention_bias": True,
        "rope_parameters": LLAMA["rope_parameters"],
    },
    "dflash2-non-causal-sliding": DFLASH2,
    "dflash2-causal": {**DFLASH2, "is_causal": True, "layer_types": ["full_attention", "sliding_attention"]},
    # z-lab's DFlashDraftModel takes `is_causal`, when given, for every layer
    # (`layer_type == "sliding_attention" if is_causal is None else bool(is_causal)`)
    "dflash-is-causal-false": {**DFLASH, "is_causal": False},
    "dflash-is-causal-true": {**DFLASH, "is_causal": True},
    # Qwen3Config drops the window without use_sliding_window: the sliding layer attends over
    # the whole context and block (causally, by the legacy rule)
    "dflash-window-without-use-sliding-window": {**DFLASH, "use_sliding_window": False},
}


@pytest.mark.parametrize("raw", list(DRAFTS.values()), ids=list(DRAFTS))
def test_draft_block_hidden_states_equal_the_written_out_draft(raw: dict[str, Any]) -> None:
    """The draft's final hidden states for a block after a context equal z-lab's forward
    written out: the context projection and its norm, the context keys normed and rotated at
    their own positions, the block's attention (bidirectional, causal or windowed as the
    config says), DFlash2's convolution pairs, the final norm."""
    draft = random_draft(raw)
    gen = torch.Generator().manual_seed(5)
    hidden = raw["hidden_size"]
    features = torch.randn(
        CONTEXT, len(raw["dflash_config"]["target_layer_ids"]) * hidden, generator=gen, dtype=F64
    )
    embeds = torch.randn(BLOCK, hidden, generator=gen, dtype=F64)
    expected = reference_draft(draft.state_dict(), raw, features, embeds)
    got = engine_block(draft, features, embeds, split=4)
    err = (got - expected).abs().max().item()
    assert err < ATOL, f"max |engine - written out| = {err:.3g}"


def written_out_logits(raw: dict[str, Any], hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """z-lab's compute_logits: the target's head, times output_multiplier, then the tanh cap."""
    logits = hidden @ head.T * raw["dflash_config"].get("output_multiplier", 1.0)
    cap = raw.get("final_logit_softcapping")
    return torch.tanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("raw", [DFLASH, DFLASH2], ids=["dflash", "dflash2"])
@torch.inference_mode()
def test_draft_proposals_are_the_written_out_logits_and_choice_of_block_slots_1_on(
    raw: dict[str, Any],
) -> None:
    """The proposals read block slots 1..B-1 through the target's head, scaled by
    output_multiplier and soft-capped; DFlash proposes each slot's argmax, DFlash2 walks its
    selector from the anchor: at slot j the best of the slot's top-K tokens by unary + <P[prev]
    * (W h_j), S[c]>, prev the token the walk took at slot j - 1."""
    draft = random_draft(raw)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(1, BLOCK, raw["hidden_size"], generator=gen, dtype=F64)
    head = torch.randn(raw["vocab_size"], raw["hidden_size"], generator=gen, dtype=F64)
    anchor = 7
    out = draft.proposals(hidden, head, anchors=torch.tensor([anchor]))
    logits, tokens = out[0][0], out[1][0].tolist()
    expected = written_out_logits(raw, hidden[0], head)[1:]
    assert (logits - expected).abs().max().item() < 1e-9
    if "DFlash2DraftModel" not in raw["architectures"]:
        assert tokens == expected.argmax(-1).tolist()
        return
    sd = draft.state_dict()
    P, S = sd["candidate_selector.predecessor_codebook"], sd["candidate_selector.successor_codebook"]
    W = sd["candidate_selector.hidden_projection.weight"]
    walk, previous = [], anchor
    for j in range(BLOCK - 1):
        candidates = expected[j].topk(raw["dflash_config"]["selector_top_k"]).indices.tolist()
        projected = W @ hidden[0, j + 1]
        scores = [float(expected[j, c] + (P[previous] * projected * S[c]).sum()) for c in candidates]
        previous = candidates[max(range(len(scores)), key=scores.__getitem__)]
        walk.append(previous)
    assert tokens == walk


def test_a_draft_without_layer_types_slides_from_max_window_layers_with_use_sliding_window() -> None:
    """Qwen3Config without layer_types: layer i is sliding_attention when a window is set
    (use_sliding_window and sliding_window) and i >= max_window_layers."""
    raw = {k: v for k, v in DFLASH.items() if k != "layer_types"}
    config = DraftConfig.from_hf({**raw, "max_window_layers": 1})
    assert config.layer_types == ("full_attention", "sliding_attention")
    assert config.sliding_window == 3


# ----------------------------------------------------------------------------- config parsing
@pytest.mark.parametrize(
    ("target_layers", "draft_layers", "expected"),
    [(12, 4, (1, 4, 6, 9)), (11, 3, (1, 4, 8)), (9, 3, (1, 4, 6)), (7, 1, (3,))],
)
def test_the_published_spread_of_target_layers_rounds_as_python_round_does(
    target_layers: int, draft_layers: int, expected: tuple[int, ...]
) -> None:
    """z-lab's build_target_layer_ids: round(1 + i * (N - 4) / (L - 1)) with Python's round
    (3.67 -> 4, and 4.5 -> 4: halves to even), or N // 2 for a one-layer draft; a draft config
    without target_layer_ids gets it."""
    assert published_target_layer_ids(target_layers, draft_layers) == expected
    raw = {
        **DFLASH,
        "num_hidden_layers": draft_layers,
        "layer_types": ["full_attention"] * draft_layers,
        "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": 5},
    }
    assert DraftConfig.from_hf(raw).target_layer_ids == expected


def test_a_directly_built_moe_config_refuses_a_dense_layer_without_an_mlp_width() -> None:
    """A Qwen3-MoE config whose mlp_only_layers leave a layer dense needs a positive
    intermediate_size however it is built (from_hf asks for the field; a config built or
    replaced in code is checked too), or that layer's MLP would have no width and add
    nothing."""
    config = TargetConfig.from_hf(QWEN3_MOE)  # layer 1 dense
    assert config.dense_layers == (1,) and config.moe_layers == (0, 2)
    with pytest.raises(
        ConfigError, match=r"layers \[1\] have a dense MLP and need a positive intermediate_size"
    ):
        dataclasses.replace(config, intermediate_size=0)
    all_moe = dataclasses.replace(config, mlp_only_layers=(), intermediate_size=0)
    assert all_moe.dense_layers == ()


def test_qwen3_sliding_layers_start_at_layer_28_without_max_window_layers() -> None:
    """Qwen3Config: max_window_layers defaults to 28, and layer i slides when a window is set
    (use_sliding_window) and i >= max_window_layers."""
    raw = {k: v for k, v in QWEN3.items() if k != "max_window_layers"}
    config = TargetConfig.from_hf({**raw, "num_hidden_layers": 30, "sliding_window": 16})
    assert config.layer_types == ("full_attention",) * 28 + ("sliding_attention",) * 2
    assert config.sliding_window == 16


def test_qwen3_use_sliding_window_without_a_sliding_window_slides_over_4096_positions() -> None:
    """Qwen3Config: sliding_window defaults to 4096 and is kept when use_sliding_window."""
    raw = {k: v for k, v in QWEN3.items() if k != "sliding_window"}
    config = TargetConfig.from_hf(raw)  # use_sliding_window true, max_window_layers 1
    assert config.sliding_window == 4096
    assert config.layer_types == ("full_attention", "sliding_attention", "sliding_attention")


BAD_VALUES = [
    # once a traceback (ValueError, TypeError) from float(), a comparison or tuple()
    pytest.param(QWEN3, "rms_norm_eps", "1e-6x", id="target-eps-not-a-number"),
    pytest.param(QWEN3, "rms_norm_eps", None, id="target-eps-null"),
    pytest.param(QWEN3, "max_window_layers", None, id="max_window_layers-null"),
    pytest.param(QWEN3, "layer_types", 3, id="layer_types-not-a-list"),
    pytest.param(QWEN3_MOE, "mlp_only_layers", 3, id="mlp_only_layers-not-a-list"),
    pytest.param(DFLASH, "dflash_config.output_multiplier", None, id="draft-output_multiplier-null"),
    pytest.param(
        DFLASH, "dflash_config.input_embedding_scale", "2x", id="draft-embedding-scale-not-a-number"
    ),
    # once accepted, as something the file does not say
    pytest.param(QWEN3, "tie_word_embeddings", "false", id="tie-string-false-read-as-true"),
    pytest.param(QWEN3_MOE, "norm_topk_prob", "false", id="norm_topk_prob-string-false-read-as-true"),
    pytest.param(QWEN3, "use_sliding_window", "false", id="use_sliding_window-a-string"),
    pytest.param(DFLASH, "dflash_config.target_layer_ids", "12", id="target_layer_ids-a-string"),
    pytest.param(DFLASH, "rms_norm_eps", -1.0, id="draft-eps-negative"),
]


@pytest.mark.parametrize(("base", "field", "value"), BAD_VALUES)
def test_a_config_value_of_the_wrong_type_or_range_is_refused_naming_the_field(
    base: dict[str, Any], field: str, value: Any
) -> None:
    """Parsing a config.json validates what it reads and raises ConfigError with the field
    (config/__init__.py), as it already does for the integer fields, the token ids and
    `is_causal`."""
    raw = {**base, field: value}
    if field.startswith("dflash_config."):
        field = field.removeprefix("dflash_config.")
        raw = {**base, "dflash_config": {**base["dflash_config"], field: value}}
    with pytest.raises(ConfigError, match=field):
        if "architectures" in raw:
            DraftConfig.from_hf(raw).check_target(TargetConfig.from_hf(QWEN3))
        else:
            TargetConfig.from_hf(raw)

"""Parity with Hugging Face transformers on the same tiny checkpoints.

Both sides read the same files. Our engine runs prefill over all prompt positions, then one
decode step at a time against its slot state; transformers runs the same tokens with its own
cache (`use_cache=True`, the cache passed back as `cache=`). Both sides get the same token at
every step, so a divergence in choice shows as a token mismatch, not as drift.

Untied tiny models are fed our greedy choice. Tied tiny models echo their input (the lm_head
is the embedding, so the fed token's own logit dominates) and greedy repeats one token
forever; they are fed random tokens instead, so that the per-step choices still vary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_engine.checkpoint import load_target
from reference_engine.models.layers import RMSNorm, RotaryEmbedding
from reference_engine.runtime.decode import decode_step, new_state
from reference_engine.runtime.sampling import greedy

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

PROMPT_LEN = 17
DECODE_STEPS = 72

# Tolerance on max |ours - HF| / max(1, max |HF logits|), relative to the logit scale
# because tied tiny models have logits near 100 while untied ones stay near 4.
# HF computes RMSNorm, RoPE angles, softmax and the gated delta rule in float32 even for a
# float64 model, while our engine keeps float64 throughout, so even the float64 comparison
# measures float32 rounding (the MoE router's softmax and top-k included, as transformers
# routes). Observed maxima over the cases below (prefill / decode):
#   float64: 1.2e-5 / 1.4e-5    float32: 7.5e-6 / 9.0e-6
# The 1.4e-5 is one ill-conditioned decode step of the h128 Qwen3.5 model, where our own
# float32 and float64 runs differ by 3.3e-5; every other step stays below 4e-6 for the
# dense families. Llama and Qwen3-MoE stay below 1e-6, Qwen3.5-MoE below 1.3e-5. The
# tolerance sits a few times above that; a real bug (a wrong norm offset, a rotary
# dimension off by one, a stale cache row, an unrenormalised routing) moves logits by 1e-2
# or more.
REL_TOL = {torch.float64: 1e-4, torch.float32: 1e-4}


MOE_VARIANT = (
    ("num_experts", 12),
    ("num_experts_per_tok", 3),
    ("norm_topk_prob", False),
    ("decoder_sparse_step", 2),
    ("mlp_only_layers", (3,)),
)


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    seed: int
    tie_word_embeddings: bool
    options: tuple[tuple[str, Any], ...] = ()  # more make_tiny_target options

    @property
    def feed_greedy(self) -> bool:
        """Feed our greedy choice back (untied), or random tokens (tied: greedy echoes)."""
        return not self.tie_word_embeddings

    @property
    def id(self) -> str:
        tie = "tied" if self.tie_word_embeddings else "untied"
        more = "".join(f"-{k}" if k == "config_overrides" else f"-{k}-{v}" for k, v in self.options)
        return f"{self.arch}-h{self.hidden}-l{self.layers}-s{self.seed}-{tie}{more}"

    def checkpoint(self, tiny_checkpoint: Callable[..., Path]) -> Path:
        return tiny_checkpoint(
            self.arch,
            seed=self.seed,
            layers=self.layers,
            hidden=self.hidden,
            tie_word_embeddings=self.tie_word_embeddings,
            **dict(self.options),
        )


SHAPES = [
    Shape("qwen3", hidden=64, layers=4, seed=0, tie_word_embeddings=False),
    Shape("qwen3", hidden=128, layers=3, seed=1, tie_word_embeddings=True),
    # sliding-window attention from layer 2 on, a window of 8: the prompt and every decode
    # step reach past it
    Shape(
        "qwen3",
        hidden=64,
        layers=4,
        seed=6,
        tie_word_embeddings=False,
        options=(
            (
                "config_overrides",
                (("use_sliding_window", True), ("sliding_window", 8), ("max_window_layers", 2)),
            ),
        ),
    ),
    Shape("qwen3_5", hidden=64, layers=4, seed=0, tie_word_embeddings=False),
    Shape("qwen3_5", hidden=96, layers=5, seed=2, tie_word_embeddings=True),
    Shape("qwen3_5", hidden=128, layers=3, seed=3, tie_word_embeddings=False),
    # llama3 RoPE scaling with frequencies in all three bands (head_dim 16 and 32)
    Shape("llama", hidden=64, layers=3, seed=0, tie_word_embeddings=False),
    Shape("llama", hidden=96, layers=2, seed=4, tie_word_embeddings=True),
    Shape("llama", hidden=64, layers=2, seed=5, tie_word_embeddings=False, options=(("bias", True),)),
    # 8 experts, top-2, renormalised, the last layer dense; per-expert tensors
    Shape("qwen3_moe", hidden=64, layers=4, seed=0, tie_word_embeddings=False),
    # 12 experts (ids 10 and 11 sort before 2 as text), top-3 not renormalised, layers 1
    # and 3 MoE by decoder_sparse_step 2 but 3 dense by mlp_only_layers; fused tensors
    Shape(
        "qwen3_moe",
        hidden=64,
        layers=4,
        seed=1,
        tie_word_embeddings=True,
        options=(
            ("expert_layout", "fused"),
            ("config_overrides", MOE_VARIANT),
        ),
    ),
    # routed experts plus the gated shared expert on every hybrid layer; per-expert text layout
    Shape("qwen3_5_moe", hidden=64, layers=4, seed=0, tie_word_embeddings=False),
    # the multimodal wrapper with fused experts (as the published checkpoints), 12 experts, top-3
    Shape(
        "qwen3_5_moe",
        hidden=64,
        layers=3,
        seed=2,
        tie_word_embeddings=True,
        options=(
            ("expert_layout", "fused"),
            ("multimodal_wrapper", True),
            ("config_overrides", (("num_experts", 12), ("num_experts_per_tok", 3))),
        ),
    ),
]
DTYPES = [torch.float64, torch.float32]


def hf_class(arch: str) -> type:
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM
    if arch == "llama":
        return transformers.LlamaForCausalLM
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM
    name = "Qwen3_5MoeForCausalLM" if arch == "qwen3_5_moe" else "Qwen3_5ForCausalLM"
    if not hasattr(transformers, name):
        pytest.skip(
            f"transformers {transformers.__version__} has no {name} "
            "(Qwen3.5 support arrived in transformers 5)"
        )
    return getattr(transformers, name)


def hf_cache(output: object) -> object:
    """transformers 5.24 renamed `past_key_values` to `cache` on model outputs."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@dataclass
class Trace:
    """Logits of both engines over one prompt and DECODE_STEPS greedy steps."""

    ours_prefill: torch.Tensor  # [PROMPT_LEN, vocab]
    hf_prefill: torch.Tensor  # [PROMPT_LEN, vocab]
    ours_decode: torch.Tensor  # [DECODE_STEPS, vocab]
    hf_decode: torch.Tensor  # [DECODE_STEPS, vocab]
    ours_tokens: list[int]  # greedy choice after the prompt and after every decode step
    hf_tokens: list[int]


@torch.inference_mode()
def run_both(
    path: Path, shape: Shape, dtype: torch.dtype, plant: Callable[[torch.nn.Module], None] | None = None
) -> Trace:
    """`plant` breaks one layer of our model first (the planted-fault tests)."""
    # transformers' default experts backend (grouped_mm) takes no float64 on the CPU
    hf = hf_class(shape.arch).from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    hf.eval()
    ours = load_target(path, dtype=dtype)
    if plant is not None:
        plant(ours)
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(shape.seed)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen)
    forced = torch.randint(0, vocab, (DECODE_STEPS,), generator=gen).tolist()

    state = new_state(ours, PROMPT_LEN + DECODE_STEPS)
    out = ours(prompt[None], torch.arange(PROMPT_LEN)[None], torch.tensor([0]), state, kv_len=PROMPT_LEN)
    state.lengths[0] = PROMPT_LEN
    hf_out = hf(input_ids=prompt[None], use_cache=True)
    ours_prefill, hf_prefill = out.logits[0], hf_out.logits[0]

    ours_logits, hf_logits = ours_prefill[-1], hf_prefill[-1]
    ours_decode, hf_decode, ours_tokens, hf_tokens = [], [], [], []
    for step in range(DECODE_STEPS):
        choice = int(greedy(ours_logits))
        ours_tokens.append(choice)
        hf_tokens.append(int(hf_logits.argmax()))
        token = choice if shape.feed_greedy else forced[step]
        ours_logits = decode_step(ours, state, 0, token)
        hf_out = hf(input_ids=torch.tensor([[token]]), cache=hf_cache(hf_out), use_cache=True)
        hf_logits = hf_out.logits[0, -1]
        ours_decode.append(ours_logits)
        hf_decode.append(hf_logits)
    ours_tokens.append(int(greedy(ours_logits)))
    hf_tokens.append(int(hf_logits.argmax()))
    return Trace(
        ours_prefill,
        hf_prefill,
        torch.stack(ours_decode),
        torch.stack(hf_decode),
        ours_tokens,
        hf_tokens,
    )


@pytest.fixture(
    scope="module",
    params=[(s, d) for s in SHAPES for d in DTYPES],
    ids=[f"{s.id}-{str(d).removeprefix('torch.')}" for s in SHAPES for d in DTYPES],
)
def case(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> tuple[Trace, torch.dtype]:
    shape, dtype = request.param
    return run_both(shape.checkpoint(tiny_checkpoint), shape, dtype), dtype


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    scale = max(1.0, reference.abs().max().item())
    return (ours.double() - reference.double()).abs().max().item() / scale


def test_prefill_logits_match_transformers_at_every_position(
    case: tuple[Trace, torch.dtype],
) -> None:
    trace, dtype = case
    assert trace.ours_prefill.shape == trace.hf_prefill.shape == (PROMPT_LEN, 512)
    assert trace.ours_prefill.dtype == trace.hf_prefill.dtype == dtype
    err = relative_error(trace.ours_prefill, trace.hf_prefill)
    assert err <= REL_TOL[dtype], f"prefill relative error {err:.3g} > {REL_TOL[dtype]}"


def test_decode_logits_match_transformers_cache_for_every_step(
    case: tuple[Trace, torch.dtype],
) -> None:
    trace, dtype = case
    assert trace.ours_decode.shape == (DECODE_STEPS, 512)
    per_step = [relative_error(o, h) for o, h in zip(trace.ours_decode, trace.hf_decode, strict=True)]
    worst = max(range(DECODE_STEPS), key=per_step.__getitem__)
    assert per_step[worst] <= REL_TOL[dtype], (
        f"decode step {worst}: relative error {per_step[worst]:.3g} > {REL_TOL[dtype]}"
    )


def test_greedy_tokens_match_transformers_argmax_for_every_step(
    case: tuple[Trace, torch.dtype],
) -> None:
    trace, _ = case
    assert trace.ours_tokens == trace.hf_tokens
    # a constant choice would make the comparison weak
    assert len(set(trace.ours_tokens)) > DECODE_STEPS // 4


# ------------------------------------------------------------------ planted faults
class GateIgnoringNorm(torch.nn.Module):
    """A Gated DeltaNet output norm that forgets its silu(z) gate."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.inner = norm

    def forward(self, x: torch.Tensor, z: torch.Tensor, ops=None) -> torch.Tensor:
        return self.inner(x, torch.full_like(z, 20.0))  # silu(20) ~ 20: a constant gate


def swap_query_and_gate(model: torch.nn.Module) -> None:
    """Qwen3.5 gated attention reading [gate | query] instead of [query | gate] per head."""
    layer = model.config.attention_layers[0]
    attn = model.model.layers[layer].self_attn
    w = attn.q_proj.weight.view(attn.num_heads, 2, attn.head_dim, -1)
    attn.q_proj.weight.copy_(w.flip(1).reshape_as(attn.q_proj.weight))


def ignore_the_gdn_gate(model: torch.nn.Module) -> None:
    linear = model.model.layers[model.config.linear_layers[0]].linear_attn
    linear.norm = GateIgnoringNorm(linear.norm)


def norm_with_offset(model: torch.nn.Module) -> None:
    """A Qwen3 layer norm applied as (1 + w), the Qwen3.5 convention."""
    model.model.layers[1].input_layernorm.weight.add_(1.0)


def skip_llama3_scaling(model: torch.nn.Module) -> None:
    """Llama RoPE with the plain theta frequencies, the llama3 scaling forgotten."""
    rotary = model.rotary
    rotary.inv_freq = RotaryEmbedding(rotary.rotary_dim, model.config.rope_theta).inv_freq


def keys_normed_per_head(model: torch.nn.Module) -> None:
    """Llama attention given Qwen3's per-head key norm (unit weight: only the norm acts)."""
    attn = model.model.layers[0].self_attn
    attn.qk_norm = True
    attn.q_norm = RMSNorm(attn.head_dim, model.config.rms_norm_eps).double()
    attn.k_norm = RMSNorm(attn.head_dim, model.config.rms_norm_eps).double()


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [model.model.layers[i].mlp for i in model.config.moe_layers]


def routing_without_renormalisation(model: torch.nn.Module) -> None:
    """norm_topk_prob ignored: the top-k softmax weights used as they are."""
    for block in moe_layers(model):
        block.gate.renormalise = False


class SwappedWeights(torch.nn.Module):
    """Experts whose outputs are summed with each other's routing weights."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.inner = experts

    def forward(self, x, weights, experts, ops=None, census=None, residual=None) -> torch.Tensor:
        return self.inner(x, weights.flip(-1), experts, residual=residual)


def experts_summed_with_swapped_weights(model: torch.nn.Module) -> None:
    block = moe_layers(model)[0]
    block.experts = SwappedWeights(block.experts)


class Ungated(torch.nn.Module):
    """A shared expert whose output the block's sigmoid gate no longer scales."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.gate = block.shared_expert, block.shared_expert_gate

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        return self.inner(x) / torch.sigmoid(self.gate(x))


def shared_expert_without_its_gate(model: torch.nn.Module) -> None:
    block = moe_layers(model)[0]
    block.shared_expert = Ungated(block)


def gate_and_up_rows_swapped(model: torch.nn.Module) -> None:
    """The fused gate_up_proj read as [up | gate] instead of [gate | up]."""
    experts = moe_layers(model)[0].experts
    w = experts.gate_up_proj
    experts.gate_up_proj.copy_(w.view(w.shape[0], 2, -1, w.shape[-1]).flip(1).reshape_as(w))


PLANTED = [
    ("qwen3", norm_with_offset),
    ("qwen3_5", swap_query_and_gate),
    ("qwen3_5", ignore_the_gdn_gate),
    ("llama", skip_llama3_scaling),
    ("llama", keys_normed_per_head),
    ("qwen3_moe", routing_without_renormalisation),
    ("qwen3_moe", experts_summed_with_swapped_weights),
    ("qwen3_moe", gate_and_up_rows_swapped),
    ("qwen3_5_moe", routing_without_renormalisation),
    ("qwen3_5_moe", shared_expert_without_its_gate),
]


@pytest.mark.parametrize("arch,plant", PLANTED, ids=[f"{arch}-{p.__name__}" for arch, p in PLANTED])
def test_parity_gate_fails_on_a_deliberately_broken_layer(
    arch: str, plant: Callable[[torch.nn.Module], None], tiny_checkpoint: Callable[..., Path]
) -> None:
    shape = next(s for s in SHAPES if s.arch == arch)
    trace = run_both(shape.checkpoint(tiny_checkpoint), shape, torch.float64, plant)
    # over prefill and decode: some faults (RoPE frequencies) grow with the position
    err = max(
        relative_error(trace.ours_prefill, trace.hf_prefill),
        relative_error(trace.ours_decode, trace.hf_decode),
    )
    assert err > 100 * REL_TOL[torch.float64], f"{plant.__name__} went unnoticed ({err:.3g})"


# ------------------------------------------------------------------ expert layouts
MOE_ARCHS = ["qwen3_moe", "qwen3_5_moe"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.inference_mode()
def test_both_expert_layouts_load_to_the_same_model_here_and_in_transformers(
    arch: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    paths = {layout: tiny_checkpoint(arch, expert_layout=layout) for layout in ("per_expert", "fused")}
    ours = {layout: load_target(path, dtype=torch.float64) for layout, path in paths.items()}
    hf = {
        layout: hf_class(arch).from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
        )
        for layout, path in paths.items()
    }
    fused, split = ours["fused"].state_dict(), ours["per_expert"].state_dict()
    assert fused.keys() == split.keys() and all(torch.equal(fused[n], split[n]) for n in fused)
    hf_fused, hf_split = hf["fused"].state_dict(), hf["per_expert"].state_dict()
    assert all(torch.equal(hf_fused[n], hf_split[n]) for n in hf_fused)
    # transformers holds the experts as we do, under the same names
    assert all(torch.equal(hf_fused[n], fused[n]) for n in fused if ".mlp." in n)
    prompt = torch.arange(3, 3 + PROMPT_LEN)[None]
    logits = {}
    for layout, model in ours.items():
        state = new_state(model, PROMPT_LEN)
        logits[layout] = model(
            prompt, torch.arange(PROMPT_LEN)[None], torch.tensor([0]), state, PROMPT_LEN
        ).logits
    assert torch.equal(logits["fused"], logits["per_expert"])
    assert torch.equal(hf["fused"](input_ids=prompt).logits, hf["per_expert"](input_ids=prompt).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_angles_are_transformers_bit_for_bit_in_every_dtype(dtype: torch.dtype) -> None:
    """cos and sin of the rotary angles, computed in float32 and rounded to the model's dtype as
    transformers computes them: at positions past 256 an angle computed in bfloat16 is another
    angle (the position itself rounds)."""
    from transformers.models.qwen3 import modeling_qwen3

    config = transformers.Qwen3Config(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    positions = torch.tensor([[0, 1, 255, 257, 1001, 4097, 32767]])
    hf_cos, hf_sin = modeling_qwen3.Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions)
    cos, sin = RotaryEmbedding(128, 1000000.0).cos_sin(positions, dtype)
    assert torch.equal(cos[:, :, 0], hf_cos) and torch.equal(sin[:, :, 0], hf_sin)


def test_the_gated_deltanet_l2_norm_is_transformers_l2norm() -> None:
    """The query and key L2 norm of Gated DeltaNet with FLA's epsilon (1e-6), as transformers'
    Qwen3.5: on vectors whose squared norm is near the epsilon the two still agree."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from reference_engine.kernels.reference import l2_norm

    scale = torch.tensor([1e-4, 1e-3, 1e-2, 1.0], dtype=torch.float64)[:, None, None]
    x = torch.randn(4, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * scale
    assert torch.allclose(l2_norm(x), modeling_qwen3_5.l2norm(x), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norms_are_transformers_bit_for_bit_in_every_dtype(dtype: torch.dtype) -> None:
    """Qwen3's RMSNorm (the normed value rounded to the model's dtype, then times the weight)
    and Qwen3.5's (times 1 + weight in float32, then rounded), as transformers runs them: in
    half precision the order of the rounding and the product changes bits."""
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from reference_engine.kernels.reference import rms_norm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 9, 256, generator=gen) * 3).to(dtype)
    for hf_class, offset, weight in (
        (modeling_qwen3.Qwen3RMSNorm, False, 1 + 0.1 * torch.randn(256, generator=gen)),
        (modeling_qwen3_5.Qwen3_5RMSNorm, True, 0.1 * torch.randn(256, generator=gen)),
    ):
        hf = hf_class(256, eps=1e-6).to(dtype)
        hf.weight.data.copy_(weight.to(dtype))
        assert torch.equal(rms_norm(x, weight.to(dtype), 1e-6, offset), hf(x)), hf_class.__name__

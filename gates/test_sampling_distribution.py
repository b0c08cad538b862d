"""Gate: at temperature > 0 speculative sampling is lossless in distribution.

Two levels, in the spirit of vLLM's rejection-sampler test:
1. The pure acceptance rule: for random target p and draft q, the first committed token's
   empirical distribution converges to p as samples grow (total variation shrinks roughly
   as 1/sqrt(N)), and stays far from a perturbed reference.
2. The engine: on a tiny target with a 16-token vocabulary, the empirical joint
   distribution of the first two output tokens of speculative runs (the second one comes
   from a draft/verify step) converges to the exact distribution computed from the target,
   with top-k honoured identically in both paths.
Seeds are fixed, so the gate is deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from reference_engine.runtime.decode import new_state, prefill
from reference_engine.runtime.engine import EngineConfig
from reference_engine.runtime.one_request import generate_speculative
from reference_engine.runtime.request import SamplingParams
from reference_engine.runtime.sampling import accept_sampled, probabilities

from .conftest import SMALL_VOCAB as VOCAB
from .faults import planted

TEMPERATURE = 1.0
TOP_K = 6


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def empirical_first_token(p, q, n_samples: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = q.shape[0]
    draft = torch.multinomial(q.expand(n_samples, n, VOCAB).reshape(-1, VOCAB), 1,
                              generator=gen).reshape(n_samples, n)
    accepted, bonus = accept_sampled(draft, q.expand(n_samples, n, VOCAB),
                                     p.expand(n_samples, n + 1, VOCAB), gen)
    first = torch.where(accepted > 0, draft[:, 0], bonus)
    return torch.bincount(first, minlength=VOCAB).double() / n_samples


def test_acceptance_rule_converges_to_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(3, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    perturbed = torch.softmax(p[0].log() * 0.8, -1)
    distances = [tv(empirical_first_token(p, q, n, seed=1), p[0]) for n in (1000, 10000, 100000)]
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.01
    assert tv(empirical_first_token(p, q, 100000, seed=2), perturbed) > 5 * distances[2]


def exact_joint(target, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) under plain sampling with the same temperature and top-k."""
    def probs_after(ids: list[int]) -> torch.Tensor:
        state = new_state(target, len(ids) + 1)
        logits, _ = prefill(target, state, 0, ids)
        return probabilities(logits, TEMPERATURE, TOP_K)

    first = probs_after(prompt)
    joint = {}
    for t1 in range(VOCAB):
        if first[t1] > 0:
            second = probs_after(prompt + [t1])
            for t2 in range(VOCAB):
                joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def speculative_joint(target, draft, prompt, n_samples: int, seed: int, fault=None):
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, ignore_eos=True)
    counts = Counter()
    with planted(fault):
        for _ in range(n_samples):
            out = generate_speculative(target, draft, prompt, params, EngineConfig(block_size=4), generator=gen)
            counts[tuple(out.output_ids)] += 1
    return {k: v / n_samples for k, v in counts.items()}


def joint_tv(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


SPEC_SAMPLES = 2000


def assert_engine_sampling_lossless(target, draft, fault=None) -> None:
    prompt = [1, 2, 3]
    exact = exact_joint(target, prompt)
    small = joint_tv(speculative_joint(target, draft, prompt, SPEC_SAMPLES // 8, 11, fault), exact)
    large = joint_tv(speculative_joint(target, draft, prompt, SPEC_SAMPLES, 12, fault), exact)
    # 36 outcomes: at 2000 samples the expected distance of a correct sampler is ~0.05
    assert large < 0.08, f"speculative joint distribution is {large:.3f} from the target's"
    assert large < small, f"no convergence: {small:.3f} at {SPEC_SAMPLES // 8}, {large:.3f}"


def test_engine_speculative_sampling_matches_plain_sampling(small_vocab_pair) -> None:
    target, draft = small_vocab_pair
    assert_engine_sampling_lossless(target, draft)


def test_top_k_support_is_respected(small_vocab_pair) -> None:
    target, draft = small_vocab_pair
    exact = exact_joint(target, [1, 2, 3])
    got = speculative_joint(target, draft, [1, 2, 3], 200, 13)
    assert set(got) <= {k for k, v in exact.items() if v > 0}
    assert len({k for k in itertools.product(range(VOCAB), repeat=2) if exact.get(k, 0) > 0}) \
        == TOP_K * TOP_K

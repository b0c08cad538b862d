"""Token choice: greedy with the lowest-id tie rule (speculative acceptance joins later)."""

from __future__ import annotations

import torch

from ..kernels.reference import greedy

__all__ = ["NOT_A_DISTRIBUTION", "accept_greedy", "accept_sampled", "greedy", "probabilities", "sample"]


def accept_greedy(
    draft_tokens: torch.Tensor,  # [batch, n] proposed tokens for block slots 1..n
    target_tokens: torch.Tensor,  # [batch, n + 1] the target's greedy choice after each slot
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: the longest prefix of draft tokens equal to the target's choices.

    Draft token j (0-based) is accepted when it equals target_tokens[:, j] and every earlier
    one was accepted. Returns (accepted [batch] in 0..n, bonus [batch]): the bonus is the
    target's own token after the accepted prefix, target_tokens[:, accepted].
    """
    matches = (draft_tokens == target_tokens[:, :-1]).to(torch.int64)
    accepted = matches.cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def probabilities(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The sampling distribution: logits / T, then top-k, then top-p (nucleus), in float32
    or wider. Top-p keeps the smallest set of most likely tokens whose mass reaches top_p
    (the token that crosses the threshold is kept). Returns [..., vocab], rows sum to 1."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(dtype) / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p
        drop[..., 0] = False  # the most likely token always stays, also where top_p rounds to 0
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


NOT_A_DISTRIBUTION = -1  # what `sample` returns for a row that holds no distribution


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row: [..., vocab] -> [...].

    A row that is not a distribution (NaN, inf, a negative entry or no mass: the arithmetic
    of that request overflowed) draws NOT_A_DISTRIBUTION instead of failing the whole
    batch, so the engine fails that request alone. No host synchronisation: the bad rows
    draw from a uniform stand-in and are overwritten."""
    flat = probs.reshape(-1, probs.shape[-1])
    ok = torch.isfinite(flat).all(-1) & (flat >= 0).all(-1) & (flat.sum(-1) > 0)  # [rows]
    safe = torch.where(ok[:, None], flat, torch.ones_like(flat))
    drawn = torch.multinomial(safe, 1, generator=generator)[:, 0]
    drawn = torch.where(ok, drawn, torch.full_like(drawn, NOT_A_DISTRIBUTION))
    return drawn.reshape(probs.shape[:-1])


def accept_sampled(
    draft_tokens: torch.Tensor,  # [batch, n]
    draft_probs: torch.Tensor,  # [batch, n, vocab] q: the distributions the drafts came from
    target_probs: torch.Tensor,  # [batch, n + 1, vocab] p: the target's, one per block slot
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), in order,
    until the first rejection. At a rejection at j the replacement is drawn from the
    residual norm(max(p_j - q_j, 0)); when all n are accepted the bonus is drawn from
    p_n. The committed tokens are then distributed exactly as sampling from p one token at
    a time. Returns (accepted [batch], bonus [batch]).
    """
    batch, n = draft_tokens.shape
    if n == 0:  # nothing drafted (a plain step): the token is drawn from p_0
        return torch.zeros(batch, dtype=torch.int64, device=target_probs.device), sample(
            target_probs[:, 0], generator
        )
    idx = draft_tokens[..., None]
    p = target_probs[:, :n].gather(-1, idx)[..., 0]  # [batch, n]
    q = draft_probs.gather(-1, idx)[..., 0]
    u = torch.rand((batch, n), generator=generator, device=p.device, dtype=p.dtype)
    ok = (u * q < p).to(torch.int64)  # u < p/q without dividing by a zero q
    accepted = ok.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=p.device)
    at = accepted.clamp(max=n - 1)
    residual = (target_probs[rows, at] - draft_probs[rows, at]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs[rows, at])
    final = torch.where((accepted == n)[:, None], target_probs[:, n], residual)
    return accepted, sample(final, generator)

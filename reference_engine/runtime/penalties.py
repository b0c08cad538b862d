"""OpenAI's presence and frequency penalties and logit bias, on one row of logits.

    logit[t] -= presence_penalty * (t was generated) + frequency_penalty * (times t was generated)
    logit[t] += logit_bias[t]

Only generated tokens count, not the prompt (OpenAI's and vLLM's definition; the
repetition penalty, token_choice.py, counts both). Plain decode applies them; a speculative
request with any of them falls back to plain decode (reason `penalties`), because the verify
step scores every block position with one set of logits and the penalties of a later
position depend on the draft tokens before it.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [vocab]
    output_ids: list[int],
    params: SamplingParams,
) -> torch.Tensor:
    """The penalised and biased logits (a new tensor when anything applies)."""
    presence, frequency = params.presence_penalty, params.frequency_penalty
    if not params.logit_bias and not (output_ids and (presence or frequency)):
        return logits
    logits = logits.clone()
    if output_ids and (presence or frequency):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1])[
            : logits.shape[-1]
        ].to(logits.dtype)
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device, dtype=logits.dtype)
        logits[ids] += bias
    return logits

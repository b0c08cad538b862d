"""The prompts the gates run on real pairs (the demo pair, a user's checkpoints)."""

from __future__ import annotations

import pytest

from reference_engine.demo import demo_prompts
from reference_engine.tokenizer import load_tokenizer


def gate_prompt_ids(config: pytest.Config, tokenizer_dir, count: int) -> list[list[int]]:
    """The prompts a gate runs on a real pair, as token ids: `--gate-prompts FILE.jsonl`
    (each row `prompt_ids`, `prompt` as token ids or text, or chat `messages`, whose turns'
    contents are joined by newlines; rows of each kind may be mixed); else the demo pair's
    held-out prompts when no --target-model is given; else the first `count` prompts of the
    built-in mixed set. A row that is none of these is a ValueError naming its line."""
    from harness.workloads import Prompt, WorkloadError, builtin, is_token_ids, jsonl_rows, prompt_from_row

    path = config.getoption("--gate-prompts")
    if path is None and config.getoption("--target-model") is None:
        return [row["prompt_ids"] for row in demo_prompts()][:count]
    if path is None:
        prompts = builtin("mixed")[:count]
    else:
        prompts = []
        for source, row in jsonl_rows(path):
            if "prompt_ids" not in row:
                prompts.append(prompt_from_row(row, source))
            elif is_token_ids(row["prompt_ids"]):
                prompts.append(Prompt(token_ids=tuple(row["prompt_ids"]), source=source))
            else:
                raise WorkloadError(
                    f"{source}: 'prompt_ids' must be a non-empty list of token ids (integers from 0), "
                    f"got {row['prompt_ids']!r:.80}"
                )
        if not prompts:
            raise WorkloadError(f"{path}: no prompts")
    tokenizer = None
    out = []
    for p in prompts:
        if p.token_ids is not None:
            out.append(list(p.token_ids))
        else:
            tokenizer = tokenizer or load_tokenizer(tokenizer_dir)
            text = p.text if p.text is not None else "\n".join(m["content"] for m in p.messages)
            out.append(tokenizer.encode(text).ids)
    return out

"""The prompts the gates run on real pairs (the demo pair, a user's checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_engine.demo import demo_prompts
from reference_engine.tokenizer import load_tokenizer


def gate_prompt_ids(config: pytest.Config, tokenizer_dir, count: int) -> list[list[int]]:
    """The prompts a gate runs on a real pair, as token ids: `--gate-prompts FILE.jsonl`
    (rows with `prompt_ids`, `prompt` as token ids or text, or chat `messages`, whose
    turns' contents are joined by newlines); else the demo pair's held-out prompts when no --target-model is
    given; else the first `count` prompts of the built-in mixed set."""
    from harness.workloads import builtin, load_jsonl

    path = config.getoption("--gate-prompts")
    if path is None and config.getoption("--target-model") is None:
        return [row["prompt_ids"] for row in demo_prompts()][:count]
    rows = []
    if path is not None:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line) if line.strip() else None
            if row is not None and "prompt_ids" in row:
                rows.append(list(row["prompt_ids"]))
        if rows:
            return rows
        prompts = load_jsonl(path)
    else:
        prompts = builtin("mixed")[:count]
    tokenizer = load_tokenizer(tokenizer_dir)
    out = []
    for p in prompts:
        if p.token_ids is not None:
            out.append(list(p.token_ids))
        else:
            text = p.text if p.text is not None else "\n".join(m["content"] for m in p.messages)
            out.append(tokenizer.encode(text).ids)
    return out

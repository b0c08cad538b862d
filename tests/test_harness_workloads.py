"""Prompt sets (harness/workloads.py): every prompt read from a file or a built-in set knows
its source; the HTTP gate's built-in set has prompts of about 128, 512 and 4096 tokens, the
same on every machine."""

from __future__ import annotations

import pytest

from harness.compare import context_bucket
from harness.tokens import TextTokenizer
from harness.workloads import GATE_COUNTS, WorkloadError, builtin, gate_prompts, load_jsonl
from reference_engine.demo import DEMO_TARGET


def test_prompts_know_their_file_line_or_builtin_index(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert [p.source for p in load_jsonl(path)] == [f"{path}:1", f"{path}:3"]
    mixed = builtin("mixed")
    assert mixed[0].source == "builtin:chat#0" and len({p.source for p in mixed}) == len(mixed)


def test_the_gate_set_has_prompts_of_about_128_512_and_4096_tokens() -> None:
    prompts = gate_prompts()
    assert prompts == gate_prompts()  # deterministic
    assert len(prompts) == sum(GATE_COUNTS.values())
    tokenizer = TextTokenizer(DEMO_TARGET)  # a trained BPE of our own, about 1.5 tokens a word
    buckets = [context_bucket(tokenizer.count(p.text)) for p in prompts]
    assert {b: buckets.count(b) for b in set(buckets)} == {"~128": 12, "~512": 12, "~4096": 4}
    assert buckets[:3] == ["~128", "~512", "~4096"]  # interleaved: a batch mixes lengths


def test_a_subset_of_the_gate_set_keeps_the_sources_of_the_whole() -> None:
    whole = {p.source: p for p in builtin("gate")}
    subset = builtin("gate:128,512")
    assert len(subset) == 24 and all(whole[p.source] == p for p in subset)
    with pytest.raises(WorkloadError, match="gate:SIZES"):
        builtin("gate:100")

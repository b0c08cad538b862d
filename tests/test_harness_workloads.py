"""Prompt sets (harness/workloads.py): every prompt read from a file or a built-in set knows
its source; the HTTP gate's built-in set has prompts of about 128, 512 and 4096 tokens, the
same on every machine; the long-and-short mix tags its prompts, and a run over it reports
each group's latencies."""

from __future__ import annotations

import csv
import json

import pytest

from harness.__main__ import main
from harness.compare import context_bucket
from harness.tokens import TextTokenizer
from harness.workloads import GATE_COUNTS, WorkloadError, builtin, gate_prompts, load_jsonl, mixed_long
from reference_engine.demo import DEMO_TARGET

from .server_process import ServerProcess


def test_prompts_know_their_file_line_or_builtin_index(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert [p.source for p in load_jsonl(path)] == [f"{path}:1", f"{path}:3"]
    mixed = builtin("mixed")
    assert mixed[0].source == "builtin:chat#0" and len({p.source for p in mixed}) == len(mixed)


def test_a_prompt_may_be_a_list_of_token_ids_and_nothing_else(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": [11, 23, 5]}\n')
    (prompt,) = load_jsonl(path)
    assert prompt.token_ids == (11, 23, 5) and prompt.text is None and prompt.messages is None
    for row in ('{"prompt": [1, "a"]}', '{"prompt": [true]}', '{"prompt": []}', '{"prompt": [-3]}'):
        path.write_text(row + "\n")
        with pytest.raises(WorkloadError, match="needs a 'prompt' string or a non-empty list of token ids"):
            load_jsonl(path)


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


def test_the_long_and_short_mix_spreads_its_long_prompts_evenly() -> None:
    prompts = mixed_long(12, 8, 100, 0.25, seed=3)
    groups = [p.group for p in prompts]
    assert groups == ["short", "short", "short", "long"] * 3
    assert {len(p.token_ids) for p in prompts if p.group == "long"} == {100}
    assert {len(p.token_ids) for p in prompts if p.group == "short"} == {8}
    assert mixed_long(12, 8, 100, 0.25, seed=3) == prompts


@pytest.mark.parametrize(("long_len", "share"), [(8, 0.25), (100, 0.0), (100, 1.0)])
def test_a_mix_without_long_or_short_prompts_is_refused(long_len: int, share: float) -> None:
    with pytest.raises(WorkloadError):
        mixed_long(12, 8, long_len, share, seed=3)


def test_bench_reports_ttft_and_itl_of_short_and_long_requests_apart(tiny_checkpoint, tmp_path) -> None:
    """End to end: the long-and-short workload against our tiny server, long prompts of
    several prefill chunks beside short ones decoding."""
    server = ServerProcess(
        "--model", str(tiny_checkpoint("qwen3")), "--prefill-chunk", "32", "--threads", "1"
    )
    try:
        out = tmp_path / "run"
        argv = ["bench", "--base-url", server.url, "--concurrency", "4", "--num-prompts", "8"]
        argv += ["--input-len", "8", "--long-input-len", "160", "--output-len", "12", "--warmup", "0"]
        assert main([*argv, "--out", str(out)]) == 0
    finally:
        server.stop()
    with (out / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    for group in ("short", "long"):
        for metric in ("ttft_ms", "itl_token_ms", "itl_chunk_ms"):
            assert float(row[f"{metric}_{group}_median"]) > 0, (metric, group)
    groups = [json.loads(line)["group"] for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(groups) == ["long"] * 2 + ["short"] * 6

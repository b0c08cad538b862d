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
from harness.workloads import (
    GATE_COUNTS,
    WorkloadError,
    arrival_times,
    builtin,
    gate_prompts,
    load_jsonl,
    mixed_long,
    synthetic,
    take,
)
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


def test_synthetic_token_ids_are_drawn_from_1_below_the_vocab_size() -> None:
    """Token id 0 (often padding or a special token) is never drawn; every id is below the
    vocabulary size, and the same seed gives the same prompts."""
    prompts = synthetic(40, 16, seed=5, vocab_size=3)
    ids = {t for p in prompts for t in p.token_ids}
    assert ids == {1, 2}
    assert synthetic(40, 16, seed=5, vocab_size=3) == prompts


def test_token_id_zero_is_a_token_and_max_tokens_wins_over_output_len(tmp_path) -> None:
    """A dataset prompt may hold token id 0; a row's `max_tokens` is its output length, and
    `output_len` stands in only where `max_tokens` is absent."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": [0, 7], "max_tokens": 5, "output_len": 9}\n'
        '{"prompt": "hi", "output_len": 9}\n'
        '{"prompt": "x"}\n'
    )
    first, second, third = load_jsonl(path)
    assert first.token_ids == (0, 7) and first.max_tokens == 5
    assert (second.max_tokens, third.max_tokens) == (9, None)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_average_one_over_the_rate_whatever_the_burstiness(burstiness: float) -> None:
    """Gaps are gamma-distributed with mean 1/rate for every shape (burstiness changes only
    how bunched they are): 2000 arrivals at 10/s take about 200 s; at rate inf all are due
    at once."""
    times = arrival_times(2000, 10.0, burstiness, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(0.1, rel=0.1)
    assert arrival_times(3, float("inf"), burstiness, seed=1) == [0.0, 0.0, 0.0]


def test_the_tokenizer_counts_the_text_alone_and_keeps_special_tokens_in_decoded_text(tmp_path) -> None:
    """A tokenizer that adds a BOS token to every encoding (a post-processor, as Llama's
    does) still counts only the text's tokens; decoding keeps special tokens, as a server
    streams them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = TextTokenizer(tmp_path)
    assert text.encode("hello world") == [1, 2] and text.count("hello world") == 2
    assert text.token_text(0) == "<s>"


def test_take_gives_as_many_prompts_as_asked_cycling_a_smaller_set() -> None:
    """take(num) returns exactly num prompts in a seeded order; a set smaller than num is
    cycled, each prompt sent as often as any other (give or take one)."""
    prompts = synthetic(3, 4, seed=0)
    taken = take(prompts, 7, seed=2)
    assert len(taken) == 7 and taken == take(prompts, 7, seed=2)
    assert sorted(taken.count(p) for p in prompts) == [2, 2, 3]
    assert taken[:3] == taken[3:6] and sorted(map(prompts.index, taken[:3])) == [0, 1, 2]
    assert len(take(prompts, 1, seed=2)) == 1

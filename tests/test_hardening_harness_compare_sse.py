"""Contracts of the harness's stream reading, comparison and counter parsing, on real inputs:

- a streamed answer (harness/answer.py over harness/sse.py): nothing generated may follow the
  finish_reason, token ids alone included; a chunk's text is a string, never null; tool-call
  pieces are joined per index and listed in index order; a stream is the one choice asked
  for, so chunks of a second choice index are not an answer.
- the comparison (harness/divergence.py, harness/compare.py): text answers whose usage counts
  differ are a `length` mismatch whichever side counts more, and a run with a mismatch at one
  concurrency level is named a mismatch (and after what its first mismatch found) though
  another level only tied.
- Prometheus pages (harness/prometheus.py): a page that carries several counter families is
  read for the first of PREFIXES whatever order the page lists them in; without a draft-token
  counter the acceptance rate is unknown, not zero; label values with escaped quotes and
  commas do not change the position read; a malformed sample is refused; per-position counts
  that total more than the accepted tokens contradict them.
- the tokenizer (harness/tokens.py): counts and encodes text without the special tokens a
  tokenizer's template adds, and decodes ids with their special tokens' text kept.
"""

from __future__ import annotations

import json
import math

import pytest

from harness.answer import Answer, AnswerError, read_stream
from harness.client import RequestRecord
from harness.compare import ComparePolicy, PromptResult, verdict
from harness.compare_io import verdict_line
from harness.divergence import Divergence, text_round
from harness.prometheus import acceptance_from_counters, counter_contradictions, parse
from harness.tokens import TextTokenizer
from reference_engine.demo import DEMO_TARGET


# ----------------------------------------------------------------------------- streamed answers
def chunk(text: str, ids: list[int] | None, finish: str | None = None, index: int = 0) -> dict:
    choice: dict = {"index": index, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


def sse(*events: dict) -> bytes:
    """A completions stream as servers write it: one `data:` line an event, then [DONE]."""
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


def usage(completion: int, prompt: int = 3) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def test_an_honest_stream_reads_as_its_text_ids_finish_reason_and_usage() -> None:
    """The reference for the streams below: chunk texts joined, ids in order, the usage read."""
    answer = read_stream(sse(chunk("He", [1]), chunk("llo", [2], "length"), usage(2)), chat=False)
    assert (answer.text, answer.ids, answer.finish_reason) == ("Hello", [1, 2], "length")
    assert (answer.completion_tokens, answer.prompt_tokens) == (2, 3)


def test_token_ids_after_the_finish_reason_are_refused_even_without_text() -> None:
    """A chunk after the finish_reason that carries only token ids (its text empty) still
    carries tokens: read as nothing, a server that generates past its finish would pass."""
    body = sse(chunk("He", [1]), chunk("llo", [2], "length"), chunk("", [3]), usage(2))
    with pytest.raises(AnswerError) as caught:
        read_stream(body, chat=False)
    assert caught.value.name == "malformed_body" and "after the finish_reason" in caught.value.message


def test_a_chunk_whose_text_is_null_is_not_an_answer() -> None:
    """A completions chunk's `text` is a string; `null` beside the chunk's token ids is not
    an empty piece of text (answer.py: text that is not a string is malformed_body)."""
    body = sse(chunk("He", [1]), {"choices": [{**chunk("", [2], "length")["choices"][0], "text": None}]})
    with pytest.raises(AnswerError) as caught:
        read_stream(body, chat=False)
    assert caught.value.name == "malformed_body" and "not a string" in caught.value.message


def tool_call_delta(index: int, name: str | None, arguments: str) -> dict:
    function = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    call = {"index": index, "function": function}
    if name is not None:
        call.update(id=f"call_{index}", type="function")
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


def test_streamed_tool_calls_are_joined_by_index_and_listed_in_index_order() -> None:
    """A server may stream its second call's pieces before the first's: the calls are the
    pieces of each index joined, in index order, as the whole message lists them."""
    events = [
        tool_call_delta(1, "get_time", '{"tz": '),
        tool_call_delta(0, "get_weather", '{"city": '),
        tool_call_delta(1, None, '"UTC"}'),
        tool_call_delta(0, None, '"Paris"}'),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    answer = read_stream(sse(*events), chat=True)
    assert answer.tool_calls == [
        {"type": "function", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function", "name": "get_time", "arguments": '{"tz": "UTC"}'},
    ]
    assert answer.finish_reason == "tool_calls" and answer.text == ""


def test_chunks_of_a_second_choice_index_are_not_one_answer() -> None:
    """A request asks for one choice; a stream whose second chunk is choice 1 carries two."""
    body = sse(chunk("He", [1]), chunk("llo", [2], "length", index=1), usage(2))
    with pytest.raises(AnswerError) as caught:
        read_stream(body, chat=False)
    assert caught.value.name == "malformed_body"


# ----------------------------------------------------------------------------- the comparison
@pytest.mark.parametrize(("base_count", "cand_count"), [(2, 3), (3, 2)], ids=["more", "fewer"])
def test_text_answers_differing_only_in_their_token_count_are_a_length_mismatch(
    base_count: int, cand_count: int
) -> None:
    """Compared by text (no ids), the same text with another usage.completion_tokens is another
    answer, whether the candidate reports more tokens than the baseline or fewer."""
    base = Answer("ab", None, "length", completion_tokens=base_count)
    cand = Answer("ab", None, "length", completion_tokens=cand_count)
    divergence, agreed = text_round(base, cand, None, 0, 0.1)
    assert divergence is not None and (divergence.kind, divergence.what) == ("mismatch", "length")
    assert (divergence.baseline_text, divergence.candidate_text) == (
        f"{base_count} tokens",
        f"{cand_count} tokens",
    )
    assert text_round(base, Answer("ab", None, "length", completion_tokens=base_count), None, 0, 0.1) == (
        None,
        0,
    )


def tie(position: int) -> Divergence:
    return Divergence(position, 5, 6, "<5>", "<6>", 0.01, "tie")


def mismatch(position: int) -> Divergence:
    return Divergence(position, -1, 9, "(end)", "<9>", None, "mismatch", what="length")


def test_a_mismatch_at_one_level_names_the_run_though_another_level_only_tied() -> None:
    """A mismatch is a bug; ties are rounding. A run with both, at different concurrency
    levels, fails as a mismatch, whichever level comes first, and names what the first
    mismatch found (never the tie before it)."""
    results = [
        PromptResult(0, False, 4, [tie(2)], compared="ids", concurrency=1),
        PromptResult(0, False, 4, [mismatch(3)], compared="ids", concurrency=4),
    ]
    summary = verdict(results, ComparePolicy("strict"))
    assert summary["verdict"] == "fail" and summary["reason"] == "mismatch"
    assert summary["first_mismatch"] == "length" and (summary["ties"], summary["mismatches"]) == (1, 1)
    line = verdict_line(results, summary)
    assert line.startswith("fail: mismatch: 1 of 2 comparisons differ") and "length at position 3" in line


# ----------------------------------------------------------------------------- Prometheus pages
def family(
    prefix: str, drafts: float, draft_tokens: float | None, accepted: float, per_pos: list[float]
) -> str:
    """One family's spec-decode counters as prometheus_client writes them (per_pos numbered
    from 0, as vLLM and lmdeploy do, or from 1 for ours)."""
    first = 1 if prefix == "dflash:" else 0
    counts = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted}
    lines = []
    for name, value in counts.items():
        if value is None:
            continue
        lines += [
            f"# HELP {prefix}spec_decode_{name} Speculative decoding counter.",
            f"# TYPE {prefix}spec_decode_{name} counter",
            f'{prefix}spec_decode_{name}_total{{model_name="m"}} {value}',
        ]
    lines += [f"# TYPE {prefix}spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [
        f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{k + first}"}} {v}'
        for k, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


def test_a_page_with_several_families_is_read_for_the_first_prefix_whatever_order_it_lists_them() -> None:
    """The page of our server run with `--metrics-names vllm,dflash` may list vLLM's names
    first: it is still read under `dflash:` (the first of PREFIXES), never under the family
    the page happens to list first."""
    page = family("vllm:", 50.0, 350.0, 20.0, [15.0, 5.0]) + family("dflash:", 10.0, 70.0, 4.0, [3.0, 1.0])
    snap = parse(page)
    assert snap["prefix:dflash:"] == 1.0 and "prefix:vllm:" not in snap
    assert (snap["drafts"], snap["draft_tokens"], snap["accepted"]) == (10.0, 70.0, 4.0)
    assert (snap["pos:1"], snap["pos:2"]) == (3.0, 1.0)


def test_without_a_draft_token_counter_the_acceptance_rate_is_unknown_not_zero() -> None:
    """rate = d(accepted) / d(draft tokens): a server that exports no draft-token counter
    gives no rate (NaN), never a rate of 0 that reads as nothing accepted."""
    before = parse(family("vllm:", 10.0, None, 4.0, [3.0, 1.0]))
    after = parse(family("vllm:", 30.0, None, 24.0, [18.0, 10.0]))
    got = acceptance_from_counters(before, after)
    assert got["acceptance_length"] == pytest.approx(1 + 20 / 20)
    assert math.isnan(got["acceptance_rate"])
    assert got["acceptance_per_position"] == pytest.approx([15 / 20, 9 / 20])


def test_escaped_quotes_and_commas_in_a_label_value_do_not_change_the_position_read() -> None:
    """A model name such as `a\\"b,position=\\"7\\"` is one label value: the sample counts at
    the position its own `position` label names."""
    model = 'a\\"b,position=\\"7\\"'
    page = (
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        f'vllm:spec_decode_num_drafts_total{{model_name="{model}"}} 8\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model}",position="1"}} 5\n'
    )
    snap = parse(page)
    assert snap["drafts"] == 8.0 and snap["pos:2"] == 5.0
    assert not any(key.startswith("pos:") and key != "pos:2" for key in snap)


@pytest.mark.parametrize(
    "line",
    [
        "vllm:spec_decode_num_drafts_total many",
        'vllm:spec_decode_num_drafts_total{model_name="m" 3',
    ],
    ids=["value not a number", "label set not closed"],
)
def test_a_malformed_sample_line_is_refused_never_read_as_some_count(line: str) -> None:
    """A page whose sample line is not exposition text is an error, not a page without (or
    with a guessed) drafts counter."""
    with pytest.raises(ValueError):
        parse("# TYPE vllm:spec_decode_num_drafts counter\n" + line + "\n")


def test_per_position_counts_that_total_more_than_the_accepted_tokens_are_a_contradiction() -> None:
    """10 drafts accepting 5 tokens in all cannot have accepted their first three tokens 10
    times each (30 tokens)."""
    before = parse(family("vllm:", 0.0, 0.0, 0.0, [0.0, 0.0, 0.0]))
    after = parse(family("vllm:", 10.0, 70.0, 5.0, [10.0, 10.0, 10.0]))
    records = [RequestRecord(i, 0.0, success=True, chunk_tokens=[1, 20]) for i in range(2)]
    assert acceptance_from_counters(before, after)["acceptance_length"] == pytest.approx(1.5)
    assert counter_contradictions(before, after, records) != ""


# ----------------------------------------------------------------------------- the tokenizer
@pytest.fixture(scope="module")
def demo_tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


def test_ids_are_decoded_with_their_special_tokens_text(demo_tokenizer: TextTokenizer) -> None:
    """A token-id prompt decoded for a server that takes text, or a token's text shown at a
    divergence, keeps a special token such as `<|im_start|>`: dropped, another prompt is sent."""
    ids = demo_tokenizer.encode("<|im_start|>user hi<|im_end|>")
    assert demo_tokenizer.decode(ids) == "<|im_start|>user hi<|im_end|>"
    assert demo_tokenizer.token_text(ids[0]) == "<|im_start|>"


def test_text_is_counted_without_the_special_tokens_a_template_adds(tmp_path) -> None:
    """A tokenizer whose template puts a BOS before every sequence: the generated text's
    count is its own tokens, never the BOS (which the server did not generate)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "[UNK]": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = TextTokenizer(tmp_path)
    assert text.encode("a b") == [2, 3] and text.count("a b a") == 3
    assert text.decode([2, 1, 3]) == "a </s> b"

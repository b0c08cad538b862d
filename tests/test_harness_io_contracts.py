"""The harness's inputs and outputs, read and written strictly: workload files and arrival
times (harness/workloads.py), the files of `harness compare` and where two answers first
differ (harness/compare_io.py, harness/divergence.py), what a results folder already holds
when a run is resumed (harness/resume.py), and one server reply read as an answer
(harness/answer.py)."""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import threading
import time
from dataclasses import asdict, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness.answer import Answer, AnswerError, Ask, ask_server, margin, read_stream, read_whole
from harness.client import Endpoint
from harness.compare import ComparePolicy, Divergence, PromptResult, compare, verdict
from harness.compare_io import RUN, RowLog, markdown, md_quote, run_identity, verdict_line, write_outputs
from harness.divergence import compare_texts, prompt_divergence
from harness.resume import (
    ResumeConflict,
    bench_identity,
    check_identity,
    check_saved_identity,
    differences,
    holds_rows,
    prepare,
    read_request_rows,
    repair_summary,
)
from harness.server_kind import KNOWN
from harness.tokens import TextTokenizer
from harness.workloads import (
    Prompt,
    WorkloadError,
    arrival_times,
    arrivals,
    builtin,
    load_jsonl,
    synthetic,
    take,
)
from reference_engine.demo import DEMO_TARGET

from .completion_stub import Reply, Stub, completion
from .test_harness_answer import chat_chunk, chunk, stream
from .test_harness_compare import against


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


# ------------------------------------------------------------------ workloads
def test_a_synthetic_workload_of_no_prompts_or_no_tokens_is_refused() -> None:
    """synthetic() needs at least one prompt of at least one token; zero of either is a
    WorkloadError, not an empty or a hollow workload."""
    assert len(synthetic(1, 1, seed=0)) == 1
    for num, input_len in ((0, 4), (4, 0), (-1, 4)):
        with pytest.raises(WorkloadError, match="needs num and input_len > 0"):
            synthetic(num, input_len, seed=0)


def test_blank_and_whitespace_lines_of_a_dataset_are_skipped_and_lines_keep_their_numbers(tmp_path) -> None:
    """A line holding only spaces or tabs is blank like an empty one: skipped, and the
    prompts after it keep the number of their own line."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n   \n\t\n\n{"prompt": "b"}\n')
    prompts = load_jsonl(path)
    assert [p.text for p in prompts] == ["a", "b"]
    assert [p.source for p in prompts] == [f"{path}:1", f"{path}:5"]


def test_a_dataset_line_that_is_not_json_is_refused_with_its_line_number(tmp_path) -> None:
    """A broken line is an error naming FILE:LINE, never a prompt silently left out."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(WorkloadError, match=rf"{path}:2: not valid JSON"):
        load_jsonl(path)


def test_token_ids_of_a_dataset_prompt_fit_in_31_bits(tmp_path) -> None:
    """Token ids run from 0 to 2**31 - 1 (a server's int32): 2**31 and above are refused."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [0, 2**31 - 1]}) + "\n")
    assert load_jsonl(path)[0].token_ids == (0, 2**31 - 1)
    for too_big in (2**31, 2**40):
        path.write_text(json.dumps({"prompt": [5, too_big]}) + "\n")
        with pytest.raises(WorkloadError, match="non-empty list of token ids"):
            load_jsonl(path)


def test_a_dataset_without_a_prompt_is_refused(tmp_path) -> None:
    """A file of blank lines only holds no prompts: a WorkloadError, not an empty workload."""
    path = tmp_path / "p.jsonl"
    path.write_text("\n  \n\n")
    with pytest.raises(WorkloadError, match="no prompts"):
        load_jsonl(path)


@pytest.mark.parametrize("value", [-5, 0, "12", 3.0, True])
@pytest.mark.parametrize("name", ["max_tokens", "output_len"])
def test_a_rows_output_length_must_be_a_positive_integer(tmp_path, name, value) -> None:
    """A row's max_tokens or output_len that is not a positive integer is refused with the
    row's line and the field's name, not sent on as it is."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", name: value}) + "\n")
    with pytest.raises(WorkloadError, match=rf"p.jsonl:2: '{name}' must be a positive integer"):
        load_jsonl(path)


def test_a_rows_null_max_tokens_leaves_its_output_len_in_charge(tmp_path) -> None:
    """max_tokens rules over output_len; a null max_tokens is left out, so output_len is the
    row's length; a row with neither has none of its own."""
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a", "max_tokens": 7, "output_len": 9},
        {"prompt": "b", "max_tokens": None, "output_len": 9},
        {"prompt": "c"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.max_tokens for p in load_jsonl(path)] == [7, 9, None]


def test_chat_prompts_read_from_a_file_hold_their_messages_as_a_tuple(tmp_path) -> None:
    """A chat row's messages are kept as a tuple, as every Prompt holds them: a prompt read
    from a file equals one built from the same messages."""
    path = tmp_path / "p.jsonl"
    messages = [{"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    (read,) = load_jsonl(path)
    assert isinstance(read.messages, tuple)
    assert read == Prompt(messages=tuple(messages))
    assert all(isinstance(p.messages, tuple) for p in builtin("chat"))


@pytest.mark.parametrize("name", ["gate:", "gate:,", "gate:128,x", "gate:100"])
def test_a_gate_subset_without_valid_sizes_is_refused(name: str) -> None:
    """`gate:SIZES` needs at least one size, each one of the gate's context lengths; no size
    at all is refused like an unknown one, never an empty prompt set."""
    with pytest.raises(WorkloadError, match="gate:SIZES"):
        builtin(name)


def test_take_shuffles_by_its_seed() -> None:
    """take() sends the prompts in an order drawn from its seed: not the file order, the same
    for the same seed, another for another seed; asked for the whole set it sends each once."""
    prompts = synthetic(20, 3, seed=0)
    order = [prompts.index(p) for p in take(prompts, 20, seed=1)]
    assert sorted(order) == list(range(20))
    assert order != list(range(20))
    assert order == [prompts.index(p) for p in take(prompts, 20, seed=1)]
    assert order != [prompts.index(p) for p in take(prompts, 20, seed=2)]


def test_arrivals_keep_to_the_schedule_after_a_late_wake_up() -> None:
    """Each arrival waits for its own due time measured from the start: when the consumer is
    held up past every due time, the rest arrive at once instead of each waiting its gap
    again; none arrives before it is due."""
    due = arrival_times(4, 4.0, 1.0, seed=3)
    held = due[-1] + 0.1

    async def consume() -> list[float]:
        start, seen = time.perf_counter(), []
        async for i in arrivals(4, 4.0, 1.0, seed=3):
            seen.append(time.perf_counter() - start)
            if i == 0:
                await asyncio.sleep(held)
        return seen

    seen = asyncio.run(consume())
    assert all(t >= d - 0.005 for t, d in zip(seen, due)), (seen, due)
    assert seen[-1] - held < sum(due[1:]) / 2, (seen, due)


# ------------------------------------------------------------------ the files of a comparison
def test_the_run_identity_is_the_same_for_a_url_with_a_trailing_slash() -> None:
    """`http://h:1/` and `http://h:1` are one server: the identity a resumed run is checked
    against names it without the slash."""
    policy = ComparePolicy()
    slash = run_identity(Endpoint("http://127.0.0.1:9/"), Endpoint("http://127.0.0.1:8/"), policy, True)
    plain = run_identity(Endpoint("http://127.0.0.1:9"), Endpoint("http://127.0.0.1:8"), policy, True)
    assert slash == plain and plain["baseline"]["url"] == "http://127.0.0.1:9"


def test_the_run_identity_leaves_out_how_a_server_kind_was_decided() -> None:
    """A kind given on the command line and the same kind found by a probe are one kind: the
    evidence is not part of the identity."""
    given = Endpoint("http://127.0.0.1:9", server=replace(KNOWN["vllm"], evidence="given"))
    probed = Endpoint("http://127.0.0.1:9", server=replace(KNOWN["vllm"], evidence="GET /version: vllm"))
    a = run_identity(given, given, ComparePolicy(), True)
    b = run_identity(probed, probed, ComparePolicy(), True)
    assert a == b and "evidence" not in a["candidate"]
    assert a["candidate"]["server_kind"] == "vllm"


def _row(index: int, **fields) -> PromptResult:
    return PromptResult(index, True, 2, compared="ids", source=f"p.jsonl:{index + 1}", max_tokens=4, **fields)


def test_a_rows_file_of_torn_lines_only_is_not_resumed_without_its_identity(tmp_path) -> None:
    """compare.jsonl holding nothing but an unreadable line still holds what an earlier run
    wrote: --resume needs compare_run.json to say what it was compared against."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "compare.jsonl").write_text('{"index": 0, "exa')
    with pytest.raises(ResumeConflict, match="no compare_run.json says"):
        RowLog(out, resume=True, identity={"stream": True})


def test_resume_drops_json_rows_that_are_not_comparisons(tmp_path) -> None:
    """A JSON object in compare.jsonl that is not a comparison (fields missing, unknown
    divergence fields) is dropped and counted, like a torn line; the rows before and after it
    are kept."""
    out, identity = tmp_path / "out", {"stream": True}
    log = RowLog(out, resume=False, identity=identity)
    log.append(_row(0))
    log.close()
    with (out / "compare.jsonl").open("a") as f:
        f.write(json.dumps({"index": 5, "note": "not a comparison"}) + "\n")
        f.write(json.dumps({**asdict(_row(2)), "divergences": [{"where": 1}]}) + "\n")
        f.write(json.dumps(asdict(_row(1))) + "\n")
    log = RowLog(out, resume=True, identity=identity)
    log.close()
    assert log.dropped == 2
    assert sorted(r.source for r in log.kept.values()) == ["p.jsonl:1", "p.jsonl:2"]


def test_resume_rewrites_the_rows_file_to_the_rows_it_keeps(tmp_path) -> None:
    """After --resume compare.jsonl holds exactly the kept rows, once each (the last copy of
    a key), without error rows or a torn line, so the next row appended starts a line of its
    own and the file reads back whole."""
    out, identity = tmp_path / "out", {"stream": True}
    log = RowLog(out, resume=False, identity=identity)
    log.append(_row(0, unchecked="first copy"))
    log.append(_row(1, error="HTTP 503", error_name="http_503"))
    log.append(_row(0))
    log.close()
    with (out / "compare.jsonl").open("a") as f:
        f.write('{"index": 9, "exa')
    log = RowLog(out, resume=True, identity=identity)
    log.append(_row(2))
    log.close()
    rows, dropped = read_request_rows(out / "compare.jsonl")
    assert dropped == 0
    assert [(r["source"], r["unchecked"], r["error"]) for r in rows] == [
        ("p.jsonl:1", None, None),
        ("p.jsonl:3", None, None),
    ]


def test_a_run_without_resume_starts_an_empty_rows_file(tmp_path) -> None:
    """Without --resume the rows file is started afresh: rows an earlier run left are not
    kept and not mixed with the new ones; compare_run.json names the new identity."""
    out = tmp_path / "out"
    log = RowLog(out, resume=False, identity={"stream": True})
    log.append(_row(0))
    log.append(_row(1))
    log.close()
    log = RowLog(out, resume=False, identity={"stream": False})
    log.append(_row(2))
    log.close()
    rows, _ = read_request_rows(out / "compare.jsonl")
    assert [r["source"] for r in rows] == ["p.jsonl:3"] and log.kept == {}
    assert json.loads((out / RUN).read_text()) == {"stream": False}


def _divergent(index: int, what: str = "token", position: int | None = 3, **fields) -> PromptResult:
    d = Divergence(position, 7, 8, "x", "y", None, "mismatch", char_position=11, what=what)
    return PromptResult(index, False, 3, [d], compared="ids", source=f"p.jsonl:{index + 1}", **fields)


def test_the_summary_csv_has_one_row_per_context_bucket_under_its_own_column(tmp_path) -> None:
    """compare_summary.csv: a row for all, one per level (`concurrency` set, `context` all)
    and one per context bucket (`context` set, `concurrency` all)."""
    results = [
        PromptResult(0, True, 2, compared="ids", context="~128", concurrency=1),
        PromptResult(1, True, 2, compared="ids", context="~512", concurrency=1),
        PromptResult(0, True, 2, compared="ids", context="~128", concurrency=4),
    ]
    summary = verdict(results, ComparePolicy())
    write_outputs(tmp_path, results, summary)
    with (tmp_path / "compare_summary.csv").open() as f:
        rows = [(r["scope"], r["concurrency"], r["context"], r["prompts"]) for r in csv.DictReader(f)]
    assert rows == [
        ("all", "all", "all", "3"),
        ("concurrency", "1", "all", "2"),
        ("concurrency", "4", "all", "1"),
        ("context", "all", "~128", "2"),
        ("context", "all", "~512", "1"),
    ]


def test_the_error_line_names_the_first_failed_comparison() -> None:
    """The one-line verdict of a run with errors names the first comparison that failed (in
    the order given) and counts the failures."""
    results = [
        PromptResult(0, True, 2, compared="ids", source="p.jsonl:1"),
        PromptResult(1, False, 0, error="HTTP 500: boom", error_name="http_500", source="p.jsonl:2"),
        PromptResult(2, False, 0, error="HTTP 503: busy", error_name="http_503", source="p.jsonl:3"),
    ]
    summary = verdict(results, ComparePolicy())
    line = verdict_line(results, summary)
    assert line == ("error: http_500: HTTP 500: boom (prompt p.jsonl:2 at c=1; 2 of 3 comparisons failed)")


@pytest.mark.parametrize(
    ("text", "quoted"),
    [("a`", "`` a` ``"), ("`a", "`` `a ``"), ("a``b", "```a``b```"), ("ab", "`ab`"), ("", "(empty)")],
)
def test_md_quote_pads_a_backtick_at_either_end(text: str, quoted: str) -> None:
    """A code span whose text starts or ends with a backtick gets a space inside its fence on
    both sides (else markdown reads the backtick as part of the fence)."""
    assert md_quote(text) == quoted


def test_markdown_lists_only_the_first_divergences_and_counts_compared_prompts_without_errors() -> None:
    """The divergence table of compare.md shows the first `shown` (5) divergences; the
    headline counts as compared only the prompts that did not fail; a text divergence's
    position is its character."""
    results = [_divergent(i) for i in range(6)] + [_divergent(6, what="text", position=None)]
    results.append(PromptResult(7, False, 0, error="HTTP 500", error_name="http_500", source="p.jsonl:8"))
    text = markdown(results, verdict(results, ComparePolicy()))
    table = [line for line in text.splitlines() if line.endswith("| mismatch |")]
    assert [line.split(" | ")[0] for line in table] == [f"| `p.jsonl:{i}`" for i in range(1, 6)]
    assert "Prompts 8: compared 7 (7 by token ids, 0 by text), errors 1" in text
    one = [_divergent(6, what="text", position=None)]
    (row,) = [
        line for line in markdown(one, verdict(one, ComparePolicy())).splitlines() if "| mismatch |" in line
    ]
    assert "| text | character 11 |" in row


# ------------------------------------------------------------------ where two answers differ
def test_a_prompt_divergence_is_located_where_its_resumed_request_starts() -> None:
    """A prompt difference found in a request resumed after a tie (output positions already
    settled: the offset) is located at that offset, not at 0."""
    ask = Ask(4, prompt=(1, 2, 3))
    base = Answer("a", [5], "length", prompt_tokens=3)
    cand = Answer("a", [5], "length", prompt_tokens=4)
    d = prompt_divergence(ask, base, cand, offset=6)
    assert (d.position, d.what, d.baseline_text, d.candidate_text) == (
        6,
        "prompt",
        "3 prompt tokens",
        "4 prompt tokens",
    )


def _near_tie(ids: list[int], at: int, runner_up: int, margin_: float = 0.01) -> dict:
    """Completions logprobs of `ids` by id, clear everywhere but `at` (runner_up all but tied)."""
    tops = [[{"token_id": t, "logprob": -1.0}, {"token_id": t + 1000, "logprob": -9.0}] for t in ids]
    tops[at] = [{"token_id": ids[at], "logprob": -1.0}, {"token_id": runner_up, "logprob": -1.0 - margin_}]
    return {"token_ids": ids, "top_token_logprobs": tops}


def _by_text(pieces: list[str], runner_up: str) -> dict:
    """Completions logprobs by text only (no ids): all but tied at position 0 with `runner_up`."""
    tops = [{pieces[0]: -1.0, runner_up: -1.01}] + [{p: -1.0, "~": -9.0} for p in pieces[1:]]
    return {"tokens": pieces, "top_logprobs": tops}


def _going_on(ids: list[int], pieces: list[str] | None = None, first=None, logprobs: dict | None = None):
    """A completions server that goes on from where a resumed prompt (5, 6, then output ids)
    left off, each id printed as its piece (`<id>` by default); `first` (ids, text) answers
    the prompt not yet resumed instead, and `logprobs` go with that answer when asked for."""
    pieces = pieces if pieces is not None else [f"<{t}>" for t in ids]

    def reply(path: str, body: dict) -> dict:
        k = len(body["prompt"]) - 2
        out = ids[k:][: body["max_tokens"]]
        text = "".join(pieces[k : k + len(out)])
        if k == 0 and first is not None:
            out, text = first
        data = completion(out, text, prompt_tokens=len(body["prompt"]))
        if k == 0 and logprobs is not None and body.get("logprobs"):
            data["choices"][0]["logprobs"] = logprobs
        return data

    return reply


TOLERANT = ComparePolicy(max_tie_rate=1.0)


def test_a_text_cut_short_where_its_last_token_reads_otherwise_is_a_length_mismatch(tokenizer) -> None:
    """`import o` and `import os` tokenise apart at their last token, but one text is a
    prefix of the other: a length mismatch, never a tie, even where the baseline's logprobs
    list the candidate's token as an all but tied runner-up."""
    a, b = "import o", "import os"
    ta, tb = tokenizer.encode(a), tokenizer.encode(b)
    assert len(ta) == len(tb) and ta[-1] != tb[-1]
    base = Answer(a, ta, "length", logprobs=_near_tie(ta, len(ta) - 1, tb[-1]))
    d = compare_texts(base, Answer(b, None, "length"), tokenizer, 0, 0.1)
    assert (d.what, d.kind, d.position, d.char_position) == ("length", "mismatch", len(ta) - 1, len(a))


def test_a_text_comparison_reads_no_margin_from_logprobs_of_other_tokens(tokenizer) -> None:
    """Where the baseline's ids are not its text's tokens under the tokenizer, its logprobs
    index other positions: the divergence has no margin and is a mismatch."""
    a, b = "import sys", "import os"
    tb = tokenizer.encode(b)
    ids = [7, 8]
    assert tokenizer.encode(a) != ids
    base = Answer(a, ids, "length", logprobs=_near_tie(ids, 1, tb[1]))
    d = compare_texts(base, Answer(b, None, "length"), tokenizer, 0, 0.1)
    assert (d.position, d.margin, d.kind, d.what) == (1, None, "mismatch", "token")


def test_a_text_comparison_after_a_tie_counts_only_the_tokens_agreed_since(tokenizer) -> None:
    """A tie at position 0 compared by ids, then a candidate that stops sending ids: the
    resumed request is compared by text, its divergence located at its output position and
    the tokens counted as compared are those agreed before it, once each."""
    ids = tokenizer.encode("import sys\nimport os\n")
    runner_up = tokenizer.encode("def")[0]
    cand_rest = tokenizer.decode(ids[1:]).replace(" os", " re")
    agreed = next(i for i, (x, y) in enumerate(zip(ids[1:], tokenizer.encode(cand_rest))) if x != y)

    def base(path: str, body: dict) -> dict:
        k = len(body["prompt"]) - 2
        data = completion(ids[k:], tokenizer.decode(ids[k:]), prompt_tokens=len(body["prompt"]))
        if k == 0:
            data["choices"][0]["logprobs"] = _near_tie(ids, 0, runner_up)
        return data

    def cand(path: str, body: dict) -> dict:
        if len(body["prompt"]) == 2:
            out = [runner_up, *ids[1:]]
            return completion(out, tokenizer.decode(out), prompt_tokens=2)
        return completion(None, cand_rest, prompt_tokens=len(body["prompt"]))

    kind = replace(KNOWN["ours"], ids_in_responses=False)  # takes ids, need not send them
    with Stub(base) as b, Stub(cand) as c:
        results, summary = asyncio.run(
            compare(
                Endpoint(b.url, server=kind, tokenizer=tokenizer),
                Endpoint(c.url, server=kind, tokenizer=tokenizer),
                [Prompt(token_ids=(5, 6))],
                len(ids),
                [1],
                TOLERANT,
            )
        )
    (result,) = results
    assert [(d.kind, d.position) for d in result.divergences] == [("tie", 0), ("mismatch", 1 + agreed)]
    assert result.compared == "text" and result.compared_tokens == agreed, result


def test_an_exact_comparison_counts_every_token_compared() -> None:
    """The same ids and text: exact, and every generated token counted as compared."""
    results, summary = against(_going_on([1, 2, 3]), _going_on([1, 2, 3]))
    assert summary["verdict"] == "pass" and results[0].compared_tokens == 3


def test_a_tie_at_the_first_position_has_nothing_unchecked_before_it() -> None:
    """At position 0 nothing was agreed: the text before the tie is empty and known, so the
    tie leaves nothing unchecked and the run passes."""
    base = _going_on([1, 2, 3], logprobs=_near_tie([1, 2, 3], 0, 9))
    cand = _going_on([1, 2, 3], first=([9, 4, 4], "<9><4><4>"))
    results, summary = against(base, cand, policy=TOLERANT)
    assert [(d.kind, d.position, d.prefix_unchecked) for d in results[0].divergences] == [("tie", 0, False)]
    assert results[0].unchecked is None and summary["verdict"] == "pass", summary


def test_a_tie_after_agreed_ids_of_unknown_text_leaves_that_text_unchecked() -> None:
    """Without the baseline's token texts or a tokenizer the text of the ids agreed before a
    tie is not known: the comparison says it was left unchecked and the run fails."""
    base = _going_on([1, 2, 3], logprobs=_near_tie([1, 2, 3], 1, 9))
    cand = _going_on([1, 2, 3], first=([1, 9, 9], "<1><9><9>"))
    results, summary = against(base, cand, policy=TOLERANT)
    assert results[0].divergences[0].prefix_unchecked is True
    assert results[0].unchecked.startswith("the text of positions 0-0, before the tie at 1")
    assert summary["reason"] == "unchecked", summary


def test_other_ids_with_nothing_generated_as_text_are_a_token_divergence() -> None:
    """Ids that print as nothing (both texts empty) prove no lie about the text: a token
    divergence, triaged by the margin (here a tie), not `ids_text`."""
    base = _going_on([1, 2], ["", ""], logprobs=_near_tie([1, 2], 0, 9))
    cand = _going_on([1, 2], ["", ""], first=([9, 2], ""))
    results, summary = against(base, cand, policy=TOLERANT)
    assert [(d.what, d.kind) for d in results[0].divergences] == [("token", "tie")]
    assert summary["verdict"] == "pass", summary


@pytest.mark.parametrize(
    ("runner_up", "cand_text", "kind"),
    [("x", "ac", "mismatch"), ("x", "xc", "tie"), ("xy", "x", "mismatch"), ("xy", "xyz", "tie")],
    ids=["the baseline's own text", "the runner-up", "part of the runner-up", "the runner-up and more"],
)
def test_a_runner_up_listed_by_text_is_a_tie_only_when_the_candidates_text_goes_on_with_it(
    runner_up: str, cand_text: str, kind: str
) -> None:
    """Alternatives listed by text only: the candidate took the runner-up when its text from
    the divergence on begins with the runner-up's whole text; going on with the baseline's own
    token text (under another id), or with part of the runner-up, is a mismatch."""
    base = _going_on([1, 2], ["a", "b"], logprobs=_by_text(["a", "b"], runner_up))
    cand = _going_on([1, 2], ["a", "b"], first=([7], cand_text))
    results, _ = against(base, cand, policy=TOLERANT)
    first = results[0].divergences[0]
    assert (first.what, first.position, first.kind) == ("token", 0, kind)


def test_a_token_divergence_shows_each_sides_own_token_text() -> None:
    """The baseline lists the candidate's token by id with its text: the divergence shows
    the baseline's token text and the candidate's, each its own."""
    logprobs = {
        "token_ids": [1, 2],
        "tokens": ["a", "b"],
        "top_token_logprobs": [
            [{"token_id": 1, "logprob": -1.0}, {"token_id": 9, "logprob": -3.0}],
            [{"token_id": 2, "logprob": -1.0}, {"token_id": 5, "logprob": -3.0}],
        ],
        "top_logprobs": [{"a": -1.0, "z": -3.0}, {"b": -1.0, "q": -3.0}],
    }
    base = _going_on([1, 2], ["a", "b"], logprobs=logprobs)
    cand = _going_on([1, 2], ["a", "b"], first=([9, 2], "zb"))
    results, _ = against(base, cand)
    d = results[0].divergences[0]
    assert (d.baseline_token, d.candidate_token, d.baseline_text, d.candidate_text, d.kind) == (
        1,
        9,
        "a",
        "z",
        "mismatch",
    )


# ------------------------------------------------------------------ resuming a benchmark folder
def test_differences_name_keys_nested_twice_with_the_whole_path() -> None:
    """A difference two levels down reads `a.b.c was X, now Y`."""
    saved = {"a": {"b": {"c": 1}, "d": 1}}
    now = {"a": {"b": {"c": 2}, "d": 1}}
    assert differences(saved, now) == ["a.b.c was 1, now 2"]


def test_the_bench_identity_writes_an_infinite_rate_as_a_string(tmp_path) -> None:
    """--request-rate inf is kept as "inf", so bench_run.json is standard JSON."""
    args = argparse.Namespace(command="bench", request_rate=float("inf"), seed=0)
    identity = bench_identity(args)
    assert identity["request_rate"] == "inf"
    json.dumps(identity, allow_nan=False)


def test_the_bench_identity_holds_the_datasets_bytes_not_its_path(tmp_path) -> None:
    """The dataset's sha256 is that of its bytes: the same path with other bytes is another
    identity; a dataset that cannot be read gives None (the workload's own error follows)."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n')
    args = argparse.Namespace(command="bench", dataset=str(path))
    first = bench_identity(args)
    assert first["dataset_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text('{"prompt": "b"}\n')
    assert bench_identity(args)["dataset_sha256"] != first["dataset_sha256"]
    gone = bench_identity(argparse.Namespace(command="bench", dataset=str(tmp_path / "gone.jsonl")))
    assert gone["dataset_sha256"] is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "bench_run.json is not an object"),
        ("{not json", "is not JSON"),
        ('"bench"', "is not an object"),
    ],
)
def test_an_identity_file_that_is_not_an_object_is_a_conflict(tmp_path, content: str, message: str) -> None:
    """bench_run.json that is not JSON, or JSON but not an object, is a ResumeConflict
    naming why, never another exception."""
    path = tmp_path / "bench_run.json"
    path.write_text(content)
    with pytest.raises(ResumeConflict, match=message):
        check_saved_identity(path, {"command": "bench"}, "held", "differ", "measured with", "again")


def test_a_folder_with_a_summary_only_needs_its_identity_to_resume(tmp_path) -> None:
    """Rows in summary.csv alone are measured rows: without bench_run.json a resume is
    refused; empty files are no rows, so a folder holding only those is not."""
    (tmp_path / "requests.jsonl").write_text("")
    (tmp_path / "summary.csv").write_text("")
    assert not holds_rows(tmp_path)
    check_identity(tmp_path, {"command": "bench"})
    (tmp_path / "summary.csv").write_text("label,concurrency,repeat,completed,failed\nA,1,0,4,0\n")
    assert holds_rows(tmp_path)
    with pytest.raises(ResumeConflict, match="no bench_run.json says"):
        check_identity(tmp_path, {"command": "bench"})


def test_request_lines_that_are_not_objects_or_cut_inside_a_character_are_dropped(tmp_path) -> None:
    """A JSON line that is not an object, and a last line cut inside a multi-byte character,
    are counted as dropped, never rows and never an exception."""
    path = tmp_path / "requests.jsonl"
    cut = '{"index": 2, "text": "caf\u00e9"}'.encode()[:-3]  # between the two bytes of the e-acute
    path.write_bytes(b'{"index": 0}\n[1, 2]\n"text"\n{"index": 1}\n' + cut)
    assert read_request_rows(path) == ([{"index": 0}, {"index": 1}], 3)


def _summary(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["label", "concurrency", "repeat", "completed", "failed"])
        writer.writeheader()
        writer.writerows(rows)


def test_prepare_keeps_every_request_of_a_done_run_and_leaves_runs_outside_the_plan_alone(tmp_path) -> None:
    """A done run keeps all its request rows (one per index); the rows of a run outside the
    plan stay in requests.jsonl and summary.csv whatever they hold; a planned run not done
    loses its rows."""
    _summary(
        tmp_path / "summary.csv",
        [
            {"label": "A", "concurrency": 1, "repeat": 0, "completed": 3, "failed": 0},
            {"label": "A", "concurrency": 2, "repeat": 0, "completed": 1, "failed": 2},
            {"label": "B", "concurrency": 1, "repeat": 0, "completed": 0, "failed": 3},
        ],
    )
    requests = [
        {"label": label, "concurrency": c, "repeat": 0, "index": i}
        for label, c in (("A", 1), ("A", 2), ("B", 1))
        for i in range(3)
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    resumed = prepare(tmp_path, {("A", 1, 0): 3, ("A", 2, 0): 3}, max_failure_rate=0.0)
    assert (resumed.done, resumed.redo) == ({("A", 1, 0)}, {("A", 2, 0)})
    kept, _ = read_request_rows(tmp_path / "requests.jsonl")
    assert [(r["label"], r["concurrency"], r["index"]) for r in kept] == [
        ("A", 1, 0),
        ("A", 1, 1),
        ("A", 1, 2),
        ("B", 1, 0),
        ("B", 1, 1),
        ("B", 1, 2),
    ]
    with (tmp_path / "summary.csv").open() as f:
        assert [(r["label"], r["concurrency"]) for r in csv.DictReader(f)] == [("A", "1"), ("B", "1")]


def test_a_summary_whose_first_line_is_not_the_header_is_set_aside(tmp_path) -> None:
    """A summary.csv whose first whole line is a row, not the header (label, concurrency,
    repeat, ...), cannot be read by column: it is moved to summary.csv.torn."""
    path = tmp_path / "summary.csv"
    path.write_text("A,1,0,4,0\nA,2,0,4,0\n")
    assert (
        repair_summary(path)
        == "summary.csv had no whole header: moved to summary.csv.torn, its runs measured again"
    )
    assert not path.exists() and (tmp_path / "summary.csv.torn").read_text() == "A,1,0,4,0\nA,2,0,4,0\n"


# ------------------------------------------------------------------ one reply read as an answer
def _whole(choice: dict, **data) -> bytes:
    return json.dumps({"choices": [{"index": 0, "finish_reason": "length", **choice}], **data}).encode()


def test_prompt_ids_echoed_beside_the_choices_are_read() -> None:
    """Servers echo the prompt's ids in the choice or at the top of the body: either is read."""
    top = read_whole(_whole({"text": "a", "token_ids": [5]}, prompt_token_ids=[1, 2, 3]), chat=False)
    inside = read_whole(_whole({"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}), chat=False)
    assert top.prompt_ids == inside.prompt_ids == [1, 2, 3]


def test_generated_ids_named_only_by_the_logprobs_are_the_answers_ids() -> None:
    """Without `token_ids` in the choice, the ids the logprobs name are the generated ids:
    completions `logprobs.token_ids`, chat `logprobs.content[i].token_id`."""
    completions = read_whole(_whole({"text": "ab", "logprobs": {"token_ids": [4, 5]}}), chat=False)
    content = [{"token": "a", "token_id": 4, "logprob": -0.1}, {"token": "b", "token_id": 5, "logprob": -0.2}]
    message = {"role": "assistant", "content": "ab"}
    chat = read_whole(_whole({"message": message, "logprobs": {"content": content}}), chat=True)
    assert completions.ids == chat.ids == [4, 5]


def test_chat_logprobs_without_token_ids_name_no_ids() -> None:
    """Chat logprobs that list tokens by text only name no ids: the answer's own token_ids
    stand, with no contradiction."""
    content = [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]
    message = {"role": "assistant", "content": "ab"}
    body = _whole({"message": message, "token_ids": [4, 5], "logprobs": {"content": content}})
    assert read_whole(body, chat=True).ids == [4, 5]


def test_a_padded_done_marker_and_a_usage_event_without_choices_end_a_stream() -> None:
    """`data: [DONE] ` (padded) is the end of the stream; a usage-only event that carries no
    `choices` key at all is read for its counts."""
    body = stream(chunk("a", [1]), chunk("b", [2], "length"), done=False)
    body += 'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata:  [DONE]  \n\n'
    body += 'data: {"never": "read"}\n\n'
    answer = read_stream(body.encode(), chat=False)
    assert (answer.text, answer.ids, answer.completion_tokens, answer.prompt_tokens) == ("ab", [1, 2], 2, 3)


def test_the_reasoning_a_client_reads_is_reasoning_content_before_reasoning() -> None:
    """A delta or message carrying both reasoning fields is read, as a client reads it, by
    `reasoning_content` first."""
    streamed = read_stream(
        stream(chat_chunk("stop", [5], reasoning_content="first", reasoning="second")), chat=True
    )
    message = {"role": "assistant", "content": "", "reasoning_content": "first", "reasoning": "second"}
    whole = read_whole(_whole({"message": message, "token_ids": [5]}), chat=True)
    assert streamed.reasoning_seen == whole.reasoning_seen == "first"
    assert whole.reasoning == {"reasoning_content": "first", "reasoning": "second"}


def test_a_whole_messages_tool_calls_without_an_index_are_kept_apart_in_order() -> None:
    """A whole message's calls are indexed by their place: two calls stay two, in order."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "[1]"}},
    ]
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    answer = read_whole(_whole({"message": message, "token_ids": [5]}), chat=True)
    assert answer.tool_calls == [
        {"type": "function", "name": "a", "arguments": "{}"},
        {"type": "function", "name": "b", "arguments": "[1]"},
    ]


@pytest.mark.parametrize(
    "body",
    [
        _whole({"text": "a", "token_ids": [True]}),
        _whole({"text": "a", "token_ids": [5], "prompt_token_ids": [1, False]}),
        _whole({"text": "a", "token_ids": [5]}, usage={"completion_tokens": True}),
        _whole({"text": "a", "token_ids": [5]}, usage={"prompt_tokens": False}),
    ],
    ids=["token id true", "prompt id false", "completion_tokens true", "prompt_tokens false"],
)
def test_booleans_are_neither_token_ids_nor_counts(body: bytes) -> None:
    """JSON true and false are not integers here: as an id or a usage count they make a
    malformed body."""
    with pytest.raises(AnswerError) as refused:
        read_whole(body, chat=False)
    assert refused.value.name == "malformed_body"


def test_the_margin_is_top_one_minus_top_two_of_any_number_listed() -> None:
    """With three alternatives listed, the margin is between the best two."""
    logprobs = {
        "top_token_logprobs": [
            [
                {"token_id": 1, "logprob": -0.1},
                {"token_id": 3, "logprob": -2.5},
                {"token_id": 2, "logprob": -0.4},
            ]
        ]
    }
    assert margin(Answer("a", [1], "length", logprobs=logprobs), 0) == pytest.approx(0.3)


def test_a_running_usage_count_ahead_of_the_ids_is_inconsistent() -> None:
    """A chunk's running usage.completion_tokens must equal the ids so far, its own
    included: a count ahead of them is an inconsistent answer even when the last count
    matches."""
    events = [
        chunk("a", [1]) | {"usage": {"completion_tokens": 2}},
        chunk("b", [2], "length") | {"usage": {"completion_tokens": 2}},
    ]
    with pytest.raises(AnswerError) as refused:
        read_stream(stream(*events), chat=False)
    assert refused.value.name == "inconsistent_answer"


def test_a_chat_stream_whose_tool_call_chunk_lacks_ids_beside_chunks_with_them_is_malformed() -> None:
    """Token ids in some chunks only is malformed, a chunk that carries only a tool call
    included."""
    call = {"index": 0, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = [
        chat_chunk(None, [1], content="a"),
        chat_chunk(None, None, tool_calls=[call]),
        chat_chunk("stop", []),
    ]
    with pytest.raises(AnswerError) as refused:
        read_stream(stream(*events), chat=True)
    assert refused.value.name == "malformed_body" and "token_ids in some chunks only" in refused.value.message


class _CutShort(BaseHTTPRequestHandler):
    """Answers every POST with HTTP 200 that promises more body than it sends, then hangs up."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b'{"choices": [{"text": "a')
        self.wfile.flush()
        self.close_connection = True


@pytest.mark.parametrize(("streamed", "name"), [(True, "truncated_stream"), (False, "malformed_body")])
def test_a_reply_cut_short_is_a_truncated_stream_or_a_malformed_body(streamed: bool, name: str) -> None:
    """A connection closed mid-reply: a streamed answer is a truncated stream, a whole one a
    malformed body."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    endpoint = Endpoint(f"http://127.0.0.1:{server.server_address[1]}")

    async def ask() -> Answer:
        async with httpx.AsyncClient(timeout=10) as client:
            return await ask_server(client, endpoint, Ask(4, prompt="hi"), logprobs=False, stream=streamed)

    try:
        with pytest.raises(AnswerError) as refused:
            asyncio.run(ask())
    finally:
        server.shutdown()
        server.server_close()
    assert refused.value.name == name, refused.value


async def _ask(url: str, model: str | None = None) -> Answer:
    async with httpx.AsyncClient(timeout=10) as client:
        endpoint = Endpoint(url, model=model)
        return await ask_server(client, endpoint, Ask(2, prompt="hi"), logprobs=False, stream=False)


@pytest.mark.parametrize("status", [201, 202, 204, 302])
def test_any_status_but_200_is_an_http_error_even_with_an_answer_in_the_body(status: int) -> None:
    """Only HTTP 200 carries an answer: another status, 2xx included, is `http_NNN` whatever
    its body holds."""
    body = json.dumps(completion([1, 2])).encode()
    with Stub(lambda p, b: Reply(status, body if status != 204 else b"")) as server:
        with pytest.raises(AnswerError) as refused:
            asyncio.run(_ask(server.url))
    assert refused.value.name == f"http_{status}"


def test_a_request_names_the_endpoints_model_only_when_it_has_one() -> None:
    """The body of a request carries `model` when the endpoint names one, and no `model`
    key at all otherwise."""
    with Stub(lambda p, b: completion([1, 2])) as server:
        assert asyncio.run(_ask(server.url, model="m-1")).ids == [1, 2]
        asyncio.run(_ask(server.url))
        assert [b.get("model", "absent") for b in server.bodies] == ["m-1", "absent"]


def test_the_baseline_is_asked_again_for_the_same_prompt_at_another_length() -> None:
    """The baseline's answers are reused by request, its length included: a prompt that is
    another's prompt extended after a tie, asked at another max_tokens, gets its own answer
    and the run passes."""
    ids = [7, 8, 9, 10, 11, 12]

    def reply(path: str, body: dict) -> dict:
        out = ids[len(body["prompt"]) - 2 :][: body["max_tokens"]]
        data = completion(out, prompt_tokens=len(body["prompt"]))
        if body.get("logprobs"):
            data["choices"][0]["logprobs"] = (
                _near_tie(out, 0, out[0] + 1) if len(body["prompt"]) == 2 else None
            )
        return data

    def candidate(path: str, body: dict) -> dict:
        if body["prompt"] == [5, 6]:  # the runner-up at the tie, then anything
            return completion([8, 1, 1, 1], prompt_tokens=2)
        return reply(path, body)

    prompts = [Prompt(token_ids=(5, 6)), Prompt(token_ids=(5, 6, 7))]
    with Stub(reply) as base, Stub(candidate) as cand:
        results, summary = asyncio.run(
            compare(Endpoint(base.url), Endpoint(cand.url), prompts, 4, [1], ComparePolicy(max_tie_rate=1.0))
        )
        asked = sorted((tuple(b["prompt"]), b["max_tokens"]) for b in base.bodies)
    assert asked == [((5, 6), 4), ((5, 6, 7), 3), ((5, 6, 7), 4)]
    assert summary["verdict"] == "pass" and summary["ties"] == 1, summary

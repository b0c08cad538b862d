"""The HTTP comparison compares like with like (harness/compare.py): ids with ids, else text
with text, locating a text difference as a token with the tokenizer; it never claims ids it
did not have, never counts an error as a comparison, and its markdown survives any text."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.client import Endpoint
from harness.compare import ComparePolicy, Divergence, PromptResult, compare, markdown, verdict
from harness.server_kind import KNOWN
from harness.tokens import TextTokenizer
from harness.workloads import Prompt
from reference_engine.demo import DEMO_TARGET

from .openai_stub import serve as serve_text_only

TEXT = "import os\nimport sys\n\n\ndef main(argv=None):\n    return 0\n"
PROMPTS = [Prompt(text="a"), Prompt(text="b"), Prompt(text="c")]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


def serve_ids(ids: list[int], tokenizer: TextTokenizer) -> tuple[ThreadingHTTPServer, str]:
    """A server like ours: token ids and text in every choice."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = ids[: body["max_tokens"]]
            choice = {"index": 0, "text": tokenizer.decode(out), "token_ids": out,
                      "finish_reason": "length", "prompt_token_ids": [1, 2]}
            data = json.dumps({"choices": [choice]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def run(base: Endpoint, cand: Endpoint, max_tokens: int = 64):
    return asyncio.run(compare(base, cand, PROMPTS, max_tokens, 2, ComparePolicy("strict")))


def test_text_is_compared_with_text_when_the_baseline_offers_no_ids(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    base, base_url = serve_text_only(lambda p, n: [tokenizer.decode([t]) for t in ids[:n]])
    cand, cand_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(Endpoint(base_url, server=KNOWN["openai"], tokenizer=tokenizer),
                               Endpoint(cand_url, server=KNOWN["ours"], tokenizer=tokenizer))
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["verdict"] == "pass" and summary["exact"] == 3, summary
    assert summary["compared"] == "text" and summary["compared_text"] == 3
    assert summary["compared_ids"] == 0
    assert all(r.compared == "text" and r.compared_tokens == len(ids) for r in results)
    assert "0 by token ids, 3 by text" in markdown(results, summary)


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_a_text_difference_is_located_as_the_first_differing_token(tokenizer,
                                                                   with_tokenizer: bool) -> None:
    ids = tokenizer.encode(TEXT)
    other = tokenizer.encode("import os\nimport re\n\n\ndef main(argv=None):\n    return 0\n")
    at = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    base, base_url = serve_text_only(lambda p, n: [tokenizer.decode([t]) for t in ids[:n]])
    cand, cand_url = serve_ids(other, tokenizer)
    tok = tokenizer if with_tokenizer else None
    try:
        results, summary = run(Endpoint(base_url, server=KNOWN["openai"], tokenizer=tok),
                               Endpoint(cand_url, server=KNOWN["ours"], tokenizer=tok))
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["verdict"] == "fail" and summary["mismatches"] == 3
    first = results[0].divergences[0]
    assert first.char_position == TEXT.index("sys")
    if with_tokenizer:
        assert (first.position, first.baseline_token, first.candidate_token) == \
            (at, ids[at], other[at])
        assert first.baseline_text == tokenizer.decode([ids[at]])
    else:
        assert first.position is None and first.baseline_text.startswith("sys")


def test_ids_are_compared_when_both_sides_offer_them(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    a, a_url = serve_ids(ids, tokenizer)
    b, b_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(Endpoint(a_url), Endpoint(b_url))
    finally:
        a.shutdown()
        b.shutdown()
    assert summary["compared"] == "ids" and summary["compared_ids"] == 3
    assert summary["verdict"] == "pass"


def test_errors_are_not_comparisons_and_no_ids_are_claimed(tokenizer) -> None:
    """The text-only server refuses vLLM's fields: every request fails with 422."""
    ids = tokenizer.encode(TEXT)
    base, base_url = serve_text_only(lambda p, n: ["x"] * n)
    cand, cand_url = serve_ids(ids, tokenizer)
    try:
        results, summary = run(Endpoint(base_url, server=KNOWN["vllm"]), Endpoint(cand_url))
    finally:
        base.shutdown()
        cand.shutdown()
    assert summary["errors"] == 3 and summary["exact"] == 0 and summary["verdict"] == "fail"
    assert summary["compared"] == "none" and summary["compared_ids"] == 0
    assert all(r.compared == "none" and "422" in r.error for r in results)
    text = markdown(results, summary)
    assert "compared 0 (0 by token ids, 0 by text), errors 3" in text
    assert verdict(results, ComparePolicy("tie-tolerant"))["verdict"] == "fail"


def test_markdown_quotes_any_text_without_breaking_the_table() -> None:
    nasty = "a|b\n`c``\r\td"
    result = PromptResult(0, False, 3, [Divergence(3, 7, 8, nasty, "|", 0.5, "mismatch")],
                          error=None, compared="ids")
    failed = PromptResult(1, False, 0, error="HTTP 422: {\n 'detail': 'x|y'\n}")
    text = markdown([result, failed], verdict([result, failed], ComparePolicy()))
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert all(line.endswith("|") for line in rows)
    header = rows[0].count("|")
    table = rows[: next(i for i, r in enumerate(rows) if r.startswith("| prompt | compared | result"))]
    for line in table:
        assert len(re.findall(r"(?<!\\)\|", line)) == header, line
    assert "\r" not in text and "\t" not in text
    per_prompt = [r for r in rows if r.startswith("| 1 |")][0]
    assert len(re.findall(r"(?<!\\)\|", per_prompt)) == 4

"""Contracts of the HTTP equivalence gate's bookkeeping and of the draft training pipeline
that the broader suites leave implicit.

The comparison (harness/compare.py, divergence.py): a divergence names each side's own token
at its output position, whichever side is longer; a text comparison locates the first
differing token and counts the tokens before it, a text cut inside a token is a `length`
mismatch, and so is the same text in another token count, more or fewer; a tie rate is ties
per compared prompt at each level, and a rate equal to --max-tie-rate passes; a run with
errors is named after the first (by level, then prompt), a mismatch after the first mismatch
past any tie; a comparison resumed after a tie keeps its prompt's own length and counts each
agreed token once. The files (compare_io.py): a resumed run refuses rows made with other
settings, the last copy of a row wins, and the verdict line counts only the comparisons that
mismatch. The server kind (server_kind.py): /v1/models decides before /metrics, a plain
server that sends ids is compared by ids, every kind takes token-id prompts and gets
`ignore_eos` only when asked. The load runner (load.py): a summary left empty gets its
header, finished runs are read back by their own fields, the busiest client process counts.

The training pipeline (reference_engine/training): the corpus leaves out vendored, empty and
non-Python files, keeps a held-out file even in a small run, refuses a lock without one and
a cached wheel changed since its fetch; every text of a stream ends with the end-of-text
token; held-out prompts are whole windows of files at least two prompts long; the final loss
is the mean of the last steps; the block loss is a weighted mean over the slots inside each
block; the learning rate warms up to its peak and decays to a tenth of it; the weights kept
are those of the first best validation, the last step validated too; a loss curve averages
each stretch of steps once; each (seed, stage) draws batches of its own; a short last block
is of any length from two to the block size; the recipe takes its boundary settings and
refuses those past them; a pair is adopted only when its target's config is the one this
recipe writes, and a draft stage already finished is kept.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import math
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.answer import Answer, Ask
from harness.client import Endpoint
from harness.compare import (
    ComparePolicy,
    Divergence,
    PromptResult,
    compare,
    comparison_key,
    verdict,
)
from harness.compare_io import RowLog, run_identity, verdict_line
from harness.divergence import prompt_divergence
from harness.load import append_summary, done_runs, merged_end
from harness.server_kind import KNOWN, probe
from harness.tokens import TextTokenizer
from harness.workloads import Prompt
from reference_engine.demo import DEMO_TARGET
from reference_engine.errors import CheckpointError
from reference_engine.tokenizer import EOS_TOKEN, train_byte_level_bpe
from reference_engine.training.corpus import Corpus, CorpusError, source_members, token_stream
from reference_engine.training.evaluation import heldout_prompts, mean_tail
from reference_engine.training.loops import block_loss, loss_curve, lr_at, optimise
from reference_engine.training.pair import adopt_pair
from reference_engine.training.selector import selector_loss
from reference_engine.training.settings import Recipe
from reference_engine.training.stages import draw_block_lengths, generator

from .completion_stub import Stub, completion
from .test_harness_compare import near_tie_logprobs
from .test_training import make_wheel_corpus
from .test_training_dflash2 import RECIPE as DFLASH2
from .test_training_dflash2 import naive_selector_loss, selector_batch, smoke_draft


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


# ------------------------------------------------------------------ where two answers differ
def answer(ids: list[int], text: str | None = None, **fields) -> Answer:
    return Answer("".join(f"<{t}>" for t in ids) if text is None else text, ids, "length", **fields)


def compare_two(base_reply, cand_reply, prompt: Prompt, max_tokens: int = 8, kind=None, tokenizer=None):
    """compare() of one prompt at one level between two scripted servers of `kind` (None:
    ours), the candidate given `tokenizer`; (its result, the summary)."""
    with Stub(base_reply) as base, Stub(cand_reply) as cand:
        results, summary = asyncio.run(
            compare(
                Endpoint(base.url, server=kind),
                Endpoint(cand.url, server=kind, tokenizer=tokenizer),
                [prompt],
                max_tokens,
                1,
                ComparePolicy(),
            )
        )
    return results[0], summary


@pytest.mark.parametrize(
    ("base_ids", "cand_ids", "at", "base_token", "cand_token", "what"),
    [
        ([1, 2, 3], [1, 2], 2, 3, -1, "length"),
        ([1, 2], [1, 2, 3], 2, -1, 3, "length"),
        ([1, 2, 3], [1, 9, 3], 1, 2, 9, "token"),
        ([4, 2, 3], [7, 2, 3], 0, 4, 7, "token"),
    ],
)
def test_a_divergence_names_each_sides_own_token_at_the_first_difference_whichever_is_longer(
    base_ids, cand_ids, at, base_token, cand_token, what
) -> None:
    r, summary = compare_two(
        lambda p, b: completion(base_ids, prompt_tokens=2),
        lambda p, b: completion(cand_ids, prompt_tokens=2),
        Prompt(token_ids=(5, 6)),
    )
    [divergence] = r.divergences
    assert (divergence.position, divergence.what, divergence.kind) == (at, what, "mismatch")
    assert (divergence.baseline_token, divergence.candidate_token) == (base_token, cand_token)
    assert r.compared == "ids" and r.compared_tokens == at and summary["reason"] == "mismatch"


TEXT = "def main(argv=None):\n    return 0\n"
TEXT_ONLY = KNOWN["openai"]


@pytest.mark.parametrize("cand_text", [TEXT, TEXT.replace("return 0", "return 1")])
def test_a_text_comparison_counts_the_tokens_before_the_first_differing_one(tokenizer, cand_text) -> None:
    r, _ = compare_two(
        lambda p, b: completion(None, TEXT),
        lambda p, b: completion(None, cand_text),
        Prompt(text="a"),
        64,
        TEXT_ONLY,
        tokenizer,
    )
    ta, tb = tokenizer.encode(TEXT), tokenizer.encode(cand_text)
    first = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
    assert r.compared == "text"
    if first is None:
        assert r.exact and r.compared_tokens == len(ta)
    else:
        assert [d.position for d in r.divergences] == [first] and r.compared_tokens == first


def test_a_text_cut_inside_a_token_is_a_length_mismatch(tokenizer) -> None:
    """The candidate's last token differs from the baseline's there, yet its text is short."""
    r, _ = compare_two(
        lambda p, b: completion(None, TEXT),
        lambda p, b: completion(None, TEXT[:17]),
        Prompt(text="a"),
        64,
        TEXT_ONLY,
        tokenizer,
    )
    [cut] = r.divergences
    assert (cut.what, cut.kind, cut.char_position) == ("length", "mismatch", 17)
    assert cut.candidate_token != -1


@pytest.mark.parametrize("cand_tokens", [3, 5])
def test_the_same_text_in_another_token_count_is_a_length_mismatch_either_way(cand_tokens: int) -> None:
    r, summary = compare_two(
        lambda p, b: completion(None, "abcd", completion_tokens=4),
        lambda p, b: completion(None, "abcd", completion_tokens=cand_tokens),
        Prompt(text="a"),
        kind=TEXT_ONLY,
    )
    [divergence] = r.divergences
    assert (divergence.what, divergence.kind) == ("length", "mismatch")
    assert divergence.candidate_text == f"{cand_tokens} tokens" and summary["verdict"] == "fail"


def test_the_prompt_a_candidate_echoes_is_held_to_the_prompt_sent() -> None:
    ask = Ask(4, prompt=(5, 6))
    honest = prompt_divergence(ask, answer([1]), answer([1], prompt_ids=[5, 6]), 0)
    assert honest is None
    lying = prompt_divergence(ask, answer([1]), answer([1], prompt_ids=[5, 6, 7]), 0)
    assert lying is not None and lying.what == "prompt" and lying.kind == "mismatch"


# ------------------------------------------------------------------ the verdict's arithmetic
def result(index: int, *kinds: str, concurrency: int = 1, error: str | None = None) -> PromptResult:
    """A comparison with a divergence of each kind given (a `length` mismatch, a `token` tie)."""
    divergences = [
        Divergence(k, 1, 2, "a", "b", None, kind, what="length" if kind == "mismatch" else "token")
        for k, kind in enumerate(kinds)
    ]
    return PromptResult(
        index,
        not kinds and error is None,
        4,
        divergences,
        error=error,
        error_name=error,
        compared="none" if error else "ids",
        concurrency=concurrency,
        source=f"p{index}",
    )


def test_a_tie_rate_is_ties_per_compared_prompt_and_a_rate_equal_to_the_limit_passes() -> None:
    results = [result(i) for i in range(19)] + [result(19, "tie")]
    summary = verdict(results, ComparePolicy(max_tie_rate=0.05))
    assert summary["tie_rate"] == pytest.approx(0.05)
    assert summary["by_concurrency"]["1"]["tie_rate"] == pytest.approx(0.05)
    assert summary["verdict"] == "pass" and summary["reason"] is None, summary
    over = verdict(results[1:], ComparePolicy(max_tie_rate=0.05))
    assert over["verdict"] == "fail" and over["reason"] == "ties"


def test_a_run_with_errors_is_named_after_the_first_by_level_then_prompt() -> None:
    results = [
        result(0, concurrency=2, error="http_500"),
        result(3, concurrency=1, error="empty_choices"),
        result(1, concurrency=1),
        result(5, concurrency=1, error="missing_ids"),
    ]
    summary = verdict(results, ComparePolicy())
    assert summary["error"] == "empty_choices" and summary["verdict"] == "fail", summary
    assert summary["errors_by_name"] == {"http_500": 1, "empty_choices": 1, "missing_ids": 1}


def test_the_first_mismatch_is_named_past_any_tie_before_it() -> None:
    results = [result(0, "tie", "mismatch"), result(1)]
    summary = verdict(results, ComparePolicy(max_tie_rate=1.0))
    assert summary["first_mismatch"] == "length" and summary["reason"] == "mismatch", summary
    line = verdict_line(results, summary)
    assert line.startswith("fail: mismatch: 1 of 2 comparisons differ"), line


def test_the_verdict_line_counts_only_the_comparisons_that_mismatch() -> None:
    results = [result(0, "tie"), result(1, "mismatch"), result(2, "tie"), result(3)]
    summary = verdict(results, ComparePolicy(max_tie_rate=1.0))
    line = verdict_line(results, summary)
    assert line.startswith("fail: mismatch: 1 of 4 comparisons differ (first: prompt p1"), line


# ------------------------------------------------------------------ a comparison resumed at a tie
def tied_everywhere(ids: list[int]):
    """A completions server that goes on from where a resumed prompt (5, 6, then output ids)
    left off; with `logprobs` each position all but tied (runner-up t + 1), listed by id with
    each token's text."""

    def reply(path: str, body: dict) -> dict:
        out = ids[len(body["prompt"]) - 2 :][: body["max_tokens"]]
        data = completion(out, prompt_tokens=len(body["prompt"]))
        if body.get("logprobs"):
            data["choices"][0]["logprobs"] = near_tie_logprobs(out)
        return data

    return reply


def test_a_comparison_resumed_after_a_tie_keeps_its_prompts_length_and_counts_each_token_once() -> None:
    with Stub(tied_everywhere([1, 2, 3, 4])) as base, Stub(tied_everywhere([1, 3, 3, 4])) as cand:
        results, summary = asyncio.run(
            compare(
                Endpoint(base.url),
                Endpoint(cand.url),
                [Prompt(token_ids=(5, 6))],
                4,
                1,
                ComparePolicy(max_tie_rate=1.0),
            )
        )
    [r] = results
    assert [(d.position, d.kind) for d in r.divergences] == [(1, "tie")]
    assert r.unchecked is None and summary["verdict"] == "pass", summary
    assert r.prompt_tokens == 2 and r.context == "~128"
    assert r.compared_tokens == 3  # positions 0, 2 and 3; 1 is the tie


# ------------------------------------------------------------------ the files of a run
def endpoint_pair(**cand) -> tuple[Endpoint, Endpoint]:
    return Endpoint("http://127.0.0.1:1"), Endpoint("http://127.0.0.1:2", **cand)


def test_the_run_identity_changes_with_every_setting_that_shapes_a_row(tokenizer) -> None:
    base, cand = endpoint_pair()
    policy = ComparePolicy()
    identity = run_identity(base, cand, policy, True)
    others = [
        run_identity(base, cand, policy, False),
        run_identity(base, cand, dataclasses.replace(policy, tie_threshold=0.2), True),
        run_identity(base, cand, dataclasses.replace(policy, max_divergences=9), True),
        run_identity(base, endpoint_pair(tokenizer=tokenizer)[1], policy, True),
        run_identity(base, endpoint_pair(server=KNOWN["vllm"])[1], policy, True),
    ]
    assert all(other != identity for other in others)
    # what only judges the rows may change on resume
    assert run_identity(base, cand, dataclasses.replace(policy, policy="strict", max_tie_rate=0.5), True) == (
        identity
    )


def test_a_resumed_run_keeps_the_last_copy_of_each_comparison(tmp_path: Path) -> None:
    base, cand = endpoint_pair()
    identity = run_identity(base, cand, ComparePolicy(), True)
    first, second = result(0, "mismatch"), result(0)
    assert first.key == second.key == comparison_key(1, "p0", None, None)
    log = RowLog(tmp_path, False, identity)
    log.append(first)
    log.append(second)
    log.close()
    resumed = RowLog(tmp_path, True, identity)
    resumed.close()
    assert list(resumed.kept) == [first.key] and resumed.kept[first.key].exact


# ------------------------------------------------------------------ a server's kind
def kind_server(owned_by: str, metrics: str, token_ids: bool) -> tuple[ThreadingHTTPServer, str]:
    """A server that names its owner in /v1/models, serves `metrics`, and answers every
    completion (with `token_ids` in its choice when asked)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def send(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.send(json.dumps({"data": [{"id": "m", "owned_by": owned_by}]}).encode())
            else:
                self.send(metrics.encode(), "text/plain")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            choice = {"index": 0, "text": "a", "finish_reason": "length"}
            if token_ids:
                choice["token_ids"] = [7]
            self.send(json.dumps({"choices": [choice]}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    ("owned_by", "metrics", "token_ids", "name", "returns_ids"),
    [
        ("vllm", "sglang:num_requests 1\n", True, "vllm", True),
        ("someone", "sglang:num_requests 1\n", False, "sglang", False),
        ("someone", "vllm:num_requests_running 1\n", True, "vllm", True),
        ("someone", "# nothing known\n", True, "openai", True),
        ("someone", "# nothing known\n", False, "openai", False),
    ],
)
def test_a_servers_owner_decides_its_kind_before_its_metrics_and_sent_ids_are_compared(
    owned_by, metrics, token_ids, name, returns_ids
) -> None:
    server, url = kind_server(owned_by, metrics, token_ids)
    try:
        found = probe(url, timeout=10.0)
    finally:
        server.shutdown()
    assert found.kind.name == name and found.kind.returns_ids == returns_ids, found.kind.evidence
    assert found.models == ("m",)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_every_kind_takes_token_id_prompts_and_ignore_eos_only_when_asked(name: str) -> None:
    kind = KNOWN[name]
    assert kind.prompt_ids
    assert "ignore_eos" not in kind.extras(ignore_eos=False)
    assert ("ignore_eos" in kind.extras(ignore_eos=True)) == kind.ignore_eos
    assert ("continuous_usage_stats" in kind.stream_options()) == kind.continuous_usage


# ------------------------------------------------------------------ the load runner's files
def test_the_run_ends_with_the_busiest_client_process_whatever_the_order() -> None:
    reports = [(3.0, 0.2), (5.0, 0.1), (4.0, 0.9)]
    for order in (reports, reports[::-1]):
        so_far = (0.0, 0.0)
        for reported in order:
            so_far = merged_end(so_far, reported)
        assert so_far == (5.0, 0.9)


def test_a_summary_left_empty_gets_its_header_and_resumed_runs_are_read_by_their_fields(tmp_path) -> None:
    path = tmp_path / "summary.csv"
    path.write_text("")  # a full disk left it empty
    append_summary(path, {"label": "dflash", "concurrency": 4, "repeat": 1, "completed": 10})
    append_summary(path, {"label": "plain", "concurrency": 8, "repeat": 0, "completed": 9})
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["completed"]) for r in rows] == [("dflash", "10"), ("plain", "9")]
    assert done_runs(path) == {("dflash", 4, 1), ("plain", 8, 0)}


# ------------------------------------------------------------------ the corpus
def test_the_corpus_leaves_out_vendored_empty_and_non_python_files(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as archive:
        for name, text in {
            "pkg/a.py": "x = 1\n",
            "pkg/sub/b.py": "y = 2\n",
            "pkg/_vendor/c.py": "z = 3\n",
            "pkg/extern/d.py": "w = 4\n",
            "pkg/empty.py": "",
            "pkg/README.md": "# hi\n",
        }.items():
            archive.writestr(name, text)
    with zipfile.ZipFile(tmp_path / "w.whl") as archive:
        assert source_members(archive) == ["pkg/a.py", "pkg/sub/b.py"]


def test_a_small_run_keeps_a_held_out_file_and_a_corpus_without_one_is_refused(tmp_path: Path) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))
    corpus = Corpus.from_lock(tmp_path / "cache", lock, max_files=2, log=lambda m: None)
    assert len(corpus.train) == 2 and len(corpus.heldout) == 1
    assert set(corpus.train).isdisjoint(corpus.heldout)
    data = json.loads(lock.read_text())
    for row in data["wheels"]:
        row["heldout"] = False
    lock.write_text(json.dumps(data))
    with pytest.raises(CorpusError, match="train/held-out split"):
        Corpus.from_lock(tmp_path / "cache", lock, log=lambda m: None)


def test_a_cached_wheel_changed_after_its_fetch_is_refused(tmp_path: Path) -> None:
    lock, _ = make_wheel_corpus(tmp_path, packages=("json", "email"), heldout=("email",))
    Corpus.from_lock(tmp_path / "cache", lock, log=lambda m: None)
    with zipfile.ZipFile(tmp_path / "cache" / "json-1.0-py3-none-any.whl", "a") as archive:
        archive.writestr("json/extra.py", "x = 1\n")
    with pytest.raises(CorpusError, match="sha256 differs from the lock"):
        Corpus.from_lock(tmp_path / "cache", lock, log=lambda m: None)


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe(["def f(x):\n    return x + 1\n"] * 20, 300)


def test_every_text_of_a_stream_is_followed_by_the_end_of_text_token(bpe) -> None:
    texts = ["def f(x):", "return x"]
    eos = bpe.token_to_id(EOS_TOKEN)
    want = [*bpe.encode(texts[0]).ids, eos, *bpe.encode(texts[1]).ids, eos]
    assert token_stream(bpe, texts).tolist() == want


class CharTokenizer:
    """One token per character."""

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) for c in text])

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_held_out_prompts_are_whole_windows_of_long_enough_files(tmp_path: Path) -> None:
    recipe = dataclasses.replace(Recipe.smoke(3), eval_prompts=5)  # prompt_len 16
    files = {f"m{i}.py": chr(ord("a") + i) * 33 + str(i) * 7 for i in range(8)}
    files |= {"short.py": "s" * 31, "tiny.py": "t" * 17}  # under two prompts long
    with zipfile.ZipFile(tmp_path / "h.whl", "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    heldout = tuple(sorted(f"h.whl:{name}" for name in files))
    corpus = Corpus(tmp_path, ("h.whl:m0.py",), heldout)
    prompts = heldout_prompts(corpus, CharTokenizer(), recipe)
    assert len(prompts) == recipe.eval_prompts
    assert len({p["file"] for p in prompts}) == len(prompts)
    for p in prompts:
        assert p["file"] not in ("h.whl:short.py", "h.whl:tiny.py")
        assert len(p["prompt_ids"]) == recipe.prompt_len
        assert p["prompt"] in files[p["file"].split(":", 1)[1]]
        assert p["prompt"] == CharTokenizer().decode(p["prompt_ids"])


# ------------------------------------------------------------------ the training loop
def test_the_final_loss_is_the_mean_of_the_last_steps() -> None:
    losses = [float(i) for i in range(100)]
    assert mean_tail(losses) == pytest.approx(sum(range(50, 100)) / 50)
    assert mean_tail(losses[:10]) == pytest.approx(4.5)


def test_the_learning_rate_warms_up_to_its_peak_then_decays_to_a_tenth() -> None:
    steps, peak, warmup = 100, 2.0, 10
    lrs = [lr_at(s, steps, peak, warmup) for s in range(steps + 1)]
    assert lrs[0] == pytest.approx(peak / warmup)
    assert lrs[warmup - 1] == pytest.approx(peak) and lrs[warmup] == pytest.approx(peak)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))
    assert lrs[steps] == pytest.approx(0.1 * peak) and min(lrs) >= 0.1 * peak - 1e-12


def fit(scores: list[float], steps: int, validate_every: int) -> dict:
    model = torch.nn.Linear(2, 2)
    seen = iter(scores)
    return optimise(
        model,
        steps,
        1e-3,
        lambda step: model(torch.ones(1, 2)).square().sum(),
        lambda message: None,
        "test",
        validate=lambda: next(seen),
        validate_every=validate_every,
    )


def test_the_weights_kept_are_the_first_best_validation_and_the_last_step_is_validated() -> None:
    # validations after steps 2, 4 and 5 (the last)
    assert fit([3.0, 1.0, 1.0], 5, 2)["best_step"] == 4
    assert fit([3.0, 2.0, 1.0], 5, 2)["best_step"] == 5
    first = fit([1.0, 2.0, 3.0], 5, 2)
    assert (first["best_step"], first["best_score"]) == (2, 1.0)


def test_the_block_loss_is_a_weighted_mean_over_the_slots_inside_each_block() -> None:
    """Every slot equally wrong (uniform logits): the loss is that slot loss, whatever the
    block lengths and the decay."""
    vocab = 7
    logits = torch.zeros(3, 4, vocab, dtype=torch.float64)
    labels = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(0))
    for lengths in (None, torch.tensor([5, 2, 3])):
        for decay in (1.0, 7.0):
            assert block_loss(logits, labels, lengths, decay).item() == pytest.approx(math.log(vocab))


def test_the_selector_scores_each_blocks_first_slot_from_its_anchor() -> None:
    """Every true token a candidate (the draft's top token), so that every slot counts: the
    loss is the naive loop's, slot 1's edges leaving the anchor, and another anchor changes it."""
    draft = smoke_draft()
    hidden, logits, _, anchors, lengths = selector_batch(draft)
    labels = logits.argmax(-1)
    decay = DFLASH2.position_decay
    loss, recall = selector_loss(draft, hidden, logits, labels, anchors, lengths, decay)
    want, want_recall = naive_selector_loss(draft, hidden, logits, labels, anchors, lengths, decay)
    assert recall.item() == want_recall == 1.0
    assert loss.item() == pytest.approx(want, abs=1e-10)
    moved, _ = selector_loss(
        draft, hidden, logits, labels, (anchors + 1) % DFLASH2.vocab_size, lengths, decay
    )
    assert abs(moved.item() - loss.item()) > 1e-6


def test_a_loss_curve_averages_each_stretch_of_steps_once() -> None:
    losses = [float(i + 1) for i in range(10)]
    assert loss_curve(losses, 5) == [(2, 1.5), (4, 3.5), (6, 5.5), (8, 7.5), (10, 9.5)]
    assert loss_curve(losses[:3], 10) == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_each_seed_and_stage_draws_batches_of_its_own() -> None:
    draws = {
        (seed, stage): tuple(torch.randint(0, 1 << 30, (4,), generator=generator(seed, stage)).tolist())
        for seed in range(4)
        for stage in range(4)
    }
    assert len(set(draws.values())) == len(draws)
    assert draws[(2, 1)] == tuple(torch.randint(0, 1 << 30, (4,), generator=generator(2, 1)).tolist())


def test_a_short_last_block_is_of_any_length_from_two_to_the_block_size() -> None:
    recipe = dataclasses.replace(Recipe.smoke(), train_block_sizes=(2,), short_block_share=1.0)
    lengths = draw_block_lengths(recipe, 3000, torch.Generator().manual_seed(0))
    counts = torch.bincount(lengths, minlength=recipe.block_size + 1).tolist()
    assert counts[:2] == [0, 0] and len(counts) == recipe.block_size + 1
    assert all(abs(c - 1000) < 150 for c in counts[2:]), counts  # uniform over 2, 3, 4
    full = dataclasses.replace(recipe, short_block_share=0.0)
    assert set(draw_block_lengths(full, 100, torch.Generator().manual_seed(0)).tolist()) == {2}


# ------------------------------------------------------------------ the recipe and the pair
def test_the_recipe_takes_its_boundary_settings_and_refuses_past_them() -> None:
    smoke = Recipe.smoke()
    dataclasses.replace(smoke, seq_len=smoke.prompt_len + smoke.block_size)
    dataclasses.replace(smoke, target_layer_ids=(0, smoke.target_layers - 1))
    dataclasses.replace(smoke, selector_top_k=smoke.vocab_size)
    for bad in (
        {"seq_len": smoke.prompt_len + smoke.block_size - 1},
        {"target_layer_ids": (0, smoke.target_layers)},
        {"selector_top_k": smoke.vocab_size + 1},
        {"train_block_sizes": (2, smoke.block_size + 1)},
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(smoke, **bad)


@pytest.mark.parametrize("ids", [(-1, 2), (), (0, 3)], ids=["negative", "none", "past-the-last"])
def test_the_recipe_refuses_target_layer_ids_that_are_not_layers_of_the_target(ids) -> None:
    """Each id must be one of the target's layers (a negative one passed before, and the run
    trained the whole target and then failed with a bare KeyError where the features are
    captured); none at all is refused by name too."""
    with pytest.raises(ValueError, match=r"target_layer_ids .*0 to 2"):
        dataclasses.replace(Recipe.smoke(), target_layer_ids=ids)


def test_the_target_repeats_two_gated_deltanet_layers_then_attention() -> None:
    config = dataclasses.replace(Recipe.smoke(), target_layers=6, target_layer_ids=(0, 5)).target_config(0)
    assert config["layer_types"] == ["linear_attention", "linear_attention", "full_attention"] * 2


def finished_pair(folder: Path, recipe: Recipe, bpe, **extra) -> Path:
    """A finished pair's folder: its target's config (with `extra` keys) and tokenizer, its
    figures, and a DFlash draft."""
    (folder / "target").mkdir(parents=True)
    (folder / "draft").mkdir()
    bpe.save(str(folder / "target" / "tokenizer.json"))
    config = recipe.target_config(bpe.token_to_id(EOS_TOKEN)) | extra
    (folder / "target" / "config.json").write_text(json.dumps(config))
    (folder / "draft" / "config.json").write_text("{}")
    figures = {"target": {"kept_step": 1}, "draft": {"final_loss": 1.0}}
    figures["parameters"] = {"target": 10, "draft_own": 5}
    (folder / "training.json").write_text(json.dumps(figures))
    return folder


def test_a_pair_whose_target_has_another_config_key_is_refused(tmp_path: Path, bpe) -> None:
    recipe = dataclasses.replace(Recipe.smoke(), vocab_size=300)
    pair = finished_pair(tmp_path / "pair", recipe, bpe, rope_scaling={"factor": 2.0})
    (tmp_path / "out" / "work").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="rope_scaling"):
        adopt_pair(pair, tmp_path / "out", recipe, lambda m: None)
    adopt_pair(finished_pair(tmp_path / "good", recipe, bpe), tmp_path / "out", recipe, lambda m: None)
    assert json.loads((tmp_path / "out" / "work" / "target.json").read_text())["parameters"] == 10


def test_adopting_a_pair_keeps_a_draft_stage_already_finished(tmp_path: Path, bpe) -> None:
    recipe = dataclasses.replace(Recipe.smoke(), vocab_size=300)
    pair = finished_pair(tmp_path / "pair", recipe, bpe)
    work = tmp_path / "out" / "work"
    work.mkdir(parents=True)
    (work / "draft.json").write_text('{"mine": true}\n')
    adopt_pair(pair, tmp_path / "out", recipe, lambda m: None)
    assert json.loads((work / "draft.json").read_text()) == {"mine": True}
    assert not (tmp_path / "out" / "draft").exists()
    assert (tmp_path / "out" / "target" / "config.json").is_file()
    assert json.loads((work / "target.json").read_text())["kept_step"] == 1

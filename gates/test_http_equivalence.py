"""Gate: with DFlash on, a server produces exactly what it produces with DFlash off, token
by token, over HTTP; every divergence is triaged (tie or mismatch) and the comparison
resumes after it. Runs against any two OpenAI-compatible servers (see gates/options.py);
by default against our own plain and DFlash servers on a tiny pair."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness.answer import ERRORS, error_class
from harness.client import Endpoint
from harness.compare import ComparePolicy, compare
from harness.server_kind import resolve
from harness.tokens import TextTokenizer
from harness.workloads import Prompt, builtin, gate_prompts, load_jsonl, synthetic
from tests.server_process import ServerProcess

from .faults import LIES
from .lying_server import LyingServer, send_answer

MAX_TOKENS = 24


def run_compare(
    baseline: Endpoint, candidate: Endpoint, prompts, policy: ComparePolicy, concurrency: int = 4
):
    return asyncio.run(compare(baseline, candidate, prompts, MAX_TOKENS, concurrency, policy))


@pytest.fixture(scope="module")
def tiny_dirs(tiny_pair):
    return tiny_pair("qwen3_5", block_size=8)


def prompts_for_us():
    return [p for p in builtin("mixed") if p.text] + synthetic(6, 20, seed=5)


# the user-servers gate: both reply forms (streamed and whole), at each of these levels
USER_LEVELS = (1, 8)
USER_FORMS = {"stream": True, "whole": False}


@dataclass(frozen=True)
class UserServers:
    """What the user-servers gate compares, read from the pytest command line."""

    baseline: str
    candidate: str
    model: str | None
    api_key: str | None
    prompts: list[Prompt]  # text, token-id and chat prompts alike
    policy: ComparePolicy
    server_kind: str
    tokenizer: str | None
    levels: tuple[int, ...] = USER_LEVELS


def user_servers(config: pytest.Config) -> UserServers | None:
    """The servers given by --baseline-url and --candidate-url (None: not both given) and what
    to compare them on: the --compare-prompts file, else the whole built-in mixed set, whose
    chat prompts go to /v1/chat/completions (every server kind takes chat)."""
    base, cand = config.getoption("--baseline-url"), config.getoption("--candidate-url")
    if not (base and cand):
        return None
    file = config.getoption("--compare-prompts")
    return UserServers(
        base,
        cand,
        config.getoption("--compare-model"),
        config.getoption("--compare-api-key"),
        load_jsonl(file) if file else builtin("mixed"),
        ComparePolicy(config.getoption("--compare-policy")),
        config.getoption("--compare-server-kind"),
        config.getoption("--compare-tokenizer"),
    )


@pytest.mark.parametrize("form", list(USER_FORMS))
def test_user_servers_are_equivalent(request, form: str) -> None:
    """Every prompt, text and chat, answered alike by the candidate streamed or whole (one
    form per run), at concurrency 1 and at a level that batches."""
    given = user_servers(request.config)
    if given is None:
        pytest.skip("no --baseline-url/--candidate-url given (the tests below use our servers)")
    tokenizer = TextTokenizer(given.tokenizer) if given.tokenizer else None

    def endpoint(url: str) -> Endpoint:
        found = resolve(given.server_kind, url, given.model, given.api_key)
        return Endpoint(
            url,
            given.model or (found.models[0] if found.models else None),
            api_key=given.api_key,
            server=found.kind,
            tokenizer=tokenizer,
        )

    results, summary = asyncio.run(
        compare(
            endpoint(given.baseline),
            endpoint(given.candidate),
            given.prompts,
            MAX_TOKENS,
            list(given.levels),
            given.policy,
            stream=USER_FORMS[form],
        )
    )
    first = next((d for r in results for d in r.divergences), None)
    assert summary["verdict"] == "pass", f"{form}: {summary}; first divergence: {first}"
    assert summary["levels"] == list(given.levels), summary
    chat = sum(1 for p in given.prompts if p.messages is not None)
    assert sum(1 for r in results if r.endpoint == "chat") == chat * len(given.levels), summary


def test_the_user_servers_gate_reads_its_servers_and_covers_chat_both_forms_and_two_levels(
    tmp_path,
) -> None:
    """The user-servers gate runs only where servers are given, so its plan is checked here."""

    class Config:
        def __init__(self, **options) -> None:
            self.options = options

        def getoption(self, name: str):
            return self.options.get(name.lstrip("-").replace("-", "_"))

    defaults = {"compare_policy": "tie-tolerant", "compare_server_kind": "auto"}
    assert user_servers(Config(baseline_url="http://127.0.0.1:1", **defaults)) is None
    urls = {"baseline_url": "http://127.0.0.1:1", "candidate_url": "http://127.0.0.1:2"}
    given = user_servers(Config(**urls, **defaults))
    assert (given.baseline, given.candidate, given.server_kind) == (*urls.values(), "auto")
    assert given.prompts == builtin("mixed") and any(p.messages for p in given.prompts)
    assert given.levels[0] == 1 and max(given.levels) > 1 and set(USER_FORMS.values()) == {True, False}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    options = {**urls, **defaults, "compare_prompts": str(prompts), "compare_policy": "strict"}
    given = user_servers(Config(**options, compare_model="m"))

    assert [p.messages is not None for p in given.prompts] == [False, True]
    assert given.policy.policy == "strict" and given.model == "m"


@pytest.fixture(scope="module")
def baseline_server(tiny_dirs):
    server = ServerProcess("--model", str(tiny_dirs[0]), "--dtype", "float64")
    yield server
    server.stop()


def compared_with_our_dflash_server(
    baseline_server, tiny_dirs, policy: ComparePolicy, *options: str, fault: str | None = None
):
    """`harness compare` of the plain baseline against our DFlash server started with
    `options` (and `fault` planted, gates/faulty_serve.py): (results, summary)."""
    candidate = ServerProcess(
        *([fault] if fault else []),
        "--model",
        str(tiny_dirs[0]),
        "--dflash-draft-model-path",
        str(tiny_dirs[1]),
        "--dtype",
        "float64",
        *options,
        module="gates.faulty_serve" if fault else "reference_engine.serve",
    )
    try:
        loop = options[options.index("--engine-loop") + 1] if "--engine-loop" in options else "thread"
        assert httpx.get(candidate.url + "/info").json()["engine_loop"] == loop
        return run_compare(Endpoint(baseline_server.url), Endpoint(candidate.url), prompts_for_us(), policy)
    finally:
        candidate.stop()


@pytest.mark.parametrize(
    "strategy, loop",
    [("replay", "thread"), ("per_token", "thread"), ("recompute", "thread"), ("per_token", "process")],
)
def test_our_dflash_server_matches_our_plain_server_exactly(
    baseline_server, tiny_dirs, strategy: str, loop: str
) -> None:
    """Every commit strategy, and the engine in a process of its own (`--engine-loop
    process`: the same tokens over the pipe)."""
    _, summary = compared_with_our_dflash_server(
        baseline_server,
        tiny_dirs,
        ComparePolicy("strict"),
        "--commit-strategy",
        strategy,
        "--engine-loop",
        loop,
    )
    assert summary["verdict"] == "pass" and summary["exact"] == summary["prompts"], summary
    assert summary["compared"] == "ids" and summary["compared_ids"] == summary["prompts"]


@pytest.mark.parametrize("loop", ["thread", "process"])
def test_a_planted_fault_fails_the_gate_and_names_the_first_divergence(
    baseline_server, tiny_dirs, loop: str
) -> None:
    """In a process of its own the engine has the fault too (gates/faulty_serve.py plants it
    there; a fault left in the HTTP process alone passed this gate)."""
    results, summary = compared_with_our_dflash_server(
        baseline_server, tiny_dirs, ComparePolicy(), "--engine-loop", loop, fault="skip_state_rollback"
    )
    assert summary["verdict"] == "fail" and summary["mismatches"] > 0, summary
    first = next(d for r in results for d in r.divergences)
    assert first.baseline_token != first.candidate_token and first.margin is not None


def test_our_dflash_server_is_exact_at_each_concurrency_and_context_of_the_gate_set(
    demo_plain_server, demo_dflash_server
) -> None:
    prompts = gate_prompts((128, 512))[:4]  # the demo target holds 4096 tokens in all
    results, summary = asyncio.run(
        compare(
            Endpoint(demo_plain_server.url),
            Endpoint(demo_dflash_server.url),
            prompts,
            16,
            [1, 4],
            ComparePolicy("strict"),
        )
    )
    assert summary["verdict"] == "pass" and summary["exact"] == summary["prompts"] == 8, summary
    assert {c: v["exact"] for c, v in summary["by_concurrency"].items()} == {"1": 4, "4": 4}
    assert {b: v["exact"] for b, v in summary["by_context"].items()} == {"~128": 4, "~512": 4}


# ------------------------------------------------------------------ tie triage, scripted
BASE = [11, 12, 13, 14, 15, 16, 17, 18]
CAND = [11, 12, 99, 14, 15, 77, 17, 18]  # near-tied swap at 2, a real bug at 5
PROMPT = [100, 101]


def scripted_server(sequence: list[int], with_logprobs: bool):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            if isinstance(prompt, str):  # a text prompt: the stub's tokenizer says PROMPT
                prompt = PROMPT
            settled = len(prompt) - len(PROMPT)
            ids = sequence[settled : settled + body["max_tokens"]]
            choice = {
                "token_ids": ids,
                "prompt_token_ids": prompt,
                "finish_reason": "length",
                "text": "".join(f"<{t}>" for t in ids),
            }
            if with_logprobs and body.get("logprobs"):
                tops = []
                for pos in range(settled, settled + len(ids)):
                    margin = 0.01 if pos == 2 else 3.0  # position 2: all but tied with 99
                    tops.append(
                        [
                            {"token_id": sequence[pos], "logprob": -0.5},
                            {
                                "token_id": CAND[pos] if CAND[pos] != sequence[pos] else 1,
                                "logprob": -0.5 - margin,
                            },
                        ]
                    )
                choice["logprobs"] = {
                    "token_ids": ids,
                    "tokens": [f"<{t}>" for t in ids],  # each token's text, as the text joins them
                    "top_token_logprobs": tops,
                }
            send_answer(self, body, {"choices": [choice]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_near_tie_is_a_tie_and_resumption_finds_the_later_mismatch() -> None:
    base, base_url = scripted_server(BASE, with_logprobs=True)
    cand, cand_url = scripted_server(CAND, with_logprobs=False)
    try:
        results, summary = asyncio.run(
            compare(
                Endpoint(base_url),
                Endpoint(cand_url),
                [Prompt(token_ids=tuple(PROMPT))],
                len(BASE),
                1,
                ComparePolicy(),
            )
        )
    finally:
        base.shutdown()
        cand.shutdown()
    kinds = [(d.position, d.kind) for d in results[0].divergences]
    assert kinds == [(2, "tie"), (5, "mismatch")]
    assert results[0].divergences[0].margin == pytest.approx(0.01)
    assert summary["ties"] == 1 and summary["mismatches"] == 1 and summary["verdict"] == "fail"
    # the same run with only the tie passes tie-tolerant and fails strict
    only_tie = CAND[:5] + BASE[5:]
    for policy, expected in (("tie-tolerant", "pass"), ("strict", "fail")):
        base, base_url = scripted_server(BASE, with_logprobs=True)
        cand, cand_url = scripted_server(only_tie, with_logprobs=False)
        try:
            _, summary = asyncio.run(
                compare(
                    Endpoint(base_url),
                    Endpoint(cand_url),
                    [Prompt(token_ids=tuple(PROMPT))] * 40,
                    len(BASE),
                    4,
                    ComparePolicy(policy, max_tie_rate=1.0),
                )
            )
        finally:
            base.shutdown()
            cand.shutdown()
        assert summary["verdict"] == expected, (policy, summary)


def test_compare_command_exit_codes_and_files(tmp_path) -> None:
    import subprocess
    import sys

    from tests.server_process import REPO

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    for cand_seq, policy, code in ((BASE, "strict", 0), (CAND, "tie-tolerant", 1)):
        base, base_url = scripted_server(BASE, with_logprobs=True)
        cand, cand_url = scripted_server(cand_seq, with_logprobs=False)
        out = tmp_path / f"out-{code}"
        try:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "harness",
                    "compare",
                    "--baseline",
                    base_url,
                    "--candidate",
                    cand_url,
                    "--prompts",
                    str(prompts),
                    "--max-tokens",
                    "8",
                    "--policy",
                    policy,
                    "--out",
                    str(out),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            base.shutdown()
            cand.shutdown()
        assert done.returncode == code, done.stdout + done.stderr
        summary = json.loads((out / "compare_summary.json").read_text())
        assert {"prompts", "exact", "ties", "mismatches", "verdict"} <= set(summary)
        assert (out / "compare.jsonl").is_file() and (out / "compare.md").is_file()
        if code:
            assert "first divergence: position 2" in done.stdout


# ------------------------------------------------------------------ lying candidates
# every lie this module plants (gates/faults.py, LIES) and sees `harness compare` fail on
CATCHES_LIES = (
    "text_wrong_ids_right",
    "ids_wrong_text_right",
    "withheld_ids",
    "another_token",
    "one_token_short",
    "one_token_long",
    "wrong_finish_reason",
    "wrong_reasoning",
    "added_tool_call",
    "usage_off_by_one",
    "usage_a_chunk_late",
    "wrong_prompt_tokens",
    "answers_another_prompt",
    "stale_answer",
    "empty_choices",
    "error_object",
    "refuses_token_id_prompts",
    "not_json",
    "cut_short",
    "http_500",
    "two_choices",
    "split_choices",
    "null_text",
    "duplicated_chunk",
    "missing_chunk",
    "tokens_after_finish",
    "two_chunks_one_event",
)
LIE_PROMPTS = [
    {"prompt": "The cache holds"},
    {"prompt": "A draft model proposes a block of tokens and the target"},
    {"messages": [{"role": "user", "content": "What is a key-value cache?"}]},
    {"prompt": [11, 23, 5, 42, 7]},  # token ids
]


def harness_compare(
    baseline: str, candidate: str, prompts: Path, out: Path, *extra: str
) -> tuple[int, dict, str]:
    """`python -m harness compare`, in this process: exit status, summary, stderr."""
    from harness.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(
            [
                "compare",
                "--baseline",
                baseline,
                "--candidate",
                candidate,
                "--server-kind",
                "ours",
                "--prompts",
                str(prompts),
                "--max-tokens",
                "6",
                "--concurrency",
                "1",
                "--out",
                str(out),
                *extra,
            ]
        )
    summary = json.loads((out / "compare_summary.json").read_text())
    return code, summary, err.getvalue()


@pytest.fixture(scope="module")
def lie_prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lies") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in LIE_PROMPTS))
    return path


@pytest.mark.parametrize("form", ["stream", "whole"])
def test_an_honest_proxy_passes(baseline_server, lie_prompts, tmp_path, form: str) -> None:
    with LyingServer(baseline_server.url, None) as proxy:
        code, summary, err = harness_compare(
            baseline_server.url, proxy.url, lie_prompts, tmp_path, f"--{'no-' * (form == 'whole')}stream"
        )
    assert code == 0 and summary["exact"] == summary["prompts"] == len(LIE_PROMPTS), err
    assert summary["compared"] == "ids" and err.splitlines()[-1].startswith("pass: ")


LIE_CASES = [(name, form) for name in sorted(LIES) for form in LIES[name].forms]


@pytest.mark.parametrize(("lie", "form"), LIE_CASES, ids=[f"{n}-{f}" for n, f in LIE_CASES])
def test_the_gate_fails_loudly_on_a_lying_candidate(
    baseline_server, tiny_dirs, lie_prompts, tmp_path, lie: str, form: str
) -> None:
    with LyingServer(baseline_server.url, LIES[lie], TextTokenizer(tiny_dirs[0])) as liar:
        code, summary, err = harness_compare(
            baseline_server.url,
            liar.url,
            lie_prompts,
            tmp_path,
            f"--{'no-' * (form == 'whole')}stream",
            *LIES[lie].args,
        )
    reason = summary["reason"]
    named = {reason, f"{reason}:{summary['first_mismatch']}"}
    assert summary["verdict"] == "fail" and named & set(LIES[lie].expect), (lie, named, err)
    status = ERRORS[error_class(reason)][0] if summary["error"] else 1
    assert code == status, (code, reason)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {reason}: " if summary["error"] else f"fail: {reason}: ")
    assert "Traceback" not in err


def test_every_lie_is_caught_by_some_gate_test() -> None:
    caught: dict[str, list[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        module = importlib.import_module(f"gates.{path.stem}")
        for name in getattr(module, "CATCHES_LIES", ()):
            caught.setdefault(name, []).append(path.stem)
            assert f'"{name}"' in path.read_text(), f"{path.name} claims {name} but never names it"
    assert sorted(caught) == sorted(LIES), (
        f"lies no gate catches: {sorted(set(LIES) - set(caught))}; "
        f"claimed but not registered: {sorted(set(caught) - set(LIES))}"
    )
    planted = {name for name, _ in LIE_CASES}
    assert planted == set(LIES) and all(LIES[n].forms for n in LIES), "a lie that lies nowhere"


def test_no_usable_prompt_is_an_error_never_a_pass(baseline_server, tmp_path) -> None:
    prompts = tmp_path / "unusable.jsonl"
    prompts.write_text('{"prompt": ""}\n{"messages": []}\n')
    code, summary, err = harness_compare(baseline_server.url, baseline_server.url, prompts, tmp_path / "out")
    assert code == ERRORS["no_usable_prompts"][0] and summary["verdict"] == "fail"
    assert summary["error"] == "no_usable_prompts" and summary["unusable"] == 2
    assert err.splitlines()[-1].startswith("error: no_usable_prompts: ")

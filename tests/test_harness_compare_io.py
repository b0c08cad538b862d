"""`harness compare` on the command line (harness/compare_io.py, harness/__main__.py): a row
per comparison the moment it is made, carrying its prompt and source; an interrupted run keeps
them and `--resume` makes only the rest; every error class exits with its own status and one
line on stderr, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.__main__ import main, parser
from harness.answer import ERRORS
from harness.compare_io import RowLog
from reference_engine.demo import DEMO_TARGET

from .completion_stub import Reply, Stub, completion
from .server_process import REPO, sigint_as_default


def answer(path: str, body: dict) -> dict:
    return completion(
        [1, 2, 3], prompt_tokens=len(body.get("prompt") or "x"), chat=path.endswith("/chat/completions")
    )


def prompts_file(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def args(base: str, cand: str, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "compare",
        "--baseline",
        base,
        "--candidate",
        cand,
        "--server-kind",
        "ours",
        "--prompts",
        str(prompts),
        "--max-tokens",
        "4",
        "--out",
        str(out),
        *extra,
    ]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "compare.jsonl").read_text().splitlines()]


def test_an_interrupted_compare_keeps_its_rows_and_resume_makes_the_rest(tmp_path) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": f"prompt {i}"} for i in range(4)])
    out = tmp_path / "out"

    def stalls_on_the_third(path: str, body: dict) -> dict:
        if body["prompt"] == "prompt 2":
            stalled.release.wait(60)
        return answer(path, body)

    with Stub(answer) as base, Stub(stalls_on_the_third) as stalled:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                *args(base.url, stalled.url, prompts, out, "--concurrency", "1"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_as_default,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            (out / "compare.jsonl").exists() and len(rows(out)) == 2 and len(stalled.bodies) == 3
        ):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted: 2 comparisons kept" in err and "Traceback" not in err
        kept = rows(out)
        assert [r["source"] for r in kept] == [f"{prompts}:1", f"{prompts}:2"]
        assert [r["prompt"] for r in kept] == [{"text": "prompt 0"}, {"text": "prompt 1"}]
        stalled.release.set()  # the same servers again: the rows kept were made against them
        asked = len(stalled.bodies)
        assert main(args(base.url, stalled.url, prompts, out, "--concurrency", "1", "--resume")) == 0
        assert [b["prompt"] for b in stalled.bodies[asked:]] == ["prompt 2", "prompt 3"]
    summary = json.loads((out / "compare_summary.json").read_text())
    assert summary["prompts"] == summary["exact"] == 4 and len(rows(out)) == 4


def test_resume_compares_again_what_failed_and_drops_a_torn_line(tmp_path) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    busy = {"b"}  # the prompts the candidate refuses, for now
    with (
        Stub(answer) as base,
        Stub(lambda p, b: Reply(503, b"busy") if b["prompt"] in busy else answer(p, b)) as cand,
    ):
        assert main(args(base.url, cand.url, prompts, out)) == ERRORS["http_error"][0]
        with (out / "compare.jsonl").open("a") as f:
            f.write('{"index": 7, "exa')
        log = RowLog(out, resume=True, identity=json.loads((out / "compare_run.json").read_text()))
        log.close()
        assert len(log.kept) == 1 and log.dropped == 2  # the http_503 row and the torn line
        busy.clear()
        assert main(args(base.url, cand.url, prompts, out, "--resume")) == 0
        assert [b["prompt"] for b in cand.bodies[2:]] == ["b"]
        # another length: other comparisons
        assert main(args(base.url, cand.url, prompts, out, "--resume", "--max-tokens", "3")) == 0
        assert sorted(b["prompt"] for b in cand.bodies[3:]) == ["a", "b"]  # concurrent: any order


def results(out: Path) -> dict[str, bytes]:
    """The files of a run (not the lock each run takes)."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ("candidate", "candidate.url"),
        ("--model", "baseline.model"),
        ("--server-kind", "baseline.server_kind"),  # both servers: sorted first
        ("--no-stream", "stream"),
        ("--tie-threshold", "tie_threshold"),
        ("--max-divergences", "max_divergences"),
        ("--tokenizer", "baseline.tokenizer"),
    ],
)
def test_resume_refuses_rows_made_against_another_candidate_or_settings(
    tmp_path, capsys, change: str, differs: str
) -> None:
    """A row of another candidate (URL, model, server kind) or of other settings proves
    nothing about this run: --resume stops with its status and leaves the folder as it was."""
    prompts = prompts_file(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    with Stub(answer) as base, Stub(answer) as cand, Stub(answer) as other:
        assert main(args(base.url, cand.url, prompts, out)) == 0
        before = results(out)
        extra = {
            "--model": ["--model", "another"],
            "--server-kind": ["--server-kind", "openai"],
            "--no-stream": ["--no-stream"],
            "--tie-threshold": ["--tie-threshold", "0.5"],
            "--max-divergences": ["--max-divergences", "2"],
            "--tokenizer": ["--tokenizer", str(DEMO_TARGET)],
        }.get(change, [])
        again = args(
            base.url, other.url if change == "candidate" else cand.url, prompts, out, "--resume", *extra
        )
        capsys.readouterr()
        assert main(again) == ERRORS["resume_conflict"][0]
        assert other.bodies == [] and len(cand.bodies) == 2  # nothing was asked
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("error: resume_conflict: the 2 rows in ") and f"{differs} was " in line, line
    assert results(out) == before


def test_resume_refuses_rows_that_say_nothing_of_what_they_were_compared_against(tmp_path, capsys) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": "a"}])
    out = tmp_path / "out"
    with Stub(answer) as base, Stub(answer) as cand:
        assert main(args(base.url, cand.url, prompts, out)) == 0
        (out / "compare_run.json").unlink()  # as an older harness left its folders
        assert main(args(base.url, cand.url, prompts, out, "--resume")) == ERRORS["resume_conflict"][0]
        assert "no compare_run.json says" in capsys.readouterr().err
        assert (
            main(args(base.url, cand.url, prompts, tmp_path / "fresh", "--resume")) == 0
        )  # no rows: nothing to refuse


def test_each_concurrency_level_is_a_row_of_its_own(tmp_path) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    with Stub(answer) as base, Stub(answer) as cand:
        assert main(args(base.url, cand.url, prompts, out, "--concurrency", "1,2")) == 0
    assert sorted((r["concurrency"], r["index"]) for r in rows(out)) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    csv_rows = (out / "compare_summary.csv").read_text().splitlines()
    assert csv_rows[0].startswith("scope,concurrency,context")
    assert any(r.startswith("concurrency,2,all,2,2,") for r in csv_rows)


def test_an_error_exits_with_its_status_and_one_line_never_a_traceback(tmp_path) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": "a"}])
    with Stub(answer) as base, Stub(lambda p, b: Reply(200, b'{"choices": []}')) as cand:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness",
                *args(base.url, cand.url, prompts, tmp_path / "out", "--no-stream"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == ERRORS["empty_choices"][0], done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: empty_choices: candidate: ")
    assert "Traceback" not in done.stderr


def test_no_usable_prompt_exits_with_its_status(tmp_path, capsys) -> None:
    prompts = prompts_file(tmp_path, [{"prompt": ""}, {"messages": []}])
    with Stub(answer) as base:
        code = main(args(base.url, base.url, prompts, tmp_path / "out"))
        assert base.bodies == []
    assert code == ERRORS["no_usable_prompts"][0]
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("error: no_usable_prompts: no usable prompt (") and ":1: an empty" in line


def test_the_builtin_chat_set_is_compared_over_chat(tmp_path) -> None:
    out = tmp_path / "out"
    with Stub(answer) as base, Stub(answer) as cand:
        code = main(
            [
                "compare",
                "--baseline",
                base.url,
                "--candidate",
                cand.url,
                "--server-kind",
                "ours",
                "--builtin",
                "chat",
                "--num-prompts",
                "3",
                "--out",
                str(out),
            ]
        )
        assert set(cand.paths) == {"/v1/chat/completions"}
    summary = json.loads((out / "compare_summary.json").read_text())
    assert code == 0 and summary["prompts"] == summary["exact"] == 3
    assert all(r["source"].startswith("builtin:chat#") for r in rows(out))


def test_the_help_names_every_exit_status() -> None:
    sub = next(a for a in parser()._actions if a.dest == "command")
    text = sub.choices["compare"].format_help()
    for name, (status, _) in ERRORS.items():
        assert f"  {status:<3} " in text and (name in text or name == "http_error")
    with pytest.raises(SystemExit):
        main(["compare", "--baseline", "http://x:1", "--candidate", "http://x:1", "--concurrency", "0"])

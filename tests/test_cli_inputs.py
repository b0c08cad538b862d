"""Bad input on the command lines of generate and serve: one error line, exit status 2, no
traceback, never a silent substitute."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import pytest

from .server_process import REPO
from .together import Results, together


def cli(*argv: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, timeout=120)


def one_error_line(done: subprocess.CompletedProcess, message: str) -> None:
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert "Traceback" not in err
    assert message in err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair("qwen3_5", block_size=8)


PORTS = ["99999", "0", "http"]
THREADS = ["0", "two"]


@pytest.fixture(scope="module")
def runs(request, pair) -> Results:
    """This module's command lines, side by side in the background (tests/together.py)."""
    target, draft = (str(path) for path in pair)
    generate = ("reference_engine.generate", "--model", target)
    serve = ("reference_engine.serve", "--model", target)
    jobs = {
        "test_generate_block_size_0_is_refused_not_replaced_by_the_drafts": (
            *generate,
            "--draft",
            draft,
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "2",
            "--block-size",
            "0",
        ),
        "test_generate_a_prompt_that_is_not_utf8_is_one_error_line": (
            *generate,
            "--prompt",
            b"caf\xe9",
            "--max-tokens",
            "2",
        ),
        **{
            f"test_serve_port_out_of_range_is_one_error_line[{port}]": (*serve, "--port", port)
            for port in PORTS
        },
        **{
            f"test_serve_threads_must_be_a_positive_count[{threads}]": (*serve, "--threads", threads)
            for threads in THREADS
        },
    }
    return together(request, {name: partial(cli, *argv) for name, argv in jobs.items()})


def test_generate_block_size_0_is_refused_not_replaced_by_the_drafts(runs, request) -> None:
    # generate --model <target> --draft <draft> --prompt-ids 1,2 --max-tokens 2 --block-size 0
    one_error_line(runs[request.node.name], "block size must be >= 2, got 0")


def test_generate_a_prompt_that_is_not_utf8_is_one_error_line(runs, request) -> None:
    # generate --model <target> --prompt b"caf\xe9" --max-tokens 2
    one_error_line(runs[request.node.name], "--prompt is not valid UTF-8")


@pytest.mark.parametrize("port", PORTS)
def test_serve_port_out_of_range_is_one_error_line(runs, request, port: str) -> None:
    # serve --model <target> --port <port>
    one_error_line(runs[request.node.name], "--port")


@pytest.mark.parametrize("threads", THREADS)
def test_serve_threads_must_be_a_positive_count(runs, request, threads: str) -> None:
    # serve --model <target> --threads <threads>
    one_error_line(runs[request.node.name], "--threads")


def test_serve_threads_sets_the_operator_threads_and_info_reports_them(pair) -> None:
    import httpx

    from .server_process import ServerProcess

    server = ServerProcess("--model", str(pair[0]), "--threads", "1")
    try:
        assert httpx.get(server.url + "/info", timeout=30).json()["threads"] == 1
    finally:
        server.stop()

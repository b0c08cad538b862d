"""Bad input on the command lines of generate and serve: one error line, exit status 2, no
traceback, never a silent substitute."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .server_process import REPO


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


def test_generate_block_size_0_is_refused_not_replaced_by_the_drafts(pair) -> None:
    target, draft = pair
    done = cli(
        "reference_engine.generate",
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
        "--block-size",
        "0",
    )
    one_error_line(done, "block size must be >= 2, got 0")


def test_generate_a_prompt_that_is_not_utf8_is_one_error_line(pair) -> None:
    done = cli(
        "reference_engine.generate", "--model", str(pair[0]), "--prompt", b"caf\xe9", "--max-tokens", "2"
    )
    one_error_line(done, "--prompt is not valid UTF-8")


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_serve_port_out_of_range_is_one_error_line(pair, port: str) -> None:
    done = cli("reference_engine.serve", "--model", str(pair[0]), "--port", port)
    one_error_line(done, "--port")


@pytest.mark.parametrize("threads", ["0", "two"])
def test_serve_threads_must_be_a_positive_count(pair, threads: str) -> None:
    done = cli("reference_engine.serve", "--model", str(pair[0]), "--threads", threads)
    one_error_line(done, "--threads")


def test_serve_threads_sets_the_operator_threads_and_info_reports_them(pair) -> None:
    import httpx

    from .server_process import ServerProcess

    server = ServerProcess("--model", str(pair[0]), "--threads", "1")
    try:
        assert httpx.get(server.url + "/info", timeout=30).json()["threads"] == 1
    finally:
        server.stop()

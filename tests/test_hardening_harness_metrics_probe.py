"""Contracts of the harness's counter pages, server probe, output folder and command line:

- Prometheus pages (harness/prometheus.py): a page in the full text format (HELP and TYPE
  lines, comments, blank lines, a timestamp after a value, exponent values, labels in any
  order, a trailing comma in a label set, `_created` samples) reads as its counts; a page
  whose counters went down between the snapshots gives no counter acceptance, whichever
  counter fell.
- the probe (harness/server_kind.py): our server's page with vLLM's names beside its own is
  ours; what /v1/models says of its owner wins over the names on /metrics; a server of no
  known kind whose probe answer carries token ids is read by them; an API key goes with
  every probe request; only a metric's name says which server it is, not a comment; a page
  behind a redirect (a Prometheus app mounted at /metrics) is read by the probe and the scrape.
- the output folder (harness/__main__.py): a dead server's run into a folder that was
  already there keeps it and what it held.
- the command line (harness/__main__.py, harness/arguments.py): defaults, and the measured
  requests a level, as the docs give them; a refusal names its flag; a level named twice in
  --concurrency is refused (it would be measured twice under one run's name); a workload that cannot be built
  is refused before a server is started or a folder made; --max-tie-rate is a fraction.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.__main__ import main, measured_count, parser
from harness.ab import free_port
from harness.prometheus import acceptance_from_counters, parse, scrape
from harness.resume import read_request_rows
from harness.server_kind import probe

from .sse_stub import Script, serve

COMPLETION = {
    "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
    "usage": {"completion_tokens": 1},
}


class Site:
    """A loopback HTTP server answering GET /v1/models and /metrics with fixed bodies (None:
    404) and POST /v1/completions with `answer`; with `key`, every path wants it as a
    bearer token (401 otherwise); with `mounted`, the page is at /metrics/ and /metrics redirects
    there, as a Prometheus app mounted under Starlette answers. It keeps the paths it was asked
    for and their headers."""

    def __init__(
        self,
        models: dict | None,
        metrics: str | None,
        key: str | None = None,
        answer: dict = COMPLETION,
        mounted: bool = False,
    ) -> None:
        self.asked: list[tuple[str, str | None]] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def authorised(self) -> bool:
                given = self.headers.get("Authorization")
                site.asked.append((self.path, given))
                if key is not None and given != f"Bearer {key}":
                    self.send(401, b'{"error": "unauthorised"}')
                    return False
                return True

            def do_GET(self) -> None:
                if not self.authorised():
                    return
                if self.path == "/v1/models" and models is not None:
                    self.send(200, json.dumps(models).encode())
                elif self.path == "/metrics" and metrics is not None and mounted:
                    self.send_response(307)
                    self.send_header("Location", "/metrics/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == ("/metrics/" if mounted else "/metrics") and metrics is not None:
                    self.send(200, metrics.encode(), "text/plain; version=0.0.4")
                else:
                    self.send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.authorised():
                    self.send(200, json.dumps(answer).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def __enter__(self) -> Site:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def models(owner: str) -> dict:
    return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]}


def spec_page(prefix: str, drafts: float, draft_tokens: float, accepted: float, first: int) -> str:
    """Our server's spec-decode counters under one family's names (positions from `first`)."""
    lines = []
    for name, value in (
        ("spec_decode_num_drafts", drafts),
        ("spec_decode_num_draft_tokens", draft_tokens),
        ("spec_decode_num_accepted_tokens", accepted),
    ):
        lines += [f"# TYPE {prefix}{name} counter", f'{prefix}{name}_total{{model_name="m"}} {value}']
    lines.append(f"# TYPE {prefix}spec_decode_num_accepted_tokens_per_pos counter")
    lines.append(
        f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{first}"}} 1'
    )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- Prometheus pages
def vllm_page(drafts: str, draft_tokens: str, accepted: str, pos: tuple[str, str]) -> str:
    """A vLLM-style page as prometheus_client writes it, with what the text format allows
    around the samples: comments, blank lines, labels in another order, a trailing comma,
    a timestamp after a value, `_created` samples and a histogram of another family."""
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="Qwen3-8B"}} 3.0

# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="Qwen3-8B"}} {drafts} 1717171717000
vllm:spec_decode_num_drafts_created{{engine="0",model_name="Qwen3-8B"}} 1.7171717e+09
# a comment line between samples
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens (a "quoted" word \\\\ and a \\n).
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{model_name="Qwen3-8B",engine="0",}} {draft_tokens}
vllm:spec_decode_num_draft_tokens_created{{model_name="Qwen3-8B",engine="0",}} 1.7171717e+09
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="Qwen3-8B"}} {accepted}

# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="1",engine="0",model_name="Qwen3-8B"}} {pos[1]}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="Qwen3-8B",position="0"}} {pos[0]}
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="Qwen3-8B"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="Qwen3-8B"}} 12.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="Qwen3-8B"}} 12.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="Qwen3-8B"}} 0.5
"""


def test_a_page_in_the_full_text_format_reads_as_its_counts() -> None:
    """Counts written as exponents (1.0e3) or with a timestamp after them are their values;
    `_created` samples, histograms and gauges of other families count for nothing."""
    before = parse(vllm_page("1.0e3", "7000", "2.5e3", ("900.0", "800")))
    after = parse(vllm_page("1.1e+03", "7.7e3", "2750", ("990", "8.8e2")))
    assert (after["drafts"], after["draft_tokens"], after["accepted"]) == (1100.0, 7700.0, 2750.0)
    assert (after["pos:1"], after["pos:2"]) == (990.0, 880.0) and "pos:0" not in after
    got = acceptance_from_counters(before, after)
    assert got["acceptance_length"] == pytest.approx(1 + 250 / 100)
    assert got["acceptance_rate"] == pytest.approx(250 / 700)
    assert got["acceptance_per_position"] == pytest.approx([0.9, 0.8])


def test_a_server_restarted_between_the_scrapes_gives_no_acceptance_whichever_counter_fell() -> None:
    """The server restarted during the run and has drafted more since than it had before the
    run, but accepted fewer tokens: a counter that fell is a counter that started again."""
    before = parse(vllm_page("100", "700", "400", ("90", "80")))
    after = parse(vllm_page("150", "1050", "300", ("120", "100")))
    assert acceptance_from_counters(before, after) == {}


# ----------------------------------------------------------------------------- the probe
def test_our_page_with_vllms_names_beside_ours_is_probed_as_ours() -> None:
    """Our server run with `--metrics-names dflash,vllm` lists vLLM's counter names too: a
    page that carries `dflash:` names is ours, however many vLLM names stand beside them."""
    page = spec_page("vllm:", 10, 70, 4, 0) + spec_page("dflash:", 10, 70, 4, 1)
    with Site({"object": "list", "data": []}, page) as site:
        found = probe(site.url)
    assert found.kind.name == "ours", found.kind.evidence
    assert "/metrics: ours" in found.kind.evidence


def test_what_v1_models_says_of_its_owner_wins_over_the_metric_names() -> None:
    """A server whose /v1/models says vLLM owns its model is vLLM, though its /metrics carries
    another family's names (a page scraped from a router in front of it, say)."""
    with Site(models("vllm"), spec_page("sglang:", 1, 7, 1, 0)) as site:
        found = probe(site.url)
    assert found.kind.name == "vllm", found.kind.evidence


def test_our_servers_owner_name_alone_says_ours() -> None:
    """`owned_by: reference_engine` is our server, with no /metrics to say it."""
    with Site(models("reference_engine"), None) as site:
        found = probe(site.url)
    assert found.kind.name == "ours" and found.models == ("m",), found.kind.evidence


def test_a_plain_server_whose_probe_answer_carries_token_ids_is_read_by_them() -> None:
    """A server of no known kind whose answer to the probe lists the generated token ids
    speaks plain OpenAI and is trusted for its ids; one whose answer has none is not."""
    with_ids = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "token_ids": [7]}]}
    with Site({"object": "list", "data": []}, None, answer=with_ids) as site:
        found = probe(site.url)
    assert found.kind.name == "openai" and found.kind.returns_ids, found.kind.evidence
    assert not found.kind.ignore_eos and "ids returned" in found.kind.evidence
    with Site({"object": "list", "data": []}, None) as site:
        assert not probe(site.url).kind.returns_ids


def test_the_api_key_goes_with_every_probe_request() -> None:
    """A server that wants its key on every route (a gateway) answers the probe's model list,
    metrics and request: all three carry the key, and the kind is read from them."""
    with Site(models("sglang"), spec_page("sglang:", 1, 7, 1, 0), key="sk-test") as site:
        found = probe(site.url, api_key="sk-test")
        asked = dict(site.asked)
    assert found.kind.name == "sglang", found.kind.evidence
    assert asked["/v1/models"] == asked["/metrics"] == asked["/v1/completions"] == "Bearer sk-test"


def test_a_metrics_page_behind_a_redirect_is_read_by_the_probe_and_the_scrape() -> None:
    """A Prometheus app mounted at /metrics under Starlette answers `GET /metrics` with a 307 to
    /metrics/: the probe still reads its names and the scrape its counters."""
    page = spec_page("vllm:", 10, 70, 4, 0)
    with Site({"object": "list", "data": []}, page, mounted=True) as site:
        found = probe(site.url)
        snapshot = scrape(site.url + "/metrics")
    assert found.kind.name == "vllm", found.kind.evidence
    assert snapshot is not None and snapshot["drafts"] == 10.0


def test_a_prefix_named_in_a_help_comment_does_not_decide_the_kind() -> None:
    """An SGLang page whose HELP text mentions a vLLM metric (the metric it mirrors) is still
    SGLang's: comments are not metric names."""
    page = (
        "# HELP sglang:num_running_reqs The number of running requests (vllm:num_requests_running).\n"
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} 2.0\n'
    )
    with Site({"object": "list", "data": []}, page) as site:
        found = probe(site.url)
    assert found.kind.name == "sglang", found.kind.evidence


# ----------------------------------------------------------------------------- the output folder
RUN = ["--concurrency", "1", "--num-prompts", "2", "--output-len", "2", "--warmup", "0", "--input-len", "4"]


def test_a_dead_servers_run_into_a_folder_that_was_there_keeps_it_and_its_files(tmp_path, capsys) -> None:
    """Only a folder the run itself created is removed when nothing was measured: one given
    with --out that already existed stays, with every file it held."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--base-url", dead, *RUN, "--out", str(out)]) == 1
    assert "no request completed" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me\n"


# ----------------------------------------------------------------------------- the command line
def test_the_defaults_are_the_documented_ones() -> None:
    """docs/harness.md and docs/harness-compare.md give these defaults."""
    bench = parser().parse_args(["bench", "--base-url", "http://127.0.0.1:8000"])
    assert bench.concurrency == [1, 4, 8, 16] and bench.label == "A"
    assert bench.endpoint == "completions" and bench.server_kind == "auto"
    assert bench.long_share == 0.25 and bench.max_failure_rate == 0.0
    assert bench.client_processes is None and bench.num_prompts is None
    assert math.isinf(bench.request_rate) and bench.burstiness == 1.0 and bench.timeout == 300.0
    ab = parser().parse_args(["ab", "--a-url", "http://127.0.0.1:1", "--b-url", "http://127.0.0.1:2"])
    assert ab.concurrency == [1, 4, 8, 16] and (ab.a_label, ab.b_label) == (None, None)
    compare = parser().parse_args(["compare", "--baseline", "http://h:1", "--candidate", "http://h:2"])
    assert compare.concurrency == [4] and compare.max_tokens == 64 and compare.timeout == 300.0
    assert compare.max_divergences == 5 and compare.stream is True
    assert compare.policy == "tie-tolerant" and compare.tie_threshold == 0.1 and compare.max_tie_rate == 0.05


def test_a_level_named_twice_is_refused_naming_the_flag(tmp_path, capsys) -> None:
    """`--concurrency 2,2` would measure level 2 twice under one run's name (label, level,
    repeat): it is refused, naming the flag and the level, before a folder is made; the same
    levels once each are measured, each request once."""
    out = tmp_path / "twice"
    server, url = serve(Script([(0.0, [1]), (0.0, [2])]))
    try:
        argv = ["bench", "--base-url", url, *RUN, "--out", str(out)]
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--concurrency", "2,2"])
        assert exit_.value.code == 2 and not out.exists()
        err = capsys.readouterr().err
        assert "--concurrency" in err and "level 2 is named twice" in err
        assert main([*argv, "--concurrency", "2"]) == 0
    finally:
        server.shutdown()
    rows, _ = read_request_rows(out / "requests.jsonl")
    repeated = Counter((r["label"], r["concurrency"], r["repeat"], r["index"]) for r in rows)
    assert rows and max(repeated.values()) == 1, repeated


def test_a_workload_that_cannot_be_built_is_refused_before_a_server_starts(tmp_path, capsys) -> None:
    marker = tmp_path / "started"
    script = tmp_path / "server.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    out = tmp_path / "ab"
    command = f"{sys.executable} {script} --port {{port}}"
    argv = ["ab", "--a-cmd", command, "--b-cmd", command, "--builtin", "no-such-set", "--out", str(out)]
    assert main(argv) == 2
    assert "unknown built-in prompt set 'no-such-set'" in capsys.readouterr().err
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("value", ["nan", "1.5", "-0.1"])
def test_the_tie_rate_allowed_is_a_fraction(value: str, capsys) -> None:
    argv = ["compare", "--baseline", "http://h:1", "--candidate", "http://h:2", "--max-tie-rate", value]
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    assert exited.value.code == 2
    assert "--max-tie-rate" in capsys.readouterr().err


def test_a_bad_argument_is_refused_naming_its_flag(capsys) -> None:
    """argparse's one error line names the flag and what it expected."""
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["bench", "--base-url", "http://h:1", "--client-processes", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--client-processes" in err and "auto or a whole number >= 1, got 0" in err
    args = parser().parse_args(["bench", "--base-url", "http://h:1", "--client-processes", "auto"])
    assert args.client_processes is None


def test_the_measured_requests_per_level_are_as_documented(tmp_path) -> None:
    """Synthetic prompts: 4 x the highest concurrency, at least 8; a dataset: its whole set,
    repeated until it reaches the highest concurrency; --num-prompts as given."""

    def count(*argv: str) -> int:
        return measured_count(parser().parse_args(["bench", "--base-url", "http://h:1", *argv]))

    assert count("--concurrency", "1,4,8") == 32 and count("--concurrency", "1") == 8
    assert count("--concurrency", "1,2") == 8 and count("--concurrency", "3") == 12
    dataset = tmp_path / "three.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    assert count("--dataset", str(dataset), "--concurrency", "1,4") == 6
    assert count("--dataset", str(dataset), "--concurrency", "2") == 3
    assert count("--concurrency", "16", "--num-prompts", "5") == 5

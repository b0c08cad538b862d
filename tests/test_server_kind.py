"""Which extensions a server accepts (harness/server_kind.py), and the client speaking plain
OpenAI to a strict server with token counts from the tokenizer (harness/client.py)."""

from __future__ import annotations

import asyncio

import pytest

from harness.client import Endpoint, payload
from harness.load import LoadSpec, measure, run_requests
from harness.server_kind import KNOWN, probe, resolve
from harness.tokens import TextTokenizer
from harness.workloads import Prompt, synthetic
from reference_engine.demo import DEMO_TARGET

from .openai_stub import serve

TEXT = "def main(argv=None):\n    return 0\n\n\nif __name__ == '__main__':\n    main()\n"


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO_TARGET)


@pytest.fixture()
def strict_server(tokenizer):
    ids = tokenizer.encode(TEXT)
    bodies: list[dict] = []
    server, url = serve(lambda prompt, n: [tokenizer.decode([t]) for t in ids[:n]], bodies)
    yield url, bodies, ids
    server.shutdown()


def test_an_unknown_server_is_spoken_to_in_plain_openai(strict_server) -> None:
    url, bodies, _ = strict_server
    found = probe(url)
    assert found.kind.name == "openai" and not found.kind.prompt_ids
    assert found.models == ("stub-model",)
    assert "owned_by ['local']" in found.kind.evidence and "refused" in found.kind.evidence
    body = payload(Endpoint(url, "m", server=found.kind), Prompt(text="hi"), 8)
    assert not {"ignore_eos", "return_token_ids"} & set(body)
    assert body["stream_options"] == {"include_usage": True}


def test_named_kinds_send_their_extensions() -> None:
    vllm = payload(Endpoint("http://x", server=resolve("vllm", "http://x").kind), Prompt(token_ids=(1, 2)), 8)
    assert vllm["ignore_eos"] and vllm["return_token_ids"] and vllm["prompt"] == [1, 2]
    assert vllm["stream_options"]["continuous_usage_stats"]
    lmdeploy = payload(Endpoint("http://x", server=KNOWN["lmdeploy"]), Prompt(text="a"), 8)
    assert lmdeploy["ignore_eos"] and "return_token_ids" not in lmdeploy
    with pytest.raises(ValueError, match="unknown server kind"):
        resolve("tgi", "http://x")


def test_a_refused_extension_downgrades_the_guess_to_plain_openai(tokenizer) -> None:
    """A server that calls itself vLLM in /v1/models but refuses vLLM's fields."""
    server, url = serve(lambda prompt, n: ["a"] * n, owned_by="vllm")
    try:
        found = probe(url)
    finally:
        server.shutdown()
    assert found.kind.name == "openai" and "vllm extensions got HTTP 422" in found.kind.evidence


def test_a_known_kind_whose_probe_answer_has_no_ids_is_compared_by_text() -> None:
    """A server that calls itself vLLM and takes its fields but returns no token ids (a vLLM
    before `return_token_ids`): the kind keeps the other extensions and stops promising ids,
    so a comparison reads its text (a declared kind that withholds them is an error:
    tests/test_harness_compare.py)."""
    server, url = serve(
        lambda prompt, n: ["a"] * n,
        owned_by="vllm",
        also_accepts=frozenset({"ignore_eos", "return_token_ids"}),
    )
    try:
        found = probe(url)
    finally:
        server.shutdown()
    assert found.kind.name == "vllm" and found.kind.ignore_eos and not found.kind.returns_ids
    assert "ids absent" in found.kind.evidence and "no ids promised" in found.kind.evidence
    assert "return_token_ids" not in payload(Endpoint(url, server=found.kind), Prompt(text="a"), 8)


def test_bench_against_a_strict_server_counts_tokens_with_the_tokenizer(
    strict_server, tokenizer, tmp_path
) -> None:
    url, bodies, ids = strict_server
    endpoint = Endpoint(url, "stub-model", server=probe(url).kind, tokenizer=tokenizer)
    spec = LoadSpec(concurrency=2, num_prompts=4, output_len=10, warmup=0, timeout_s=10.0)
    summary = measure(
        endpoint,
        synthetic(4, 6, 0, as_text=True),
        spec,
        tmp_path,
        {"label": "A", "concurrency": 2, "repeat": 0},
        url + "/metrics",
    )
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["count_source"] == "tokenizer"
    assert summary["streams_without_done"] == 4 and summary["server_kind"] == "openai"
    records, _ = asyncio.run(run_requests(endpoint, [Prompt(text="x")], spec))
    record = records[0]
    assert record.success and not record.done_marker
    assert record.output_tokens == 10 == record.usage_completion_tokens
    assert record.chunk_tokens == [1] * 10  # one token per chunk, as the server streamed
    # no tokenizer: one token per text chunk, said so
    records, _ = asyncio.run(run_requests(Endpoint(url, server=KNOWN["openai"]), [Prompt(text="x")], spec))
    assert records[0].success and records[0].count_source == "estimated"
    assert records[0].estimated_counts


def test_id_prompts_to_the_chat_endpoint_need_the_tokenizer(tokenizer) -> None:
    """The chat endpoint takes messages: a token-id prompt (synthetic, or a dataset's) is sent
    as its text with a tokenizer, never as an empty message (which would be measured)."""
    with pytest.raises(ValueError, match="the chat endpoint takes messages, not token ids"):
        payload(Endpoint("http://127.0.0.1:9", kind="chat"), Prompt(token_ids=(10, 11)), 4)
    body = payload(
        Endpoint("http://127.0.0.1:9", kind="chat", tokenizer=tokenizer), Prompt(token_ids=(10, 11)), 4
    )
    assert body["messages"] == [{"role": "user", "content": tokenizer.decode([10, 11])}]


def test_id_prompts_to_a_text_only_server_need_the_tokenizer(strict_server, tokenizer) -> None:
    url, bodies, _ = strict_server
    kind = probe(url).kind
    with pytest.raises(ValueError, match="takes no token-id prompts"):
        payload(Endpoint(url, server=kind), Prompt(token_ids=(10, 11)), 4)
    body = payload(Endpoint(url, server=kind, tokenizer=tokenizer), Prompt(token_ids=(10, 11)), 4)
    assert body["prompt"] == tokenizer.decode([10, 11])


def test_a_server_error_on_the_token_id_probe_is_no_refusal() -> None:
    """Only a 4xx says the server takes no token-id prompts; a 5xx says nothing of it (the
    server failed), so the ids are tried rather than the prompts left unsent."""
    from .completion_stub import Reply, Stub, completion

    def answer(path: str, body: dict):
        if isinstance(body.get("prompt"), list):
            return Reply(500, b'{"error": {"message": "the engine failed"}}')
        return completion([1], "a")

    with Stub(answer) as stub:
        found = probe(stub.url)
    assert found.kind.name == "openai" and found.kind.prompt_ids
    assert "token-id prompts accepted" in found.kind.evidence

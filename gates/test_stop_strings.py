"""Gate: stop strings on our server. The text never contains any part of a stop string;
text, token ids and finish_reason do not depend on how many tokens a chunk carries, so the
plain and the DFlash server return the same result for the same tokens, streamed or not.

Stop strings are cut out of each prompt's own greedy continuation (the demo pair, float32):
one token's text, two tokens, a span that crosses a DFlash chunk boundary, spans that end
or start at a boundary, a span that starts inside a token, a long span over two boundaries,
and a string that never occurs. The expected result is computed from the full continuation
alone: the text before the first occurrence, the ids up to the token that completes it. The
usage counts what was sent: the final count and each chunk's running count
(continuous_usage_stats) equal the ids the client got, the cut ones left out.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from reference_engine.demo import DEMO_DRAFT, DEMO_TARGET, demo_prompts
from reference_engine.tokenizer import load_tokenizer
from tests.poison import KILL, POISON

from .poisoned_serve import serving_here

CATCHES = ("stop_token_text_in_reply",)

MAX_TOKENS = 32
NUM_PROMPTS = 8
ABSENT = "\u00a7never\u00a7"


async def _request(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    stream: bool,
    stop: list[str] | None,
    extra: dict | None = None,
) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **(extra or {}),
    }
    if stop:
        body["stop"] = stop
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        _assert_usage(data["usage"], len(prompt), len(choice["token_ids"]), "the body")
        return {
            "text": choice["text"],
            "ids": choice["token_ids"],
            "finish": choice["finish_reason"],
            "chunks": [len(choice["token_ids"])],
        }
    # the usage a client is told, after each chunk (a running count) and at the end, must count
    # the ids it was sent: a cut at a stop string sends fewer than the engine made
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    text, ids, finish, chunks, final = "", [], None, [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not event["choices"]:
                final = event["usage"]
                continue
            choice = event["choices"][0]
            text += choice["text"]
            ids += choice["token_ids"]
            chunks.append(len(choice["token_ids"]))
            finish = choice["finish_reason"] or finish
            _assert_usage(event["usage"], len(prompt), len(ids), f"chunk {len(chunks)}'s running usage")
    assert final is not None, "no usage chunk with include_usage"
    _assert_usage(final, len(prompt), len(ids), "the final usage chunk")
    return {"text": text, "ids": ids, "finish": finish, "chunks": chunks}


def _assert_usage(usage: dict, prompt_tokens: int, sent: int, where: str) -> None:
    got = (usage["prompt_tokens"], usage["completion_tokens"])
    assert got == (prompt_tokens, sent), (
        f"{where}: usage (prompt, completion) {got}, the request sent {(prompt_tokens, sent)}"
    )


def _run_all(jobs: list[tuple]) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            semaphore = asyncio.Semaphore(8)

            async def one(job):
                async with semaphore:
                    return await _request(client, *job)

            return await asyncio.gather(*(one(j) for j in jobs))

    return asyncio.run(main())


def stop_cases(ids: list[int], chunks: list[int], decode) -> dict[str, str]:
    """Stop strings cut from one continuation, named by where they sit."""
    prefix = [decode(ids[:k]) for k in range(len(ids) + 1)]

    def span(a: int, b: int) -> str:
        return prefix[b][len(prefix[a]) :]

    bounds = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    inner = [b for b in bounds if 4 <= b <= len(ids) - 4]
    first = inner[0] if inner else len(ids) // 2
    later = inner[-1] if len(inner) > 1 else first
    cases = {
        "one_token": span(5, 6),
        "two_tokens": span(8, 10),
        "across_boundary": span(first - 1, first + 1),
        "ends_at_boundary": span(first - 2, first),
        "starts_at_boundary": span(first, first + 2),
        "long_over_boundaries": span(max(first - 2, 0), min(later + 2, len(ids))),
        "absent": ABSENT,
    }
    token = span(12, 13)
    if len(token) >= 2:  # last character of token 12 + the next token's first character
        cases["inside_a_token"] = token[-1] + span(13, 14)[:1]
    return {name: s for name, s in cases.items() if s}


def expected(ids: list[int], stops: list[str], decode) -> dict:
    """Token by token: the first token whose text completes a stop string ends the output;
    the text is cut where the earliest stop string found in it by then begins."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return {"text": text[: min(found)], "ids": ids[:k], "finish": "stop"}
    return {"text": decode(ids), "ids": ids, "finish": "length"}


@pytest.fixture(scope="module")
def continuations(demo_plain_server, demo_dflash_server):
    """Per prompt: the full greedy continuation and the DFlash server's chunk sizes."""
    prompts = [row["prompt_ids"] for row in demo_prompts()[:NUM_PROMPTS]]
    plain = _run_all([(demo_plain_server.url, p, False, None) for p in prompts])
    spec = _run_all([(demo_dflash_server.url, p, True, None) for p in prompts])
    for a, b in zip(plain, spec):
        assert a["ids"] == b["ids"], "plain and DFlash continuations differ"
    assert any(n > 1 for s in spec for n in s["chunks"]), "no DFlash chunk carried >1 token"
    return [(p, a["ids"], b["chunks"]) for p, a, b in zip(prompts, plain, spec)]


def test_stop_strings_cut_exactly_and_do_not_depend_on_chunking(
    continuations, demo_plain_server, demo_dflash_server
) -> None:
    decode = load_tokenizer(DEMO_TARGET).decode
    cases = []
    for prompt, ids, chunks in continuations:
        for name, stop in stop_cases(ids, chunks, decode).items():
            cases.append((prompt, name, stop, expected(ids, [stop], decode)))
    servers = {"plain": demo_plain_server.url, "dflash": demo_dflash_server.url}
    jobs = [
        (url, prompt, stream, [stop])
        for prompt, _, stop, _ in cases
        for url in servers.values()
        for stream in (False, True)
    ]
    results = iter(_run_all(jobs))
    failures, leaks, differ = [], 0, 0
    for _prompt, name, stop, want in cases:
        got = {
            f"{server}/{'stream' if stream else 'full'}": next(results)
            for server in servers
            for stream in (False, True)
        }
        bad = {
            k: (g["text"], g["ids"], g["finish"])
            for k, g in got.items()
            if (g["text"], g["ids"], g["finish"]) != (want["text"], want["ids"], want["finish"])
        }
        if any(
            want["finish"] == "stop" and g["text"] != want["text"] and g["text"].startswith(want["text"])
            for g in got.values()
        ):
            leaks += 1
        if got["plain/stream"]["text"] != got["dflash/stream"]["text"]:
            differ += 1
        if bad:
            failures.append(
                f"{name} stop={stop!r}: want {want['text'][-30:]!r} ({want['finish']}), got {bad}"
            )
    print(
        f"stop-string sweep: {len(cases)} cases, {len(failures)} wrong, {leaks} leak part of "
        f"the stop string, {differ} differ between plain and DFlash streams"
    )
    assert len(cases) >= 56
    assert not failures, (
        f"{len(failures)} of {len(cases)} cases wrong ({leaks} leak, {differ} "
        f"plain != DFlash):\n" + "\n".join(failures[:10])
    )


def test_several_stop_strings_the_first_to_complete_wins(
    continuations, demo_plain_server, demo_dflash_server
) -> None:
    decode = load_tokenizer(DEMO_TARGET).decode
    prompt, ids, _ = continuations[0]
    late, early = decode(ids[10:14]), decode(ids[6:8])
    stops = [late, early, ABSENT]
    want = expected(ids, stops, decode)
    assert want["finish"] == "stop" and len(want["ids"]) < 14
    for url in (demo_plain_server.url, demo_dflash_server.url):
        for got in _run_all([(url, prompt, s, stops) for s in (False, True)]):
            assert (got["text"], got["ids"], got["finish"]) == (want["text"], want["ids"], want["finish"]), (
                url,
                got,
            )


# ------------------------------------------------------------------ stop tokens
def assert_stop_tokens_end_the_text(urls: list[str], continuations) -> None:
    """A stop_token_ids entry inside the continuation ends the output there: its id is the last
    one sent and its text is not in the reply (as vLLM returns it), streamed and not."""
    decode = load_tokenizer(DEMO_TARGET).decode
    cases = []
    for prompt, ids, _ in continuations[:4]:
        if prompt[0] in (POISON, KILL):
            continue
        k = next(k for k in range(4, len(ids)) if ids[k] not in ids[:k] and decode([ids[k]]).strip())
        want = {"text": decode(ids[:k]), "ids": ids[: k + 1], "finish": "stop"}
        cases += [
            ((url, prompt, stream, None, {"stop_token_ids": [ids[k]]}), want)
            for url in urls
            for stream in (False, True)
        ]
    assert len(cases) >= 8
    failures = []
    for (job, want), got in zip(cases, _run_all([job for job, _ in cases])):
        if (got["text"], got["ids"], got["finish"]) != (want["text"], want["ids"], want["finish"]):
            failures.append(
                f"stop token {job[4]} (stream {job[2]}): want {want['text'][-20:]!r}, "
                f"got {got['text'][-30:]!r}"
            )
    assert not failures, "a stop token's reply is wrong:\n" + "\n".join(failures[:6])


def test_a_stop_token_ends_the_output_without_its_text(
    continuations, demo_plain_server, demo_dflash_server
) -> None:
    assert_stop_tokens_end_the_text([demo_plain_server.url, demo_dflash_server.url], continuations)


def test_the_gate_catches_a_stop_tokens_text_in_the_reply(continuations) -> None:
    serve = ("--model", str(DEMO_TARGET), "--dflash-draft-model-path", str(DEMO_DRAFT), "--block-size", "8")
    with (
        serving_here("stop_token_text_in_reply", (*serve, "--dtype", "float32", "--threads", "1")) as url,
        pytest.raises(AssertionError, match="a stop token's reply is wrong"),
    ):
        assert_stop_tokens_end_the_text([url], continuations)

"""The server's request and stream path, where the existing tests leave room:
- the chat template (serving/chat_template.py) renders with what transformers'
  `apply_chat_template` gives a template: the tokenizer's special tokens (`bos_token`,
  `eos_token`, ...) and `tools` (None when the request has none) beside the messages;
- chat logprobs (serving/protocol.py, replies.py): each token's `bytes` are its own UTF-8
  bytes, so a character split over byte tokens is whole again when a client joins them
  (OpenAI's reason for the field);
- a request's end as /metrics counts it (serving/generation.py): one the engine ended
  ("length", "stop") is a success under that finish_reason, whichever reply read it, not an
  abort;
- a connection (serving/connections.py) owes each request's headers within the header
  timeout of its previous response too, not only of its opening: a keep-alive connection
  that sends no next request is closed at that deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, processors

from reference_engine.errors import CheckpointError
from reference_engine.runtime.request import SamplingParams
from reference_engine.serving.args import ServeArgs
from reference_engine.serving.chat_template import (
    compile_chat_template,
    render_chat_template,
    template_special_tokens,
)
from reference_engine.serving.connections import connection_policy_protocol
from reference_engine.serving.service import Server
from reference_engine.tokenizer import TokenBytes, load_tokenizer

from .server_process import free_port, uvicorn_in_thread
from .test_serve_app import answered, metrics_page, parsed_request
from .test_serve_metrics import value


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


# ----------------------------------------------------------------------------- the chat template
def test_a_chat_template_sees_the_tokenizers_special_tokens_as_transformers_gives_them(
    model_dir: Path, copy_checkpoint
) -> None:
    """transformers renders a chat template with the tokenizer's special tokens as variables
    (tokenizer_config.json's `eos_token` here); the server's prompt is transformers' text."""
    transformers = pytest.importorskip("transformers")
    model = copy_checkpoint(model_dir)
    template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (model / "chat_template.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = transformers.AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    eos = json.loads((model / "tokenizer_config.json").read_text())["eos_token"]
    assert expected == f"hi{eos}yo{eos}"
    server = Server(ServeArgs.parse(["--model", str(model), "--device", "cpu"]))
    assert server.apply_chat_template(messages) == expected


def test_a_chat_template_sees_tools_as_none_when_the_request_has_none() -> None:
    """transformers passes `tools` (None without tools) to the template: a tool block guarded
    by `tools is not none` is left out, and the prompt is the messages' text."""
    template = (
        "{% if tools is not none %}[TOOLS]{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat_template(compile_chat_template(template), messages) == "hi"


def test_a_chat_prompt_holds_the_bos_its_template_writes_once_as_transformers_tokenises_it(
    model_dir: Path, copy_checkpoint
) -> None:
    """A tokenizer whose post-processor adds a BOS (Llama 3's, Mistral's) and a template that
    writes `{{ bos_token }}`: the chat prompt's ids are transformers' apply_chat_template's
    (one BOS: the rendered text is tokenised without the post-processor's); a completion's
    prompt still gets the post-processor's BOS."""
    transformers = pytest.importorskip("transformers")
    model = copy_checkpoint(model_dir)
    bos = "<|im_start|>"  # a special token of the tiny vocabulary, standing for a BOS
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(str(model / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    (model / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    expected = list(
        hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    )
    assert expected.count(tok.token_to_id(bos)) == 1
    server = Server(ServeArgs.parse(["--model", str(model), "--device", "cpu"]))
    body = {"messages": messages, "max_tokens": 1}
    assert list(server.parse(json.dumps(body).encode(), chat=True).prompt_ids) == expected
    completion = server.parse(b'{"prompt": "hi", "max_tokens": 1}', chat=False).prompt_ids
    assert list(completion) == hf("hi")["input_ids"] and completion[0] == tok.token_to_id(bos)


def test_the_templates_special_tokens_are_read_as_transformers_reads_them() -> None:
    """tokenizer_config.json's named special tokens, strings or added tokens' objects, and a
    legacy special_tokens_map.json's for the names the config lacks; null is no token."""
    config = {"eos_token": {"content": "</s>", "special": True}, "pad_token": None, "unk_token": "<unk>"}
    legacy = {"bos_token": "<s>", "eos_token": "<other>", "mask_token": {"content": "<mask>"}}
    assert template_special_tokens(config, legacy) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    with pytest.raises(CheckpointError, match="eos_token"):
        template_special_tokens({"eos_token": 3})


# ----------------------------------------------------------------------------- logprobs
@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return load_tokenizer(model_dir)


def chat_content(reply, stream: bool) -> list[dict]:
    if stream:
        chunks = [e["choices"][0] for e in reply[:-1] if e.get("choices")]
        return [entry for c in chunks if c["logprobs"] for entry in c["logprobs"]["content"]]
    return reply["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_of_a_character_split_over_tokens_join_into_it(tokenizer, stream: bool) -> None:
    """OpenAI's chat logprobs give each token's UTF-8 `bytes` for characters that span
    several tokens: joined in order, the tokens' bytes are the text's. 'é' is two byte tokens
    of the tiny byte-level tokenizer, 0xC3 and 0xA9."""
    ids = tokenizer.encode("é").ids
    assert len(ids) == 2 and tokenizer.decode(ids) == "é"
    parsed = parsed_request(chat=True, stream=stream, logprobs=0, params=SamplingParams(max_tokens=2))
    turns = [[(ids, "length", 1.0, [{t: -0.5} for t in ids])]]
    reply, _, _ = asyncio.run(
        answered(parsed, turns, detokenize=tokenizer.decode, token_bytes=TokenBytes(tokenizer))
    )
    content = chat_content(reply, stream)
    assert [entry["token_id"] for entry in content] == ids
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode() == "é"


def test_token_bytes_join_into_the_text_for_byte_level_and_byte_fallback_vocabularies(
    model_dir: Path,
) -> None:
    """A byte-level BPE's tokens (the server's own, as it serves them): joined, their bytes
    are the text's UTF-8 whatever characters the tokens split; a byte-fallback token
    (`<0xC3>`) is its byte; an added token is its text."""
    server = Server(ServeArgs.parse(["--model", str(model_dir), "--device", "cpu"]))
    text = "é naïve 😀 ok"
    ids = server.tokenizer.encode(text).ids
    assert len(ids) > len(text.split())  # characters split over tokens
    assert b"".join(server.token_bytes(i) for i in ids) == text.encode()
    vocab = {"<0xC3>": 0, "<0xA9>": 1, "a": 2, "\u2581caf": 3}
    fallback = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    # as Llama 2's and Mistral's: the word-boundary mark is a space, bytes are <0xNN>
    fallback.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fallback.add_special_tokens(["<0x41>"])  # added: its text, not a byte
    spelled = TokenBytes(fallback)
    assert [spelled(i) for i in range(4)] == [b"\xc3", b"\xa9", b"a", b" caf"]
    assert b"".join(spelled(i) for i in (3, 0, 1)).decode() == " café"
    assert spelled(fallback.token_to_id("<0x41>")) == b""  # a special token decodes to nothing


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_that_ends_a_request_adds_its_id_and_no_text(stream: bool) -> None:
    """A request the engine ends at a stop token (EOS, or a `stop_token_ids` entry that is an
    ordinary token) gets that token's id and not its text, as vLLM returns it; one that ends
    at its length keeps its last token's text."""
    for reason, text in (("stop", "Hello"), ("length", "Hello wo")):
        parsed = parsed_request(stream=stream, params=SamplingParams(max_tokens=3))
        reply, _, _ = asyncio.run(answered(parsed, [[([0, 1], None, 1.0)], [([2], reason, 2.0)]]))
        if stream:
            choices = [e["choices"][0] for e in reply[:-1] if e.get("choices")]
            got = ("".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]])
        else:
            got = (reply["choices"][0]["text"], reply["choices"][0]["token_ids"])
        assert got == (text, [0, 1, 2]), reason


# ----------------------------------------------------------------------------- the end, as counted
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reason", ["length", "stop"])
def test_a_request_the_engine_ended_is_a_success_under_its_finish_reason(reason: str, stream: bool) -> None:
    """/metrics' `dflash:request_success_total{finish_reason}` counts a request the engine
    ended (max_tokens reached, a stop token) under the finish_reason its client got, once;
    nothing under "abort" and no failure."""
    parsed = parsed_request(stream=stream, params=SamplingParams(max_tokens=3))
    reply, _, server = asyncio.run(answered(parsed, [[([0, 1], None, 1.0)], [([2], reason, 2.0)]]))
    if stream:
        assert [e["choices"][0]["finish_reason"] for e in reply[:-1]][-1] == reason
    else:
        assert reply["choices"][0]["finish_reason"] == reason
    page = metrics_page(server)
    assert value(page, "dflash:request_success_total", finish_reason=reason) == 1
    assert value(page, "dflash:request_success_total", finish_reason="abort") == 0
    assert value(page, "dflash:request_failure_total") == 0


# ----------------------------------------------------------------------------- a connection's deadlines
HEADER_TIMEOUT_S = 0.5


async def hello(scope, receive, send) -> None:
    """A route that answers every request with a small JSON body."""
    if scope["type"] != "http":
        return
    body = b'{"ok": true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def policy_server():
    """uvicorn on loopback with the server's connection policy (a short header timeout, a
    keep-alive timeout far longer, so only the header deadline can close a connection)."""
    policy = connection_policy_protocol(HEADER_TIMEOUT_S, 30.0, 16)
    with uvicorn_in_thread(hello, free_port(), policy) as port:
        yield port


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (the bytes read before are dropped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_keep_alive_connection_owes_its_next_requests_headers_within_the_header_timeout(
    policy_server,
) -> None:
    """A connection must deliver a request's headers within the header timeout of its
    previous response, as of its opening: after one complete request and its response, a
    connection that sends no next request is closed at that deadline, not held until the
    (far longer) keep-alive timeout."""
    with socket.create_connection(("127.0.0.1", policy_server), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b'{"ok": true}'):
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert closed_within(sock, 20 * HEADER_TIMEOUT_S)
        assert time.monotonic() - start < 20 * HEADER_TIMEOUT_S

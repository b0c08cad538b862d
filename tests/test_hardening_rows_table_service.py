"""The commit's row copies, the served engine and the server's own state, where the existing
tests leave room:
- the row copies (reference_engine/kernels/rows.py): a row longer than one column block is
  copied whole, and tensors the kernels would misread (rows of another shape, a strided
  source, a strided conv state or recorded input) are refused before any launch, the
  destination untouched;
- the served engine (serving/engine_build.py): an explicit --engine-loop is kept as given
  and a process loop at two ranks is refused, --threads sets torch's threads, the numerics
  asked for reach the tensor-parallel group, a block size is taken beside a draft, the
  HTTP side's EngineInfo carries each value in its own field, and a forced acceptance makes
  forced proposers over the target's vocabulary;
- the server (serving/service.py): the quick prompt-length bound counts UTF-8 bytes against
  the vocabulary's longest token in bytes and refuses exactly from the context's length on,
  the default-temperature note is said once and only for a request without temperature,
  the chat template is the checkpoint's string or ChatML, and the options reach the name,
  body limit (MiB), shutdown grace, counter namings and request ids;
- serve's command line (serving/args.py): the values each option refuses, with its message.
Kernels run under Triton's interpreter without CUDA (tests/test_kernels.py says how)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastapi.testclient import TestClient  # noqa: E402

from reference_engine.errors import ReferenceEngineError  # noqa: E402
from reference_engine.kernels import reference as ref  # noqa: E402
from reference_engine.runtime.request import SamplingParams  # noqa: E402
from reference_engine.serving import engine_build  # noqa: E402
from reference_engine.serving.app import create_app  # noqa: E402
from reference_engine.serving.args import ServeArgs  # noqa: E402
from reference_engine.serving.engine_build import EngineInfo, build_engine, engine_loop_mode  # noqa: E402
from reference_engine.serving.protocol import ProtocolError  # noqa: E402
from reference_engine.serving.service import Server  # noqa: E402
from reference_engine.tokenizer import CHAT_TEMPLATE  # noqa: E402
from tests.kernel_inputs import DEVICE, rand  # noqa: E402
from tests.test_kernels_runtime_contracts import kernel_test  # noqa: E402


@pytest.fixture
def rows():
    """reference_engine.kernels.rows, skipped where triton is not installed."""
    pytest.importorskip("triton")
    from reference_engine.kernels import rows

    return rows


# ----------------------------------------------------------------------------- row copies
@kernel_test
def test_copy_rows_copies_a_row_longer_than_one_column_block_whole(rows) -> None:
    """A Gated DeltaNet state row is heads * dk * dv elements, many column blocks: every block
    of each kept row is copied, the last one ragged."""
    row_len = 2 * rows.BLOCK + 3
    states = rand(5, row_len)
    slots, kept = torch.tensor([3, 0], device=DEVICE), torch.tensor([4, 2], device=DEVICE)
    got = rand(4, row_len, seed=1)
    want = got.clone()
    rows.copy_rows(got, slots, states, kept)
    ref.copy_rows(want, slots, states, kept)
    assert torch.equal(got, want)
    assert torch.equal(got[3], states[4]) and torch.equal(got[0], states[2])


@kernel_test
def test_copy_rows_refuses_rows_of_another_shape_or_a_strided_source(rows) -> None:
    """The kernel reads `row_len` contiguous elements per row: a source whose rows differ
    from the destination's, or are not contiguous, is refused and nothing is written."""
    slots, kept = torch.tensor([1], device=DEVICE), torch.tensor([0], device=DEVICE)
    dst = rand(3, 4, 6)
    before = dst.clone()
    for src in (rand(3, 4, 5, seed=1), rand(3, 6, 4, seed=1).transpose(1, 2)):
        with pytest.raises(ValueError, match="copy_rows: contiguous tensors with the same row shape"):
            rows.copy_rows(dst, slots, src, kept)
        assert torch.equal(dst, before)
    with pytest.raises(ValueError, match="copy_rows"):
        rows.copy_rows(rand(3, 6, 4).transpose(1, 2), slots, rand(3, 4, 6, seed=1), kept)


@kernel_test
def test_conv_state_at_refuses_a_strided_conv_state_or_recorded_input(rows) -> None:
    slots, processed = torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE)
    recorded = rand(2, 5, 3 + 4, seed=1)
    conv = rand(2, 5, 3)
    before = conv.clone()
    message = "conv_state_at: a contiguous conv state, recorded inputs contiguous per channel"
    with pytest.raises(ValueError, match=message):
        channels_last = recorded.transpose(1, 2).contiguous().transpose(1, 2)  # the same values
        rows.conv_state_at(conv, slots, channels_last, processed)
    assert torch.equal(conv, before)
    with pytest.raises(ValueError, match=message):
        rows.conv_state_at(rand(2, 3, 5).transpose(1, 2), slots, recorded, processed)


# ----------------------------------------------------------------------------- the served engine
def serve(*argv: str) -> ServeArgs:
    return ServeArgs.parse(["--model", "m", *argv])


def test_an_explicit_engine_loop_is_the_one_given_and_a_process_refused_at_two_ranks(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert engine_loop_mode(serve("--device", "cpu", "--engine-loop", "process")) == "process"
    assert engine_loop_mode(serve("--device", "cuda", "--engine-loop", "thread")) == "thread"
    assert engine_loop_mode(serve("--device", "cuda", "--engine-loop", "auto")) == "process"
    assert engine_loop_mode(serve()) == "process"  # --device auto: the GPU there is
    with pytest.raises(
        ReferenceEngineError, match="--engine-loop process runs one rank; with --tensor-parallel-size 2"
    ):
        engine_loop_mode(serve("--device", "cuda", "--engine-loop", "process", "--tensor-parallel-size", "2"))
    with pytest.raises(ReferenceEngineError, match="size 2 use --engine-loop thread"):
        engine_loop_mode(serve("--device", "cpu", "--engine-loop", "process", "--tensor-parallel-size", "2"))


def test_threads_set_torchs_threads_and_the_info_carries_each_value_in_its_field(served_pair) -> None:
    target, _ = served_pair
    before = torch.get_num_threads()
    try:
        engine, _, _ = build_engine(
            serve("--model", target, "--device", "cpu", "--threads", "2", "--max-model-len", "48")
        )
        assert torch.get_num_threads() == 2
        info = EngineInfo.of(engine)
    finally:
        torch.set_num_threads(before)
    assert (info.threads, info.context_len, info.vocab_size) == (2, 48, 512)
    assert (info.device, info.dtype, info.max_num_seqs) == ("cpu", "float32", engine.config.max_num_seqs)
    engine, _, _ = build_engine(serve("--model", target, "--device", "cpu", "--dtype", "float64"))
    assert EngineInfo.of(engine).dtype == "float64"


def test_the_numerics_asked_for_reach_the_tensor_parallel_group(served_pair, monkeypatch) -> None:
    """Above one rank the followers build their kernels from the numerics rank 0 passes:
    the option's, else the device's default."""
    target, _ = served_pair
    joined = []

    def init(size, device, numerics, command):
        joined.append((size, device.type, numerics, command))

    monkeypatch.setattr(engine_build, "init_tensor_parallel", init)
    build_engine(serve("--model", target, "--device", "cpu", "--numerics", "exact"))
    build_engine(serve("--model", target, "--device", "cpu"))
    assert joined == [(1, "cpu", "exact", "serve"), (1, "cpu", "fast", "serve")]


def test_a_block_size_is_taken_beside_a_draft(served_pair) -> None:
    target, draft = served_pair  # the draft's own block size is 4
    argv = ["--model", target, "--dflash-draft-model-path", draft, "--device", "cpu", "--block-size", "3"]
    engine, _, _ = build_engine(serve(*argv))
    assert EngineInfo.of(engine).block_size == 3 and EngineInfo.of(engine).speculative


def test_a_forced_acceptance_makes_forced_proposers_over_the_targets_vocabulary(served_pair) -> None:
    target, draft = served_pair
    argv = ["--model", target, "--dflash-draft-model-path", draft, "--device", "cpu"]
    engine, _, make_oracle = build_engine(serve(*argv, "--oracle-acceptance", "2.5"))
    oracle = make_oracle(SamplingParams(max_tokens=2))
    assert oracle.forced and oracle.vocab_size == engine.target.config.vocab_size == 512
    assert sum(oracle.schedule) / len(oracle.schedule) == 1.5  # accepted drafts: mean - 1


# ----------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


def server_for(model: str, *argv: str) -> Server:
    return Server(ServeArgs.parse(["--model", model, "--device", "cpu", *argv]))


def test_the_quick_prompt_bound_refuses_from_the_contexts_length_on_counting_bytes(model_dir) -> None:
    """No token is longer than the vocabulary's longest (in UTF-8 bytes), so a text of
    context_len * longest bytes has at least context_len tokens: refused untokenised; one
    byte less passes the bound. Characters of two bytes count twice."""
    server = server_for(model_dir, "--max-model-len", "16")
    longest, context = server.max_token_bytes, server.info.context_len
    assert context == 16 and longest == max(len(t.encode()) for t in server.tokenizer.get_vocab())
    with pytest.raises(ProtocolError, match=f"at least {context} tokens but the context holds {context}"):
        server.tokenize("a" * (context * longest))
    assert server.tokenize("a" * (context * longest - 1))
    wide = "é" * (context * longest // 2) + "a" * (context * longest % 2)
    assert len(wide.encode()) == context * longest
    with pytest.raises(ProtocolError, match=f"at least {context} tokens"):
        server.tokenize(wide)


def test_a_prompt_of_wide_tokens_that_fits_the_context_is_not_refused(model_dir, copy_checkpoint) -> None:
    """The bound divides bytes by the longest token in bytes, not in characters: a token of
    20 two-byte characters is 40 bytes of text for one token."""
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer

    model = copy_checkpoint(Path(model_dir))
    word = "é" * 20
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(word, special=False, normalized=False)])
    tokenizer.save(str(model / "tokenizer.json"))
    server = server_for(str(model), "--max-model-len", "16")
    assert server.max_token_bytes == 40
    assert len(server.tokenize(word * 10)) == 10  # 10 tokens of a 16-token context


def test_an_added_token_that_is_not_special_keeps_its_text_in_the_reply(model_dir, copy_checkpoint) -> None:
    """Only special tokens are skipped when the server detokenises: an added token that is
    not special (a tool-call marker, say) is text the client gets."""
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer

    from reference_engine.serving.stop_strings import StopStringText

    model = copy_checkpoint(Path(model_dir))
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    tokenizer.save(str(model / "tokenizer.json"))
    server = server_for(str(model))
    marker = server.tokenizer.token_to_id("<tool>")
    special = {i for i, t in server.tokenizer.get_added_tokens_decoder().items() if t.special}
    assert marker is not None and marker not in special and server.skipped_ids == special
    words = server.tokenize("Hello")
    text = StopStringText(server.detokenize, (), server.skipped_ids)
    pieces = [text.push([marker, *words, min(special)], final=False), text.push([], final=True)]
    assert "".join(piece for piece, _ in pieces) == "<tool>Hello"


def completion(**fields) -> bytes:
    return json.dumps({"prompt": [1, 2], "max_tokens": 1, **fields}).encode()


def test_the_default_temperature_note_is_said_once_and_only_without_a_temperature(model_dir, caplog) -> None:
    server = server_for(model_dir)
    with caplog.at_level(logging.WARNING, logger="reference_engine.serving.service"):
        server.parse(completion(temperature=0), chat=False)
        server.parse(completion(temperature=0.0), chat=False)
        assert not [r for r in caplog.records if "temperature" in r.getMessage()]
        server.parse(completion(), chat=False)
        server.parse(completion(), chat=False)
        server.parse(completion(temperature=None), chat=False)
    notes = [r for r in caplog.records if "without 'temperature'" in r.getMessage()]
    assert len(notes) == 1


@pytest.mark.parametrize(
    ("template", "jinja", "rendered"),
    [
        ("<<{{ messages[0]['content'] }}>>", None, "<<hi>>"),
        (
            [
                {"name": "tool_use", "template": "[[{{ messages[0]['content'] }}]]"},
                {"name": "default", "template": "<<{{ messages[0]['content'] }}>>"},
            ],
            None,
            "<<hi>>",
        ),
        ([{"name": "tool_use", "template": "[[{{ messages[0]['content'] }}]]"}], None, None),
        ("<<{{ messages[0]['content'] }}>>", "{{ messages[0]['content'] }}!", "hi!"),
        (None, "{{ messages[0]['content'] }}!", "hi!"),
        (None, None, None),
    ],
    ids=["string", "named-list", "list-without-default", "jinja-file-first", "jinja-file", "none"],
)
def test_the_chat_template_is_the_checkpoints_string_or_chatml(
    model_dir, copy_checkpoint, template, jinja, rendered
) -> None:
    """The chat template is found as transformers finds it: chat_template.jinja when the
    checkpoint has one (before tokenizer_config.json's), else tokenizer_config.json's
    chat_template, a string or the list's template named "default"; without any, ChatML."""
    from pathlib import Path

    from reference_engine.serving.chat_template import compile_chat_template, render_chat_template

    model = copy_checkpoint(Path(model_dir))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (model / "chat_template.jinja").write_text(jinja)
    messages = [{"role": "user", "content": "hi"}]
    if rendered is None:
        rendered = render_chat_template(compile_chat_template(CHAT_TEMPLATE), messages)
    assert server_for(str(model)).apply_chat_template(messages) == rendered


@pytest.mark.parametrize(
    ("name", "content"),
    [("chat_template.jinja", b"{{ '\xff' }}\xff"), ("tokenizer_config.json", b"{not json")],
    ids=["jinja-not-utf8", "config-not-json"],
)
def test_a_chat_template_file_that_cannot_be_read_stops_start_up_naming_it(
    model_dir, copy_checkpoint, name, content
) -> None:
    """A chat template file that is not UTF-8, or a tokenizer config that is not JSON, is a
    CheckpointError naming the file (serve's one error line), not a decoder's traceback."""
    from pathlib import Path

    from reference_engine.errors import CheckpointError
    from reference_engine.serving.service import _chat_template

    model = copy_checkpoint(Path(model_dir))
    (model / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"chat template in .*{name}"):
        _chat_template(model)


def test_the_servers_options_reach_its_name_grace_counters_and_request_ids(model_dir) -> None:
    from pathlib import Path

    server = server_for(model_dir)
    assert server.name == Path(model_dir).name and server.lifecycle.grace_s == 5.0
    assert [server.new_request_id(chat) for chat in (False, True, False)][0].endswith("-1")
    ids = [server.new_request_id(False) for _ in range(2)]
    assert [i.rsplit("-", 1)[1] for i in ids] == ["4", "5"]
    named = server_for(
        model_dir, "--served-model-name", "tiny", "--shutdown-grace", "7.5", "--metrics-names", "dflash,vllm"
    )
    assert named.name == "tiny" and named.lifecycle.grace_s == 7.5
    first = named.new_request_id(True)
    assert first.startswith("chatcmpl-") and first.endswith("-1")
    page = named.metrics.render(named.lifecycle.totals(), False)[0].decode()
    assert "vllm:spec_decode_num_drafts" in page and "dflash:spec_decode_num_drafts" in page
    page = server.metrics.render(server.lifecycle.totals(), False)[0].decode()
    assert "vllm:spec_decode_num_drafts" not in page


def test_the_body_limit_is_in_mebibytes(model_dir) -> None:
    """--max-body-mb 1 takes a body of 1,040,000 bytes (over a million, under 2**20) to the
    parser (here a 400 for n=2) and refuses one byte over 2**20 with 413."""
    client = TestClient(create_app(server_for(model_dir, "--max-body-mb", "1")))
    head = completion(n=2)
    headers = {"Content-Type": "application/json"}
    under = client.post("/v1/completions", content=head + b" " * (1_040_000 - len(head)), headers=headers)
    assert under.status_code == 400 and "only n=1" in under.text
    over = client.post("/v1/completions", content=head + b" " * (2**20 + 1 - len(head)), headers=headers)
    assert over.status_code == 413 and "at most 1048576" in over.text


# ----------------------------------------------------------------------------- serve's options
def refused(capsys, *argv: str) -> str:
    """The one error line argparse prints for serve's `argv`, which must exit with status 2."""
    with pytest.raises(SystemExit) as stop:
        serve(*argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_threads_take_one_and_refuse_zero_or_a_fraction(capsys) -> None:
    assert serve("--threads", "1").threads == 1 and serve().threads is None
    assert "--threads: threads must be >= 1, got 0" in refused(capsys, "--threads", "0")
    assert "--threads: not a thread count: '1.5'" in refused(capsys, "--threads", "1.5")


def test_port_zero_is_refused(capsys) -> None:
    """Port 0 would listen on a port the kernel picks, which no client knows."""
    assert "port must be in 1-65535, got 0" in refused(capsys, "--port", "0")


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout", "--max-body-mb", "--shutdown-grace"])
def test_seconds_and_sizes_refuse_infinity_and_words_by_name(capsys, flag: str) -> None:
    for value in ("inf", "-inf", "soon"):
        assert f"argument {flag}: not a finite number: '{value}'" in refused(capsys, f"{flag}={value}")


def test_max_connections_names_a_word_it_cannot_read(capsys) -> None:
    assert "--max-connections: not an integer: 'many'" in refused(capsys, "--max-connections", "many")


@pytest.mark.parametrize("loop", ["auto", "process", "thread"])
def test_every_engine_loop_the_help_names_is_taken(loop: str) -> None:
    assert serve("--engine-loop", loop).engine_loop == loop

"""Small contracts of request parsing and checkpoint config parsing, checked on the functions
directly: the OpenAI fields `serving.protocol` refuses (JSON booleans where a number is
expected, values just outside a range, empty stop strings) and takes (both ends of every
range, the "not used" values of unimplemented parameters, null as "left out"), the bodies it
builds (usage, ids, spec_decode, prompt_token_ids), how a checkpoint's chat template renders,
the tiny byte-level tokenizer, and what `config.fields`, `config.target` and `config.draft`
read, default and refuse."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from reference_engine.config import (
    DFLASH,
    DFLASH2,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    DraftConfig,
    Llama3RopeScaling,
    TargetConfig,
)
from reference_engine.errors import CheckpointError, ConfigError
from reference_engine.serving.chat_template import compile_chat_template, render_chat_template
from reference_engine.serving.protocol import (
    ProtocolError,
    full_response,
    new_id,
    parse_request,
    usage,
)
from reference_engine.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_byte_level_bpe,
)

F, L, S = FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
VOCAB = 256


def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
    return [ord(c) % 200 for c in text]


def parsed(chat: bool = False, **body: Any):
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hello")
    return parse_request(
        body, "m", tokenize, chat, apply_chat_template=lambda m: m[-1]["content"], vocab_size=VOCAB
    )


def refused(param: str, chat: bool = False, **body: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as raised:
        parsed(chat=chat, **body)
    assert raised.value.param == param and raised.value.status == 400, (param, body, raised.value)
    return raised.value


# ------------------------------------------------------------------ protocol.py: parsing
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
def test_a_json_boolean_is_not_a_number(field: str) -> None:
    """Every float field refuses true and false (Python counts them as 1 and 0) with a 400
    naming the field, as it refuses a string."""
    for value in (True, False):
        assert "must be a number" in str(refused(field, **{field: value}))


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "n", "logprobs"])
def test_a_json_boolean_is_not_an_integer(field: str) -> None:
    """Every integer field refuses true and false with a 400 naming the field."""
    assert "must be an integer" in str(refused(field, **{field: True}))


def test_chat_top_logprobs_refuses_a_json_boolean() -> None:
    """Chat top_logprobs is an integer: true is a 400 naming it."""
    assert "must be an integer" in str(refused("top_logprobs", chat=True, logprobs=True, top_logprobs=True))


def test_token_id_lists_refuse_json_booleans() -> None:
    """A prompt of token ids and stop_token_ids are lists of integers: a boolean among them is
    refused (400 on the field), not read as token 1 or 0."""
    refused("prompt", prompt=[5, True, 7])
    refused("stop_token_ids", stop_token_ids=[3, False])
    assert parsed(prompt=[5, 1, 7]).prompt_ids == [5, 1, 7]
    assert parsed(stop_token_ids=[3, 0]).params.stop_token_ids == (3, 0)


def test_the_ends_of_every_documented_range_are_accepted_and_a_step_past_them_refused() -> None:
    """Ranges are closed: temperature [0, 2], presence and frequency penalty [-2, 2], logit
    bias values [-100, 100], logit bias token ids [0, vocab), completions logprobs and chat
    top_logprobs [0, 20]; a value just outside is a 400 naming its own field."""
    assert parsed(temperature=2.0).params.temperature == 2.0
    assert parsed(temperature=0.0).params.greedy
    refused("temperature", temperature=2.0001)
    refused("temperature", temperature=-0.0001)
    for name in ("presence_penalty", "frequency_penalty"):
        assert getattr(parsed(**{name: -2.0}).params, name) == -2.0
        assert getattr(parsed(**{name: 2.0}).params, name) == 2.0
        refused(name, **{name: -2.01})
        refused(name, **{name: 2.01})
    bias = parsed(logit_bias={"7": -100, "9": 100, str(VOCAB - 1): 1.5}).params.logit_bias
    assert bias == ((7, -100.0), (9, 100.0), (VOCAB - 1, 1.5))
    refused("logit_bias", logit_bias={"7": -100.5})
    refused("logit_bias", logit_bias={str(VOCAB): 1})
    assert parsed(logprobs=20).logprobs == 20 and parsed(logprobs=0).logprobs == 0
    refused("logprobs", logprobs=21)
    assert parsed(chat=True, logprobs=True, top_logprobs=20).logprobs == 20


def test_logit_bias_keys_are_ascii_digits_only() -> None:
    """A logit_bias key is a token id in ASCII decimal digits: digits of other scripts, which
    Python's int() reads as numbers, are refused."""
    for key in ("\u0663", "\uff15", "\u00b2"):
        refused("logit_bias", logit_bias={key: 1})
    assert parsed(logit_bias={"0042": 1}).params.logit_bias == ((42, 1.0),)


def test_a_seed_outside_int64_is_refused_on_the_seed_field() -> None:
    """seed: both ends of the int64 range are taken; one past either is a 400 whose param is
    `seed`."""
    assert parsed(seed=2**63 - 1).params.seed == 2**63 - 1
    assert parsed(seed=-(2**63)).params.seed == -(2**63)
    for seed in (2**63, -(2**63) - 1):
        refused("seed", seed=seed)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("echo", False),
        ("best_of", 1),
        ("suffix", ""),
        ("response_format", {"type": "text"}),
        ("tools", []),
        ("tool_choice", "none"),
        ("tool_choice", "auto"),
        ("functions", []),
        ("function_call", "none"),
        ("modalities", ["text"]),
        ("store", False),
        ("service_tier", "auto"),
        ("service_tier", "default"),
        ("audio", None),
        ("reasoning_effort", None),
    ],
)
def test_the_not_used_value_of_an_unimplemented_parameter_is_accepted(name: str, value: Any) -> None:
    """Each value docs/engine.md lists as "not used" (and null for every parameter) is
    accepted on both endpoints."""
    for chat in (False, True):
        assert parsed(chat=chat, **{name: value}).prompt_ids


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("echo", True),
        ("echo", 0),
        ("best_of", True),
        ("best_of", 2),
        ("store", 0),
        ("tool_choice", "required"),
        ("suffix", " end"),
    ],
)
def test_an_unimplemented_parameter_with_a_value_that_means_something_is_refused(
    name: str, value: Any
) -> None:
    """A value other than the "not used" ones is a 400 naming the parameter, and so is one
    that only compares equal to it (0 for false, true for 1)."""
    assert "not supported" in str(refused(name, **{name: value}))


@pytest.mark.parametrize("field", ["stream", "ignore_eos", "logprobs"])
def test_null_leaves_a_boolean_at_its_default(field: str) -> None:
    """A boolean sent as null is left out: the request is the one without it."""
    chat = field == "logprobs"
    with_null = parsed(chat=chat, **{field: None})
    assert with_null == parsed(chat=chat)


def test_null_for_a_number_or_integer_leaves_it_at_its_default() -> None:
    """temperature, top_p, max_tokens and the other optional fields sent as null are the
    request without them."""
    nulls = dict(temperature=None, top_p=None, max_tokens=None, top_k=None, seed=None, n=None)
    assert parsed(**nulls) == parsed()
    assert parsed().params.temperature == 1.0 and parsed().params.max_tokens == 16


def test_an_empty_stop_string_is_refused() -> None:
    """Each stop string must be non-empty (an empty one would match everywhere): alone or in
    a list it is a 400 on `stop`."""
    refused("stop", stop="")
    refused("stop", stop=["a", ""])


def test_chat_logprobs_without_top_logprobs_gives_the_chosen_tokens_logprob_only() -> None:
    """Chat `logprobs: true` with no top_logprobs asks for logprobs with 0 alternatives (as
    OpenAI), not for none."""
    assert parsed(chat=True, logprobs=True).logprobs == 0
    assert parsed(chat=True, logprobs=True).params.logprobs == 0
    assert parsed(chat=True, logprobs=False).logprobs is None


def test_max_completion_tokens_is_a_chat_field_only() -> None:
    """Chat reads max_completion_tokens before max_tokens; completions know only max_tokens
    and leave a max_completion_tokens they are sent alone (the default 16 stays)."""
    assert parsed(chat=True, max_completion_tokens=3, max_tokens=9).params.max_tokens == 3
    assert parsed(max_completion_tokens=3).params.max_tokens == 16
    assert parsed(max_completion_tokens=3, max_tokens=9).params.max_tokens == 9


# ------------------------------------------------------------------ protocol.py: bodies
def test_usage_totals_prompt_and_completion_tokens() -> None:
    """usage: total_tokens = prompt_tokens + completion_tokens."""
    assert usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_ids_carry_openais_prefix_per_endpoint() -> None:
    """A chat response id starts with `chatcmpl-`, a completion's with `cmpl-`; each is new."""
    chat, completion = new_id(True), new_id(False)
    assert chat.startswith("chatcmpl-") and completion.startswith("cmpl-")
    assert not completion.startswith("chatcmpl-") and new_id(True) != chat


def test_a_whole_response_carries_spec_decode_only_when_there_is_one() -> None:
    """full_response: `spec_decode` appears when the request has speculative statistics and
    is absent otherwise (a plain server's reply); a completion's choice carries
    prompt_token_ids, a chat choice the assistant's message."""
    args = ("id", "m")
    plain = full_response(*args, False, "t", [1], "length", None, usage(2, 1), None, [4, 5])
    assert "spec_decode" not in plain and plain["choices"][0]["prompt_token_ids"] == [4, 5]
    spec = {"steps": 1}
    chat = full_response(*args, True, "t", [1], "stop", None, usage(2, 1), spec)
    assert chat["spec_decode"] == spec and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "t"}


# ------------------------------------------------------------------ chat_template.py
MESSAGES = [{"role": "user", "content": "hi"}]


def test_raise_exception_fails_the_request_with_the_templates_own_message() -> None:
    """raise_exception(...), which Hugging Face templates call for an unsupported role, is a
    400 whose message carries the template's text."""
    template = compile_chat_template("{{ raise_exception('roles must alternate user/assistant') }}")
    with pytest.raises(ProtocolError, match="TemplateError: roles must alternate user/assistant") as e:
        render_chat_template(template, MESSAGES)
    assert e.value.status == 400


def test_message_text_reaches_the_prompt_unescaped() -> None:
    """The template renders text as it is: no HTML escaping of <, >, & or quotes (the prompt
    is not HTML)."""
    content = "<b>a & b</b> \"q\" 'x'"
    text = render_chat_template(compile_chat_template(CHAT_TEMPLATE), [{"role": "user", "content": content}])
    assert text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_does_not_parse_is_a_checkpoint_error() -> None:
    """compile_chat_template: a template that is not valid Jinja is the checkpoint's fault
    (CheckpointError naming the chat template), found when the server starts."""
    for source in ("{% for m in messages %}", "{{ messages[0 }}"):
        with pytest.raises(CheckpointError, match="chat template does not parse"):
            compile_chat_template(source)


def test_the_template_sources_final_newline_is_not_rendered() -> None:
    """As Jinja and transformers render it, a single newline that ends the template source is
    dropped; one in the middle stays."""
    text = render_chat_template(compile_chat_template("{{ messages[0]['content'] }}\n"), MESSAGES)
    assert text == "hi"
    assert render_chat_template(compile_chat_template("a\n{{ messages[0]['content'] }}"), MESSAGES) == "a\nhi"


# ------------------------------------------------------------------ tokenizer.py
@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tiny_tokenizer(512)


def test_the_smallest_byte_level_vocabulary_is_accepted_and_one_less_refused() -> None:
    """train_byte_level_bpe needs 256 byte tokens plus the special tokens: exactly that many
    builds (the special tokens at the last ids), one fewer is a CheckpointError."""
    smallest = 256 + len(SPECIAL_TOKENS)
    tok = build_tiny_tokenizer(smallest)
    assert tok.get_vocab_size() == smallest
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(256, smallest))
    with pytest.raises(CheckpointError, match=f"needs at least {smallest}"):
        train_byte_level_bpe(["abc"], smallest - 1)


def test_the_tiny_tokenizer_fills_its_vocabulary_with_the_special_tokens_last(tiny_tokenizer) -> None:
    """A tiny tokenizer of 512 tokens has exactly 512, and its last four ids are end-of-text,
    im_start, im_end and mask, in that order, the layout of the committed demo target's
    tokenizer (whose config names the first of them as eos)."""
    from reference_engine.demo import DEMO_TARGET

    order = (EOS_TOKEN, IM_START, IM_END, MASK_TOKEN)
    assert tiny_tokenizer.get_vocab_size() == 512
    assert [tiny_tokenizer.token_to_id(t) for t in order] == [508, 509, 510, 511]
    demo = load_tokenizer(DEMO_TARGET)
    size = demo.get_vocab_size()
    assert [demo.token_to_id(t) for t in order] == list(range(size - 4, size))
    demo_eos = json.loads((DEMO_TARGET / "config.json").read_text())["eos_token_id"]
    assert demo_eos in (size - 4, [size - 4])


@pytest.mark.parametrize("size", [545, 1000, 4096])
def test_a_vocabulary_larger_than_the_text_can_learn_is_filled_to_its_size(size: int) -> None:
    """The built-in training text learns fewer merges than these sizes ask for: the tokenizer
    still has exactly `size` tokens, the special tokens at the last ids, the ids between the
    learned ones and the special ones reserved (never produced from ordinary text), and text
    still round-trips through it as through the 512-token one."""
    tok = build_tiny_tokenizer(size)
    assert tok.get_vocab_size() == size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(size - 4, size))
    names = [tok.id_to_token(i) for i in range(size - len(SPECIAL_TOKENS))]
    is_reserved = [re.fullmatch(r"<\|reserved_\d+\|>", t) is not None for t in names]
    learned = is_reserved.index(True)
    assert learned > 256 and all(is_reserved[learned:]), names[learned:][:3]
    assert len(set(names)) == len(names)
    # the same as the tokenizer whose size is just what the text learns, which reserves none
    exact = build_tiny_tokenizer(learned + len(SPECIAL_TOKENS))
    assert not any(t.startswith("<|reserved_") for t in exact.get_vocab())
    text = "The quick brown fox, def greedy(logits): print(i * i) 🙂"
    ids = tok.encode(text).ids
    assert ids == exact.encode(text).ids and max(ids) < learned
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    "text", ["Hello world", " leading space", "héllo wörld 🙂 ünïcode", "tabs\tand\nnewlines", "\x00\x7f"]
)
def test_any_text_decodes_back_to_itself(tiny_tokenizer, text: str) -> None:
    """Byte-level BPE: every text, whatever its bytes (characters never seen in training
    included), encodes with no unknown token and decodes back to exactly itself, no space
    added before it."""
    ids = tiny_tokenizer.encode(text).ids
    assert all(0 <= i < 508 for i in ids)
    assert tiny_tokenizer.decode(ids) == text


def test_special_tokens_are_special_and_encode_as_one_token(tiny_tokenizer) -> None:
    """Every special token is registered as special (decode skips it) and encodes as its own
    single id."""
    added = {t.content: t.special for t in tiny_tokenizer.get_added_tokens_decoder().values()}
    assert added == {t: True for t in SPECIAL_TOKENS}
    eos = tiny_tokenizer.token_to_id(EOS_TOKEN)
    assert tiny_tokenizer.encode(EOS_TOKEN).ids == [eos]
    assert tiny_tokenizer.decode([eos, *tiny_tokenizer.encode("ok").ids]) == "ok"


def test_a_saved_tokenizer_loads_back_with_its_config(tiny_tokenizer, tmp_path: Path) -> None:
    """save_tokenizer writes tokenizer.json (loaded back the same by load_tokenizer) and a
    tokenizer_config.json naming the end-of-text token as eos and pad, the ChatML chat
    template and the model's maximum length, as transformers reads them."""
    save_tokenizer(tiny_tokenizer, tmp_path)
    assert load_tokenizer(tmp_path).to_str() == tiny_tokenizer.to_str()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == EOS_TOKEN
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 131072


# ------------------------------------------------------------------ config: shared fields
QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 7,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def qwen3(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(QWEN3), **changes}


def llama(**changes: Any) -> dict[str, Any]:
    return qwen3(**{"model_type": "llama", "rope_scaling": copy.deepcopy(LLAMA3_SCALING), **changes})


def qwen3_moe(**changes: Any) -> dict[str, Any]:
    moe = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return qwen3(**{**moe, **changes})


def qwen3_5_text(**changes: Any) -> dict[str, Any]:
    hybrid = dict(
        model_type="qwen3_5_text",
        layer_types=[L, L, L, F],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    return qwen3(**{**hybrid, **changes})


def rejected(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TargetConfig.from_hf(raw)


@pytest.mark.parametrize("field", ["factor", "low_freq_factor", "high_freq_factor"])
def test_llama3_scaling_factors_refuse_json_booleans(field: str) -> None:
    """The llama3 scaling factors are numbers: true or false is refused naming the field."""
    rejected(llama(rope_scaling={**LLAMA3_SCALING, field: True}), f"'{field}' must be a number, got True")


def test_llama3_scaling_bounds_are_factor_at_least_1_and_a_positive_low_freq_factor() -> None:
    """Llama3RopeScaling: factor 1 (no scaling) is accepted, below 1 refused; low_freq_factor
    must be > 0 (0 would divide by zero) and below high_freq_factor."""
    assert Llama3RopeScaling(1.0, 1.0, 4.0, 8192).factor == 1.0
    assert (
        TargetConfig.from_hf(llama(rope_scaling={**LLAMA3_SCALING, "factor": 1.0})).rope_scaling.factor == 1.0
    )
    with pytest.raises(ConfigError, match="'factor' must be >= 1"):
        Llama3RopeScaling(0.99, 1.0, 4.0, 8192)
    for low in (0.0, -1.0):
        with pytest.raises(ConfigError, match="expected 0 < low_freq_factor < high_freq_factor"):
            Llama3RopeScaling(8.0, low, 4.0, 8192)


def test_rope_parameters_win_over_rope_scaling_field_by_field() -> None:
    """A config that carries both spellings reads v5's rope_parameters first: its rope_type
    and each scaling factor it names win over the v4 rope_scaling's."""
    both = llama(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0},
        rope_scaling={**LLAMA3_SCALING, "factor": 8.0},
    )
    scaling = TargetConfig.from_hf(both).rope_scaling
    assert scaling is not None and scaling.factor == 4.0 and scaling.high_freq_factor == 4.0
    default_first = llama(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert TargetConfig.from_hf(default_first).rope_scaling is None


@pytest.mark.parametrize("theta", [0, 0.0, -5, True, "1e6"])
def test_rope_theta_must_be_a_positive_number_wherever_it_is_given(theta: Any) -> None:
    """rope_theta, top level or in rope_parameters, is a positive number: 0, a negative, a
    boolean or a string is refused naming it (a rope_parameters value is not skipped for the
    top level's or the default)."""
    rejected(qwen3(rope_theta=theta), "'rope_theta' must be a positive number")
    raw = qwen3(rope_parameters={"rope_type": "default", "rope_theta": theta})
    del raw["rope_theta"]
    rejected(raw, "'rope_theta' must be a positive number")


def test_an_eos_token_id_of_0_is_kept() -> None:
    """eos_token_id 0 (alone or in a list) is a token id like any other, not an absent one."""
    assert TargetConfig.from_hf(qwen3(eos_token_id=0)).eos_token_ids == (0,)
    assert TargetConfig.from_hf(qwen3(eos_token_id=[0, 5])).eos_token_ids == (0, 5)
    assert TargetConfig.from_hf(qwen3(eos_token_id=None)).eos_token_ids == ()


def test_a_llama3_field_given_as_null_is_missing() -> None:
    """A required llama3 scaling factor given as null is reported as missing, as one left out."""
    rejected(
        llama(rope_scaling={**LLAMA3_SCALING, "high_freq_factor": None}),
        r"required field 'high_freq_factor' is missing",
    )


# ------------------------------------------------------------------ config: target
def test_a_rotary_dimension_of_zero_is_refused() -> None:
    """head_dim * partial_rotary_factor must be a positive even number: a factor that rounds
    the rotary dimension down to 0 is refused."""
    rejected(qwen3(partial_rotary_factor=0.05), r"rotary dimension .* = 0 must be a positive even")
    assert TargetConfig.from_hf(qwen3(partial_rotary_factor=0.125)).rotary_dim == 2


def test_a_negative_eos_token_id_is_outside_the_vocabulary() -> None:
    """Every eos id is in [0, vocab): a negative one is refused like one past the end."""
    rejected(qwen3(eos_token_id=-1), r"eos_token_id -1 outside the vocabulary \[0, 1000\)")
    rejected(qwen3(eos_token_id=[7, -2]), r"eos_token_id -2 outside the vocabulary")


def test_mlp_only_layers_must_be_indices_of_existing_layers() -> None:
    """qwen3_moe mlp_only_layers: each is an integer layer index in [0, layers); a negative
    index or a boolean is refused."""
    rejected(qwen3_moe(mlp_only_layers=[-1]), r"mlp_only_layers \[-1\] out of range for 4 layers")
    rejected(qwen3_moe(mlp_only_layers=[True]), r"'mlp_only_layers' must be a list of layer indices")
    assert TargetConfig.from_hf(qwen3_moe(mlp_only_layers=[0])).dense_layers == (0,)


def test_a_null_head_dim_is_hidden_size_over_heads() -> None:
    """head_dim null (as some configs write it) is hidden_size // num_attention_heads, as when
    it is left out."""
    assert TargetConfig.from_hf(qwen3(head_dim=None)).head_dim == 64 // 4


def test_target_defaults_follow_transformers() -> None:
    """Fields left out take transformers' defaults: max_position_embeddings 32768 (Qwen) and
    2048 (Llama), rms_norm_eps 1e-6, untied embeddings, no attention or MLP bias,
    full_attention_interval 4 (Qwen3.5)."""
    qwen = qwen3()
    llama_raw = llama()
    for raw in (qwen, llama_raw):
        for name in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
            del raw[name]
    del llama_raw["rope_scaling"]
    q, ll = TargetConfig.from_hf(qwen), TargetConfig.from_hf(llama_raw)
    assert (q.max_position_embeddings, ll.max_position_embeddings) == (32768, 2048)
    assert q.rms_norm_eps == ll.rms_norm_eps == 1e-6
    assert not q.tie_word_embeddings and not ll.tie_word_embeddings
    assert not q.attention_bias and not ll.attention_bias and not ll.mlp_bias
    hybrid = qwen3_5_text(num_hidden_layers=8)
    del hybrid["layer_types"]
    assert TargetConfig.from_hf(hybrid).layer_types == (L, L, L, F, L, L, L, F)


def test_mlp_bias_is_read_for_llama_only() -> None:
    """mlp_bias is a Llama field: a Qwen3 config that carries it has no MLP bias."""
    assert TargetConfig.from_hf(llama(mlp_bias=True)).mlp_bias
    assert not TargetConfig.from_hf(qwen3(mlp_bias=True)).mlp_bias


def test_explicit_sliding_layer_types_read_the_sliding_window_only_with_use_sliding_window() -> None:
    """Qwen3 with explicit layer_types naming sliding_attention layers reads sliding_window
    when use_sliding_window is true; false, those layers attend without a window (Qwen3Config
    sets sliding_window to None)."""
    raw = qwen3(layer_types=[F, S, F, S], sliding_window=256, use_sliding_window=True)
    c = TargetConfig.from_hf(raw)
    assert c.layer_types == (F, S, F, S) and c.sliding_window == 256
    off = TargetConfig.from_hf({**raw, "use_sliding_window": False})
    assert off.layer_types == (F, S, F, S) and off.sliding_window is None


def test_moe_checks_hold_on_a_config_built_directly() -> None:
    """TargetConfig's own checks, without from_hf: a decoder_sparse_step of 0 and a qwen3_5_moe
    shared expert of width 0 are refused."""
    moe = TargetConfig.from_hf(qwen3_moe())
    with pytest.raises(ConfigError, match="decoder_sparse_step must be positive, got 0"):
        TargetConfig(**{**moe.__dict__, "decoder_sparse_step": 0})
    hybrid = TargetConfig.from_hf(
        qwen3_5_text(
            model_type="qwen3_5_moe_text",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    )
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size must be positive, got 0"):
        TargetConfig(**{**hybrid.__dict__, "shared_expert_intermediate_size": 0})


# ------------------------------------------------------------------ config: draft
DRAFT: dict[str, Any] = {
    "architectures": [DFLASH],
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_target_layers": 4,
    "dflash_config": {"mask_token_id": 999, "target_layer_ids": [0, 2], "block_size": 8},
}
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def draft(dflash: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    raw = {**copy.deepcopy(DRAFT), **changes}
    raw["dflash_config"].update(dflash or {})
    return raw


def dflash2(dflash: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    return draft({**DFLASH2_FIELDS, **(dflash or {})}, **{"architectures": [DFLASH2], **changes})


def test_selector_top_k_may_be_the_whole_vocabulary() -> None:
    """DFlash2 selector_top_k is at most vocab_size: equal is accepted, one more refused."""
    assert DraftConfig.from_hf(dflash2({"selector_top_k": 1000})).selector_top_k == 1000
    with pytest.raises(ConfigError, match="selector_top_k 1001 exceeds the vocabulary 1000"):
        DraftConfig.from_hf(dflash2({"selector_top_k": 1001}))


def test_a_draft_naming_both_architectures_is_dflash2() -> None:
    """architectures naming both DFlashDraftModel and DFlash2DraftModel (in either order)
    parse as DFlash2."""
    for names in ([DFLASH, DFLASH2], [DFLASH2, DFLASH]):
        assert DraftConfig.from_hf(dflash2(architectures=names)).is_dflash2


def test_a_softcap_of_0_means_no_softcapping() -> None:
    """final_logit_softcapping 0 or null turns soft capping off (None), as in transformers."""
    for softcap in (0, 0.0, None):
        assert DraftConfig.from_hf(draft(final_logit_softcapping=softcap)).final_logit_softcapping is None
    assert DraftConfig.from_hf(draft(final_logit_softcapping=30)).final_logit_softcapping == 30.0


def test_draft_defaults_follow_transformers() -> None:
    """A draft's num_key_value_heads defaults to num_attention_heads, head_dim to
    hidden_size // heads, max_position_embeddings to 32768, rms_norm_eps to 1e-6, and
    attention_bias to false."""
    raw = draft()
    for name in ("num_key_value_heads", "head_dim"):
        del raw[name]
    c = DraftConfig.from_hf(raw)
    assert (c.num_key_value_heads, c.head_dim) == (4, 16)
    assert c.max_position_embeddings == 32768 and c.rms_norm_eps == 1e-6 and not c.attention_bias


def test_dflash_config_causal_wins_over_is_causal() -> None:
    """DFlash2 causality: dflash_config.causal first, then the top level's is_causal; a
    value that is not a JSON boolean is refused."""
    assert DraftConfig.from_hf(dflash2({"causal": True}, is_causal=False)).causal is True
    assert DraftConfig.from_hf(dflash2({"causal": False}, is_causal=True)).causal is False
    assert DraftConfig.from_hf(dflash2(is_causal=True)).causal is True
    assert DraftConfig.from_hf(dflash2()).causal is None
    for value in ("false", 0):
        with pytest.raises(ConfigError, match="'is_causal' must be true or false"):
            DraftConfig.from_hf(dflash2(is_causal=value))


def test_a_non_causal_draft_is_non_causal_in_every_layer() -> None:
    """layer_causal: causal false makes every layer bidirectional, sliding ones included;
    without it the legacy rule holds (sliding causal, full not)."""
    layers = {"layer_types": [S, F], "sliding_window": 64}
    off = DraftConfig.from_hf(dflash2({"causal": False}, **layers))
    assert [off.layer_causal(i) for i in range(2)] == [False, False]
    legacy = DraftConfig.from_hf(draft(**layers))
    assert [legacy.layer_causal(i) for i in range(2)] == [True, False]


def test_an_empty_target_layer_list_takes_the_published_spread() -> None:
    """target_layer_ids [] (as left out) takes z-lab's spread over 1..N-3; one draft layer
    takes the middle target layer, rounded down."""
    c = DraftConfig.from_hf(draft({"target_layer_ids": []}, num_target_layers=36, num_hidden_layers=5))
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    one = DraftConfig.from_hf(draft({"target_layer_ids": []}, num_target_layers=7, num_hidden_layers=1))
    assert one.target_layer_ids == (3,)


def test_a_chat_template_renders_as_hugging_faces_apply_chat_template_does() -> None:
    """The environment of transformers' `apply_chat_template`, which the peer servers use:
    blocks trimmed, break and continue, a tojson that neither escapes nor sorts, and
    strftime_now. Each template gives transformers' text."""
    trimmed = '{% for m in messages %}\n{{ m["content"] }}\n{% endfor %}'
    assert render_chat_template(compile_chat_template(trimmed), MESSAGES) == "hi\n"
    indented = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}[{{ m.content }}]{% endif %}\n{% endfor %}"
    )
    assert render_chat_template(compile_chat_template(indented), MESSAGES) == "[hi]"
    loop = '{% for m in messages %}{{ m["content"] }}{% break %}{% endfor %}'
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat_template(compile_chat_template(loop), two) == "a"
    skip = (
        '{% for m in messages %}{% if m.content == "a" %}{% continue %}{% endif %}{{ m.content }}{% endfor %}'
    )
    assert render_chat_template(compile_chat_template(skip), two) == "b"
    as_json = "{{ messages[0] | tojson }}"
    text = render_chat_template(compile_chat_template(as_json), [{"role": "user", "content": "<a> é"}])
    assert text == '{"role": "user", "content": "<a> é"}'
    indented_json = "{{ messages[0] | tojson(indent=2) }}"
    assert render_chat_template(compile_chat_template(indented_json), MESSAGES) == (
        '{\n  "role": "user",\n  "content": "hi"\n}'
    )
    import datetime

    today = render_chat_template(compile_chat_template('{{ strftime_now("%Y") }}'), MESSAGES)
    assert today in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}

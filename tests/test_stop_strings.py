"""Stop strings cut text exactly, whatever the chunking (serving/stop_strings.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from reference_engine.serving import stop_strings
from reference_engine.serving.stop_strings import REPLACEMENT, IncrementalText, StopStringText, held_back

# a toy vocabulary: token id -> text (several characters per token, as BPE tokens)
VOCAB = {0: "Hel", 1: "lo", 2: " wo", 3: "rld", 4: "!", 5: " E", 6: "ND", 7: "\n"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def run(ids: list[int], stops: tuple[str, ...], sizes: list[int]) -> tuple[list[str], list[int], bool]:
    """Feed `ids` in chunks of `sizes` (cycled); returns the emitted pieces, ids, stopped."""
    stream = StopStringText(decode, stops)
    pieces, out, at = [], [], 0
    for size in itertools.cycle(sizes):
        chunk = ids[at : at + size]
        at += size
        text, new = stream.push(chunk, final=at >= len(ids))
        pieces.append(text)
        out += new
        if at >= len(ids) or stream.stopped:
            break
    return pieces, out, stream.stopped


IDS = [0, 1, 2, 3, 4, 5, 6, 7]  # "Hello world! END\n"


@pytest.mark.parametrize(
    "stop, text, kept",
    [
        ("world", "Hello ", 4),  # spans two tokens
        ("o w", "Hell", 3),  # starts inside a token
        ("!", "Hello world", 5),  # one token
        ("END\n", "Hello world! ", 8),  # ends the output
        ("absent", "Hello world! END\n", 8),
    ],
)
def test_text_never_contains_a_stop_string_part_and_chunking_does_not_matter(
    stop: str, text: str, kept: int
) -> None:
    results = set()
    for sizes in ([1], [2], [3], [8], [1, 4], [5, 1]):
        pieces, ids, stopped = run(IDS, (stop,), sizes)
        assert "".join(pieces) == text, sizes
        assert ids == IDS[:kept], sizes
        assert stopped == (stop != "absent")
        results.add(("".join(pieces), tuple(ids), stopped))
    assert len(results) == 1


def test_a_held_back_tail_is_released_once_it_cannot_start_a_match() -> None:
    stream = StopStringText(decode, ("lo wX",))
    assert stream.push([0], final=False) == ("He", [0])  # "l" may begin "lo wX"
    assert stream.push([1], final=False) == ("l", [1])  # "Hello": "lo" still may
    assert stream.push([2], final=False) == ("lo wo", [2])  # "lo wo" cannot any more
    assert stream.push([3], final=True) == ("rld", [3])


def test_the_first_stop_string_to_complete_wins_across_a_chunk() -> None:
    # "Hello world": "world" completes at token 3, "ello w" at token 2 (and starts earlier)
    for sizes in ([1], [4], [8]):
        pieces, ids, _ = run(IDS, ("world", "lo w"), sizes)
        assert ("".join(pieces), ids) == ("Hel", IDS[:3]), sizes
    # a later-completing stop string that begins earlier does not win in a bigger chunk
    for sizes in ([1], [4], [8]):
        pieces, ids, _ = run(IDS, ("ello world", "wo"), sizes)
        assert ("".join(pieces), ids) == ("Hello ", IDS[:3]), sizes


def test_nothing_is_taken_after_a_stop() -> None:
    stream = StopStringText(decode, ("lo",))
    assert stream.push([0, 1, 2], final=False) == ("Hel", [0, 1])
    assert stream.push([3], final=True) == ("", [])


def test_an_incomplete_character_waits_for_its_next_byte() -> None:
    def broken(ids: list[int]) -> str:
        return "a" + ("é" if ids[1:] == [1, 2] else "\ufffd" if ids[1:] == [1] else "")

    stream = StopStringText(broken)
    assert stream.push([0], final=False)[0] == "a"
    assert stream.push([1], final=False)[0] == ""
    assert stream.push([2], final=True)[0] == "é"


def test_held_back_is_the_longest_suffix_of_the_text_that_is_a_proper_prefix_of_a_stop() -> None:
    """`held_back` against its definition, every length tried, on random texts and stop
    strings over small alphabets (repeats and overlaps: "abab", "aaa"), empty text included."""
    import random

    def by_definition(text: str, stops: tuple[str, ...]) -> int:
        return max(
            (n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
            default=0,
        )

    rng = random.Random(11)
    for _ in range(5000):
        alphabet = rng.choice(["ab", "abc", "a", "xy ab"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 10)))
            for _ in range(rng.randrange(1, 5))
        )
        assert held_back(text, stops) == by_definition(text, stops), (text, stops)


def test_held_back_is_the_longest_suffix_that_begins_a_stop() -> None:
    assert held_back("abcab", ("abd",)) == 2
    assert held_back("abcab", ("xyz",)) == 0
    assert held_back("abc", ("abc",)) == 0  # a whole match is not a tail to hold
    assert held_back("xa", ("ab", "xab")) == 2


# ---------------------------------------------------------------- incremental detokenisation
# Real tokenizers: the demo checkpoint's byte-level BPE, a SentencePiece-style one (Metaspace:
# a word's leading space is a token's "▁", dropped at the start of a text), and a WordPiece
# one, whose decoder joins "##" pieces and cleans spaces around punctuation (it rewrites
# text across token boundaries).


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"], show_progress=False)
    text = "Hello world, héllo wörld! ünïcödé 数字 and more words here."
    tok.train_from_iterator([text] * 4, trainer=trainer)
    tok.add_tokens(bytes_)  # byte-fallback pieces: plain tokens, which decode keeps
    return tok


def _wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(["Hello, world! Don't stop: it's 3.5 tokens a step."] * 4, trainer=trainer)
    return tok


def _tokenizers():
    from reference_engine.demo import DEMO_TARGET
    from reference_engine.tokenizer import load_tokenizer

    return {
        "byte-level (demo)": load_tokenizer(DEMO_TARGET),
        "metaspace": _metaspace_tokenizer(),
        "wordpiece": _wordpiece_tokenizer(),
    }


@pytest.fixture(scope="module")
def real_tokenizers():
    return _tokenizers()


def counting_decoder(tok) -> tuple[Callable[[list[int]], str], list[int]]:
    """`tok.decode`, recording the number of ids of every call in the returned list."""
    decoded: list[int] = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tok.decode(ids)

    return counting, decoded


SPECIALS = {"<|endoftext|>", "<|im_end|>", "</s>", "[SEP]"}


def special_ids(tok) -> frozenset[int]:
    """The tokenizer's special tokens, which its decode skips (as the server reads them)."""
    return frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)


def _streamed(decode, ids: list[int], sizes: list[int]) -> list[str]:
    stream = StopStringText(decode)
    pieces, at = [], 0
    for size in itertools.cycle(sizes):
        at += size
        pieces.append(stream.push(ids[at - size : at], final=at >= len(ids))[0])
        if at >= len(ids):
            return pieces


@pytest.mark.parametrize("skipping", [False, True])
@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_incremental_text_is_the_whole_decode_at_every_token(real_tokenizers, name, skipping) -> None:
    """After every token, the incremental text is the decode of the whole output so far, on
    random ids (byte tokens that split characters, special tokens) as long as that decode
    only grows (a byte-fallback decoder turns a group of bytes into replacement characters
    once a later byte makes it invalid, rewriting text already streamed, whoever streams it);
    with the special tokens decoded (`skipping` False) and never decoded (True, as the server
    does)."""
    import random

    tok = real_tokenizers[name]
    rng = random.Random(3)
    specials = [i for t, i in tok.get_vocab().items() if t in SPECIALS | {"<unk>", "[UNK]"}]
    checked = 0
    for _ in range(150):
        # a third of them special tokens, which decode skips: runs of them before a word
        ids = [
            rng.choice(specials) if rng.random() < 0.35 else rng.randrange(tok.get_vocab_size())
            for _ in range(rng.randrange(1, 60))
        ]
        text = IncrementalText(tok.decode, special_ids(tok) if skipping else ())
        before = ""
        for n, token in enumerate(ids, 1):
            text.push(token)
            whole = tok.decode(ids[:n])
            if not whole.startswith(before.rstrip(REPLACEMENT)):
                break  # the whole decode rewrote its own text
            assert text.text() == whole, (name, ids[:n])
            before = whole
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_streamed_text_is_the_whole_decode_for_every_chunking(real_tokenizers, name, caplog) -> None:
    tok = real_tokenizers[name]
    ids = tok.encode("Hello wörld, ünïcödé 数字! Don't stop: it's 3.5 tokens.").ids * 3
    specials = [tok.token_to_id(t) for t in tok.get_vocab() if t in SPECIALS][:2]
    assert specials, name
    ids[len(ids) // 2 : len(ids) // 2] = specials
    whole = tok.decode(ids)
    with caplog.at_level("WARNING"):
        for sizes in ([1], [2], [3], [7, 1], [len(ids)]):
            pieces = _streamed(tok.decode, ids, sizes)
            assert "".join(pieces) == whole, (name, sizes)
    assert not [r for r in caplog.records if "differed" in r.getMessage()]


def test_incremental_text_decodes_a_window_not_the_whole_output(real_tokenizers) -> None:
    """Linear cost: each token decodes a few ids, however long the output is (a server that
    decodes the whole output at every step takes time growing with its square)."""
    tok = real_tokenizers["byte-level (demo)"]
    counting, decoded = counting_decoder(tok)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40).ids
    stream = StopStringText(counting)
    for i, token in enumerate(ids):
        stream.push([token], final=i == len(ids) - 1)
    per_token = (sum(decoded) - len(ids)) / len(ids)  # less the one whole decode at the end
    assert per_token <= 24, per_token  # about 9 here; the whole output's length when it is decoded
    # one decode a token, the window's settled text reused from the push before (1.25 here:
    # every fourth token the window moves on and its settled text is decoded again)
    calls = (len(decoded) - 1) / len(ids)
    assert calls <= 1.3, calls
    assert tok.decode(ids) == stream.incremental.text()


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
@pytest.mark.parametrize("size", [1, 3])
def test_a_run_of_tokens_that_decode_to_nothing_costs_one_decode_a_token(real_tokenizers, name, size) -> None:
    """A model that repeats a special token (decode skips it) for hundreds of tokens, after
    text and before more: each push decodes once, as any other token's does, rather than
    reaching back through the whole run to find text before it (time growing with the
    run's cube)."""
    tok = real_tokenizers[name]
    special = tok.token_to_id(next(t for t in tok.get_vocab() if t in SPECIALS))
    counting, decoded = counting_decoder(tok)
    ids = tok.encode("Hello there").ids + [special] * 400 + tok.encode("world again").ids
    stream = StopStringText(counting)
    chunks = [ids[at : at + size] for at in range(0, len(ids), size)]
    pieces = [stream.push(c, final=i == len(chunks) - 1)[0] for i, c in enumerate(chunks)]
    assert "".join(pieces) == tok.decode(ids)
    calls = (len(decoded) - 1) / len(ids)  # less the one whole decode at the end
    assert calls <= 1.3, calls


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_ids_the_decoder_skips_are_never_decoded(real_tokenizers, name) -> None:
    """Given the ids decode skips (the server passes its tokenizer's special tokens), a run of
    them costs no decode at all, whether pushed one at a time or in chunks, and the text is
    still the decode of the whole output (specials before, inside and after text)."""
    tok = real_tokenizers[name]
    skipped = special_ids(tok)
    special = tok.token_to_id(next(t for t in tok.get_vocab() if t in SPECIALS))
    assert special in skipped
    words = tok.encode("Hello there world").ids
    ids = [special] * 50 + words + [special] * 2000 + words + [special] * 3
    for size in (1, 4):
        counting, decoded = counting_decoder(tok)
        stream = StopStringText(counting, skipped=skipped)
        chunks = [ids[at : at + size] for at in range(0, len(ids), size)]
        pieces = [stream.push(c, final=i == len(chunks) - 1)[0] for i, c in enumerate(chunks)]
        assert "".join(pieces) == tok.decode(ids), (name, size)
        assert stream.ids == ids
        assert len(decoded) - 1 <= 2 * len(words) + 2, (name, size, len(decoded))
        assert sum(decoded) - len(ids) <= 24 * 2 * len(words), (name, size, sum(decoded))


def test_invalid_bytes_do_not_hold_the_window_open(real_tokenizers) -> None:
    """An output of bytes that never complete a character (a model emitting garbage) decodes
    to replacement characters: they settle once no later byte can complete them, so the cost
    stays linear and the text is still the whole decode."""
    tok = real_tokenizers["byte-level (demo)"]
    invalid = tok.token_to_id("ÿ")  # the byte 0xFF, never part of UTF-8
    counting, decoded = counting_decoder(tok)

    ids = [invalid] * 300 + tok.encode(" and then text").ids
    text = IncrementalText(counting)
    for token in ids:
        text.push(token)
    assert text.text() == tok.decode(ids)
    assert sum(decoded) / len(ids) <= 60  # ids decoded a token; 150 when the bytes wait for good


def test_a_decoder_that_rewrites_text_outside_the_window_is_caught_at_the_end(caplog) -> None:
    """The last push decodes the whole output once: a decoder whose later tokens change text
    before the window (here: the whole text upper-cased once an output of more than 10
    tokens ends in "!"; a window holds at most 9) is logged, and the rest of the text follows
    the whole decode."""

    def rewriting(ids: list[int]) -> str:
        text = decode(ids)
        return text.upper() if len(ids) > 10 and ids[-1] == 4 else text

    ids = [0, 1, 2, 3, 5, 6, 7, 0, 1, 2, 3, 4]  # "Hello world END\nHello world!"
    stream = StopStringText(rewriting)
    with caplog.at_level("WARNING"):
        pieces = [stream.push([token], final=i == len(ids) - 1)[0] for i, token in enumerate(ids)]
    assert "".join(pieces[:-1]) == "Hello world END\nHello world"  # streamed before the rewrite
    assert pieces[-1] == "!"  # the whole decode's text past what was sent
    assert [r for r in caplog.records if "differed" in r.getMessage()]


def test_of_two_stop_strings_completed_by_one_token_the_earlier_one_cuts() -> None:
    """ "Hello" completes "llo" and "ello" at once: the cut is at the one that starts first,
    whatever the order the request lists them in."""
    for stops in (("llo", "ello"), ("ello", "llo")):
        for sizes in ([1], [2], [8]):
            pieces, ids, stopped = run(IDS, stops, sizes)
            assert ("".join(pieces), ids, stopped) == ("H", IDS[:2], True), (stops, sizes)


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_a_chunk_decoded_at_once_is_its_tokens_pushed_one_at_a_time(real_tokenizers, name) -> None:
    """`extend` (a DFlash step's several tokens, without stop strings) against `push` token by
    token, on random ids (byte tokens that split characters, special tokens) cut into random
    chunks: after every chunk the texts are equal, and equal to the whole decode while that
    decode only grows."""
    import random

    tok = real_tokenizers[name]
    rng = random.Random(11)
    specials = [i for t, i in tok.get_vocab().items() if t in SPECIALS | {"<unk>", "[UNK]"}]
    checked = whole_checked = 0
    for _ in range(150):
        ids = [
            rng.choice(specials) if rng.random() < 0.3 else rng.randrange(tok.get_vocab_size())
            for _ in range(rng.randrange(2, 70))
        ]
        chunked, single = IncrementalText(tok.decode), IncrementalText(tok.decode)
        at, before = 0, ""
        while at < len(ids):
            size = rng.randrange(1, 9)
            chunked.extend(ids[at : at + size])
            for token in ids[at : at + size]:
                single.push(token)
            at += size
            assert chunked.text() == single.text(), (name, ids[:at])
            assert chunked.ids == ids[:at]
            checked += 1
            whole = tok.decode(ids[:at])
            if whole.startswith(before.rstrip(REPLACEMENT)):
                assert chunked.text() == whole, (name, ids[:at])
                whole_checked += 1
            before = whole
    assert checked > 1000 and whole_checked > 500, (checked, whole_checked)


@pytest.mark.parametrize("size", [2, 4])
def test_a_chunk_without_stop_strings_costs_one_decode(real_tokenizers, size: int) -> None:
    """A DFlash server's chunks carry several tokens (two, the fewest, as well as four):
    without stop strings each is decoded once (its window reused from the chunk before), not
    once a token."""
    tok = real_tokenizers["byte-level (demo)"]
    counting, decoded = counting_decoder(tok)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40).ids
    assert len(ids) >= 200
    stream = StopStringText(counting)
    chunks = [ids[at : at + size] for at in range(0, len(ids), size)]
    pieces = [stream.push(c, final=i == len(chunks) - 1)[0] for i, c in enumerate(chunks)]
    assert "".join(pieces) == tok.decode(ids)
    calls = (len(decoded) - 1) / len(chunks)  # less the one whole decode at the end
    assert calls <= 1.6, calls  # 1.5 for chunks of 4: every other chunk the window moves on
    assert (sum(decoded) - len(ids)) / len(chunks) <= 24
    with_stop = StopStringText(counting, ("never there",))
    decoded.clear()
    for i, c in enumerate(chunks):
        with_stop.push(c, final=i == len(chunks) - 1)
    assert (len(decoded) - 1) / len(ids) >= 1  # a stop string needs every token's text


def test_a_chunk_that_ends_inside_a_character_waits_without_decoding_the_whole_output(
    real_tokenizers,
) -> None:
    """Chunks of CJK and accented text cut inside a character's bytes: the chunk's text is not
    settled until the character's next bytes come, so every decode stays a short window (a
    replacement character settled there would be rewritten by the next token, and a rewrite
    is settled by decoding the whole output: a cost growing with its square)."""
    tok = real_tokenizers["byte-level (demo)"]
    ids = tok.encode("数字と漢字、ünïcödé 😀 texte. " * 20).ids
    decoded = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tok.decode(ids)

    stream = StopStringText(counting)
    chunks = [ids[at : at + 3] for at in range(0, len(ids), 3)]
    assert any(tok.decode(ids[: 3 * n]).endswith(REPLACEMENT) for n in range(1, len(chunks)))
    pieces = [stream.push(c, final=i == len(chunks) - 1)[0] for i, c in enumerate(chunks)]
    assert "".join(pieces) == tok.decode(ids)
    assert max(decoded[:-1]) <= 24, max(decoded[:-1])  # about 17 here; the last: the whole decode


@pytest.mark.parametrize("stops", [(), ("never there",)])
def test_an_output_that_ends_inside_a_character_ends_with_its_replacement_character(
    real_tokenizers, stops: tuple[str, ...]
) -> None:
    """An output cut short inside a character (max_tokens reached between its bytes) ends as
    the whole decode ends, with U+FFFD: held back while more bytes might come, but released
    with the last chunk, with or without stop strings, whatever the chunking."""
    tok = real_tokenizers["byte-level (demo)"]
    ids = tok.encode("Hello 数字").ids
    whole = tok.decode(ids[:-1])
    assert whole.endswith(REPLACEMENT)
    for size in (1, 2, len(ids)):
        stream = StopStringText(tok.decode, stops)
        pieces, at = [], 0
        while at < len(ids) - 1:
            chunk = ids[at : min(at + size, len(ids) - 1)]
            at += len(chunk)
            pieces.append(stream.push(chunk, final=at == len(ids) - 1)[0])
        assert "".join(pieces) == whole, (stops, size)


def test_the_last_piece_follows_the_whole_decode_where_the_incremental_text_differs(caplog) -> None:
    """A decoder that rewrites text outside the window at the last token (here: the whole
    text upper-cased once an output of more than 10 tokens ends in "rld"): what is still to
    send comes from the whole decode, not from the incremental text."""

    def rewriting(ids: list[int]) -> str:
        text = decode(ids)
        return text.upper() if len(ids) > 10 and ids[-1] == 3 else text

    ids = [0, 1, 2, 3, 5, 6, 7, 0, 1, 2, 3]  # "Hello world END\nHello world"
    for stops in ((), ("never there",)):
        stream = StopStringText(rewriting, stops)
        with caplog.at_level("WARNING"):
            pieces = [stream.push([token], final=i == len(ids) - 1)[0] for i, token in enumerate(ids)]
        assert "".join(pieces[:-1]) == "Hello world END\nHello wo", stops
        assert pieces[-1] == "RLD", stops


def _first_stop_by_whole_text(decode, ids: list[int], stops: tuple[str, ...]) -> tuple[str, list[int]] | None:
    """The text and ids a stop string ends an output at, found the plain way: after each
    token, every stop string searched for in the whole incremental text so far."""
    text = IncrementalText(decode)
    for n, token in enumerate(ids, 1):
        text.push(token)
        found = [text.text().find(s) for s in stops if s in text.text()]
        if found:
            return text.text()[: min(found)], ids[:n]
    return None


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_stop_strings_are_found_where_a_search_of_the_whole_text_finds_them(real_tokenizers, name) -> None:
    """Stop strings of one to many tokens, inside words, across token boundaries and where a
    decoder rewrites text it gave before (WordPiece's cleanup of spaces around punctuation):
    the text and ids a stream stops at are those of searching the whole text after every
    token, for every chunking, though each search reads only the text after the last one."""
    import random

    tok = real_tokenizers[name]
    rng = random.Random(5)
    words = "Hello world, héllo wörld! Don't stop: it's 3.5 tokens a step. 数字 and more words here.".split()
    stopped = 0
    for _ in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(20, 60)))
        ids = tok.encode(text).ids
        whole = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 5)):
            at, length = rng.randrange(len(whole)), rng.randrange(1, 12)
            stops.append(whole[at : at + length] if rng.random() < 0.7 else f"absent{rng.random()}")
        stops = tuple(s for s in stops if s.strip()) or ("absent",)
        expected = _first_stop_by_whole_text(tok.decode, ids, stops)
        for sizes in ([1], [3], [2, 5]):
            stream = StopStringText(tok.decode, stops)
            pieces, taken, at = [], [], 0
            for size in itertools.cycle(sizes):
                piece, new = stream.push(ids[at : at + size], final=at + size >= len(ids))
                pieces.append(piece)
                taken += new
                at += size
                if stream.stopped or at >= len(ids):
                    break
            if expected is None:
                assert not stream.stopped, (name, stops, sizes)
            else:
                assert stream.stopped, (name, stops, sizes)
                assert ("".join(pieces), taken) == expected, (name, stops, sizes)
        stopped += expected is not None
    assert stopped >= 20


def test_a_long_output_with_stop_strings_is_searched_in_linear_time(real_tokenizers, monkeypatch) -> None:
    """Each token's search for stop strings reads the text added since the search before and
    the longest stop string's length before it, so the characters searched over an output
    grow with its length, not with its square (searching the whole text every token: about
    3 s of the event loop for 32000 tokens with four stop strings)."""
    tok = real_tokenizers["byte-level (demo)"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 300).ids
    stops = ("never there", "another stop", "<end>", "###")
    searched: list[int] = []
    original = stop_strings.earliest

    def counting(text: str, stops: tuple[str, ...], start: int) -> int | None:
        searched.append(len(text) - start)
        return original(text, stops, start)

    monkeypatch.setattr(stop_strings, "earliest", counting)
    stream = StopStringText(tok.decode, stops)
    for i, token in enumerate(ids):
        stream.push([token], final=i == len(ids) - 1)
    assert len(searched) == len(ids)
    longest = max(map(len, stops))
    assert max(searched) <= longest + 16, max(searched)  # the new text (a token's) and the reach
    assert stream.incremental.text() == tok.decode(ids)


def test_a_stop_string_that_a_decoder_rewrites_into_earlier_text_is_found() -> None:
    """A decoder that rewrites text it gave before (here one token upper-cases the whole
    text): the stop string that the rewrite makes, far before the newest text, ends the
    output at that token, as a search of the whole text finds it; the searches that read only
    the newest text start over from the beginning after a rewrite."""
    vocab = {0: "hello", 1: " aa", 2: "!"}

    def shouting(ids: list[int]) -> str:
        text = "".join(vocab[i] for i in ids)
        return text.upper() if 2 in ids else text

    ids = [0] + [1] * 40 + [2, 1, 1]
    expected = _first_stop_by_whole_text(shouting, ids, ("HELLO",))
    assert expected == ("", ids[:42])
    for size in (1, 3):
        stream = StopStringText(shouting, ("HELLO",))
        taken = []
        for at in range(0, len(ids), size):
            taken += stream.push(ids[at : at + size], final=at + size >= len(ids))[1]
            if stream.stopped:
                break
        assert stream.stopped and taken == ids[:42], size


def test_growing_text_reads_its_end_as_the_string_would() -> None:
    """GrowingText against a plain string: appends of every size (past a block at once, empty
    ones), every tail and every suffix test, a start text of several blocks."""
    import random

    rng = random.Random(2)
    for start in ("", "x" * 9000):
        grown, plain = stop_strings.GrowingText(start), start
        for _ in range(300):
            piece = "".join(rng.choice("ab\ufffdé") for _ in range(rng.choice([0, 1, 3, 50, 5000])))
            grown.append(piece)
            plain += piece
            assert grown.length == len(plain)
            for at in {0, len(plain), len(plain) + 3, rng.randrange(len(plain) + 1), max(len(plain) - 7, 0)}:
                assert grown.tail(at) == plain[at:], at
            end = plain[-rng.randrange(1, 20) :] if plain else "a"
            assert grown.endswith(end) == plain.endswith(end)
            assert not grown.endswith("q")
        assert str(grown) == plain
        assert all(len(block) >= grown.BLOCK for block in grown.blocks)


def _reference_pushes(decode, ids: list[int], stops: tuple[str, ...], sizes: list[int]) -> list:
    """What each push returns by the module's rules, read off the whole text at every token:
    the first stop string found in the whole text cuts it; otherwise the text past what was
    sent, less a trailing incomplete character and the end that could begin a stop string
    (all of it, checked against the whole decode, at the last push)."""
    sent, out, at, text = 0, [], 0, IncrementalText(decode)
    for size in itertools.cycle(sizes):
        chunk, at = ids[at : at + size], at + size
        final, taken, stop = at >= len(ids), [], None
        for token in chunk:
            text.push(token)
            taken.append(token)
            whole = text.text()
            found = [whole.find(s) for s in stops if s in whole]
            if found:
                stop = min(found)
                break
        whole = text.text()
        if stop is not None:
            out.append((whole[sent:stop], taken))
            return out
        if final:
            whole = decode(ids)
        else:
            whole = whole.rstrip(REPLACEMENT)
            whole = whole[: len(whole) - held_back(whole, stops)]
        out.append((whole[sent:], taken))
        sent = max(sent, len(whole))
        if final:
            return out


@pytest.mark.parametrize("name", ["byte-level (demo)", "metaspace", "wordpiece"])
def test_each_push_returns_what_the_whole_text_gives(real_tokenizers, name) -> None:
    """Every push's text and ids, not only their sum, are those read off the whole text at
    every token (`_reference_pushes`), though a push reads only the text's end: outputs with
    and without stop strings, stop strings that are prefixes of the text's tail, invalid
    bytes (byte-level: ids that decode to U+FFFD), for three chunkings."""
    import random

    tok = real_tokenizers[name]
    rng = random.Random(11)
    words = "Hello world, héllo wörld! Don't stop: it's 3.5 tokens a step. 数字 and more words here.".split()
    vocab = tok.get_vocab_size()
    for trial in range(30):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(10, 50)))).ids
        if trial % 3 == 0:  # ids at random: invalid bytes, special tokens
            ids = [rng.randrange(vocab) if rng.random() < 0.3 else i for i in ids]
        whole = tok.decode(ids)
        stops: tuple[str, ...] = ()
        if trial % 2:
            picks = [whole[a : a + rng.randrange(2, 9)] for a in rng.sample(range(len(whole)), 2)]
            stops = tuple(s for s in picks if s.strip()) + ("zz" + whole[-3:],)
        for sizes in ([1], [3], [2, 5]):
            stream = StopStringText(tok.decode, stops)
            got, at = [], 0
            for size in itertools.cycle(sizes):
                got.append(stream.push(ids[at : at + size], final=at + size >= len(ids)))
                at += size
                if stream.stopped or at >= len(ids):
                    break
            assert got == _reference_pushes(tok.decode, ids, stops, sizes), (name, trial, stops, sizes)


@pytest.mark.parametrize("stops", [(), ("never there", "<end>")])
def test_a_long_output_is_read_from_its_end_at_every_push(real_tokenizers, monkeypatch, stops) -> None:
    """A push reads the text since what it last sent or searched (and the longest stop
    string's length before it), not the whole output: only the last push reads it whole (the
    check against one decode). The settled text grows in blocks, so no push copies it whole
    either (a string grown by `+` would: time growing with the output's length squared)."""
    tok = real_tokenizers["byte-level (demo)"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 400).ids
    reads: list[int] = []
    wholes: list[int] = []
    tail, text = IncrementalText.tail, IncrementalText.text

    def counted_tail(self, start: int) -> str:
        out = tail(self, start)
        reads.append(len(out))
        return out

    def counted_text(self) -> str:
        wholes.append(len(reads))
        return text(self)

    monkeypatch.setattr(IncrementalText, "tail", counted_tail)
    monkeypatch.setattr(IncrementalText, "text", counted_text)
    stream = StopStringText(tok.decode, stops)
    pieces = [stream.push([token], final=i == len(ids) - 1)[0] for i, token in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids)
    assert len(wholes) == 1  # the last push's check
    longest = max(map(len, stops), default=0)
    assert max(reads[:-1]) <= longest + 16, max(reads[:-1])
    blocks = stream.incremental.settled_text
    assert len(blocks.open) < blocks.BLOCK and blocks.length == len(tok.decode(ids))


def test_the_incremental_texts_tail_reads_into_its_pending_character() -> None:
    """tail(k) is text()[k:] for every k, also inside the pending text of a token that ends in
    an incomplete character after complete ones ("ab" and the first byte of "数")."""
    pieces = {0: b"Hi ", 1: b"ab\xe6", 2: b"\x95\xb0", 3: b"!"}

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    text = IncrementalText(decode)
    for token in (0, 1, 2, 3):
        text.push(token)
        whole = text.text()
        assert whole == decode([0, 1, 2, 3][: len(text.ids)])
        for k in range(len(whole) + 2):
            assert text.tail(k) == whole[k:], (text.ids, k)
    assert text.text() == "Hi ab数!"

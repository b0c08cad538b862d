"""Stop strings cut text exactly, whatever the chunking (serving/stop_strings.py)."""

from __future__ import annotations

import itertools

import pytest

from reference_engine.serving.stop_strings import StopStringText, held_back

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


def test_held_back_is_the_longest_suffix_that_begins_a_stop() -> None:
    assert held_back("abcab", ("abd",)) == 2
    assert held_back("abcab", ("xyz",)) == 0
    assert held_back("abc", ("abc",)) == 0  # a whole match is not a tail to hold
    assert held_back("xa", ("ab", "xab")) == 2

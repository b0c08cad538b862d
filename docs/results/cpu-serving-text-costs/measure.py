"""Event-loop time of one request's detokenisation and stop-string work (serving/stop_strings.py)
for long and adversarial outputs, with the demo tokenizer. Run from the repository root:

    python docs/results/cpu-serving-text-costs/measure.py [--short] [--before]

`--short`: 1600 special tokens only, not also 8000 (the tree before this change takes hours
on 8000). `--before`: without the special ids, which that tree's StopStringText does not
take. `after.txt` is `--short` on this tree, `before.txt` `--short --before` on a100d16,
back to back. Each figure is one run (seconds of one core, or decode calls), pushed one token
at a time as a plain server's chunks come."""

from __future__ import annotations

import sys
import time

from reference_engine.demo import DEMO_TARGET
from reference_engine.serving.stop_strings import StopStringText, held_back
from reference_engine.tokenizer import load_tokenizer

tok = load_tokenizer(DEMO_TARGET)
special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
eot = tok.token_to_id("<|endoftext|>")
words = tok.encode("The quick brown fox jumps over the lazy dog. ").ids


def run(ids: list[int], stops: tuple[str, ...] = (), skipped=frozenset()) -> tuple[float, int]:
    calls = [0]

    def decode(x: list[int]) -> str:
        calls[0] += 1
        return tok.decode(x)

    stream = StopStringText(decode, stops, skipped) if skipped else StopStringText(decode, stops)
    start = time.perf_counter()
    for i, token in enumerate(ids):
        stream.push([token], final=i == len(ids) - 1)
    return time.perf_counter() - start, calls[0]


print("| output | stop strings | special ids given | seconds | decodes |")
print("|---|---|---|---|---|")
before, short = "--before" in sys.argv[1:], "--short" in sys.argv[1:]
for n in (1600,) if short else (1600, 8000):
    ids = tok.encode("Hello there").ids + [eot] * n + tok.encode(" world").ids
    for skipped in (frozenset(),) if before else (frozenset(), special_ids):
        seconds, calls = run(ids, skipped=skipped)
        print(f"| text, {n} x <|endoftext|>, text | none | {bool(skipped)} | {seconds:.3f} | {calls} |")
stops = ("never there", "another stop", "<end>", "###")
for n in (4000, 16000, 32000):
    ids = (words * (n // len(words) + 1))[:n]
    for s in ((), stops):
        seconds, calls = run(ids, s)
        print(f"| {n} tokens of text | {len(s)} | no | {seconds:.3f} | {calls} |")

print()
print("| stop string | text | held_back ms a call |")
print("|---|---|---|")
for label, stop, text in (
    ("'ab' x 512 (1024 characters)", "ab" * 512, "x" * 50000 + "ab" * 100),
    ("'ab' x 8000 (16000, over the limit)", "ab" * 8000, "x" * 50000 + "ab" * 100),
):
    start = time.perf_counter()
    for _ in range(10):
        held_back(text, (stop,))
    print(f"| {label} | 50000 + 200 characters | {(time.perf_counter() - start) * 100:.3f} |")

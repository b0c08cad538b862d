"""Where two answers to one request first differ, and what differed.

Like is compared with like, and every field an answer reports must agree. When both servers
report the generated token ids (ours, vLLM with `return_token_ids`), the ids *and* the texts
are compared; otherwise the texts, and at a text difference the first differing token is
located by tokenising both texts with the model's tokenizer (`--tokenizer`; without it only
the character position is known). Each divergence says what differed (`what`):

    token          the token ids differ at a position: a tie when the baseline's top-2
                   margin there is below the threshold and the candidate's token is the
                   baseline's other one (where the baseline lists alternatives by id), else a
                   mismatch
    length         one answer is a strict prefix of the other: one token short or long is a
                   mismatch, never a tie
    text           the ids agree and the texts do not
    ids_text       the ids differ and the texts are the same (ids that disagree with text)
    reasoning      the same tokens and text, another reasoning text (a chat reply's
                   `reasoning_content` or `reasoning`; none, null and "" are the same)
    tool_calls     the same tokens, text and reasoning, other tool calls (type, function
                   name and arguments, in order; none, null and [] are the same)
    finish_reason  the same tokens, another finish_reason
    prompt         the servers saw different prompts (usage.prompt_tokens or echoed prompt
                   ids disagree, or the candidate's echo is not the prompt sent)

Pure functions of the two answers (answer.py); compare.py runs the rounds and resumes after
a tie (a text comparison does not resume).
"""

from __future__ import annotations

from dataclasses import dataclass

from .answer import REASONING_FIELDS, Answer, Ask, listed_ids, listed_texts, margin, token_pieces, token_texts


@dataclass
class Divergence:
    position: int | None  # index in the generated output (None: text, no tokenizer)
    baseline_token: int
    candidate_token: int
    baseline_text: str
    candidate_text: str
    margin: float | None  # the baseline's top-1 minus top-2 logprob there
    kind: str  # "tie" or "mismatch"
    char_position: int | None = None  # in the generated text (text comparison) or the reasoning text
    what: str = "token"  # what differed (see the module doc)
    # the candidate's text over the agreed ids before this position was never compared: the
    # neither the baseline's token texts nor a tokenizer tell the text of the agreed ids
    prefix_unchecked: bool = False


def _divergence(
    base: Answer, cand: Answer, at: int, offset: int, kind: str, what: str, margin_: float | None = None
) -> Divergence:
    b_tok = base.ids[at] if base.ids and at < len(base.ids) else -1
    c_tok = cand.ids[at] if cand.ids and at < len(cand.ids) else -1
    texts = token_texts(base, at)
    return Divergence(
        offset + at,
        b_tok,
        c_tok,
        "(end)" if b_tok == -1 else texts.get(b_tok, "?"),
        "(end)" if c_tok == -1 else texts.get(c_tok, "?"),
        margin_,
        kind,
        what=what,
    )


def _first_char_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _text_divergence(base: Answer, cand: Answer, what: str | None = None) -> Divergence:
    """At the first differing character; `what` by default: `length` when one text is a
    prefix of the other, else `text`."""
    char = _first_char_difference(base.text, cand.text)
    if what is None:
        what = "length" if char == min(len(base.text), len(cand.text)) else "text"
    return Divergence(
        None,
        -1,
        -1,
        base.text[char : char + 20] or "(end)",
        cand.text[char : char + 20] or "(end)",
        None,
        "mismatch",
        char,
        what,
    )


def prompt_divergence(ask: Ask, base: Answer, cand: Answer, offset: int) -> Divergence | None:
    """Whether the servers saw different prompts, as far as their answers tell."""
    sent = list(ask.prompt) if isinstance(ask.prompt, tuple) else None
    pairs = [(base.prompt_tokens, cand.prompt_tokens, "prompt tokens")]
    if base.prompt_ids is not None and cand.prompt_ids is not None:
        pairs.append((base.prompt_ids, cand.prompt_ids, "prompt ids"))
    if sent is not None and cand.prompt_ids is not None:
        pairs.append((sent, cand.prompt_ids, "prompt ids"))
    for a, b, name in pairs:
        if a is not None and b is not None and a != b:
            shown = [len(x) if isinstance(x, list) else x for x in (a, b)]
            return Divergence(
                offset, -1, -1, f"{shown[0]} {name}", f"{shown[1]} {name}", None, "mismatch", what="prompt"
            )
    return None


def compare_texts(
    base: Answer, cand: Answer, tokenizer, offset: int, tie_threshold: float
) -> Divergence | None:
    """The first difference between two generated texts, located as a token by tokenising
    both texts (without a tokenizer: only the character position). A text that is a prefix
    of the other is a `length` mismatch."""
    a, b = base.text, cand.text
    if a == b:
        return None
    if tokenizer is None:
        return _text_divergence(base, cand)
    char = _first_char_difference(a, b)
    ta, tb = tokenizer.encode(a), tokenizer.encode(b)
    at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    b_tok = ta[at] if at < len(ta) else -1
    c_tok = tb[at] if at < len(tb) else -1
    margin_ = None
    if base.ids == ta and b_tok != -1 and c_tok != -1:  # its logprobs index these tokens
        margin_ = margin(base, at)
    what = "length" if -1 in (b_tok, c_tok) or char == min(len(a), len(b)) else "token"
    kind = (
        "mismatch"
        if what == "length"
        else _triage(base, at, c_tok, margin_, tie_threshold, cand_piece=tokenizer.token_text(c_tok))
    )
    text = tokenizer.token_text
    return Divergence(
        offset + at,
        b_tok,
        c_tok,
        "(end)" if b_tok == -1 else text(b_tok),
        "(end)" if c_tok == -1 else text(c_tok),
        margin_,
        kind,
        char,
        what,
    )


def _reasoning_pairs(base: Answer, cand: Answer) -> list[tuple[str, str, str]]:
    """(field, baseline text, candidate text) to compare. Servers name one reasoning text
    differently (`reasoning_content`, vLLM's newer `reasoning`, some both), so the texts a
    client reads are compared first (`reasoning_seen`, under the first name either side
    used), then every field either side sent, each side's field of that name or, where that
    side has none, its text: a field a client may read instead must say the same, whichever
    side sent it."""
    fields = base.reasoning.keys() | cand.reasoning.keys()
    name = next((n for n in REASONING_FIELDS if n in fields), REASONING_FIELDS[0])
    pairs = [(name, base.reasoning_seen, cand.reasoning_seen)]
    for field in sorted(fields):
        pairs.append(
            (
                field,
                base.reasoning.get(field, base.reasoning_seen),
                cand.reasoning.get(field, cand.reasoning_seen),
            )
        )
    return pairs


def _same_ending(base: Answer, cand: Answer, at: int, offset: int) -> Divergence | None:
    """After the same tokens: the same text, reasoning, tool calls and finish_reason."""
    if base.text != cand.text:
        return _text_divergence(base, cand, "text")
    for name, a, b in _reasoning_pairs(base, cand):
        if a != b:
            char = _first_char_difference(a, b)
            return Divergence(
                offset + at,
                -1,
                -1,
                f"{name}: {a[char : char + 20] or '(end)'}",
                f"{name}: {b[char : char + 20] or '(end)'}",
                None,
                "mismatch",
                char,
                "reasoning",
            )
    if base.tool_calls != cand.tool_calls:
        k = next(
            (k for k, (a, b) in enumerate(zip(base.tool_calls, cand.tool_calls)) if a != b),
            min(len(base.tool_calls), len(cand.tool_calls)),
        )
        shown = [
            f"{calls[k]['name']}({calls[k]['arguments'][:40]})" if k < len(calls) else "(none)"
            for calls in (base.tool_calls, cand.tool_calls)
        ]
        return Divergence(
            offset + at,
            -1,
            -1,
            f"call {k}: {shown[0]}",
            f"call {k}: {shown[1]}",
            None,
            "mismatch",
            what="tool_calls",
        )
    if base.finish_reason != cand.finish_reason:
        return Divergence(
            offset + at,
            -1,
            -1,
            base.finish_reason,
            cand.finish_reason,
            None,
            "mismatch",
            what="finish_reason",
        )
    return None


def text_round(
    base: Answer, cand: Answer, tokenizer, offset: int, tie_threshold: float
) -> tuple[Divergence | None, int]:
    """The divergence of one round compared by text (a server reported no ids), and the
    tokens agreed before it (known with a tokenizer only)."""
    divergence = compare_texts(base, cand, tokenizer, offset, tie_threshold)
    if divergence is not None:
        known = tokenizer is not None and divergence.position is not None
        return divergence, divergence.position - offset if known else 0
    agreed = tokenizer.count(base.text) if tokenizer is not None else 0
    divergence = _same_ending(base, cand, agreed, offset)
    counts = (base.completion_tokens, cand.completion_tokens)
    if divergence is None and None not in counts and counts[0] != counts[1]:
        divergence = Divergence(
            offset, -1, -1, f"{counts[0]} tokens", f"{counts[1]} tokens", None, "mismatch", what="length"
        )
    return divergence, agreed


def agreed_text(base: Answer, at: int, tokenizer) -> str | None:
    """The text of the baseline's first `at` generated tokens: its logprobs' token texts, else
    the agreed ids decoded by the tokenizer (up to a character a token boundary cuts, which
    decodes to U+FFFD), each trusted only as a prefix of the baseline's own text; None when
    neither tells it."""
    if at == 0:
        return ""
    pieces = token_pieces(base)
    if pieces is not None and len(pieces) >= at:
        joined = "".join(pieces[:at])
        # token texts need not join to the text (a character split over two tokens reads as
        # U+FFFD in each; a leading space dropped): then the tokenizer, else nothing
        if base.text.startswith(joined):
            return joined
    if tokenizer is not None:
        try:
            decoded = tokenizer.decode(base.ids[:at]).rstrip("\ufffd")
        except (OverflowError, TypeError, ValueError):  # ids the tokenizer cannot decode
            return None
        if base.text.startswith(decoded):
            return decoded
    return None


def ids_round(
    base: Answer, cand: Answer, offset: int, tie_threshold: float, tokenizer=None
) -> tuple[Divergence | None, int]:
    """The divergence of one round compared by ids (None: the same answer), and the
    tokens agreed before it. At a token divergence the candidate's text must still begin
    with the text of the agreed ids (`agreed_text`); where nothing tells that text the
    divergence says so (`prefix_unchecked`), since a tie would vouch for it."""
    base_ids, cand_ids = base.ids, cand.ids
    at = next((i for i, (a, b) in enumerate(zip(base_ids, cand_ids)) if a != b), None)
    if at is None:
        common = min(len(base_ids), len(cand_ids))
        if len(base_ids) != len(cand_ids):
            return _divergence(base, cand, common, offset, "mismatch", "length"), common
        return _same_ending(base, cand, common, offset), common
    if any(base.generated()) and base.generated() == cand.generated():  # other ids, the same text: a lie
        return _divergence(base, cand, at, offset, "mismatch", "ids_text"), at
    prefix = agreed_text(base, at, tokenizer)
    if prefix is not None and base.text.startswith(prefix) and not cand.text.startswith(prefix):
        return _text_divergence(base, cand, "text"), at  # the agreed ids, another text
    margin_ = margin(base, at)
    # the candidate sends no logprobs, so its token's text is known only as the text it goes on with
    cand_rest = cand.text[len(prefix) :] if prefix is not None and cand.text.startswith(prefix) else None
    kind = _triage(base, at, cand_ids[at], margin_, tie_threshold, cand_rest=cand_rest)
    divergence = _divergence(base, cand, at, offset, kind, "token", margin_)
    divergence.prefix_unchecked = prefix is None
    return divergence, at


def _triage(
    base: Answer,
    at: int,
    cand_token: int,
    margin_: float | None,
    tie_threshold: float,
    cand_piece: str | None = None,
    cand_rest: str | None = None,
) -> str:
    """A tie: the baseline's top two all but equal, and the candidate took another token the
    baseline lists there; else a mismatch. Alternatives listed by text only (no ids) are
    matched by the candidate token's text (`cand_piece`), else by the candidate's text from
    that position on (`cand_rest`) starting with a listed runner-up's; knowing neither, or
    finding no such runner-up, it is a mismatch (any token would do otherwise)."""
    if margin_ is None or margin_ >= tie_threshold:
        return "mismatch"
    listed = listed_ids(base, at)
    if listed is not None:
        return "tie" if cand_token in listed else "mismatch"
    pieces = token_pieces(base)
    own = pieces[at] if pieces and at < len(pieces) else None
    runners_up = {t for t in listed_texts(base, at) if t and t != own}
    if cand_piece is not None:
        return "tie" if cand_piece in runners_up else "mismatch"
    if cand_rest is not None:
        return "tie" if any(cand_rest.startswith(t) for t in runners_up) else "mismatch"
    return "mismatch"

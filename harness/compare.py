"""Token-by-token comparison of two OpenAI-compatible servers, with tie triage
(docs/harness-compare.md).

Both servers decode every prompt greedily. At a divergence of the token ids the baseline's
top-2 logprob margin there decides: `tie` below the threshold (kernels that round
differently may pick either of two all but equal tokens), `mismatch` otherwise (a bug). The
comparison then resumes from the prompt + the common prefix + the baseline's token, as
token ids, so one tie does not hide a later bug (a chat prompt cannot be extended by ids,
nor a text comparison: what follows such a tie is `unchecked`).
Only the baseline is asked for logprobs (a candidate asked for them may leave its
speculative path, ours does); its answers are the reference, one request per prompt
whatever the number of concurrency levels. The candidate is asked for streamed answers by
default, the path a client sees. Chat prompts go to /v1/chat/completions.

Like is compared with like, and every field an answer reports must agree (divergence.py):
ids and texts when both servers report ids, else texts.

A reply that is not an answer is a named error (answer.py), never a comparison. Each prompt
records what was compared (`ids`, `text`, or `none` after an error). Requests carry only the
extensions the server accepts (`Endpoint.server`, see server_kind.py). At each concurrency
level N the candidate gets every prompt in a closed loop, N in flight.

The verdict: a run passes when every level passes (no error, no mismatch, ties within the
policy: tie-tolerant allows `max_tie_rate` per comparison at each level, strict none, and no
comparison left `unchecked`: a tie it could not resume from, with output positions after it
that were never compared, or a tie before which the candidate's text over the agreed ids
could not be compared (neither the baseline's token texts nor a tokenizer tell that text),
fails as `unchecked`, since a pass would vouch for them; and no prompt left
unsent: token-id prompts for a server that takes text only, without a tokenizer to decode
them, fail the run as `unsent`, so a candidate cannot choose the prompts it is judged on by
refusing ids at the probe). No comparison at all is the error `no_usable_prompts`, never a
pass; a run with errors is named after its first (by level, then prompt). The summary counts
overall, per level and per context bucket (prompt tokens from the server's usage, else the
prompt's id count).

Default tie threshold, 0.1 (logprob units, equal to the logit margin): bfloat16 keeps 8
significant bits, so a logit of magnitude 16-32 is rounded in steps of 0.125 and two
kernels that accumulate in a different order disagree by about one such step; a top-2 gap
below 0.1 is inside that rounding, a larger one is not explained by it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from .answer import Answer, AnswerError, Ask, ask_server, takes_ids
from .client import Endpoint
from .divergence import Divergence, ids_round, prompt_divergence, text_round
from .workloads import Prompt

POLICIES = ("strict", "tie-tolerant")
DEFAULT_TIE_THRESHOLD = 0.1
# context buckets: the nearest of 128, 512 and 4096 tokens on a log scale
CONTEXT_BUCKETS = (("~128", 256), ("~512", 1448), ("~4096", 8192))


def context_bucket(tokens: int | None) -> str:
    if tokens is None:
        return "unknown"
    return next((name for name, upper in CONTEXT_BUCKETS if tokens <= upper), ">8192")


@dataclass(frozen=True)
class ComparePolicy:
    policy: str = "tie-tolerant"
    tie_threshold: float = DEFAULT_TIE_THRESHOLD
    max_tie_rate: float = 0.05  # ties per compared prompt at each level, tie-tolerant only
    max_divergences: int = 5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy '{self.policy}', expected one of {POLICIES}")


@dataclass
class PromptResult:
    index: int
    exact: bool
    compared_tokens: int
    divergences: list[Divergence] = field(default_factory=list)
    error: str | None = None
    compared: str = "none"  # "ids", "text", or "none" (an error before any comparison)
    error_name: str | None = None  # e.g. "http_500", "empty_choices" (answer.py)
    concurrency: int = 1
    endpoint: str = "completions"  # or "chat"
    source: str | None = None  # "FILE:LINE" or "builtin:SET#INDEX"
    prompt: dict | None = None  # {"text": ...}, {"token_ids": [...]} or {"messages": [...]}
    prompt_tokens: int | None = None
    context: str = "unknown"  # the context bucket
    max_tokens: int | None = None
    # what output was never compared, and why: the positions after a tie that could not be
    # resumed from (a chat prompt, a text comparison, ...), or the text over the agreed ids
    # before a tie that nothing told; None when everything was compared
    unchecked: str | None = None

    @property
    def key(self) -> str:
        return comparison_key(self.concurrency, self.source, self.prompt, self.max_tokens)


def comparison_key(concurrency: int, source: str | None, prompt: dict | None, max_tokens: int | None) -> str:
    """What identifies one comparison across runs (for --resume)."""
    return json.dumps([concurrency, source, prompt, max_tokens], sort_keys=True)


@dataclass(frozen=True)
class Case:
    """One usable prompt, numbered in the given order."""

    index: int
    source: str
    first: Ask

    @property
    def prompt(self) -> dict:
        if self.first.chat:
            return {"messages": list(self.first.messages)}
        if isinstance(self.first.prompt, tuple):
            return {"token_ids": list(self.first.prompt)}
        return {"text": self.first.prompt}


def plan(
    prompts: Sequence[Prompt], max_tokens: int, endpoints: Sequence[Endpoint]
) -> tuple[list[Case], list[str], list[str]]:
    """The usable prompts; why each prompt unusable in itself is (empty, chat turns without
    roles); and why each prompt a server would not take was not sent (token ids for a server
    that takes text only, with no --tokenizer to decode them into text). The first are the
    prompts file's fault and only noted; the second are a server's choice, so the verdict
    fails on them (`unsent`): a candidate that refuses token-id prompts at the probe must
    not shrink the set of prompts it is judged on."""
    cases, unusable, unsent = [], [], []
    for i, p in enumerate(prompts):
        source = p.source or f"#{i}"
        why = refused = None
        if p.messages is not None:
            if not p.messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in p.messages
            ):
                why = "chat messages without a role each (or none at all)"
            ask = Ask(max_tokens, messages=tuple(p.messages))
        elif p.token_ids is not None:
            refusing = [e.base_url for e in endpoints if not takes_ids(e)]
            if not p.token_ids:
                why = "no token ids"
            elif refusing:
                refused = f"token ids, and {refusing[0]} takes text only (give --tokenizer)"
            ask = Ask(max_tokens, prompt=tuple(p.token_ids))
        else:
            why = "an empty prompt" if not p.text else None
            ask = Ask(max_tokens, prompt=p.text)
        if why is not None:
            unusable.append(f"{source}: {why}")
        elif refused is not None:
            unsent.append(f"{source}: {refused}")
        else:
            cases.append(Case(i, source, ask))
    return cases, unusable, unsent


class _Session:
    """One comparison run: the HTTP client, both servers, the baseline's answers so far."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        baseline: Endpoint,
        candidate: Endpoint,
        policy: ComparePolicy,
        stream: bool,
    ) -> None:
        self.client, self.baseline, self.candidate = client, baseline, candidate
        self.policy, self.stream = policy, stream
        self.reference: dict[str, asyncio.Task] = {}  # Ask.key() -> the baseline's answer

    async def answers(self, ask: Ask) -> tuple[Answer, Answer]:
        if ask.key() not in self.reference:
            self.reference[ask.key()] = asyncio.ensure_future(
                ask_server(self.client, self.baseline, ask, logprobs=True, stream=False)
            )
        base, cand = await asyncio.gather(
            self.reference[ask.key()],
            ask_server(self.client, self.candidate, ask, logprobs=False, stream=self.stream),
            return_exceptions=True,
        )
        for side, got in (("baseline", base), ("candidate", cand)):
            if isinstance(got, AnswerError):
                raise AnswerError(got.name, f"{side}: {got.message}")
            if isinstance(got, BaseException):
                raise got
        return base, cand

    async def level(
        self, cases: list[Case], concurrency: int, on_result: Callable[[PromptResult], None] | None
    ) -> list[PromptResult]:
        """Every case, `concurrency` in flight: each worker takes the next when it is done."""
        queue, results = iter(cases), []

        async def worker() -> None:
            for case in queue:
                result = await compare_prompt(self, case, concurrency)
                results.append(result)
                if on_result is not None:
                    on_result(result)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(cases)))))
        return sorted(results, key=lambda r: r.index)


async def compare_prompt(session: _Session, case: Case, concurrency: int) -> PromptResult:
    result = PromptResult(
        case.index,
        True,
        0,
        concurrency=concurrency,
        endpoint="chat" if case.first.chat else "completions",
        source=case.source,
        prompt=case.prompt,
        max_tokens=case.first.max_tokens,
    )
    policy = session.policy
    ask, offset = case.first, 0  # offset: output positions settled before this round
    try:
        while ask.max_tokens > 0:
            base, cand = await session.answers(ask)
            withheld_ids(session, base, cand)
            if offset == 0:
                result.prompt_tokens = (
                    base.prompt_tokens
                    or cand.prompt_tokens
                    or (
                        len(base.prompt_ids)
                        if base.prompt_ids
                        else len(ask.prompt)
                        if isinstance(ask.prompt, tuple)
                        else None
                    )
                )
                result.context = context_bucket(result.prompt_tokens)
            by_ids = base.ids is not None and cand.ids is not None
            result.compared = "ids" if by_ids else "text"
            divergence = prompt_divergence(ask, base, cand, offset)
            if divergence is None:
                tokenizer = session.candidate.tokenizer or session.baseline.tokenizer
                threshold = policy.tie_threshold
                divergence, agreed = (
                    ids_round(base, cand, offset, threshold, tokenizer)
                    if by_ids
                    else text_round(base, cand, tokenizer, offset, threshold)
                )
                result.compared_tokens += agreed
            if divergence is None:
                return result
            result.exact = False
            result.divergences.append(divergence)
            if divergence.kind != "tie":
                return result
            if divergence.prefix_unchecked:
                _unchecked(
                    result,
                    f"the text of positions {offset}-{divergence.position - 1}, before the tie at "
                    f"{divergence.position}: neither the baseline's logprobs (token texts that join "
                    "to its text) nor a --tokenizer (a decode that begins it) tell that text",
                )
            # resume after the tie: prompt + common prefix + the baseline's token, as ids
            at = divergence.position - offset
            prompt_ids = (
                base.prompt_ids
                if base.prompt_ids is not None
                else (list(ask.prompt) if isinstance(ask.prompt, tuple) else None)
            )
            why = _why_not_resumed(session, ask, by_ids, prompt_ids, len(result.divergences))
            if why is not None:
                if ask.max_tokens > at + 1:  # positions after the tie that were never compared
                    _unchecked(result, f"from position {divergence.position + 1} on: {why}")
                return result
            ask = Ask(ask.max_tokens - (at + 1), prompt=tuple(prompt_ids) + tuple(base.ids[: at + 1]))
            offset += at + 1
    except AnswerError as exc:
        result.error, result.error_name = exc.message, exc.name
        result.exact = False
    return result


def _unchecked(result: PromptResult, why: str) -> None:
    """Note output the comparison did not check (each such stretch, in order)."""
    result.unchecked = why if result.unchecked is None else f"{result.unchecked}; {why}"


def _why_not_resumed(
    session: _Session, ask: Ask, by_ids: bool, prompt_ids: list[int] | None, divergences: int
) -> str | None:
    """Why the comparison cannot go on after a tie (None: it can)."""
    if divergences >= session.policy.max_divergences:
        return f"--max-divergences {session.policy.max_divergences} reached"
    if not by_ids:
        return "a text comparison does not resume (no ids to resume from)"
    if ask.chat:
        return "a chat prompt cannot be extended by token ids"
    if prompt_ids is None:
        return "the prompt's token ids are not known (neither sent nor echoed)"
    refusing = [e.base_url for e in (session.baseline, session.candidate) if not takes_ids(e)]
    if refusing:
        return f"{refusing[0]} takes no token-id prompts"
    return None


def withheld_ids(session: _Session, base: Answer, cand: Answer) -> None:
    """AnswerError when a side whose server kind returns token ids sent none: without them the
    comparison falls back to text, where another token sequence with the same text, or
    another token count, would pass."""
    for side, endpoint, answer in (
        ("baseline", session.baseline, base),
        ("candidate", session.candidate, cand),
    ):
        if answer.ids is None and endpoint.accepts.returns_ids:
            raise AnswerError(
                "missing_ids",
                f"the {side}'s answer carries no token ids, though its server kind "
                f"({endpoint.accepts.name}) returns them",
            )


def compared_kind(results: list[PromptResult]) -> str:
    """What the comparisons were over the prompts compared: ids, text, mixed or none."""
    kinds = {r.compared for r in results if r.compared != "none" and not r.error}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _counts(results: list[PromptResult]) -> dict:
    prompts = len(results)
    exact = sum(1 for r in results if r.exact and not r.error)
    ties = sum(1 for r in results for d in r.divergences if d.kind == "tie")
    return {
        "prompts": prompts,
        "exact": exact,
        "ties": ties,
        "mismatches": sum(1 for r in results for d in r.divergences if d.kind == "mismatch"),
        "errors": sum(1 for r in results if r.error),
        "unchecked": sum(1 for r in results if r.unchecked and not r.error),
        "match_rate": exact / prompts if prompts else 0.0,
        "tie_rate": ties / prompts if prompts else 0.0,
    }


def _reason(counts: dict, policy: ComparePolicy) -> str | None:
    """Why one group of comparisons fails (None: it passes)."""
    if counts["errors"]:
        return "error"
    if counts["mismatches"]:
        return "mismatch"
    if counts["ties"] and (policy.policy == "strict" or counts["tie_rate"] > policy.max_tie_rate):
        return "ties"
    if counts["unchecked"]:
        return "unchecked"  # a pass would vouch for tokens never compared
    return None


def verdict(
    results: list[PromptResult],
    policy: ComparePolicy,
    unusable: Sequence[str] = (),
    unsent: Sequence[str] = (),
) -> dict:
    """The summary of a run. `unusable`: prompts unusable in themselves (noted); `unsent`:
    prompts a server would not take, never compared, which fail the run (`unsent`) unless
    something else already does."""
    results = sorted(results, key=lambda r: (r.concurrency, r.index))
    levels = sorted({r.concurrency for r in results})
    by_level = {str(c): _counts([r for r in results if r.concurrency == c]) for c in levels}
    contexts = [name for name, _ in CONTEXT_BUCKETS] + [">8192", "unknown"]
    by_context = {b: _counts(group) for b in contexts if (group := [r for r in results if r.context == b])}
    failed = next((r for r in results if r.error), None)
    first = next((d for r in results for d in r.divergences if d.kind == "mismatch"), None)
    error = message = None
    if not results:
        error = "no_usable_prompts"
        first_why = [*unsent, *unusable][:1]
        message = "no usable prompt" + (f" ({first_why[0]})" if first_why else "")
    elif failed is not None:
        error, message = failed.error_name, failed.error
    if error is not None:
        reason = error
    else:
        reasons = {_reason(c, policy) for c in by_level.values()}
        reason = next((r for r in ("mismatch", "ties", "unchecked") if r in reasons), None)
        if reason is None and unsent:
            reason = "unsent"  # a pass would vouch for prompts never compared
    return {
        **_counts(results),
        "policy": policy.policy,
        "tie_threshold": policy.tie_threshold,
        "max_tie_rate": policy.max_tie_rate,
        "verdict": "fail" if reason else "pass",
        "reason": reason,
        "error": error,
        "error_message": message,
        "compared": compared_kind(results),
        "compared_ids": sum(1 for r in results if r.compared == "ids" and not r.error),
        "compared_text": sum(1 for r in results if r.compared == "text" and not r.error),
        "distinct_prompts": len({(r.source, json.dumps(r.prompt, sort_keys=True)) for r in results}),
        "unusable": len(unusable),
        "unusable_reasons": list(unusable[:5]),
        "unsent": len(unsent),
        "unsent_reasons": list(unsent[:5]),
        "levels": levels,
        "by_concurrency": by_level,
        "by_context": by_context,
        "first_mismatch": first.what if first else None,
        "first_unchecked": next((r.unchecked for r in results if r.unchecked and not r.error), None),
        "mismatch_what": dict(
            Counter(d.what for r in results for d in r.divergences if d.kind == "mismatch")
        ),
        "errors_by_name": dict(Counter(r.error_name for r in results if r.error)),
    }


async def compare(
    baseline: Endpoint,
    candidate: Endpoint,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency: int | Sequence[int],
    policy: ComparePolicy,
    stream: bool = True,
    timeout: float = 300.0,
    done: Mapping[str, PromptResult] | None = None,
    on_result: Callable[[PromptResult], None] | None = None,
) -> tuple[list[PromptResult], dict]:
    """Compare every usable prompt at each concurrency level. `done`: comparisons already
    made (by key, from an earlier run), kept as they are; `on_result` sees each new one."""
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    cases, unusable, unsent = plan(prompts, max_tokens, (baseline, candidate))
    done = done or {}
    results: list[PromptResult] = []
    if cases:
        limits = httpx.Limits(max_connections=2 * max(levels) + 2)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            session = _Session(client, baseline, candidate, policy, stream)
            for level in levels:
                keys = {c.index: comparison_key(level, c.source, c.prompt, max_tokens) for c in cases}
                results += [done[keys[c.index]] for c in cases if keys[c.index] in done]
                todo = [c for c in cases if keys[c.index] not in done]
                results += await session.level(todo, level, on_result)
    results.sort(key=lambda r: (r.concurrency, r.index))
    return results, verdict(results, policy, unusable, unsent)

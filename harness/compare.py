"""Token-by-token comparison of two OpenAI-compatible servers, with tie triage.

For every prompt both servers decode greedily (temperature 0); the generated token ids
are compared. At a divergence the baseline's top-2 logprob margin at that position decides:
`tie` when it is below the threshold (the two tokens were all but equally likely: kernels
that round differently may pick either), `mismatch` otherwise (a bug). The comparison then
resumes: both servers get the prompt + the common prefix + the baseline's token, as token
ids, so one tie does not hide a later bug; up to `max_divergences` per prompt.

Only the baseline is asked for logprobs: a candidate asked for logprobs may leave its
speculative path (ours does), and the gate must test that path.

Like is compared with like. When both servers report the generated token ids (ours, vLLM
with `return_token_ids`), ids are compared. Otherwise texts are compared, and at a text
difference the first differing token is located by tokenising both texts with the model's
tokenizer (`--tokenizer`; without it only the character position is known); a text
comparison does not resume. Each prompt records what was compared (`ids`, `text`, or
`none` when a request failed: an error is never counted as a comparison), and the summary
says `ids`, `text` or `mixed` over the prompts compared. Requests carry only the
extensions the server accepts (`Endpoint.server`, see server_kind.py).

Default tie threshold, 0.1 (logprob units, equal to the logit margin): bfloat16 keeps 8
significant bits, so a logit of magnitude 16-32 is rounded in steps of 0.125 and two
kernels that accumulate in a different order disagree by about one such step; a top-2 gap
below 0.1 is inside that rounding, a larger one is not explained by it.
"""

from __future__ import annotations

import asyncio
import csv
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from .client import Endpoint
from .workloads import Prompt

POLICIES = ("strict", "tie-tolerant")
DEFAULT_TIE_THRESHOLD = 0.1


@dataclass(frozen=True)
class ComparePolicy:
    policy: str = "tie-tolerant"
    tie_threshold: float = DEFAULT_TIE_THRESHOLD
    max_tie_rate: float = 0.05  # ties per compared prompt, tie-tolerant only
    max_divergences: int = 5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy '{self.policy}', expected one of {POLICIES}")


@dataclass
class Divergence:
    position: int | None  # index in the generated output (None: text, no tokenizer)
    baseline_token: int
    candidate_token: int
    baseline_text: str
    candidate_text: str
    margin: float | None  # the baseline's top-1 minus top-2 logprob there
    kind: str  # "tie" or "mismatch"
    char_position: int | None = None  # in the generated text, for a text comparison


@dataclass
class PromptResult:
    index: int
    exact: bool
    compared_tokens: int
    divergences: list[Divergence] = field(default_factory=list)
    error: str | None = None
    compared: str = "none"  # "ids", "text", or "none" (an error before any comparison)


class ServerError(RuntimeError):
    pass


async def _complete(client: httpx.AsyncClient, endpoint: Endpoint, prompt, max_tokens: int,
                    logprobs: bool) -> dict:
    if isinstance(prompt, list) and not endpoint.accepts.prompt_ids:
        if endpoint.tokenizer is None:
            raise ServerError(f"{endpoint.base_url} ({endpoint.accepts.name}) takes no token-id "
                              "prompts: give text prompts or --tokenizer")
        prompt = endpoint.tokenizer.decode(prompt)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **endpoint.accepts.extras(ignore_eos=False)}
    if endpoint.model:
        body["model"] = endpoint.model
    if logprobs:
        body["logprobs"] = 2
    r = await client.post(endpoint.base_url.rstrip("/") + "/v1/completions", json=body,
                          headers=endpoint.headers())
    if r.status_code != 200:
        raise ServerError(f"{endpoint.base_url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]


def _ids(choice: dict) -> list[int] | None:
    """The generated token ids, when the server reports them."""
    if choice.get("token_ids") is not None:
        return list(choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    if logprobs.get("token_ids") is not None:
        return list(logprobs["token_ids"])
    return None


def compare_texts(base: dict, cand: dict, tokenizer, offset: int,
                  policy: ComparePolicy) -> Divergence | None:
    """The first difference between two generated texts, located as a token by tokenising
    both texts (without a tokenizer: only the character position)."""
    a, b = base.get("text") or "", cand.get("text") or ""
    if a == b:
        return None
    char = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if tokenizer is None:
        return Divergence(None, -1, -1, a[char:char + 20], b[char:char + 20] or "(end)", None,
                          "mismatch", char)
    ta, tb = tokenizer.encode(a), tokenizer.encode(b)
    at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    b_tok = ta[at] if at < len(ta) else -1
    c_tok = tb[at] if at < len(tb) else -1
    margin = None
    if _ids(base) == ta and b_tok != -1:  # the baseline's logprobs index these very tokens
        margin = _margin(base, at)
    kind = "tie" if margin is not None and margin < policy.tie_threshold else "mismatch"
    text = tokenizer.token_text
    return Divergence(offset + at, b_tok, c_tok, "(end)" if b_tok == -1 else text(b_tok),
                      "(end)" if c_tok == -1 else text(c_tok), margin, kind, char)


def _texts(choice: dict, position: int) -> dict[int, str]:
    """Token id -> text at one position, from the baseline's logprobs (when it gives both)."""
    logprobs = choice.get("logprobs") or {}
    out = {}
    ids, tokens = logprobs.get("token_ids"), logprobs.get("tokens")
    if ids and tokens and position < len(ids):
        out[ids[position]] = tokens[position]
    by_id, by_text = logprobs.get("top_token_logprobs"), logprobs.get("top_logprobs")
    if by_id and by_text and position < len(by_id) and position < len(by_text):
        out.update(zip((e["token_id"] for e in by_id[position]), by_text[position]))
    return out


def _margin(choice: dict, position: int) -> float | None:
    logprobs = choice.get("logprobs") or {}
    by_id = logprobs.get("top_token_logprobs")
    if by_id and position < len(by_id):
        values = sorted((e["logprob"] for e in by_id[position]), reverse=True)
    else:
        top = logprobs.get("top_logprobs")
        if not top or position >= len(top) or not top[position]:
            return None
        values = sorted(top[position].values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


async def compare_prompt(client: httpx.AsyncClient, baseline: Endpoint, candidate: Endpoint,
                         index: int, prompt: Prompt, max_tokens: int,
                         policy: ComparePolicy) -> PromptResult:
    result = PromptResult(index, True, 0)
    current = list(prompt.token_ids) if prompt.token_ids is not None else prompt.text
    budget = max_tokens
    offset = 0  # output positions already settled before this round
    try:
        while budget > 0:
            base, cand = await asyncio.gather(
                _complete(client, baseline, current, budget, logprobs=True),
                _complete(client, candidate, current, budget, logprobs=False))
            base_ids, cand_ids = _ids(base), _ids(cand)
            if base_ids is None or cand_ids is None:  # text with text; no resumption
                result.compared = "text"
                tokenizer = candidate.tokenizer or baseline.tokenizer
                divergence = compare_texts(base, cand, tokenizer, offset, policy)
                if tokenizer is not None:
                    result.compared_tokens += tokenizer.count(base.get("text") or "") \
                        if divergence is None else divergence.position - offset
                if divergence is not None:
                    result.exact = False
                    result.divergences.append(divergence)
                return result
            result.compared = "ids"
            at = next((i for i, (a, b) in enumerate(zip(base_ids, cand_ids)) if a != b), None)
            if at is None:
                result.compared_tokens += min(len(base_ids), len(cand_ids))
                if len(base_ids) != len(cand_ids):
                    at = min(len(base_ids), len(cand_ids))  # one stopped early
                else:
                    return result
            result.exact = False
            margin = _margin(base, at) if at < len(base_ids) else None
            kind = "tie" if margin is not None and margin < policy.tie_threshold else "mismatch"
            b_tok = base_ids[at] if at < len(base_ids) else -1
            c_tok = cand_ids[at] if at < len(cand_ids) else -1
            texts = _texts(base, at)
            result.divergences.append(Divergence(
                offset + at, b_tok, c_tok, texts.get(b_tok, "?"),
                texts.get(c_tok, "(end)" if c_tok == -1 else "?"), margin, kind))
            result.compared_tokens += at
            if len(result.divergences) >= policy.max_divergences or at >= len(base_ids):
                return result
            prefix_ids = base.get("prompt_token_ids")
            if prefix_ids is None and prompt.token_ids is None:
                return result  # cannot resume without the prompt's ids
            base_prompt = prefix_ids if prefix_ids is not None else current
            current = list(base_prompt) + base_ids[: at + 1]
            offset += at + 1
            budget -= at + 1
    except (ServerError, httpx.HTTPError) as exc:
        result.error = str(exc)
        result.exact = False
    return result


def compared_kind(results: list[PromptResult]) -> str:
    """What the comparisons were over the prompts compared: ids, text, mixed or none."""
    kinds = {r.compared for r in results if r.compared != "none" and not r.error}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def verdict(results: list[PromptResult], policy: ComparePolicy) -> dict:
    prompts = len(results)
    errors = sum(1 for r in results if r.error)
    exact = sum(1 for r in results if r.exact and not r.error)
    ties = sum(1 for r in results for d in r.divergences if d.kind == "tie")
    mismatches = sum(1 for r in results for d in r.divergences if d.kind == "mismatch")
    tie_rate = ties / prompts if prompts else 0.0
    if policy.policy == "strict":
        passed = exact == prompts
    else:
        passed = mismatches == 0 and errors == 0 and tie_rate <= policy.max_tie_rate
    return {"prompts": prompts, "exact": exact, "ties": ties, "mismatches": mismatches,
            "errors": errors, "match_rate": exact / prompts if prompts else 0.0,
            "tie_rate": tie_rate, "policy": policy.policy,
            "tie_threshold": policy.tie_threshold, "verdict": "pass" if passed else "fail",
            "compared": compared_kind(results),
            "compared_ids": sum(1 for r in results if r.compared == "ids" and not r.error),
            "compared_text": sum(1 for r in results if r.compared == "text" and not r.error)}


async def compare(baseline: Endpoint, candidate: Endpoint, prompts: list[Prompt],
                  max_tokens: int, concurrency: int,
                  policy: ComparePolicy) -> tuple[list[PromptResult], dict]:
    """Compare every prompt, `concurrency` at a time (batching on the candidate)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300,
                                 limits=httpx.Limits(max_connections=2 * concurrency)) as client:
        async def one(i: int, prompt: Prompt) -> PromptResult:
            async with semaphore:
                return await compare_prompt(client, baseline, candidate, i, prompt, max_tokens,
                                            policy)

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(results), verdict(list(results), policy)


def write_outputs(out: Path, results: list[PromptResult], summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compare.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "compare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "compare_summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary))
        writer.writeheader()
        writer.writerow(summary)
    (out / "compare.md").write_text(markdown(results, summary))


def md_quote(text: str) -> str:
    """`text` as one inline code span that cannot break a markdown table or line: control
    characters written as escapes (repr), pipes escaped, a fence longer than any backtick run."""
    body = repr(text)[1:-1].replace("|", "\\|")
    if not body:
        return "(empty)"
    fence = "`" * (max((len(run) for run in re.findall("`+", body)), default=0) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


COMPARED = {"ids": "token ids", "text": "text (a server reported no ids)",
            "none": "nothing (error)"}


def markdown(results: list[PromptResult], summary: dict, shown: int = 5) -> str:
    compared = summary["prompts"] - summary["errors"]
    lines = [
        "## HTTP equivalence",
        "",
        f"Verdict: **{summary['verdict']}** (policy `{summary['policy']}`, tie threshold "
        f"{summary['tie_threshold']} logprob). Prompts {summary['prompts']}: compared "
        f"{compared} ({summary['compared_ids']} by token ids, {summary['compared_text']} by "
        f"text), errors {summary['errors']} (not comparisons); exact {summary['exact']} "
        f"({100 * summary['match_rate']:.1f}%), ties {summary['ties']}, mismatches "
        f"{summary['mismatches']}. Compared: **{summary['compared']}**.",
        "",
    ]
    divergent = [(r, d) for r in results for d in r.divergences]
    if divergent:
        lines += ["| prompt | compared | position | baseline | candidate | margin | kind |",
                  "|---|---|---|---|---|---|---|"]
        for r, d in divergent[:shown]:
            margin = "n/a" if d.margin is None else f"{d.margin:.4f}"
            position = f"character {d.char_position}" if d.position is None else str(d.position)
            lines.append(f"| {r.index} | {r.compared} | {position} | {d.baseline_token} "
                         f"{md_quote(d.baseline_text)} | {d.candidate_token} "
                         f"{md_quote(d.candidate_text)} | {margin} | {d.kind} |")
        lines.append("")
    lines += ["Per prompt:", "", "| prompt | compared | result |", "|---|---|---|"]
    for r in results:
        outcome = ("error: " + md_quote(r.error[:200])) if r.error else \
            "exact" if r.exact else f"{len(r.divergences)} divergence(s)"
        lines.append(f"| {r.index} | {COMPARED[r.compared if not r.error else 'none']} "
                     f"| {outcome} |")
    return "\n".join(lines) + "\n"

"""Which OpenAI extensions a server accepts, so the harness sends only those.

Plain OpenAI servers (Hugging Face `transformers serve`, hosted APIs) reject fields they do
not know (HTTP 422 or 400), so a request that carries vLLM's `ignore_eos` or
`return_token_ids` fails on them. A `ServerKind` lists what one kind of server accepts and
where it reports generated token ids; `probe` decides it for a server we were not told
about, from `GET /v1/models` (`owned_by`), `GET /metrics` (metric name prefixes) and one
tiny request sent with the guessed kind's extensions (a refusal downgrades to plain OpenAI).
Plain OpenAI takes token-id prompts (the API allows them) unless the server refuses one
with a 4xx (`transformers serve` takes text only).

    kind      ignore_eos  continuous usage  return_token_ids  ids in responses
    ours      yes         yes               no (always on)    token_ids in every choice
    vllm      yes         yes               yes               token_ids, prompt_token_ids
    sglang    yes         yes               no                meta_info (native /generate)
    lmdeploy  yes         no                no                none
    openai    no          no                no                none

Where a server reports no ids, token counts come from the model's tokenizer
(`--tokenizer DIR`) and every record says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import httpx

SERVER_KINDS = ("auto", "ours", "vllm", "sglang", "lmdeploy", "openai")


@dataclass(frozen=True)
class ServerKind:
    name: str
    ignore_eos: bool = False  # accepts `ignore_eos`
    continuous_usage: bool = False  # accepts stream_options.continuous_usage_stats
    return_token_ids: bool = False  # send vLLM's `return_token_ids` to get ids back
    prompt_ids: bool = False  # accepts a completions prompt as a list of token ids
    ids_in_responses: bool = False  # choices carry the generated token ids
    evidence: str = ""  # how the kind was decided

    def __post_init__(self) -> None:
        if self.name not in SERVER_KINDS[1:]:
            raise ValueError(f"unknown server kind '{self.name}', expected one of {', '.join(SERVER_KINDS)}")

    @property
    def returns_ids(self) -> bool:
        """Whether its answers carry the generated token ids (by default or when asked)."""
        return self.ids_in_responses or self.return_token_ids

    def extras(self, ignore_eos: bool) -> dict:
        """Fields beyond plain OpenAI to add to a completions or chat body."""
        body: dict = {}
        if ignore_eos and self.ignore_eos:
            body["ignore_eos"] = True
        if self.return_token_ids:
            body["return_token_ids"] = True
        return body

    def stream_options(self) -> dict:
        options = {"include_usage": True}  # plain OpenAI
        if self.continuous_usage:
            options["continuous_usage_stats"] = True
        return options

    def as_dict(self) -> dict:
        return {
            "server_kind": self.name,
            "ignore_eos": self.ignore_eos,
            "continuous_usage": self.continuous_usage,
            "ids_in_responses": self.returns_ids,
            "prompt_ids": self.prompt_ids,
            "evidence": self.evidence,
        }


KNOWN = {
    "ours": ServerKind(
        "ours", ignore_eos=True, continuous_usage=True, prompt_ids=True, ids_in_responses=True
    ),
    "vllm": ServerKind(
        "vllm",
        ignore_eos=True,
        continuous_usage=True,
        return_token_ids=True,
        prompt_ids=True,
        ids_in_responses=True,
    ),
    "sglang": ServerKind("sglang", ignore_eos=True, continuous_usage=True, prompt_ids=True),
    "lmdeploy": ServerKind("lmdeploy", ignore_eos=True, prompt_ids=True),
    # the OpenAI API takes a prompt as token ids; a server that refuses them (4xx) is noted
    "openai": ServerKind("openai", prompt_ids=True),
}
OWNERS = {"reference_engine": "ours", "vllm": "vllm", "sglang": "sglang", "lmdeploy": "lmdeploy"}
METRIC_PREFIXES = {"dflash:": "ours", "vllm:": "vllm", "sglang:": "sglang", "lmdeploy:": "lmdeploy"}


def _metric_names(page: str) -> set[str]:
    """The metric names of a Prometheus text page's samples (comments are not samples)."""
    names = set()
    for line in page.splitlines():
        line = line.strip()
        words = line.split("{", 1)[0].split(None, 1) if not line.startswith("#") else []
        if words:  # a line with no name before its labels (not Prometheus text) names nothing
            names.add(words[0])
    return names


@dataclass(frozen=True)
class ProbeResult:
    kind: ServerKind
    models: tuple[str, ...]  # ids listed by GET /v1/models


def _get(client: httpx.Client, url: str, headers: dict) -> httpx.Response | None:
    """A GET, following redirects (a Prometheus app mounted at /metrics answers with a 307 to
    /metrics/); None when there is no answer."""
    try:
        return client.get(url, headers=headers, follow_redirects=True)
    except httpx.HTTPError:
        return None


def _first_choice(response: httpx.Response) -> dict:
    """The first choice of a JSON completion; {} for anything else (a stream, not JSON)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    choices = body.get("choices") if isinstance(body, dict) else None
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}


def probe(
    base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 60.0
) -> ProbeResult:
    """Decide a server's kind from what it says about itself and one tiny request."""
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    notes, guess, models = [], None, ()
    with httpx.Client(timeout=timeout) as client:
        r = _get(client, base + "/v1/models", headers)
        if r is not None and r.status_code == 200:
            try:
                data = r.json().get("data") or []
            except (json.JSONDecodeError, AttributeError):
                data = []
            if not isinstance(data, list):  # a models list that is not one names no models
                data = []
            models = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
            owners = {str(m.get("owned_by")) for m in data if isinstance(m, dict)}
            guess = next((OWNERS[o] for o in owners if o in OWNERS), None)
            notes.append(f"/v1/models owned_by {sorted(owners)}")
        else:
            notes.append(f"/v1/models: {'no answer' if r is None else r.status_code}")
        r = _get(client, base + "/metrics", headers)
        if r is not None and r.status_code == 200:
            names = _metric_names(r.text)
            prefix = next(
                (k for p, k in METRIC_PREFIXES.items() if any(n.startswith(p) for n in names)), None
            )
            notes.append(f"/metrics: {prefix or 'no known prefix'}")
            guess = guess or prefix
        else:
            notes.append(f"/metrics: {'no answer' if r is None else r.status_code}")
        kind = KNOWN[guess or "openai"]
        body = {
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            **kind.extras(ignore_eos=True),
        }
        if model or models:
            body["model"] = model or models[0]
        try:
            r = client.post(base + "/v1/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:  # the run itself reports an unreachable server
            notes.append(f"probe request failed ({type(exc).__name__}): plain OpenAI")
            return ProbeResult(replace(KNOWN["openai"], evidence="; ".join(notes)), models)
        if r.status_code != 200 and kind.name != "openai":
            notes.append(f"a request with {kind.name} extensions got HTTP {r.status_code}: plain OpenAI")
            kind = KNOWN["openai"]
        elif r.status_code == 200:
            choice = _first_choice(r)
            notes.append(f"probe request ok, ids {'returned' if 'token_ids' in choice else 'absent'}")
            if "token_ids" in choice and not kind.returns_ids:
                kind = replace(kind, ids_in_responses=True)
            elif "token_ids" not in choice and kind.returns_ids:  # e.g. a vLLM before return_token_ids
                kind = replace(kind, ids_in_responses=False, return_token_ids=False)
                notes.append("no ids promised")
        else:
            notes.append(f"probe request: HTTP {r.status_code}: {r.text[:200]}")
        if kind.name == "openai":
            ids_body = {k: v for k, v in body.items() if k != "prompt"} | {"prompt": [1, 2]}
            try:
                status = client.post(base + "/v1/completions", json=ids_body, headers=headers).status_code
            except httpx.HTTPError:
                status = None
            refused = status is not None and 400 <= status < 500  # else: not known, try them
            kind = replace(kind, prompt_ids=not refused)
            notes.append(f"token-id prompts {'refused' if refused else 'accepted'}")
    return ProbeResult(replace(kind, evidence="; ".join(notes)), models)


def resolve(name: str, base_url: str, model: str | None = None, api_key: str | None = None) -> ProbeResult:
    """`--server-kind NAME`: a named kind as is, or `auto`: probe."""
    if name == "auto":
        return probe(base_url, model, api_key)
    if name not in KNOWN:
        raise ValueError(f"unknown server kind '{name}', expected one of {', '.join(SERVER_KINDS)}")
    return ProbeResult(replace(KNOWN[name], evidence="given"), ())

"""Measuring the demo pair: held-out prompts, acceptance through the engine, the model card."""

from __future__ import annotations

import random

from ..demo import DEMO_PROMPTS
from ..runtime.engine import Engine, EngineConfig
from ..runtime.request import SamplingParams
from .corpus import Corpus, CorpusError

PROMPTS_FILE = DEMO_PROMPTS.name


def heldout_prompts(corpus: Corpus, tokenizer, recipe) -> list[dict]:
    """One prompt per held-out file (files in a seeded order): `prompt_len` tokens from a
    seeded offset, as ids and as decoded text. None at all is a CorpusError."""
    rng = random.Random(recipe.seed)
    files = list(corpus.heldout)
    rng.shuffle(files)
    prompts = []
    for path in files:
        ids = tokenizer.encode(corpus.text(path)).ids
        if len(ids) < 2 * recipe.prompt_len:
            continue
        start = rng.randrange(len(ids) - recipe.prompt_len)
        window = ids[start : start + recipe.prompt_len]
        prompts.append({"file": path, "prompt_ids": window, "prompt": tokenizer.decode(window)})
        if len(prompts) == recipe.eval_prompts:
            break
    if not prompts:
        raise CorpusError(
            f"no held-out prompt: none of the {len(files)} held-out files is {2 * recipe.prompt_len} "
            f"tokens long (twice prompt_len {recipe.prompt_len}); lower prompt_len or hold out more files"
        )
    return prompts


def evaluate(target, draft, prompts: list[list[int]], block_sizes, max_tokens: int) -> dict:
    """Greedy outputs of plain and DFlash decode on all prompts at once (continuous batch);
    per block size: mean acceptance length, acceptance rate, and how many requests differ
    from plain decode."""
    if not prompts:
        raise CorpusError("no held-out prompt to evaluate the draft on")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def run(with_draft, block_size=None):
        engine = Engine(
            target,
            with_draft,
            EngineConfig(
                max_num_seqs=len(prompts),
                block_size=block_size,
                commit_strategy="per_token",
                # acceptance is a property of the draft at block size B: verify every draft
                # token, whatever a step's measured cost would choose
                verify_width="fixed",
                max_model_len=max(map(len, prompts)) + max_tokens,
            ),
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            engine.step()
        outputs = [engine.collect(str(i)).output_ids for i in range(len(prompts))]
        return outputs, engine.stats()

    plain, _ = run(None)
    result = {}
    for B in block_sizes:
        outputs, stats = run(draft, B)
        result[B] = {
            "mean_acceptance_length": stats["spec"]["mean_acceptance_length"],
            "acceptance_rate": stats["spec"]["acceptance_rate"],
            "mismatched_requests": sum(o != p for o, p in zip(outputs, plain)),
        }
    return result


def mean_tail(losses: list[float], n: int = 50) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def curve_rows(curve: list) -> str:
    return "\n".join(f"| {step} | {loss:.3f} |" for step, loss in curve)


def last_layer_note(rec: dict) -> str:
    """How the draft reads the target's last layer, when it lists it (a recipe without the
    setting is the shipped one, trained on the raw output)."""
    if rec["target_layers"] - 1 not in rec["target_layer_ids"]:
        return ""
    if rec.get("last_layer_feature", "raw") == "raw":
        return " (the last one's raw output, before the final norm)"
    return " (the last one after the final norm)"


def model_card(r: dict) -> str:
    rec, corpus, acc = r["recipe"], r["corpus"], r["acceptance"]
    rows = "\n".join(
        f"| {B} | {a['mean_acceptance_length']:.2f} | {a['acceptance_rate']:.3f} | "
        f"{a['mismatched_requests']} |"
        for B, a in acc.items()
    )
    seconds = r["seconds"]
    total = sum(seconds.values())
    return f"""# Demo pair: a small Qwen3.5 hybrid target and its DFlash draft

Trained by `scripts/train_demo_pair.py` (seed {rec["seed"]}) on {r["device"]}, Python
{r["python"]}, torch {r["torch"]}: target {seconds["target"]:.0f} s, the target's
continuations {seconds["continuations"]:.0f} s, draft {seconds["draft"]:.0f} s, evaluation
{seconds["eval"]:.0f} s ({total / 60:.1f} minutes). Both are stored in bfloat16, in the
Hugging Face layout the engine loads (`target/`, `draft/`).

## Target (`target/`)

- Qwen3.5 text architecture (`Qwen3_5ForCausalLM`): {rec["target_layers"]} layers in the
  pattern Gated DeltaNet, Gated DeltaNet, gated attention; hidden size {rec["hidden_size"]},
  MLP {3 * rec["hidden_size"]}, tied embeddings; {r["parameters"]["target"]:,} parameters.
- Tokenizer: byte-level BPE, {rec["vocab_size"]} tokens including `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>` and the draft's `<|mask|>`, trained on about
  {rec["tokenizer_chars"]:,} characters of train files taken at an even stride.
- Trained as a causal LM for {rec["target_steps"]} steps of {rec["target_batch"]} windows of
  {rec["seq_len"]} tokens (AdamW, peak lr {rec["target_lr"]}, cosine), keeping the weights with
  the lowest held-out loss (checked every {rec["validate_every"]} steps): step
  {r["target"]["kept_step"]}, held-out loss {r["target"]["heldout_loss"]:.3f} nats/token (train
  loss over the last 50 steps {r["target"]["final_loss"]:.3f}).

## Draft (`draft/`)

- DFlash draft (`DFlashDraftModel`): {rec["draft_layers"]} layers, block size
  {rec["block_size"]}, context from target layers {rec["target_layer_ids"]}{last_layer_note(rec)};
  {r["parameters"]["draft_own"]:,} parameters of its own (it borrows the target's embeddings
  and lm_head).
- Trained against the frozen target as shipped (bfloat16 weights) for {rec["draft_steps"]}
  steps of {rec["draft_batch"]} sequences x {rec["anchors_per_seq"]} blocks. Block lengths as
  the engine drafts them: a full block of {rec["train_block_sizes"]}, or for
  {rec["short_block_share"]:.0%} of blocks any length from 2 to {rec["block_size"]} (a
  request's last block). Sequences: {rec["continuations"]:,} prompts of {rec["prompt_len"]}
  train tokens continued by the target's own greedy decoding to {rec["seq_len"]} tokens;
  each block starts at a random generated position, slot j learns the target's greedy token
  for position anchor + j (loss weight exp(-(j-1)/{rec["position_decay"]})). Final loss
  {r["draft"]["final_loss"]:.3f}.

Loss curves (mean over the steps since the row above):

| target step | loss |
|---|---|
{curve_rows(r["target"]["curve"])}

| draft step | loss |
|---|---|
{curve_rows(r["draft"]["curve"])}

## Data

The `.py` files of {corpus["wheels"]} pure-Python wheels from PyPI pinned by version and
sha256 in `reference_engine/training/corpus.lock.json` (sha256 of the lock
`{corpus["lock_sha256"][:16]}...`), vendored copies of other packages left out. Split by
package: {", ".join(corpus["heldout_packages"])} are held out.
{corpus["train_files"]:,} train files ({corpus["train_tokens"]:,} tokens),
{corpus["heldout_files"]:,} held-out files ({corpus["heldout_tokens"]:,} tokens).

## Measured acceptance (held-out, greedy)

{r["eval"]["prompts"]} prompts of {rec["prompt_len"]} tokens, one per held-out file
(`{PROMPTS_FILE}`), {r["eval"]["max_tokens"]} output tokens each, {r["eval"]["dtype"]}, the
shipped bfloat16 weights loaded back through the engine's loader, all prompts in one
continuous batch, per_token commit. Mean acceptance length counts committed tokens per
step, bonus included.

| block size | mean acceptance length | acceptance rate | requests differing from plain |
|---|---|---|---|
{rows}

## Rebuilding it

    python scripts/train_demo_pair.py --fetch-only --corpus-cache results/corpus   # needs PyPI
    python scripts/train_demo_pair.py --corpus-cache results/corpus --out results/demo-pair

The second command needs no network once the cache is filled (copy it to a machine without
internet). It resumes: run it again after an interruption or a `--max-minutes` stop, or
run it in parts with `--stop-after target`.
"""

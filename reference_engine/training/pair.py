"""A finished pair taken as the start of a recipe run (`--from-pair DIR`).

The folder of a finished run, or the shipped pair (reference_engine/assets/demo): `target/`
(weights, config.json, tokenizer.json), `training.json` (its figures), and, when present,
`draft/`, its DFlash draft. Taking it makes the target stage (and the DFlash draft stage)
finished in `--out`, as the recipe's resumption reads them, so that a run with
`--draft-arch dflash2` trains only the DFlash2 draft, against that target, and measures the
DFlash draft beside it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from ..errors import CheckpointError
from ..tokenizer import EOS_TOKEN

if TYPE_CHECKING:
    from .settings import Recipe


def adopt_pair(pair: Path, out: Path, recipe: Recipe, log: Callable[[str], None]) -> None:
    """Copy the target, its tokenizer and, when there is one, the DFlash draft of `pair` into
    `out` with their `work/<stage>.json` summaries, each unless `out` has that stage already.
    The target must be the one `recipe` would train (the same config.json)."""
    pair, work = Path(pair), Path(out) / "work"
    results_file = pair / "training.json"
    for needed in (pair / "target" / "config.json", pair / "target" / "tokenizer.json", results_file):
        if not needed.is_file():
            raise CheckpointError(
                f"--from-pair {pair}: no {needed.relative_to(pair)}; expected a finished pair's folder"
            )
    results = pair_results(results_file, with_draft=(pair / "draft").is_dir())
    if not (work / "target.json").exists():
        tokenizer = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
        differ = target_differences(pair / "target", recipe, tokenizer.token_to_id(EOS_TOKEN))
        if differ:
            raise CheckpointError(
                f"--from-pair {pair}: its target is not the one this recipe trains "
                f"(config.json differs in {', '.join(differ)}); run with its recipe's settings"
            )
        shutil.copytree(pair / "target", out / "target", dirs_exist_ok=True)
        shutil.copyfile(pair / "target" / "tokenizer.json", work / "tokenizer.json")
        summary = {**results["target"], "parameters": results["parameters"]["target"]}
        (work / "target.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"target: taken from {pair}")
    if (pair / "draft").is_dir() and not (work / "draft.json").exists():
        shutil.copytree(pair / "draft", out / "draft", dirs_exist_ok=True)
        summary = {**results["draft"], "parameters": results["parameters"]["draft_own"]}
        (work / "draft.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"draft (DFlash): taken from {pair}")


def pair_results(results_file: Path, with_draft: bool) -> dict:
    """The finished pair's `training.json`, checked for the figures adopting it copies (the
    target's and, `with_draft`, the draft's summary and parameter count) before anything is
    copied."""
    try:
        results = json.loads(results_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"--from-pair: {results_file} is not JSON ({exc})") from None
    needed = [("target",), ("parameters", "target")]
    if with_draft:
        needed += [("draft",), ("parameters", "draft_own")]
    for path in needed:
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None or (len(path) == 1 and not isinstance(value, dict)):
            raise CheckpointError(
                f"--from-pair: {results_file} has no {'.'.join(path)}; expected a finished pair's results"
            )
    return results


def target_differences(folder: Path, recipe: Recipe, eos_id: int) -> list[str]:
    """The keys in which the target config.json in `folder` differs from the one `recipe`
    writes (none: it is the target this recipe trains)."""
    have = json.loads((folder / "config.json").read_text())
    want = recipe.target_config(eos_id)
    return sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))

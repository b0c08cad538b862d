"""The draft architectures side by side: a DFlash2 step against a DFlash step on one target,
and the share of a DFlash2 draft phase its convolution and selector take.

`--draft-arch dflash,dflash2` (random shapes) measures both drafts interleaved in one run,
each with its own engine, as `--numerics` does for several numerics. A DFlash2 draft's
`conv` and `selector` phases are timed in eager forwards only (runtime/stats.py NESTED):
under CUDA graphs the draft forward is one replay, and its row says they were not measured.
"""

from __future__ import annotations

from ..models.dflash import DFlashDraft
from ..models.dflash2 import DFlash2Draft


def arch_of(draft: DFlashDraft) -> str:
    """The draft's architecture as `--draft-arch` names it."""
    return "dflash2" if isinstance(draft, DFlash2Draft) else "dflash"


def draft_comparison(rows: list[dict]) -> list[dict]:
    """DFlash2 against DFlash per (numerics, concurrency) with both measured: `step_ratio`
    = DFlash2 ms per decode step / DFlash ms per decode step (draft, verify, accept and
    commit per verify), `draft_ratio` the same for the draft phase alone, per draft forward."""
    by = {(r["draft"], r["numerics"], r["concurrency"]): r for r in rows if r["mode"] == "dflash"}
    out = []
    for (arch, numerics, c), dflash2 in by.items():
        dflash = by.get(("dflash", numerics, c))
        if arch != "dflash2" or dflash is None or not dflash["ms_per_decode_step"] or not dflash["n_draft"]:
            continue
        out.append(
            {
                "numerics": numerics,
                "concurrency": c,
                "dflash_ms": dflash["ms_per_decode_step"],
                "dflash2_ms": dflash2["ms_per_decode_step"],
                "step_ratio": dflash2["ms_per_decode_step"] / dflash["ms_per_decode_step"],
                "draft_ratio": per_draft(dflash2) / per_draft(dflash),
            }
        )
    return out


def per_draft(row: dict) -> float:
    """Milliseconds of the draft phase per draft forward."""
    return row["ms_draft"] / row["n_draft"]


def draft_parts(rows: list[dict]) -> list[dict]:
    """Per DFlash2 row: the convolution's and the selector's share of the draft phase and
    their ms per draft forward, None where they were not timed (a replayed draft)."""
    out = []
    for r in rows:
        if r["mode"] != "dflash" or r["draft"] != "dflash2":
            continue
        timed = r["n_selector"] > 0 and r["ms_draft"] > 0
        part = {"numerics": r["numerics"], "concurrency": r["concurrency"], "timed": timed}
        for phase in ("conv", "selector"):
            part[f"{phase}_share"] = r[f"ms_{phase}"] / r["ms_draft"] if timed else None
            part[f"{phase}_ms"] = r[f"ms_{phase}"] / r[f"n_{phase}"] if timed else None
        out.append(part)
    return out


def print_drafts(rows: list[dict]) -> None:
    """The DFlash2-against-DFlash table (both measured) and the draft phase's parts (DFlash2)."""
    comparison = draft_comparison(rows)
    if comparison:
        print(
            "numerics | concurrency | DFlash ms per decode step | DFlash2 ms per decode step | "
            "DFlash2 step / DFlash step | DFlash2 draft / DFlash draft"
        )
        for r in comparison:
            print(
                f"{r['numerics']} | {r['concurrency']} | {r['dflash_ms']:.2f} | {r['dflash2_ms']:.2f} | "
                f"{r['step_ratio']:.2f} | {r['draft_ratio']:.2f}"
            )
    parts = draft_parts(rows)
    if parts:
        print(
            "numerics | concurrency | DFlash2 conv % of draft | conv ms per draft | "
            "selector % of draft | selector ms per draft"
        )
    for r in parts:
        if not r["timed"]:
            print(
                f"{r['numerics']} | {r['concurrency']} | not timed: the draft forward replayed as one "
                "CUDA graph (--enforce-eager times its parts)"
            )
            continue
        print(
            f"{r['numerics']} | {r['concurrency']} | {100 * r['conv_share']:.1f} | {r['conv_ms']:.2f} | "
            f"{100 * r['selector_share']:.1f} | {r['selector_ms']:.2f}"
        )

"""`python -m reports profile DIR`: DIR/profile.md and DIR/plots/phase_breakdown.png, the
phase breakdown of each profiled run in DIR (one per mode and concurrency, and per draft or
numerics of a benchmark that measured several), plain and DFlash side by side, from Nsight
Systems captures or from the engine benchmark's built-in timer.

The report depends on the files in DIR alone, so rebuilding it gives the same bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .nsys import NsysError, top_kernels
from .phases import NESTED, OTHER, STEP, TOP_LEVEL, PhaseTimes, ProfileError, breakdown, load_profiles
from .plots import PLOTS_DIR
from .tables import fmt, markdown_table

PROFILE = "profile.md"
PLOT = "phase_breakdown.png"
COMMANDS = "commands.txt"  # what scripts/profile.sh ran, shown in the report
TOP_KERNELS = 10
KERNEL_NAME_CHARS = 90
PHASE_COLORS = {phase: f"C{i}" for i, phase in enumerate((*TOP_LEVEL, OTHER))}

DEFINITIONS = {
    "nsys": """\
- **Source**: Nsight Systems, over the measured repeats only (the benchmark opens a CUDA
  profiler capture range after its warm-up). **Total** is host time inside the NVTX range
  `dflash:<phase>`, summed over its instances (`nsys stats` report `nvtx_sum`); **mean** is
  per instance. **GPU proj** is the range as the GPU sees it: from the start of the first
  GPU operation launched inside it to the end of the last, idle gaps between them included
  (`nvtx_gpu_proj_sum`, `Total Proj Time`). Kernels launch asynchronously, so a phase's
  host time is its launch cost plus any wait (the first host sync after it, accept's one
  transfer or sample, waits for the GPU); the kernels' own time is in the kernel tables
  (`cuda_gpu_kern_sum`), and their sum against the step time says how busy the GPU was.
- **Per token** divides by the output tokens of the captured runs (from the benchmark CSV
  of the same run: tokens of one run x repeats).""",
    "timer": """\
- **Source**: the engine's built-in phase timer, through the engine benchmark's CSV:
  `ms_<phase>` is CUDA-event time on a GPU and monotonic host time on a CPU (the CSV's
  `phase_clock`), `ms_step` host wall time inside `engine.step()`, per run, medians over
  the repeats; instances are `n_<phase>` and `steps` of one run. No GPU projection.
- **Per token** divides by the output tokens of one run.""",
}
SHARED_DEFINITIONS = """\
- **Nesting**: a step runs schedule, prefill, decode, draft, verify, accept and commit one
  after another; `sample` runs inside prefill and decode, and an eager DFlash2 draft's
  `conv` and `selector` inside draft, so they are shown but not summed (under CUDA graphs
  the draft is one replay and they have no rows; nsys counts a `conv` instance per
  convolution, the timer one per draft forward).
  **other** = step - the sum of the top-level phases: time inside a step but outside every
  phase (request bookkeeping after the commit, finishing requests, reading the timer's CUDA
  events once per step). The top-level rows and `other` add up to **step** exactly.
- **Share of step** = a phase's total / the step total."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reports profile",
        description="Build profile.md and plots/phase_breakdown.png from nsys stats CSVs "
        "(<mode>-c<concurrency>_nvtx_sum.csv ...) or engine benchmark CSVs.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--source",
        choices=("auto", "nsys", "timer"),
        default="auto",
        help="auto: nsys captures when there are any, else benchmark CSVs",
    )
    parser.add_argument("--top-kernels", type=int, default=TOP_KERNELS)
    args = parser.parse_args(argv)
    try:
        path = build_profile(args.directory, args.source, args.top_kernels)
    except (ProfileError, NsysError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_profile(directory: Path, source: str = "auto", top: int = TOP_KERNELS) -> Path:
    """Rebuild `directory/profile.md` and its plot from the captures or CSVs there."""
    directory = Path(directory)
    profiles = load_profiles(directory, source)
    plot_dir = directory / PLOTS_DIR
    plot_dir.mkdir(exist_ok=True)
    caption = draw_breakdown(plot_dir / PLOT, profiles)
    commands = directory / COMMANDS
    text = render_profile(
        directory.name, profiles, caption, commands.read_text() if commands.is_file() else None, top
    )
    path = directory / PROFILE
    path.write_text(text)
    return path


def render_profile(
    name: str, profiles: list[PhaseTimes], plot_caption: str, commands: str | None, top: int
) -> str:
    source = profiles[0].source
    lines = [
        f"# Phase profile: {name}",
        "",
        f"Runs: {', '.join(p.label for p in profiles)}. "
        f"Source: {'Nsight Systems' if source == 'nsys' else 'built-in phase timer'}.",
        "",
    ]
    notes = list(dict.fromkeys(n for p in profiles for n in p.notes))
    if notes:
        lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    lines += ["## Definitions", "", DEFINITIONS[source], SHARED_DEFINITIONS, ""]
    lines += ["## Phase breakdown", "", f"![Phase breakdown]({PLOTS_DIR}/{PLOT})", "", plot_caption, ""]
    by_concurrency: dict[int | None, list[PhaseTimes]] = {}
    for p in profiles:
        by_concurrency.setdefault(p.concurrency, []).append(p)
    for concurrency, group in by_concurrency.items():
        title = f"Concurrency {concurrency}" if concurrency is not None else "Other runs"
        lines += [f"## {title}", "", side_by_side(group), ""]
        for times in group:
            lines += [f"### {times.label}", "", detail_table(times), ""]
            kernels = kernel_table(times, top)
            if kernels:
                lines += [kernel_summary(times, top), "", kernels, ""]
    if commands:
        lines += ["## Commands", "", "```", commands.strip("\n"), "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def side_by_side(group: list[PhaseTimes]) -> str:
    """One row per phase, the runs of one concurrency (plain, then DFlash) as columns:
    time per output token (or total ms when a run's token count is unknown) and share."""
    per_token = all(t.output_tokens for t in group)
    unit = "ms/token" if per_token else "ms"
    tables = {t.label: breakdown(t) for t in group}
    phases = [
        p for p in (*TOP_LEVEL, OTHER, *NESTED, STEP) if any(p in table.index for table in tables.values())
    ]
    gpu = {t.label for t in group if t.gpu_ms}
    header = ["Phase"]
    for t in group:
        name = _run_name(t)
        header += [f"{name} {unit}", f"{name} % of step"]
        if t.label in gpu:
            header.append(f"{name} GPU {unit}")
    rows = []
    for phase in phases:
        row = [_phase_title(phase)]
        for t in group:
            table = tables[t.label]
            if phase not in table.index:
                row += ["–", "–"] + (["–"] if t.label in gpu else [])
                continue
            r = table.loc[phase]
            scale = 1 / t.output_tokens if per_token else 1.0
            row += [fmt(r.total_ms * scale, 3 if per_token else 2), fmt(r.share_pct, 1)]
            if t.label in gpu:
                row.append(fmt(r.gpu_ms * scale, 3 if per_token else 2))
        rows.append(row)
    return markdown_table(header, rows)


def detail_table(times: PhaseTimes) -> str:
    table = breakdown(times)
    gpu = bool(times.gpu_ms)
    header = ["Phase", "Instances", "Total (ms)", "Mean (ms)", "Share of step (%)"]
    header += ["GPU proj (ms)"] if gpu else []
    rows = []
    for phase, r in table.iterrows():
        row = [
            _phase_title(phase, r.inside),
            "n/a" if r.instances is None or pd.isna(r.instances) else str(int(r.instances)),
            fmt(r.total_ms, 2),
            fmt(r.mean_ms, 3),
            fmt(r.share_pct, 1),
        ]
        rows.append(row + ([fmt(r.gpu_ms, 2)] if gpu else []))
    return markdown_table(header, rows)


def kernel_summary(times: PhaseTimes, top: int) -> str:
    total = times.kernels["total_ms"].sum()
    launches = int(times.kernels["instances"].sum())
    share = fmt(100 * total / times.step_ms, 1) if times.step_ms else "n/a"
    line = f"All kernels: {fmt(total, 2)} ms of GPU time in {launches} launches, {share}% of the step time."
    if times.step_ms and total > times.step_ms:
        line += (
            " **More kernel time than step time: the capture holds GPU work outside the "
            "engine's steps (graph capture, a warm-up), so this "
            "share does not say how busy the steps kept the GPU; open the capture range "
            "after the engine is built and warmed up, as scripts/bench_engine.py "
            "--profile-capture does.**"
        )
    return line + f" Top {min(len(times.kernels), top)} by total time:"


def kernel_table(times: PhaseTimes, top: int) -> str | None:
    if times.kernels is None or times.kernels.empty or top <= 0:
        return None
    rows = []
    for _, k in top_kernels(times.kernels, top).iterrows():
        name = str(k.kernel)
        if len(name) > KERNEL_NAME_CHARS:
            name = name[: KERNEL_NAME_CHARS - 1] + "…"
        rows.append(
            [f"`{name}`", str(int(k.instances)), fmt(k.total_ms, 2), fmt(k.share_pct, 1), fmt(k.mean_us, 1)]
        )
    return markdown_table(
        ["Kernel", "Instances", "Total (ms)", "Share of kernel time (%)", "Mean (us)"], rows
    )


def draw_breakdown(path: Path, profiles: list[PhaseTimes]) -> str:
    """Stacked bars, one per run: the top-level phases and `other`, per output token when
    every run's token count is known, else per step. Returns the caption."""
    if all(p.output_tokens for p in profiles):
        unit, scales = "ms per output token", [1 / p.output_tokens for p in profiles]
    elif all(p.steps for p in profiles):
        unit, scales = "ms per engine step", [1 / p.steps for p in profiles]
    else:
        unit, scales = "ms (all steps)", [1.0 for _ in profiles]
    figure = Figure(figsize=(max(6.0, 1.1 * len(profiles) + 2.5), 4.5), dpi=100, layout="constrained")
    ax = figure.add_subplot()
    x = list(range(len(profiles)))
    bottoms = [0.0] * len(profiles)
    totals = [breakdown(times).total_ms for times in profiles]
    clipped = sorted({t.label for t, total in zip(profiles, totals) if total.get(OTHER, 0) < 0})
    for phase in (*TOP_LEVEL, OTHER):
        heights = []
        for total, scale in zip(totals, scales):
            value = total.get(phase, 0.0) * scale
            heights.append(0.0 if math.isnan(value) or value < 0 else value)
        if any(heights):
            ax.bar(x, heights, bottom=bottoms, color=PHASE_COLORS[phase], label=phase, width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(x, [_bar_label(p) for p in profiles])
    ax.set_ylabel(unit)
    ax.set_title("Where an engine step's time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", metadata={"Software": None})
    source = "host time per NVTX range" if profiles[0].source == "nsys" else "built-in timer"
    caption = (
        f"One bar per mode and concurrency; segments are the top-level phases and "
        f"`other` in {unit} ({source}), so each bar is the step time in that unit."
    )
    if clipped:
        caption += f" A negative `other` is drawn as 0 ({', '.join(clipped)})."
    return caption


def _phase_title(phase: str, inside: str = "") -> str:
    if phase == STEP:
        return "**step (total)**"
    if phase in NESTED:
        return f"{phase} (inside {inside or ', '.join(NESTED[phase])}; not summed)"
    return phase


def _run_name(times: PhaseTimes) -> str:
    """The run's mode, and its draft or numerics when its benchmark measured several
    (the label's words after `<mode>-c<concurrency>`)."""
    stem = f"{times.mode}-c{times.concurrency}"
    return times.mode + times.label[len(stem) :] if times.label.startswith(stem) else times.mode


def _bar_label(times: PhaseTimes) -> str:
    name = _run_name(times)
    return name if times.concurrency is None else f"{name}\nc={times.concurrency}"

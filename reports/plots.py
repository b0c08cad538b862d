"""PNG plots of a result set, drawn headless: figures are built with `matplotlib.figure.Figure`
and the Agg canvas directly, never through pyplot, so no backend or global state is touched.

Each plot either draws from the data it needs or is skipped with the reason (its stale PNG
from an earlier build is removed), so a report never links a picture of other data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from .results import ResultSet, acceptance_histograms, acceptance_per_position, aggregate_repeats

PLOTS_DIR = "plots"
PERCENTILES = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))
CLIP_QUANTILE = 0.995  # ITL distribution x axis
# series told apart by shape, not only by shade
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
HATCHES = ("", "//", "..", "xx")


@dataclass(frozen=True)
class Plot:
    title: str
    filename: str
    caption: str  # what is drawn, or why nothing was
    drawn: bool


@dataclass(frozen=True)
class Skip:
    """What a draw function returns instead of a caption when its data is absent."""

    reason: str


def write_plots(results: ResultSet, out_dir: Path) -> list[Plot]:
    """Draw every plot of PLOTS into `out_dir` as PNG; return each with its caption or skip reason."""
    out_dir.mkdir(parents=True, exist_ok=True)
    agg = aggregate_repeats(results.summary)
    colors = {label: f"C{i % 10}" for i, label in enumerate(results.labels)}
    plots = []
    for title, filename, draw in PLOTS:
        path = out_dir / filename
        figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
        outcome = draw(figure, results, agg, colors)
        if isinstance(outcome, Skip):
            path.unlink(missing_ok=True)
            plots.append(Plot(title, filename, outcome.reason, drawn=False))
            continue
        FigureCanvasAgg(figure)
        # no Software tag: the same data gives the same bytes whatever the matplotlib version
        figure.savefig(path, format="png", metadata={"Software": None})
        plots.append(Plot(title, filename, outcome, drawn=True))
    return plots


Colors = dict[str, str]
Draw = Callable[[Figure, ResultSet, pd.DataFrame, Colors], "str | Skip"]


def throughput(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    if not _has(agg, "output_tokens_per_s"):
        return Skip("no output_tokens_per_s values in summary.csv")
    ax = figure.add_subplot()
    for i, label in enumerate(results.labels):
        rows = agg.loc[label].dropna(subset=["output_tokens_per_s"])
        if rows.empty:
            continue
        median = rows["output_tokens_per_s"].to_numpy()
        spread = np.vstack(
            [
                median - rows["output_tokens_per_s_min"].to_numpy(),
                rows["output_tokens_per_s_max"].to_numpy() - median,
            ]
        )
        ax.errorbar(
            rows.index.to_numpy(),
            median,
            yerr=spread,
            color=colors[label],
            marker=MARKERS[i % len(MARKERS)],
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            capsize=4,
            label=f"{results.display(label)} (n={int(rows['n'].max())})",
        )
    _concurrency_axis(ax, results.concurrencies)
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Output throughput vs concurrency")
    ax.legend()
    return "Median over repeats; error bars span the minimum and maximum repeat."


def latency_percentiles(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    metrics = [
        (m, t)
        for m, t in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))
        if any(_has(agg, f"{m}_{s}") for s, _, _ in PERCENTILES)
    ]
    if not metrics:
        return Skip("no TTFT or TPOT percentiles in summary.csv")
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for ax, (metric, title) in zip(axes, metrics):
        for i, label in enumerate(results.labels):
            rows = agg.loc[label]
            for stat, name, style in PERCENTILES:
                column = f"{metric}_{stat}"
                if column in rows.columns and rows[column].notna().any():
                    ax.plot(
                        rows.index.to_numpy(),
                        rows[column].to_numpy(),
                        linestyle=style,
                        marker=MARKERS[i % len(MARKERS)],
                        color=colors[label],
                        label=f"{results.display(label)} {name}",
                    )
        _concurrency_axis(ax, results.concurrencies)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title} percentiles")
    # one legend for both panels, outside them: six lines would cover the data
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    return "Per-request percentiles of each repeat, median over repeats."


def itl_bars(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    if not (_has(agg, "itl_token_ms_mean") or _has(agg, "itl_chunk_ms_mean")):
        return Skip("no ITL means in summary.csv")
    ax = figure.add_subplot()
    concurrencies = results.concurrencies
    x = np.arange(len(concurrencies))
    bars = [(label, kind) for label in results.labels for kind in ("token", "chunk")]
    width = 0.8 / len(bars)
    for i, (label, kind) in enumerate(bars):
        values = [_get(agg, label, c, f"itl_{kind}_ms_mean") for c in concurrencies]
        ax.bar(
            x - 0.4 + (i + 0.5) * width,
            values,
            width,
            color=colors[label],
            alpha=1.0 if kind == "token" else 0.5,
            hatch="" if kind == "token" else "//",
            edgecolor="black",
            linewidth=0.5,
            label=f"{results.display(label)} per {kind}",
        )
    ax.set_xticks(x, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("mean ITL (ms)")
    ax.set_title("Per-token vs chunk inter-token latency")
    ax.legend(fontsize="small")
    return (
        "Mean per-token ITL (each chunk gap split among the tokens it carries) next to the "
        "mean raw chunk gap; they differ when chunks carry several tokens."
    )


def itl_distribution(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    if not results.itl:
        reason = "requests.jsonl absent" if results.requests is None else "no chunk timings in requests.jsonl"
        return Skip(reason)
    concurrencies = sorted({c for _, c in results.itl})
    cols = min(4, len(concurrencies))
    # shared axes: the panels are read against each other
    axes = figure.subplots(
        (len(concurrencies) + cols - 1) // cols, cols, squeeze=False, sharey=True, sharex=True
    ).ravel()
    quantiles = np.linspace(0, 1, 201)
    widest = 0.0
    for ax, concurrency in zip(axes, concurrencies):
        right = 0.0
        for label in results.labels:
            samples = results.itl.get((label, concurrency))
            if samples is None:
                continue
            series = ((samples.token_ms, "-", "per token"), (samples.chunk_ms, "--", "chunk"))
            for values, style, name in series:
                if values.size:
                    ax.plot(
                        np.quantile(values, quantiles),
                        quantiles,
                        linestyle=style,
                        color=colors[label],
                        label=f"{results.display(label)} {name}",
                    )
                    right = max(right, float(np.quantile(values, CLIP_QUANTILE)))
        ax.set_title(f"concurrency {concurrency}", fontsize="medium")
        ax.set_xlabel("ITL (ms)")
        ax.grid(alpha=0.3)
        widest = max(widest, right)
    # one stalled request must not squash the body of the distribution against the axis
    axes[0].set_xlim(0, widest * 1.1 or None)
    for ax in axes[len(concurrencies) :]:
        ax.set_visible(False)
    axes[0].set_ylabel("cumulative share (tokens or gaps)")
    axes[0].legend(fontsize="small")
    figure.suptitle("ITL distribution (CDF), all repeats")
    return (
        f"From requests.jsonl: successful requests, every repeat pooled; the x axis ends "
        f"near the p{CLIP_QUANTILE * 100:g} gap."
    )


def acceptance_histogram(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    hists = acceptance_histograms(results.summary)
    if not hists:
        return Skip("no acceptance_histogram in summary.csv (server exposes no per-request acceptance)")
    ax = figure.add_subplot()
    seen = {length for h in hists.values() for length in h}
    lengths = list(range(min(seen), max(seen) + 1))  # lengths no step reached show as gaps
    width = 0.8 / len(hists)
    for i, (label, hist) in enumerate(hists.items()):
        total = sum(hist.values())
        shares = [hist.get(length, 0.0) / total for length in lengths]
        mean = sum(length * n for length, n in hist.items()) / total
        ax.bar(
            np.arange(len(lengths)) - 0.4 + (i + 0.5) * width,
            shares,
            width,
            color=colors[label],
            hatch=HATCHES[i % len(HATCHES)],
            edgecolor="black",
            linewidth=0.5,
            label=f"{results.display(label)} (mean {mean:.2f}, {total:,.0f} steps)",
        )
    ax.set_xticks(np.arange(len(lengths)), [str(length) for length in lengths])
    ax.set_xlabel("acceptance length (committed tokens per step, bonus included)")
    ax.set_ylabel("share of steps")
    ax.set_title("Acceptance length histogram, all concurrencies and repeats")
    ax.legend()
    return "Steps by acceptance length, summed over concurrencies and repeats."


def acceptance_positions(figure: Figure, results: ResultSet, agg: pd.DataFrame, colors: Colors) -> str | Skip:
    rates = acceptance_per_position(results.summary)
    if not rates:
        return Skip("no acceptance_per_position in summary.csv (server exposes no per-position counters)")
    labels = [label for label in results.labels if any(k[0] == label for k in rates)]
    axes = figure.subplots(1, len(labels), squeeze=False, sharey=True)[0]
    for ax, label in zip(axes, labels):
        keys = [k for k in rates if k[0] == label]
        for i, key in enumerate(keys):  # marker and line style tell concurrencies apart
            positions = np.arange(1, len(rates[key]) + 1)
            ax.plot(
                positions,
                rates[key],
                marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                color=colors[label],
                label=f"c={key[1]}",
            )
        ax.set_xticks(np.arange(1, max(len(rates[k]) for k in keys) + 1))
        ax.set_xlabel("draft position")
        ax.grid(alpha=0.3)
        ax.set_title(results.display(label))
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("acceptance rate")
    figure.suptitle("Per-position acceptance rate (median over repeats)")
    return "Share of steps whose draft token at position k was accepted."


PLOTS: tuple[tuple[str, str, Draw], ...] = (
    ("Output throughput", "throughput.png", throughput),
    ("TTFT and TPOT percentiles", "latency_percentiles.png", latency_percentiles),
    ("Per-token vs chunk ITL", "itl.png", itl_bars),
    ("ITL distribution", "itl_distribution.png", itl_distribution),
    ("Acceptance length histogram", "acceptance_histogram.png", acceptance_histogram),
    ("Per-position acceptance rate", "acceptance_per_position.png", acceptance_positions),
)


def _concurrency_axis(ax: Axes, concurrencies: list[int]) -> None:
    if min(concurrencies) > 0 and max(concurrencies) / min(concurrencies) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency")
    ax.grid(alpha=0.3)


def _has(agg: pd.DataFrame, column: str) -> bool:
    return column in agg.columns and bool(agg[column].notna().any())


def _get(agg: pd.DataFrame, label: str, concurrency: int, column: str) -> float:
    if column not in agg.columns or (label, concurrency) not in agg.index:
        return float("nan")
    return float(agg.loc[(label, concurrency), column])

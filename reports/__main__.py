"""`python -m reports DIR`: rebuild DIR/report.md and DIR/plots/*.png from the result files in
DIR alone, and print the report's path. Exit 2 with one `error:` line when DIR cannot be read.

`python -m reports profile DIR`: DIR/profile.md and DIR/plots/phase_breakdown.png from nsys
stats CSVs or engine benchmark CSVs (reports/profile.py; a results directory that is itself
named `profile` is reached as `./profile`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import profile
from .markdown import build_report
from .results import ResultsError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 and argv[0] == "profile":
        return profile.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m reports",
        description="Build report.md and PNG plots from a benchmark results directory.",
        epilog="python -m reports profile DIR: profile.md and a phase-breakdown plot from nsys "
        "stats CSVs or engine benchmark CSVs (python -m reports profile --help).",
    )
    parser.add_argument("directory", type=Path, help="results directory holding summary.csv")
    args = parser.parse_args(argv)
    try:
        path = build_report(args.directory)
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

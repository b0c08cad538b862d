"""Reports from benchmark result files: `python -m reports DIR` writes DIR/report.md and
DIR/plots/*.png. Reads CSV/JSON/JSONL with pandas and draws with matplotlib; imports neither
torch nor `reference_engine` nor `harness`, so a report can be rebuilt on any machine."""

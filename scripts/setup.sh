#!/usr/bin/env bash
# make setup: torch first (the CPU build unless told otherwise), then this package with its dev
# extras, then z-lab's reference loop (an independent oracle for the gates; its pins are not ours),
# then other projects' benchmark clients for the peer tests (PEERS=no leaves them out).
#
#   DEPS=range   (default) the newest versions inside pyproject.toml's ranges: what a fresh
#                virtual environment gets; an existing one keeps what already satisfies them
#   DEPS=newest  the same, every dependency upgraded to the newest in range (torch held)
#   DEPS=tested  exactly the set the CPU tier last passed with (requirements/tested-cpu.txt)
#
# TORCH is the torch requirement and TORCH_INDEX an extra index to find it on. By default the
# CPU build from PyTorch's CPU index: on Linux the torch that PyPI serves is the CUDA build,
# several GB. On a GPU machine: TORCH=torch TORCH_INDEX= (or the index of your CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEPS=${DEPS:-range}
PEERS=${PEERS:-yes}
# macOS wheels are CPU builds without the +cpu label
[ "$(uname -s)" = Darwin ] && default_torch=torch==2.13.0 || default_torch=torch==2.13.0+cpu
TORCH=${TORCH:-$default_torch}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
LOCK=requirements/tested-cpu.txt

pip() { "$PYTHON" -m pip "$@"; }
index=()
[ -n "$TORCH_INDEX" ] && index=(--extra-index-url "$TORCH_INDEX")

case "$DEPS" in
  range|newest|tested) ;;
  *) echo "error: DEPS=$DEPS: expected range, newest or tested" >&2; exit 2 ;;
esac
case "$PEERS" in
  yes|no) ;;
  *) echo "error: PEERS=$PEERS: expected yes or no" >&2; exit 2 ;;
esac
# a fresh install takes about 2.4 GB (torch's CPU build, its dependencies, this package) and the
# peer clients 1.3 GB more, with room for pip to unpack wheels: a full disk otherwise shows only
# as an OSError halfway through
free_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}')
need_gb=$([ "$PEERS" = yes ] && echo 5 || echo 4)
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
  echo "warning: $((free_kb / 1024)) MiB free on this disk; a fresh install needs about $need_gb GB" >&2
fi
# torch alone from its index, then its dependencies and the rest from the default index only
# (pip asks an extra index about every package, and retries each time where it is unreachable)
if [ "$DEPS" = tested ]; then
  TORCH=$(grep -m1 '^torch==' "$LOCK")
fi
pip install --retries 2 --no-deps "${index[@]}" "$TORCH"
pip install "$TORCH"
extra=()
case "$DEPS" in
  tested) extra=(-c "$LOCK") ;;
  newest)
    held=$(mktemp)
    trap 'rm -f "$held"' EXIT
    "$PYTHON" -c "import torch; print('torch==' + torch.__version__)" >"$held"
    extra=(--upgrade --upgrade-strategy eager -c "$held")
    ;;
esac
pip install "${extra[@]}" -e ".[dev]"
pip install --no-deps dflash==0.1.0
# vLLM's, SGLang's and guidellm's clients, pinned with every module they import and without their
# own requirements (their servers' CUDA torch among them), into a folder only their processes put
# on their path (tests/peer_clients.py); again only when the list or the interpreter changed
if [ "$PEERS" = yes ]; then
  stamp=$( "$PYTHON" -V; cat requirements/peers.txt )
  if [ "$stamp" != "$(cat .peers/.installed 2>/dev/null)" ]; then
    rm -rf .peers
    pip install --no-deps --target .peers -r requirements/peers.txt
    printf '%s\n' "$stamp" >.peers/.installed
  fi
fi
"$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version


def installed(name: str) -> str:
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"{name} (none)"


names = ("torch", "triton", "numpy", "transformers", "tokenizers", "fastapi", "pytest")
print("installed: " + ", ".join(installed(n) for n in names))
PY

#!/usr/bin/env bash
# Write requirements/tested-cpu.txt from the current environment: run it after the CPU tier
# passed there (make setup DEPS=newest && make test), so the lock names a set that passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
{
  echo "# The exact set the CPU tier last passed with (Python $("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])'), $(uname -s) $(uname -m)), for make setup DEPS=tested."
  echo "# Regenerate after a green run on the newest versions: scripts/lock.sh"
  "$PYTHON" -m pip freeze --exclude-editable | grep -v -e '^dflash==' -e '^dflash-reference'
} >requirements/tested-cpu.txt
echo "wrote requirements/tested-cpu.txt ($(grep -vc '^#' requirements/tested-cpu.txt) packages)"

#!/usr/bin/env bash
# Set everything up (once) and run the main job: the headless demo on the embedded model.
# Extra arguments go to `python -m engine run`, e.g. `scripts/run.sh --scenario single --json`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then set -- --scenario batch; fi
exec "$ROOT/.venv/bin/python" -m engine run "$@"

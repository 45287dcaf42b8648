#!/usr/bin/env bash
# Set everything up (once) and start the app on the embedded model: Streamlit prints the local URL.
# Extra arguments go to `streamlit run`, e.g. `scripts/run.sh --server.port 8600`.
# The headless demo without a browser: `.venv/bin/python -m engine run --scenario batch`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m streamlit run app.py "$@"

#!/usr/bin/env bash
# Set everything up (once) and start the app on the embedded model: Streamlit prints the local URL.
# Extra arguments go to `streamlit run`, e.g. `scripts/run.sh --server.port 8600`.
# `--class` starts a class server (PAL_CLASS_SERVER=1: the embedded model only, capped sizes, idle sessions
# released; docs/deploy.md), listening on every interface so students reach it:
#   bash scripts/run.sh --class                      (http://<this machine>:8501)
# The headless demo without a browser: `.venv/bin/python -m engine run --scenario batch`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=()
for arg in "$@"; do
    if [ "$arg" = "--class" ]; then
        export PAL_CLASS_SERVER=1
    else
        args+=("$arg")
    fi
done
if [ "${PAL_CLASS_SERVER:-}" = 1 ]; then
    # first, so a later --server.address / --server.port of the caller wins
    args=(--server.address 0.0.0.0 "${args[@]}")
fi
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m streamlit run app.py "${args[@]}"

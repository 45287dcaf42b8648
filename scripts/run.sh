#!/usr/bin/env bash
# Set everything up (once) and start the app on the embedded model: Streamlit prints the local URL.
# Extra arguments go to `streamlit run`, e.g. `scripts/run.sh --server.port 8600`.
# `--class` starts a class server (PAL_CLASS_SERVER=1: the embedded model only, capped sizes, idle sessions
# released; docs/deploy.md), listening on every interface so students reach it:
#   bash scripts/run.sh --class                      (http://<this machine>:8501)
# `--class --workers N` runs N Streamlit processes behind nginx (one core each; scripts/class_server.py, which
# takes --port / --address for the public side and passes other options to every worker):
#   bash scripts/run.sh --class --workers 2
# The headless demo without a browser: `.venv/bin/python -m engine run --scenario batch`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=()
workers=""
while [ $# -gt 0 ]; do
    case "$1" in
        --class) export PAL_CLASS_SERVER=1 ;;
        --workers) workers="${2:?--workers needs a number}"; shift ;;
        --workers=*) workers="${1#--workers=}" ;;
        *) args+=("$1") ;;
    esac
    shift
done
if [ -n "$workers" ]; then
    if [ "${PAL_CLASS_SERVER:-}" != 1 ]; then
        echo "run.sh: --workers serves a class: use it with --class" >&2
        exit 2
    fi
    bash "$ROOT/scripts/setup.sh"
    cd "$ROOT"
    exec "$ROOT/.venv/bin/python" scripts/class_server.py --workers "$workers" ${args[@]+"${args[@]}"}
fi
if [ "${PAL_CLASS_SERVER:-}" = 1 ]; then
    # first, so a later --server.address / --server.port of the caller wins
    args=(--server.address 0.0.0.0 "${args[@]}")
fi
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m streamlit run app.py "${args[@]}"

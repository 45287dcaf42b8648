#!/usr/bin/env bash
# Set up (or reuse) the project's virtual environment in .venv. Idempotent: a second run with the same
# pyproject.toml and this script does nothing. Used by scripts/run.sh and scripts/test.sh.
#
# torch: on a machine without an NVIDIA GPU we install a CPU-only build (about 200 MB) instead of PyPI's
# default CUDA build (several GB): first a CPU wheel that pip can already see locally (a find-links
# folder in pip's configuration), then PyTorch's own CPU index, and only if both fail PyPI's default.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.setup-stamp"
cd "$ROOT"

log() { printf '[setup] %s\n' "$*" >&2; }

find_python() {
    for cand in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
        [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    log "Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)"; return 1
}

want_stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
    exit 0  # already set up for this pyproject.toml
fi

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)"
    log "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

local_cpu_torch_wheel() {
    # The newest torch-*+cpu wheel for this Python in a find-links folder of pip's configuration.
    local tag dirs
    tag="cp$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    dirs="$("${PIP[@]}" config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n')"
    for d in $dirs; do
        d="${d#file://}"
        [ -d "$d" ] && ls "$d"/torch-*+cpu-"$tag"-*"$(uname -m)".whl 2>/dev/null
    done | sort -V | tail -n 1
}

install_torch() {
    if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        return 0
    fi
    if has_nvidia_gpu; then
        log "NVIDIA GPU found: installing torch with CUDA from PyPI"
        "${PIP[@]}" install "torch>=2.4"
        return 0
    fi
    local wheel
    wheel="$(local_cpu_torch_wheel || true)"
    if [ -n "$wheel" ]; then
        log "no GPU: installing the CPU build of torch from $wheel"
        "${PIP[@]}" install "$wheel" && return 0
    fi
    log "no GPU: installing the CPU build of torch from PyTorch's CPU index"
    if "${PIP[@]}" install --timeout 30 --retries 1 "torch>=2.4" \
        --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple; then
        return 0
    fi
    log "PyTorch's CPU index is unreachable: falling back to PyPI's default torch build (large download)"
    "${PIP[@]}" install "torch>=2.4"
}

install_torch
log "installing the project and its dev tools"
"${PIP[@]}" install -q -e ".[dev]"
"$VENV/bin/python" -c 'import torch, transformers, engine; print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}: ready")' >&2
echo "$want_stamp" > "$STAMP"

#!/usr/bin/env bash
# One prepared run on a CUDA machine: the GPU tests, then the kernel and engine benchmark.
# Results go to $OUT (or ./gpu_out): gpu_tests.log, bench.log, benchmarks_gpu.md, bench.json.
# Uses the machine's own python3 (torch, triton, transformers preinstalled); installs nothing.
set -uo pipefail
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_triton.py 2>&1 | tee "$OUT/gpu_tests.log"
fi
"$PY" bench/kernels.py --out "$OUT/benchmarks_gpu.md" --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# A real-size architecture (SmolLM2-135M's config from the lessons, random weights) on the lab's engine against
# transformers' generate_batch on the same GPU (issue 14).
"$PY" -m bench.real_size --device cuda --batch 64 --prompt-len 128 --max-tokens 128 \
    --out "$OUT/real_size.md" --json "$OUT/real_size.json" 2>&1 | tee "$OUT/real_size.log"

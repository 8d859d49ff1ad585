#!/usr/bin/env bash
# GPU check (not in CI): analyze + quantize + eval of the bundled model on a CUDA GPU
# against the CPU float32 protocol, with peak GPU memory. Needs an environment with a
# CUDA build of torch and fp4sense + fp4sense-llmcompressor installed (`make setup` on a
# machine with a GPU). About 6 minutes on one GPU with 16 CPU cores. SERVE_PYTHON: a CUDA
# vLLM environment's python, where stock vLLM (no fp4sense plugin) serves the rotated
# checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" scripts/gpu_check.py --device "${DEVICE:-cuda}" --out "${OUT:-gpu-check}" \
  ${SERVE_PYTHON:+--serve-python "$SERVE_PYTHON"} "$@"

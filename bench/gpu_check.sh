#!/usr/bin/env bash
# One prepared GPU check (a few minutes on one H200, no network):
#   bash bench/gpu_check.sh [WHEEL_DIR]
# WHEEL_DIR holds wheels for what the machine lacks (megatron-core, this project's pure-Python deps);
# torch with CUDA must already be installed. Prints the figures as JSON and writes $OUT/gpu_check.json
# when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${1:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$1" megatron-core transformers safetensors tokenizers || true
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name())"
"$PY" bench/gpu_check.py --device cuda | tee "${OUT:-/tmp}/gpu_check.json"

#!/usr/bin/env bash
# One prepared GPU check (a few minutes on one H200, cut at 8 minutes; no network):
#   bash bench/gpu_check.sh [WHEEL_DIR]      # on the GPU machine
#   bash bench/gpu_check.sh --dry-run        # the same code on CPU with the tiny model (about a minute)
# WHEEL_DIR holds wheels for what the machine lacks (megatron-core, this project's pure-Python deps);
# torch with CUDA must already be installed. Prints the figures as JSON (bench/gpu_check.py says what each
# is) and writes $OUT/gpu_check.json (default /tmp); the log goes to $OUT/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp}
if [ "${1:-}" = "--dry-run" ]; then
  exec "$PY" bench/gpu_check.py --device cpu --quick --json "$OUT_DIR/gpu_check.json"
fi
if [ -n "${1:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$1" megatron-core transformers safetensors tokenizers || true
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name())"
timeout 480 "$PY" bench/gpu_check.py --device cuda --json "$OUT_DIR/gpu_check.json" 2> "$OUT_DIR/gpu_check.log"

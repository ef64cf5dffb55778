#!/usr/bin/env bash
# Issue 22's GPU checks and benchmarks, on the device machine (an H200 or H100), in at most
# 8 minutes. Prepare once here: `bash benchmarks/gpu_prepare.sh` (SmolLM2's tokenizer and
# the wheels the device lacks, into .gpu-carry/, git-ignored). Then, with the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-carry"], timeout_s=560)
# Writes $OUT/gpu_check.json, gpu_check.log and gpu_check.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -d .gpu-carry/wheels ]; then
  pip install -q --no-index --no-deps --find-links .gpu-carry/wheels .gpu-carry/wheels/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "some wheels did not install (see pip.log)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu_check.log"
PYTHONPATH=src timeout 480 python benchmarks/gpu_check.py --tokenizer .gpu-carry/tokenizer \
  --out "$OUT" 2>&1 | tee -a "$OUT/gpu_check.log"

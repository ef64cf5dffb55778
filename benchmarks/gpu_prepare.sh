#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on the device machine that it cannot fetch there (no
# registry, no default model): SmolLM2's tokenizer as infire exports it, and the wheels of
# infire's pure-Python dependencies the device image may lack. Into .gpu-carry/ (ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-carry && mkdir -p .gpu-carry/wheels
.venv/bin/python benchmarks/gpu_check.py --export-tokenizer .gpu-carry/tokenizer
.venv/bin/pip download -q --no-deps -d .gpu-carry/wheels gguf msgpack psutil pyyaml
du -sh .gpu-carry

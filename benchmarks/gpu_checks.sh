#!/usr/bin/env bash
# The GPU checks this repo cannot run in CI, as one prepared script (about 8 minutes on one H200).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR
#
# 1. The CUDA loading tests (`load_model` on CUDA, NF4 through bitsandbytes) that CI skips without a GPU.
# 2. Step latency of the 7B-shaped Llama with the transformers forward (MEDUSA_CHAT_LEAN=0) and with the
#    engine's lean forward (default), same script, same process settings: the before/after of the lean loop
#    on a host-bound GPU, plus greedy losslessness of the lean path in fp16 and NF4.
# Needs: torch with CUDA, transformers, bitsandbytes (the repo's requirements); no network, no downloads.
set -euo pipefail
out="${1:-gpu-checks}"
mkdir -p "$out"
py="${PYTHON:-python}"
cd "$(dirname "$0")/.."

echo "== CUDA loading tests"
timeout 240 "$py" -m pytest -q -p no:cacheprovider tests/test_loading.py tests/test_lean_forward.py -k cuda 2>&1 | tee "$out/cuda_tests.log" | tail -3

echo "== step latency, transformers forward"
MEDUSA_CHAT_LEAN=0 timeout 200 "$py" benchmarks/gpu_step_latency.py --reps 10 \
    --out "$out/step_latency_transformers.json" 2>&1 | tee "$out/step_latency_transformers.log" | tail -15

echo "== step latency, lean forward + greedy losslessness"
timeout 260 "$py" benchmarks/gpu_step_latency.py --reps 10 --check-lossless \
    --out "$out/step_latency_lean.json" 2>&1 | tee "$out/step_latency_lean.log" | tail -20

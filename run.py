#!/usr/bin/env python3
"""Start the medusa-chat web UI: `python run.py [OPTIONS]` is `medusa-chat web [OPTIONS]`.

python run.py                      # the embedded SmolLM2-135M demo model, http://127.0.0.1:7860
python run.py --model vicuna-7b    # Vicuna-7B with its Medusa heads (downloads once; a CUDA GPU is best)
python run.py --help               # every option (--port, --host, --open-browser, --tree-size, ...)
"""

from __future__ import annotations

import os
import sys

# Private and offline by default, before anything imports gradio or huggingface_hub.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # works from a checkout, installed or not

from medusa_chat.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["web", *sys.argv[1:]]))

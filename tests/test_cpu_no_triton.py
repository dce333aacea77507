"""A command on a CPU loads no Triton: the app's kernels serve the CUDA int4 load only, and torch's own import of
it (through transformers' masking code) is refused there (medusa_chat/triton_gate.py). With Triton loaded, every
command ended with ~25 lines of "nanobind: leaked ..." on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("medusa_chat.kernels.triton_matmul", "medusa_chat.kernels.triton_attention",
           "medusa_chat.kernels.triton_linears")  # fmt: skip
SCRIPT = f"""
import json, sys
from medusa_chat.cli import main
code = main(["ask", "--device", "cpu", "--quant", "int4", "--max-new-tokens", "2", "Hi"])
print("MODULES", json.dumps(sorted(m for m in [*{list(KERNELS)!r}, "triton"] if m in sys.modules)))
sys.exit(code)
"""


@pytest.mark.slow
def test_ask_on_a_cpu_loads_no_triton_kernel_and_prints_no_nanobind_lines() -> None:
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("needs the embedded model's GGUF")
    env = {**os.environ, "MEDUSA_CHAT_AUTO_CALIBRATE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [x for x in run.stdout.splitlines() if x.startswith("MODULES ")]
    assert json.loads(line.removeprefix("MODULES ")) == []
    assert "nanobind" not in run.stderr, run.stderr[-3000:]

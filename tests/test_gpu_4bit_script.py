"""benchmarks/gpu_4bit.py, dry-run on this CPU (tiny shapes, Triton's interpreter) as it must be before a GPU is
lent: the kernels stage runs every kernel it can here and records the others' errors, and the summary reads its
figures from the stages' files (nothing derived by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_chat.kernels import triton_matmul

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_4bit.py"
pytestmark = pytest.mark.skipif(not triton_matmul.available(), reason="needs triton (a GPU or its interpreter)")


def test_the_kernels_stage_dry_runs_and_records_what_it_cannot_run(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "MEDUSA_CHAT_CACHE": str(tmp_path / "cache")}
    subprocess.run([sys.executable, str(SCRIPT), "kernels", "--tiny", "--device", "cpu", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)  # fmt: skip
    doc = json.loads(out.read_text())
    assert set(doc["shapes"]) == {"96x128", "160x64"}
    for entry in doc["shapes"].values():
        kernels = entry["kernels"]
        ours = kernels["triton_int4"]
        assert set(ours["us"]) == {"1", "4", "16"} and ours["rows_bitwise_invariant"] is True
        assert kernels["triton_dense16"]["rows_bitwise_invariant"] is True
        assert "error" in kernels["tinygemm_int4"]  # no CPU packing: recorded, not hidden
        assert entry["triton_int4_config"] in entry["triton_int4_tuning"]


def test_the_summary_reads_every_figure_from_the_stage_files(tmp_path: Path) -> None:
    files = {
        "kernels.json": {"card": "NVIDIA H200"},
        "step7b.json": {"card": "NVIDIA H200", "paths": {
            "int4": {"plain_tok_s": 321.5, "tree64_step_ratio": 1.21, "kernel": "triton",
                     "greedy_identical_fraction": 1.0},
            "nf4": {"plain_tok_s": 150.2, "tree64_step_ratio": 2.6}, "bf16": {"plain_tok_s": 140.5}}},
        "fidelity.json": {"paths": {"int4": {"mean_kl": 0.01}, "int4_g128": {"mean_kl": 0.02},
                                    "nf4": {"mean_kl": 0.03}}},
        "embedded_hydra_int4.json": {"summary": {"speedup_vs_plain_loop": 1.9,
                                                 "identical_to_plain_loop_fraction": 1.0}},
        "embedded_eagle3_int4.json": {"summary": {"speedup_vs_plain_loop": 2.1,
                                                  "identical_to_plain_loop_fraction": 0.9}},
    }  # fmt: skip
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    subprocess.run([sys.executable, str(SCRIPT), "summary", str(tmp_path)], check=True, cwd=ROOT,
                   capture_output=True, timeout=120)  # fmt: skip
    [written] = tmp_path.glob("gpu_4bit_nvidia_h200_*.json")
    doc = json.loads(written.read_text())
    assert doc["card"] == "NVIDIA H200"
    assert (doc["plain_tok_s_7b"], doc["nf4_plain_tok_s_7b"], doc["tree64_step_ratio_7b"]) == (321.5, 150.2, 1.21)
    assert (doc["kl_4bit"], doc["kl_nf4"]) == (0.01, 0.03)
    assert (doc["embedded_medusa_speedup"], doc["embedded_identical_fraction"]) == (1.9, 1.0)
    assert doc["embedded_runs"]["embedded_eagle3_int4.json"]["identical_to_plain_loop_fraction"] == 0.9

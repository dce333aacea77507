"""benchmarks/gpu_4bit.py, dry-run on this CPU (tiny shapes, Triton's interpreter) as it must be before it runs on a GPU
machine: the kernels stage runs every kernel it can here and records the others' errors, and the summary reads its
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
pytestmark = pytest.mark.skipif(
    not triton_matmul.available(), reason="needs triton (a GPU or its interpreter)"
)


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
    assert (doc["plain_tok_s_7b"], doc["nf4_plain_tok_s_7b"], doc["tree64_step_ratio_7b"]) == (
        321.5,
        150.2,
        1.21,
    )
    assert (doc["kl_4bit"], doc["kl_nf4"]) == (0.01, 0.03)
    assert (doc["embedded_medusa_speedup"], doc["embedded_identical_fraction"]) == (1.9, 1.0)
    assert doc["embedded_runs"]["embedded_eagle3_int4.json"]["identical_to_plain_loop_fraction"] == 0.9


GIB_GGUF = 98_362_432  # the embedded GGUF's size (the plan measures the file where it is present)
LIMITS = {"GPU_PLAN_COMMANDS": "3", "GPU_PLAN_TOTAL_S": "540", "GPU_PLAN_COMMAND_S": "600",
          "GPU_PLAN_PAYLOAD_BYTES": str(60 << 20)}  # fmt: skip


def _plan(env: dict[str, str], whl: int = 6 << 20) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), "plan", "--gguf-bytes", str(GIB_GGUF), "--whl-bytes", str(whl)]
    return subprocess.run(
        args, env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_plan_fits_the_limits_it_is_given() -> None:
    """At most 3 commands, each under its payload and time limits, ~9 minutes in all, every summary key yielded
    by some stage, the GGUF in two pieces; and the same plan against tighter limits says what breaks."""
    run = _plan(LIMITS)
    assert run.returncode == 0, run.stdout + run.stderr
    plan = json.loads(run.stdout)
    assert plan["problems"] == [] and len(plan["commands"]) <= 3 and plan["total_time_s"] <= 540
    assert len(plan["pieces"]) == 2 and sum(plan["pieces"]) == GIB_GGUF
    names = [s["name"] for c in plan["commands"] for s in c["stages"]]
    assert names.index("step_4bit") < names.index("embedded_hydra_int4") < names.index("kernels_4bit")
    for c in plan["commands"]:
        assert c["bytes"] < 60 << 20 and sum(s["limit_s"] for s in c["stages"]) <= c["time_limit_s"] <= 600
        assert (
            "/assets/smollm2-135m-eagle3/" not in c["tracked"] or c["name"] == "part3"
        )  # drafts stay behind
        assert not any("results" in p for p in c["tracked"])
    assert set(plan["summary_keys"]) >= {"card", "plain_tok_s_7b", "nf4_plain_tok_s_7b", "tree64_step_ratio_7b",
                                         "kl_4bit", "kl_nf4", "embedded_medusa_speedup",
                                         "embedded_identical_fraction"}  # fmt: skip
    tight = _plan({**LIMITS, "GPU_PLAN_TOTAL_S": "300", "GPU_PLAN_PAYLOAD_BYTES": str(40 << 20)})
    assert tight.returncode == 1
    found = json.loads(tight.stdout)["problems"]
    assert any("> 300 s" in p for p in found) and any("carries" in p or "pieces" in p for p in found), found


def _slim_copy(plan_cmd: dict, dest: Path) -> None:
    """The repository as the command would find it on the GPU machine: its tracked paths and carried paths."""
    import shutil

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_plan

    for name in gpu_plan.tracked_files(ROOT):
        if any(gpu_plan.matches(name, p) for p in plan_cmd["tracked"]):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    for path in plan_cmd["carry"]:
        if (ROOT / path).exists():
            shutil.copytree(ROOT / path, dest / path, dirs_exist_ok=True)


@pytest.mark.slow
def test_the_whole_plan_dry_runs_on_this_cpu(tmp_path: Path) -> None:
    """Every command of the plan, in a copy holding only what that command carries (its tracked paths, the GGUF's
    pieces staged by gpu_stage_gguf.sh at the plan's sizes), run by gpu_checks.sh on this CPU: tiny shapes under
    Triton's interpreter, one short prompt per draft, limits scaled for the interpreter. Each stage's JSON lands
    in its part's output folder, and the summary reads them all."""
    from medusa_chat.model.sources.embedded import embedded_model_dir, gguf_path

    if gguf_path() is None or not (embedded_model_dir() / "model.safetensors").is_file():
        pytest.skip("needs the embedded model converted once")
    plan = json.loads(_plan(LIMITS).stdout)
    stage = subprocess.run(["bash", "benchmarks/gpu_stage_gguf.sh", *map(str, plan["pieces"])], cwd=ROOT,
                           env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert stage.returncode == 0, stage.stdout + stage.stderr
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHON": sys.executable, "GPU_DEVICE": "cpu",
           "GPU_4BIT_ARGS": "--tiny --device cpu --chunks 1", "GPU_BENCH_ARGS": "--limit 1 --max-new-tokens 4",
           "GPU_WORK": str(tmp_path / "work"), "GPU_LIMIT_SCALE": "8", "PYTHONPATH": ""}  # fmt: skip
    outs = {}
    for cmd in plan["commands"]:
        repo = tmp_path / cmd["name"]
        _slim_copy(cmd, repo)
        stages = " ".join(
            s["name"] for s in cmd["stages"] if s["name"] != "cuda_tests"
        )  # the suite runs those
        outs[cmd["name"]] = out = tmp_path / f"out_{cmd['name']}"
        subprocess.run(["bash", "benchmarks/gpu_checks.sh", cmd["name"], str(out)], cwd=repo, timeout=3000,
                       env={**env, "GPU_STAGES": stages}, capture_output=True)  # fmt: skip
        status = {
            line.split()[0]: int(line.split()[1])
            for line in (out / f"{cmd['name']}_stages.txt").read_text().splitlines()
        }
        assert status == dict.fromkeys(stages.split(), 0), (out / f"{cmd['name']}.log").read_text()[-3000:]
    assert (
        json.loads((outs["part1"] / "step7b.json").read_text())["paths"]["int4"]["greedy_identical_fraction"]
        == 1.0
    )
    hydra = json.loads((outs["part2"] / "embedded_hydra_int4.json").read_text())
    assert hydra["summary"]["identical_to_plain_loop_fraction"] == 1.0
    [summary] = outs["part3"].glob("gpu_4bit_cpu_*.json")
    doc = json.loads(summary.read_text())
    assert doc["plain_tok_s_7b"] and doc["kl_4bit"] is not None and doc["embedded_medusa_speedup"]
    assert len(list(outs["part3"].iterdir())) <= 8  # what a GPU machine returns may be limited in count

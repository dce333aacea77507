"""`medusa-chat step-cost`: the engine's tree step timed at several node counts on this CPU, written to a result
JSON a user can share (no absolute paths), with llama.cpp's own figure beside it where a binary is found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from medusa_chat import cli
from medusa_chat.kernels import cbind


@pytest.mark.skipif(not cbind.available(), reason="the block kernel cannot run here")
def test_step_cost_times_every_size_and_writes_a_shareable_result(
    embedded_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MEDUSA_CHAT_LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench to find: its column says why
    out = tmp_path / "cost.json"
    args = ["step-cost", "--sizes", "1,2,4", "--threads", "1", "--prefetch", "auto", "--rounds", "1", "--reps", "2"]
    assert cli.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["isa"] and doc["cpu"] and doc["command"].startswith("medusa-chat step-cost --sizes 1,2,4")
    (model,) = doc["models"]
    assert model["model"] == "smollm2-135m" and model["drafter"] == "heads"
    rows = model["variants"]["threads=1 prefetch=auto"]
    assert set(rows) == {"1", "2", "4"} and rows["1"]["ratio"] == 1.0
    assert all(r["median_ms"] > 0 for r in rows.values())
    assert model["llama_bench"].startswith("skipped")
    assert "/tmp/" not in out.read_text() and str(tmp_path) not in out.read_text()
    printed = capsys.readouterr().out
    assert "threads=1 prefetch=auto" in printed and "4-node ms" in printed


def test_step_cost_refuses_what_it_cannot_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["step-cost", "--prefetch", "t9"]) == 2
    assert cli.main(["step-cost", "--no-embedded"]) == 2
    assert "nothing to time" in capsys.readouterr().err

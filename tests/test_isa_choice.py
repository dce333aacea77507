"""The kernel library's instruction set, chosen by measuring (kernels/isa_choice.py): the rule on synthetic
timings, the cache of the choice, the environment override, and a real measurement of every path this CPU runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medusa_chat.kernels import cbind, isa_choice
from medusa_chat.machine import cpu_flags

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def test_the_paths_a_cpu_can_run_widest_first() -> None:
    assert isa_choice.candidates(AVX512) == ["avx512vnni", "avx2"]
    assert isa_choice.candidates(AVX512 | {"avx_vnni"}) == ["avx512vnni", "avxvnni", "avx2"]
    assert isa_choice.candidates({"avx2", "fma", "avx_vnni"}) == ["avxvnni", "avx2"]
    assert isa_choice.candidates({"avx2", "fma", "avx512f"}) == ["avx2"]  # AVX-512 without VNNI: no 512-bit path
    assert isa_choice.best_isa({"avx2", "fma", "avx_vnni"}) == "avxvnni"  # given flags: the widest they allow


def _timings(**totals: float) -> dict[str, dict[str, float]]:
    return {isa: {"q4_1 1": t / 2, "q4_1 4": t / 2} for isa, t in totals.items()}


def test_the_widest_path_is_kept_unless_another_is_clearly_faster() -> None:
    order = ["avx512vnni", "avxvnni", "avx2"]
    assert isa_choice.choose(_timings(avx512vnni=1.0, avxvnni=1.2, avx2=1.5), order) == "avx512vnni"
    assert isa_choice.choose(_timings(avx512vnni=1.0, avxvnni=0.98, avx2=1.5), order) == "avx512vnni"  # near tie
    assert isa_choice.choose(_timings(avx512vnni=1.0, avxvnni=0.95, avx2=0.90), order) == "avx2"
    assert isa_choice.choose(_timings(avx2=1.0), order) == "avx2"  # the others could not be built
    assert isa_choice.choose({}, order) == "avx512vnni"


def test_the_choice_is_measured_once_and_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def fake_measure(isas: list[str], rounds: int = 5, total_bytes: int | None = None) -> dict[str, dict[str, float]]:
        calls.append(isas)
        return {isa: {"q4_1 1": 1.0 + i, "q4_1 4": 1.0 + i} for i, isa in enumerate(reversed(isas))}  # avx2 first

    monkeypatch.setattr(isa_choice, "measure", fake_measure)
    isa_choice.forget()
    try:
        assert isa_choice.measured_isa(AVX512) == "avx2" and calls == [["avx512vnni", "avx2"]]
        (cached,) = (tmp_path / "kernels").glob("isa-*.json")
        record = json.loads(cached.read_text())
        assert record["isa"] == "avx2" and set(record["seconds"]) == {"avx512vnni", "avx2"}
        assert isa_choice.measured_isa(AVX512) == "avx2" and len(calls) == 1  # this process's decision
        isa_choice.forget()
        assert isa_choice.measured_isa(AVX512) == "avx2" and len(calls) == 1  # the cache file
        isa_choice.forget()
        cached.write_text("{not json")  # an unreadable cache is measured again
        assert isa_choice.measured_isa(AVX512) == "avx2" and len(calls) == 2
        assert isa_choice.measured_isa({"avx2", "fma"}) == "avx2" and len(calls) == 2  # one path: nothing to time
    finally:
        isa_choice.forget()


def test_the_environment_overrides_the_measured_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", "avx2")
    assert isa_choice.best_isa() == "avx2"
    monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", "sse2")
    with pytest.raises(ValueError, match="MEDUSA_CHAT_QGEMM_ISA"):
        isa_choice.best_isa()


@pytest.mark.skipif(not cbind.available(), reason="the block kernel cannot run here")
def test_every_path_this_cpu_runs_is_timed_on_the_same_work() -> None:
    isas = isa_choice.candidates(cpu_flags())
    measured = isa_choice.measure(isas, rounds=1, total_bytes=4 << 20)
    assert set(measured) == set(isas)
    keys = {f"{f} {r}" for f in isa_choice.FAMILIES for r in isa_choice.ROWS}
    assert all(set(m) == keys and all(t > 0 for t in m.values()) for m in measured.values())
    assert isa_choice.best_isa() in isas

"""Which instruction set's kernel library this CPU runs, chosen by measuring.

The kernels have a path per integer-dot instruction set (cbuild.ISA_FLAGS: AVX512-VNNI, AVX-VNNI, AVX2); every
path gives the same bits, so the choice is one of speed only, and speed is a property of the machine, not of its
flags: a CPU may run 512-bit instructions at half rate (Zen 4 splits them in two), or slow its clock for them. So
the first start times every path the CPU can run on the same work (the block products of a plain step and of a
4-row tree step, over weights larger than the L3, each path in its own weight layout, the paths taking turns
within each round), keeps the fastest, and caches the choice per CPU model and kernel sources. The widest path is
kept unless another is ISA_KEEP_MARGIN faster. One extra library is compiled for it, once: on the 2-vCPU Zen 4
a first `ask` with a fresh cache (no calibration) took 15.4 s instead of 10.1 s with the path forced; the next 5.4 s.

Measured on the 2-vCPU Zen 4 this project's figures come from (`MEDUSA_CHAT_QGEMM_ISA` forcing each path in turn,
the embedded model's whole step at 1 / 2 / 4 / 8 rows, two rounds): AVX512-VNNI 3.49-3.82 / 3.78-3.98 / 4.19-4.60 /
6.39-6.95 ms, AVX2 3.63-3.86 / 3.97-4.38 / 5.71-5.79 / 10.15-10.35 ms (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import threading
import time
from typing import Any

from medusa_chat import envvars
from medusa_chat.errors import SettingError
from medusa_chat.kernels import cbuild, prefetch
from medusa_chat.kernels.cdecl import declare
from medusa_chat.machine import cpu_flags

ISA_KEEP_MARGIN = 0.03  # a narrower path replaces the widest only when this much faster
FAMILIES = ("q4_1", "kquant")  # the embedded model's blocks, and the K-quant files'
ROWS = (1, 4)  # a plain step's products and a 4-node tree step's, weighed alike
# {candidate paths: isa} decided in this process: every later call (cbind.load, the known-answer checks) reads it
# without hashing the sources again, and a test's other cache root does not re-measure
_CHOSEN: dict[tuple[str, ...], str] = {}
_LOCK = threading.Lock()  # one measurement at a time (cbind.prebuild's thread and the first kernel user)


def best_isa(flags: set[str] | None = None) -> str:
    """The instruction set whose kernel library runs here: MEDUSA_CHAT_QGEMM_ISA where set (e.g. `avx2` to measure
    the plain AVX2 path on a VNNI machine); else for this CPU the fastest of its paths as measured once and cached
    (`measured_isa`); for a given set of `flags`, the widest path they allow."""
    forced = envvars.value("MEDUSA_CHAT_QGEMM_ISA")
    if forced:
        if forced not in cbuild.ISA_FLAGS:
            raise SettingError(f"MEDUSA_CHAT_QGEMM_ISA must be one of {', '.join(cbuild.ISA_FLAGS)} (got {forced!r})")
        return forced
    if flags is not None:
        return candidates(flags)[0]
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags or not envvars.enabled("MEDUSA_CHAT_QGEMM"):
        return candidates(flags)[0]  # no library runs here: nothing to measure
    return measured_isa(flags)


def candidates(flags: set[str]) -> list[str]:
    """The paths this CPU can run, widest first."""
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        out.append("avx512vnni")
    if "avx_vnni" in flags:
        out.append("avxvnni")
    return [*out, "avx2"]


def measure(isas: list[str], rounds: int = 5, total_bytes: int | None = None) -> dict[str, dict[str, float]]:
    """Seconds (the fastest of `rounds`) of one product over a weight stream larger than the L3, on one thread,
    per path, family and row count: {isa: {"q4_1 1": s, "q4_1 4": s, "kquant 1": s, ...}}. Paths whose library
    cannot be built here are left out."""
    total = total_bytes or min(max(2 * prefetch.l3_bytes(), 48 << 20), 128 << 20)
    libs = {isa: lib for isa in isas if (lib := _library(isa)) is not None}
    out: dict[str, dict[str, float]] = {isa: {} for isa in libs}
    for family in FAMILIES:
        runs = {isa: prefetch.weight_stream(lib, family, total, max(ROWS)) for isa, lib in libs.items()}
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(rounds + 1):  # the first round warms up (page faults, clocks) and is not counted
            for rows in ROWS:
                for isa, run in runs.items():
                    t0 = time.perf_counter()
                    run(rows)
                    if r:
                        times.setdefault((isa, rows), []).append(time.perf_counter() - t0)
        for (isa, rows), ts in times.items():
            out[isa][f"{family} {rows}"] = min(ts)
        del runs
    return out


def _library(isa: str) -> ctypes.CDLL | None:
    """`isa`'s library for timing (built if needed; the same file cbind.load opens), its functions declared, its
    own prefetch hints in force; None where it cannot be built here."""
    try:
        path = cbuild.library_file(isa)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    declare(lib)
    prefetch.apply_prefetch(lib, isa, path.stem)
    return lib


def choose(measured: dict[str, dict[str, float]], widest_first: list[str]) -> str:
    """The path with the least total time over the measured products; the widest unless another is
    ISA_KEEP_MARGIN faster."""
    totals = {isa: sum(m.values()) for isa, m in measured.items() if m}
    ranked = [isa for isa in widest_first if isa in totals]
    if not ranked:
        return widest_first[0]
    best = min(ranked, key=totals.__getitem__)
    return best if totals[best] < totals[ranked[0]] * (1 - ISA_KEEP_MARGIN) else ranked[0]


def measured_isa(flags: set[str]) -> str:
    """This CPU's path: the cached measurement for this CPU model and these kernel sources, else measured now and
    cached (a CPU with one path only is not measured)."""
    isas = candidates(flags)
    if len(isas) == 1:
        return isas[0]
    chosen = _CHOSEN.get(tuple(isas))
    if chosen is None:
        with _LOCK:
            chosen = _CHOSEN.get(tuple(isas)) or _measured(isas)
            _CHOSEN[tuple(isas)] = chosen
    return chosen


def _measured(isas: list[str]) -> str:
    """The cached choice for this CPU model and these kernel sources, else measured now and cached."""
    from medusa_chat.atomic import atomic_write_json, read_json
    from medusa_chat.errors import MedusaChatError
    from medusa_chat.machine import cpu_model, slug
    from medusa_chat.paths import cache_root

    h = cbuild.hash_sources(hashlib.sha256(" ".join(isas).encode()))
    key = f"{slug(cpu_model())}-{h.hexdigest()[:16]}"
    path = cache_root() / "kernels" / f"isa-{key}.json"
    record: dict[str, Any] | None = None
    try:
        record = read_json(path) if path.is_file() else None
        if record is not None and record.get("isa") not in isas:
            record = None
    except (OSError, ValueError, MedusaChatError):
        record = None
    if record is None:
        try:
            seconds = measure(isas)
        except (RuntimeError, MemoryError, OSError):  # keep the widest rather than fail a load
            return isas[0]
        record = {"cpu": cpu_model(), "candidates": isas, "isa": choose(seconds, isas), "seconds": seconds}
        try:
            atomic_write_json(path, record)
        except OSError:
            pass
    return str(record["isa"])


def forget() -> None:
    """Drop this process's decisions (tests: measure or read the cache again)."""
    _CHOSEN.clear()

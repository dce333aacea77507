"""The weight stream's software prefetch: which cache level it fills, chosen by measuring.

The kernels prefetch the weight stream 8 KB ahead (csrc/qblock.h). Into L1 (prefetcht0) suited the Xeon it was
tuned on; on a Zen 4 EPYC it held the K-quant stream to the L1's few outstanding misses (~15 of ~28 GB/s a core
streams) and an extra tree row's arithmetic came on top of the stream. Which hint streams best is a property of
the machine, so it is measured here once per CPU model and library (a stream of weights larger than the L3, one
thread, each hint in turn, interleaved), cached, and set per kernel family and per tile of one row / of more. A
prefetch is only a hint: the arithmetic, so every output bit, is the same whichever is chosen.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from medusa_chat import envvars
from medusa_chat.errors import SettingError
from medusa_chat.kernels.quantizers import QK

PREFETCH_HINTS = ("t0", "t1", "t2", "off")  # csrc/qblock.h PF_T0 .. PF_OFF
PREFETCH_FAMILIES = ("q4_1", "q8_0", "kquant")  # PF_FAM_*: qgemm.c's two formats, kquants.c's tiles
PREFETCH_MEASURED = ("t0", "t1")  # the candidates timed (t2 measured the same as t1 on a Zen 4; "off" slower)
PREFETCH_KEEP_MARGIN = 0.05  # another hint replaces t0 (the tuned default) only when this much faster
# what is in force, per instruction set: {"hints": {family: [one row, more rows]}, "source": ..., "seconds": ...}
_PREFETCH: dict[str, dict[str, object]] = {}
# every library hints were put in force in ({id: (isa, library)}): `set_prefetch` reaches them all
_HINTED: dict[int, tuple[str, ctypes.CDLL]] = {}
_DEFAULT_ISA = [""]  # the instruction set of the library this CPU runs (mark_default)


def l3_bytes() -> int:
    """This CPU's last-level cache as one core sees it (sysfs), 32 MiB where unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    try:
        for idx in base.glob("index*"):
            if (idx / "level").read_text().strip() == "3":
                text = (idx / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        return 32 << 20
    return best or 32 << 20


def weight_stream(lib: ctypes.CDLL, family: str, total_bytes: int, max_rows: int = 2) -> Callable[[int], None]:
    """A call that runs one `family` product over ~total_bytes of weights (so they come from DRAM) for a given
    number of activation rows (up to `max_rows`), on the calling thread alone (a *_team function outside a
    parallel region), in `lib`'s own weight layout. The weights are random codes with small fp16 factors: the
    timing, not the values, matters (also isa_choice.py's)."""
    group, k = int(lib.qgemm_group()), 2048
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, k, generator=gen)
    qx = torch.empty(2 * max_rows * k, dtype=torch.int8)
    dx = torch.empty(2, max_rows * k // QK)
    scratch = (qx.data_ptr(), dx[0].data_ptr(), dx[1].data_ptr())  # qx, dx: kept alive by `run.keep` below
    per_weight = {"q4_1": 20 / 32, "q8_0": 34 / 32, "kquant": 148 / 256}[family]
    n = max(group, int(total_bytes / (k * per_weight)) // group * group)
    y = torch.empty(max_rows, n)
    if family == "q4_1":
        q = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=gen)
        f = torch.full((2, n * k // QK), 1e-3, dtype=torch.float16)

        def run(rows: int) -> None:
            lib.q4_1_gemm_team(x.data_ptr(), rows, k, q.data_ptr(), f[0].data_ptr(), f[1].data_ptr(), n,
                               y.data_ptr(), *scratch)  # fmt: skip
    elif family == "q8_0":
        q = torch.randint(-127, 128, (n * k,), dtype=torch.int8, generator=gen)
        f = torch.full((n * k // QK,), 1e-3, dtype=torch.float16)
        s = torch.zeros(n * k // QK, dtype=torch.int16)

        def run(rows: int) -> None:
            lib.q8_0_gemm_team(x.data_ptr(), rows, k, q.data_ptr(), f.data_ptr(), s.data_ptr(), n, y.data_ptr(),
                               *scratch)  # fmt: skip
    else:  # Q4_K superblocks (kquants.c): 144 * group code and scale bytes, then d and dmin (fp16) per column
        q = torch.randint(0, 256, (n // group, k // 256, 148 * group), dtype=torch.uint8, generator=gen)
        q[..., 144 * group :] = torch.full((2 * group,), 1e-3, dtype=torch.float16).view(torch.uint8)

        def run(rows: int) -> None:
            lib.q4_k_gemm_team(x.data_ptr(), rows, k, q.data_ptr(), n, y.data_ptr(), *scratch)

    run.keep = (qx, dx)  # type: ignore[attr-defined]  # the scratch the raw pointers point into
    return run


def measure_prefetch(
    lib: ctypes.CDLL, rounds: int = 7, total_bytes: int | None = None, hints: tuple[str, ...] = PREFETCH_MEASURED
) -> dict[str, dict[str, float]]:
    """Seconds (the fastest of `rounds`) of one product over a weight stream larger than the L3, on one thread,
    per family, tile ("1": one row, "2": two rows) and hint: {family: {"1 t0": s, "2 t1": s, ...}}. Within a
    family every (rows, hint) is timed in turn in each round (a shared machine's slow spells hit them alike);
    one family's weights at a time. The hints in force before are restored."""
    import time

    total = total_bytes or min(max(2 * l3_bytes(), 48 << 20), 256 << 20)
    before = {(f, c): int(lib.mc_get_prefetch(f, c)) for f in range(len(PREFETCH_FAMILIES)) for c in (0, 1)}
    out: dict[str, dict[str, float]] = {}
    try:
        for fi, family in enumerate(PREFETCH_FAMILIES):
            run = weight_stream(lib, family, total)
            times: dict[str, list[float]] = {}
            for r in range(rounds + 1):  # the first round warms up (page faults, clocks) and is not counted
                for rows in (1, 2):
                    for hint in hints:
                        lib.mc_set_prefetch(fi, int(rows > 1), PREFETCH_HINTS.index(hint))
                        t0 = time.perf_counter()
                        run(rows)
                        if r:
                            times.setdefault(f"{rows} {hint}", []).append(time.perf_counter() - t0)
            out[family] = {key: min(ts) for key, ts in times.items()}  # the least disturbed run of each
            del run
    finally:
        for (f, c), h in before.items():
            lib.mc_set_prefetch(f, c, h)
    return out


def choose_prefetch(measured: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    """{family: [hint for one-row tiles, for more rows]}: the fastest measured, t0 unless another is at least
    PREFETCH_KEEP_MARGIN faster."""
    chosen: dict[str, list[str]] = {}
    for family in PREFETCH_FAMILIES:
        m = measured.get(family, {})
        pick = []
        for rows in (1, 2):
            cand = {h: m[f"{rows} {h}"] for h in PREFETCH_HINTS if f"{rows} {h}" in m}
            best = min(cand, key=cand.__getitem__) if cand else "t0"
            if "t0" in cand and cand[best] > cand["t0"] * (1 - PREFETCH_KEEP_MARGIN):
                best = "t0"
            pick.append(best)
        chosen[family] = pick
    return chosen


def _set_hints(lib: ctypes.CDLL, hints: dict[str, list[str]]) -> None:
    for fi, family in enumerate(PREFETCH_FAMILIES):
        for c, hint in enumerate(hints.get(family, ["t0", "t0"])):
            lib.mc_set_prefetch(fi, c, PREFETCH_HINTS.index(hint))


def apply_prefetch(lib: ctypes.CDLL, isa: str, lib_name: str) -> None:
    """Put the prefetch hints in force: MEDUSA_CHAT_PREFETCH (one of PREFETCH_HINTS, every family; `measure`:
    measure again), else this CPU's cached measurement, else measure now (well under a second) and cache it."""
    from medusa_chat.atomic import atomic_write_json, read_json
    from medusa_chat.errors import MedusaChatError
    from medusa_chat.machine import cpu_model, slug
    from medusa_chat.paths import cache_root

    _HINTED[id(lib)] = (isa, lib)

    forced = envvars.value("MEDUSA_CHAT_PREFETCH") or ""
    if forced and forced != "measure":
        if forced not in PREFETCH_HINTS:
            raise SettingError(f"MEDUSA_CHAT_PREFETCH must be one of {', '.join(PREFETCH_HINTS)} or measure")
        hints = {f: [forced, forced] for f in PREFETCH_FAMILIES}
        _set_hints(lib, hints)
        _PREFETCH[isa] = {"hints": hints, "source": "MEDUSA_CHAT_PREFETCH"}
        return
    path = cache_root() / "kernels" / f"prefetch-{slug(cpu_model())}-{lib_name}.json"
    record: dict | None = None
    if forced != "measure" and path.is_file():
        try:
            record = read_json(path)
            hints = record["hints"]
            assert all(h in PREFETCH_HINTS for f in PREFETCH_FAMILIES for h in hints[f])
        except (OSError, ValueError, KeyError, TypeError, AssertionError, MedusaChatError):
            record = None
    if record is None:
        try:
            measured = measure_prefetch(lib)
        except (RuntimeError, MemoryError) as err:  # keep the default (t0) rather than fail a load
            _PREFETCH[isa] = {"hints": {f: ["t0", "t0"] for f in PREFETCH_FAMILIES}, "source": f"default ({err})"}
            return
        record = {"cpu": cpu_model(), "isa": isa, "hints": choose_prefetch(measured), "seconds": measured}
        try:
            atomic_write_json(path, record)
        except OSError:
            pass
    _set_hints(lib, record["hints"])
    _PREFETCH[isa] = {"hints": record["hints"], "source": str(path), "seconds": record.get("seconds")}


def mark_default(isa: str) -> None:
    """`isa`'s library is the one this CPU runs (cbind.load): `prefetch_choice()` describes it."""
    _DEFAULT_ISA[0] = isa


def prefetch_choice(isa: str | None = None) -> dict[str, object]:
    """The prefetch hints in force for this CPU's (or `isa`'s) library and where they came from ({} before the
    library is loaded)."""
    return dict(_PREFETCH.get(isa or _DEFAULT_ISA[0], {}))


def set_prefetch(hints: dict[str, list[str]] | str) -> None:
    """Put hints in force in every loaded library: one of PREFETCH_HINTS for all, or {family: [one row, more]}
    (benchmarks: before / after side by side). Only a hint: no output changes."""
    if isinstance(hints, str):
        hints = {f: [hints, hints] for f in PREFETCH_FAMILIES}
    for isa, lib in list(_HINTED.values()):
        _set_hints(lib, hints)
        _PREFETCH[isa] = {**_PREFETCH.get(isa, {}), "hints": hints, "source": "set_prefetch"}

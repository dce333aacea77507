"""GGUF-block linears (Q4_1, Q8_0) on the CPU with a small AVX2 kernel of our own (csrc/qgemm.c), built with
AVX-VNNI / AVX512-VNNI dot products where this CPU has them (`best_isa`; the results are the same bits).

The kernel is compiled once per instruction set with the system C compiler the first time it is needed (a few
seconds) and kept in the user cache dir; a machine without a compiler or without AVX2+FMA simply does not get these linears
(`available()` is False) and the CPU paths fall back to torch's weight-only kernels. It runs on the OpenMP
runtime torch already loaded (same libgomp soname), so it shares torch's threads instead of adding a pool.

Why a kernel: see csrc/qgemm.c. In short, a tree step reads each weight block once for all its rows, and the
weights are the file's own blocks (Q4_1 for the projections, Q8_0 for the embedding / lm_head), dequantized
exactly as the float model converted from the file has them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from medusa_chat.machine import cpu_flags

QK = 32
# -ffp-contract=off: no implicit a*b+c -> fma fusion, whose use could differ between a loop's vector body and
# its scalar remainder; every FMA in the kernels is an explicit intrinsic, so each element is computed alike.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# Integer dot-product instructions, used where this CPU has them (qgemm.c: the same exact integer block sums in
# fewer instructions, so results are bitwise the same as the AVX2 build's)
ISA_FLAGS = {
    "avx2": (),
    "avxvnni": ("-mavxvnni",),
    "avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
}
_LIBS: dict[str, ctypes.CDLL | None] = {}
_ERROR = ""
# One build at a time: `prebuild`'s thread and the first kernel user may ask for the same library at once.
_LOAD_LOCK = threading.RLock()


def best_isa(flags: set[str] | None = None) -> str:
    """The widest integer-dot instruction set of this CPU the kernel has a path for (MEDUSA_CHAT_QGEMM_ISA
    overrides it, e.g. `avx2` to measure the plain AVX2 path on a VNNI machine)."""
    forced = os.environ.get("MEDUSA_CHAT_QGEMM_ISA")
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"MEDUSA_CHAT_QGEMM_ISA must be one of {', '.join(ISA_FLAGS)} (got {forced!r})")
        return forced
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512vnni"
    if "avx_vnni" in flags:
        return "avxvnni"
    return "avx2"


def _sources() -> tuple[list[str], list[str]]:
    """The C sources and headers in csrc/ (sorted): every one is compiled or included, and hashed."""
    names = sorted(f.name for f in resources.files("medusa_chat.kernels.csrc").iterdir() if f.is_file())
    return [n for n in names if n.endswith(".c")], [n for n in names if n.endswith(".h")]


def _compile_all(cc: str, flags: tuple[str, ...], c_files: list[str]) -> str:
    """Compile every `x.c` to `x.o` beside it, up to one process per core at a time; the first failure's
    compiler output, or "" when all compiled."""
    from concurrent.futures import ThreadPoolExecutor

    def one(c_file: str) -> str:
        cmd = [cc, *flags, "-c", c_file, "-o", c_file[:-2] + ".o"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return (done.stderr or f"{cc} exited with {done.returncode}") if done.returncode else ""

    with ThreadPoolExecutor(max_workers=max(1, min(len(c_files), os.cpu_count() or 1))) as pool:
        return next((err for err in pool.map(one, c_files) if err), "")


def _build(out: Path, flags: tuple[str, ...]) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) found")
    with tempfile.TemporaryDirectory() as tmp:
        c_files = []
        sources, headers = _sources()
        for name in headers:
            (Path(tmp) / name).write_text(resources.files("medusa_chat.kernels.csrc").joinpath(name).read_text())
        for name in sources:
            c_file = Path(tmp) / name
            c_file.write_text(resources.files("medusa_chat.kernels.csrc").joinpath(name).read_text())
            c_files.append(str(c_file))
        so = Path(tmp) / "qgemm.so"
        # Each source its own compiler process, as many at once as there are cores, then one link: the same
        # objects as one `cc a.c b.c ...`, which compiles them one after another (attention.c and kquants.c
        # alone take most of it). The build is part of the very first start's wait; on busy cores the
        # parallel build gains little (10.3 -> 9.4 s measured at load 4.4 on 2 cores), on idle ones up to
        # the number of cores.
        failed = _compile_all(cc, flags, c_files)
        if failed:
            raise RuntimeError(f"compiling the qgemm kernel failed: {failed.strip()[:300]}")
        cmd = [cc, *flags, *(c[:-2] + ".o" for c in c_files), "-o", str(so)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"linking the qgemm kernel failed: {done.stderr.strip()[:300]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(so, tmp_out)
        os.replace(tmp_out, out)


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library for `isa` (default: this CPU's best), building it on first use; None where it
    cannot run here."""
    global _ERROR
    if os.environ.get("MEDUSA_CHAT_QGEMM", "1") == "0":
        _ERROR = "disabled by MEDUSA_CHAT_QGEMM=0"
        return None
    cpu = cpu_flags()
    if not {"avx2", "fma"} <= cpu:
        _ERROR = "this CPU lacks AVX2/FMA"
        return None
    isa = isa or best_isa(cpu)
    if isa in _LIBS:
        return _LIBS[isa]
    with _LOAD_LOCK:
        if isa not in _LIBS:
            _LIBS[isa] = _build_and_open(isa)
    return _LIBS[isa]


def prebuild() -> None:
    """Start building (or opening) this CPU's kernel library in a background thread, so that a first start's
    compile (~8 s on 2 slow cores) overlaps the model's metadata reading instead of following it; the first
    user of the kernels then waits only for what is left of it (`load` holds the build lock)."""
    if os.environ.get("MEDUSA_CHAT_QGEMM", "1") == "0" or _LIBS:
        return
    threading.Thread(target=load, name="medusa-chat-kernel-build", daemon=True).start()


def _build_and_open(isa: str) -> ctypes.CDLL | None:
    global _ERROR
    from medusa_chat.paths import cache_root

    flags = (*CFLAGS, *ISA_FLAGS[isa])
    h = hashlib.sha256(" ".join(flags).encode())
    for name in (n for group in _sources() for n in group):
        h.update(name.encode())
        h.update(resources.files("medusa_chat.kernels.csrc").joinpath(name).read_bytes())
    path = cache_root() / "kernels" / f"qgemm-{isa}-{h.hexdigest()[:16]}.so"
    lib = None
    try:
        if not path.is_file():
            _build(path, flags)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _ERROR = str(err)
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.q4_1_gemm.argtypes = [p, i, i, p, p, p, i, p, p, p, p]
        lib.q8_0_gemm.argtypes = [p, i, i, p, p, p, i, p, p, p, p]
        lib.q4_1_gemm.restype = lib.q8_0_gemm.restype = None
        for kq in ("q4_k_gemm", "q5_k_gemm", "q6_k_gemm"):  # kquants.c: (x, M, K, stream, N, y, scratch x3)
            getattr(lib, kq).argtypes = [p, i, i, p, i, p, p, p, p]
            getattr(lib, kq).restype = None
        lib.kq_repack.argtypes = [i, p, i, i, i, p]
        lib.kq_repack.restype = lib.kq_rows.restype = None
        lib.kq_rows.argtypes = [i, p, i, i, p, i, p]
        lib.decoder_forward.argtypes = [p, i, p, p, p, p, i, i, p, p, i, p, p, i, p]
        lib.decoder_forward.restype = None
        lib.decoder_scratch_bytes.argtypes = [p, i, i]
        lib.decoder_scratch_bytes.restype = ctypes.c_size_t
        lib.qgemm_isa.restype = lib.qgemm_group.restype = i
        lib.hydra_resblocks.argtypes = [i, i, i, p, p, p, p, p, p, p]
        lib.hydra_cell.argtypes = [i, i, p, p, p, p, p, p, p, p, p]
        lib.hydra_draft.argtypes = [i, p, p, p, p, p, p, p, p, p, i, p, p, i, p, p, p]
        lib.hydra_draft_shaped.argtypes = [i, p, p, p, p, i, p, p, p, p, i, i, i, p, p, p, p, p, p]
        lib.hydra_draft_shaped.restype = i
        lib.medusa_draft.argtypes = [i, p, i, i, p, p, p, p, p, p, p]
        lib.medusa_draft.restype = None
        lib.eagle_work_floats.argtypes = [p, i, i]
        lib.eagle_work_floats.restype = ctypes.c_size_t
        lib.eagle_draft_shaped.argtypes = [p, i, p, p, i, p, p, p, p, i, i, i, i, p, p, p, p, p, p, p]
        lib.eagle_draft_shaped.restype = i
        lib.medusa_draft_shaped.argtypes = [i, p, i, i, i, p, p, p, p, p, p, p, p]
        lib.medusa_draft_shaped.restype = i
        lib.q8_0_gemm_argmax.argtypes = [p, i, i, p, p, p, i, p, p, p, p]
        lib.q8_0_gemm_argmax.restype = i
        lib.q8_0_rows.argtypes = [p, p, i, i, p, i, p]
        lib.q8_0_rows.restype = None
        lib.hydra_resblocks.restype = lib.hydra_cell.restype = lib.hydra_draft.restype = None
        lib.mc_set_threads.argtypes = [i]
        lib.mc_set_threads.restype = None
        lib.mc_get_threads.restype = lib.mc_team_probe.restype = i
        lib.mc_duet.restype = lib.duet_available.restype = i
        lib.duet_quiesce.restype = lib.duet_set_test_delay.restype = None
        lib.duet_set_test_delay.argtypes = [i]
        lib.duet_stolen_chunks.restype = ctypes.c_long
        lib.mc_set_prefetch.argtypes = [i, i, i]
        lib.mc_set_prefetch.restype = None
        lib.mc_get_prefetch.argtypes = [i, i]
        lib.mc_get_prefetch.restype = i
        for fn in ("q4_1_gemm_team", "q8_0_gemm_team"):
            getattr(lib, fn).argtypes = [p, i, i, p, p, p, i, p, p, p, p]
            getattr(lib, fn).restype = None
        lib.q4_k_gemm_team.argtypes = [p, i, i, p, i, p, p, p, p]
        lib.q4_k_gemm_team.restype = None
        _apply_prefetch(lib, isa, path.stem)
    return lib


# ---- the weight stream's software prefetch: which cache level it fills, chosen by measuring -------------------
# The kernels prefetch the weight stream 8 KB ahead (csrc/qblock.h). Into L1 (prefetcht0) suited the Xeon it was
# tuned on; on a Zen 4 EPYC it held the K-quant stream to the L1's few outstanding misses (~15 of ~28 GB/s a core
# streams) and an extra tree row's arithmetic came on top of the stream. Which hint streams best is a property of
# the machine, so it is measured here once per CPU model and library (a stream of weights larger than the L3, one
# thread, each hint in turn, interleaved), cached, and set per kernel family and per tile of one row / of more. A
# prefetch is only a hint: the arithmetic, so every output bit, is the same whichever is chosen.
PREFETCH_HINTS = ("t0", "t1", "t2", "off")  # csrc/qblock.h PF_T0 .. PF_OFF
PREFETCH_FAMILIES = ("q4_1", "q8_0", "kquant")  # PF_FAM_*: qgemm.c's two formats, kquants.c's tiles
PREFETCH_MEASURED = ("t0", "t1")  # the candidates timed (t2 measured the same as t1 on a Zen 4; "off" slower)
PREFETCH_KEEP_MARGIN = 0.05  # another hint replaces t0 (the tuned default) only when this much faster
# what is in force, per instruction set: {"hints": {family: [one row, more rows]}, "source": ..., "seconds": ...}
_PREFETCH: dict[str, dict[str, object]] = {}


def _l3_bytes() -> int:
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


def _prefetch_stream(lib: ctypes.CDLL, family: str, total_bytes: int) -> Callable[[int], None]:
    """A call that runs one `family` product over ~total_bytes of weights (so they come from DRAM) for a given
    number of activation rows, on the calling thread alone (a *_team function outside a parallel region). The
    weights are random codes with small fp16 factors: the timing, not the values, matters."""
    group, k = int(lib.qgemm_group()), 2048
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, k, generator=gen)
    qx = torch.empty(2 * 2 * k, dtype=torch.int8)
    dx = torch.empty(2, 2 * k // QK)
    scratch = (qx.data_ptr(), dx[0].data_ptr(), dx[1].data_ptr())  # qx, dx: kept alive by `run.keep` below
    per_weight = {"q4_1": 20 / 32, "q8_0": 34 / 32, "kquant": 148 / 256}[family]
    n = max(group, int(total_bytes / (k * per_weight)) // group * group)
    y = torch.empty(2, n)
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

    total = total_bytes or min(max(2 * _l3_bytes(), 48 << 20), 256 << 20)
    before = {(f, c): int(lib.mc_get_prefetch(f, c)) for f in range(len(PREFETCH_FAMILIES)) for c in (0, 1)}
    out: dict[str, dict[str, float]] = {}
    try:
        for fi, family in enumerate(PREFETCH_FAMILIES):
            run = _prefetch_stream(lib, family, total)
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


def _apply_prefetch(lib: ctypes.CDLL, isa: str, lib_name: str) -> None:
    """Put the prefetch hints in force: MEDUSA_CHAT_PREFETCH (one of PREFETCH_HINTS, every family; `measure`:
    measure again), else this CPU's cached measurement, else measure now (well under a second) and cache it."""
    from medusa_chat.atomic import atomic_write_json, read_json
    from medusa_chat.errors import MedusaChatError
    from medusa_chat.machine import cpu_model, slug
    from medusa_chat.paths import cache_root

    forced = os.environ.get("MEDUSA_CHAT_PREFETCH", "")
    if forced and forced != "measure":
        if forced not in PREFETCH_HINTS:
            raise ValueError(f"MEDUSA_CHAT_PREFETCH must be one of {', '.join(PREFETCH_HINTS)} or measure")
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


def prefetch_choice(isa: str | None = None) -> dict[str, object]:
    """The prefetch hints in force for this CPU's (or `isa`'s) library and where they came from ({} before the
    library is loaded)."""
    return dict(_PREFETCH.get(isa or best_isa(), {}))


def set_prefetch(hints: dict[str, list[str]] | str) -> None:
    """Put hints in force in every loaded library: one of PREFETCH_HINTS for all, or {family: [one row, more]}
    (benchmarks: before / after side by side). Only a hint: no output changes."""
    if isinstance(hints, str):
        hints = {f: [hints, hints] for f in PREFETCH_FAMILIES}
    for isa, lib in _LIBS.items():
        if lib is not None:
            _set_hints(lib, hints)
            _PREFETCH[isa] = {**_PREFETCH.get(isa, {}), "hints": hints, "source": "set_prefetch"}


DUET = -1  # set_threads(DUET): the caller alone, its block products shared with a helper it never waits for


def set_threads(n: int) -> None:
    """How many threads our kernels' parallel regions use (every built ISA's library; 0: the OpenMP runtime's
    default; DUET: the duet mode, csrc/duet.c). The outputs are the same bits whatever the count (the work is
    split by rows, column groups, heads and key ranges, never inside one sum)."""
    for isa in list(_LIBS) or [None]:
        lib = _LIBS.get(isa) if isa else load()
        if lib is not None:
            lib.mc_set_threads(int(n))


def duet_available() -> bool:
    """Can the duet mode run here (the kernel built, its helper thread started)?"""
    lib = load()
    return lib is not None and bool(lib.duet_available())


def quiesce() -> None:
    """Wait until the duet helper is out of any product (before the weights it may read are freed)."""
    for lib in _LIBS.values():
        if lib is not None:
            lib.duet_quiesce()


def get_threads() -> int:
    """The team size our kernels' regions use now (DUET in the duet mode; 0 where the kernel cannot run here)."""
    lib = load()
    return int(lib.mc_get_threads()) if lib is not None else 0


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    load()
    return _ERROR


class BlockLinear(nn.Module):
    """A bias-free linear whose weight is stored as GGUF blocks; fp32 in, fp32 out (other dtypes converted)."""

    kind = ""
    c_kind = -1  # decoder.h BLin.kind: how the native C step calls this kind
    buffer_names: tuple[str, ...] = ()  # the weight buffers, rows first (`fuse` concatenates them)

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        if in_features % QK:
            raise ValueError(f"{self.kind} needs in_features divisible by {QK} (got {in_features})")
        lib = load()
        if lib is None:
            raise RuntimeError(f"the qgemm kernel cannot run here: {_ERROR}")
        self._fn = getattr(lib, f"{self.kind}_gemm")
        # rows per interleaved group, the layout of this build's kernel (qgemm.c GW: 16 with 512-bit tiles, else
        # 8); each module records the width its weights were laid out for
        self.group = int(lib.qgemm_group())
        self.in_features, self.out_features = in_features, out_features

    def _call(self, x: int, m: int, y: int) -> None:
        raise NotImplementedError

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as contiguous fp32 rows [M, K], with activation scratch for M rows."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if x2.shape[0] > self._scratch_rows:
            self._grow_scratch(x2.shape[0])
        return x2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of a decoding step (7 calls per layer): no per-call allocation but the output.
        shape = x.shape
        x2 = self._rows(x)
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        self._call(x2.data_ptr(), m, y.data_ptr())  # type: ignore[attr-defined]
        return (
            y.view(*shape[:-1], self.out_features)
            if x.dtype == torch.float32
            else y.view(*shape[:-1], self.out_features).to(x.dtype)
        )

    _scratch_rows = 0

    def _bind(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        out = super()._apply(fn, recurse)
        self._bind()  # buffers may have moved: refresh the raw pointers
        return out

    def _grow_scratch(self, rows: int) -> None:
        """Scratch for the 8-bit activation blocks (codes, block scales, scaled sums), kept between calls."""
        rows = max(rows, 16)
        self._qx = torch.empty(2 * rows * self.in_features, dtype=torch.int8)  # codes, and codes + 128 (Q8_0)
        self._dx = torch.empty(2, rows * self.in_features // QK, dtype=torch.float32)
        self._scratch = (self._qx.data_ptr(), self._dx[0].data_ptr(), self._dx[1].data_ptr())
        self._scratch_rows = rows

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class Q41Linear(BlockLinear):
    """GGUF Q4_1: per 32 weights a scale d and a minimum m, w = d * q + m.

    Stored as the kernel reads it (csrc/qgemm.c, q4_1_tile): output rows in groups (`group`: 16 rows for
    512-bit builds, else 8), each group's blocks interleaved so that one vector load holds 4 codes of every row
    of the group. The buffers keep the shapes of the plain layout (qs [N, K / 2], d and m [N, K / 32])
    and a group occupies the same bytes as its rows, so slicing or concatenating at multiples of the group
    (`fuse`) still works. N is padded to a multiple of the group with
    zero weights, never read back (`out_features` is the true N). d and m are fp16 as in the file: a block costs
    the file's 20 bytes, so a step streams no more bytes than llama.cpp's does (the step is memory-bound).
    """

    kind = "q4_1"
    c_kind = 1
    buffer_names = ("qs", "d", "m")

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """codes [N, K] in 0..15 (block element order), d and m [N, K / 32]."""
        n, k = codes.shape
        super().__init__(n, k)
        pad = -n % self.group
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            d, m = torch.cat([d, d.new_zeros(pad, k // QK)]), torch.cat([m, m.new_zeros(pad, k // QK)])
        # d, m stored as fp16, as in the file
        qs, d8, m8 = interleave_q4_1(codes, d.float(), m.float(), self.group)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d8)
        self.register_buffer("m", m8)
        self._bind()

    def _bind(self) -> None:
        # plain ints in __dict__: reading buffers through nn.Module.__getattr__ costs microseconds per call
        self._args = (
            self.in_features,
            self.qs.data_ptr(),
            self.d.data_ptr(),
            self.m.data_ptr(),
            self.out_features,
        )

    def _call(self, x: int, m: int, y: int) -> None:
        k, qs, d, mn, n = self._args
        self._fn(x, m, k, qs, d, mn, n, y, *self._scratch)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K], d, m [N, K / 32]) in the plain layout."""
        codes, d, m = deinterleave_q4_1(self.qs, self.d, self.m, self.group)
        n = self.out_features
        return codes[:n], d[:n], m[:n]

    def dequantized(self) -> torch.Tensor:
        codes, d, m = self.blocks()
        w = d[..., None] * codes.float().reshape(self.out_features, -1, QK) + m[..., None]
        return w.reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> Q41Linear:
        codes, d, m = self.blocks()
        return Q41Linear(codes.index_select(0, index), d.index_select(0, index), m.index_select(0, index))


def interleave_q4_1(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain Q4_1 blocks (codes [N, K], N % group == 0; d, m [N, K / 32]) -> the kernel's interleaved layout.

    Within a group of `group` rows and a block b: byte (j, c, t) = code of block element 4j + t of row c (low nibble)
    and of element 16 + 4j + t (high nibble), j, t in 0..3; then the group's d, then their m."""
    n, k = codes.shape
    g, nb = n // group, k // QK
    c = codes.to(torch.uint8).view(g, group, nb, 2, 4, 4)  # [group, row, block, half, j, t]
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [group, row, block, j, t]
    qs = packed.permute(0, 2, 3, 1, 4).contiguous().view(n, k // 2)
    d8 = d.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    m8 = m.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    return qs, d8, m8


def deinterleave_q4_1(
    qs: torch.Tensor, d8: torch.Tensor, m8: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_q4_1`."""
    n, nb = d8.shape
    g = n // group
    p = qs.reshape(g, nb, 4, group, 4).permute(0, 3, 1, 2, 4)  # [group, row, block, j, t]
    codes = torch.stack([p & 0x0F, p >> 4], dim=3).reshape(n, nb * QK)  # [group, row, block, half, j, t]
    d = d8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    m = m8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    return codes, d, m


class Q80Linear(BlockLinear):
    """GGUF Q8_0: per 32 weights a scale d, w = d * q, q in -127..127.

    Interleaved in groups of output rows like Q41Linear (qs [N, K], d [N, K / 32] fp16 in the kernel's order),
    plus `s` [N, K / 32] int16: each block's sum of codes (the VNNI product's correction term, qgemm.c)."""

    kind = "q8_0"
    c_kind = 0
    buffer_names = ("qs", "d", "s")

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        n, k = codes.shape
        super().__init__(n, k)
        pad = -n % self.group
        if pad:
            codes, d = torch.cat([codes, codes.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, k // QK)])
        qs, d8, s8 = interleave_q8_0(codes.to(torch.int8), d.float(), self.group)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d8)
        self.register_buffer("s", s8)
        self._argmax = load().q8_0_gemm_argmax  # type: ignore[union-attr]  # BlockLinear checked the kernel
        self._bind()

    def _bind(self) -> None:
        self._args = (
            self.in_features,
            self.qs.data_ptr(),
            self.d.data_ptr(),
            self.s.data_ptr(),
            self.out_features,
        )

    def _call(self, x: int, m: int, y: int) -> None:
        k, qs, d, ws, n = self._args
        self._fn(x, m, k, qs, d, ws, n, y, *self._scratch)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """greedy_tokens(self(x)) [rows] without the outputs ever being written (qgemm.c, q8_0_gemm_argmax: the
        same values, compared in place): for a vocab projection, the greedy tokens of a step. None when the
        kernel does not take this many rows (then compute the outputs)."""
        x2 = self._rows(x)
        m = x2.shape[0]
        out = torch.empty(m, dtype=torch.long)
        k, qs, d, ws, n = self._args
        if not self._argmax(x2.data_ptr(), m, k, qs, d, ws, n, out.data_ptr(), *self._scratch):
            return None
        return out.view(x.shape[:-1])

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K] int8, d [N, K / 32]) in the plain layout."""
        codes, d = deinterleave_q8_0(self.qs, self.d, self.group)
        return codes[: self.out_features], d[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        codes, d = self.blocks()
        # reshape: with a single group the deinterleaved codes can be a strided view
        w = d[..., None] * codes.float().reshape(self.out_features, -1, QK)
        return w.reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> Q80Linear:
        codes, d = self.blocks()
        return Q80Linear(codes.index_select(0, index), d.index_select(0, index))


class RowLookupEmbedding(nn.Module):
    """A token embedding looked up in a block linear's own blocks (`table`), each row dequantized by C as it is
    looked up, so the table is never held a second time in fp32. Subclasses say how a row is read (`_lookup`).

    `weight` is an empty [0, H] fp32 buffer: it answers the dtype/device questions code asks of an embedding,
    and fails loudly where code would read its values."""

    def __init__(self, table: BlockLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        # not a submodule: a tied lm_head owns (and saves) the blocks; a plain attribute keeps a table made for
        # the embedding alone alive
        self.__dict__["table"] = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.padding_idx = padding_idx
        self.register_buffer("weight", torch.empty(0, table.in_features), persistent=False)

    def _lookup(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = torch.empty(flat.numel(), self.embedding_dim)
        self._lookup(flat, out)
        return out.view(*ids.shape, self.embedding_dim)


class BlockEmbedding(RowLookupEmbedding):
    """A token embedding looked up in a Q8_0 block linear's own blocks: the lm_head's, when the model ties the
    two and the float table is exactly those blocks dequantized (the embedded GGUF stores one Q8_0 token_embd
    for both; `cpu_linears.share_tied_embedding` checks the equality before swapping). A row is dequantized as it
    is looked up (csrc/qgemm.c, q8_0_rows: d * q, exact in fp32), so the table is not held a second time in fp32
    (49152 x 576: 113 MB for the embedded model)."""

    def __init__(self, table: Q80Linear, padding_idx: int | None = None) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"the qgemm kernel cannot run here: {_ERROR}")
        super().__init__(table, padding_idx)
        self._rows_fn = lib.q8_0_rows

    def _lookup(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        t = self.table
        self._rows_fn(
            t.qs.data_ptr(), t.d.data_ptr(), t.in_features, t.group, flat.data_ptr(), flat.numel(), out.data_ptr()
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the Q8_0 lm_head"


def interleave_q8_0(
    codes: torch.Tensor, d: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain Q8_0 blocks (codes [N, K] int8, N % group == 0; d [N, K / 32]) -> the kernel's interleaved layout:
    within a group of rows and a block, byte (j, c, t) = code of element 4j + t of row c, j in 0..7; then
    the group's d and block sums of codes."""
    n, k = codes.shape
    g, nb = n // group, k // QK
    c = codes.view(g, group, nb, 8, 4)  # [group, row, block, j, t]
    qs = c.permute(0, 2, 3, 1, 4).contiguous().view(n, k)
    # |sum| <= 32 * 127: 16 bits hold it. In chunks of rows: the sum widens its input to int16 first, which for
    # a 7B model's 32,000 x 4,096 head would be a 0.26 GB temporary (peak memory while heads load)
    sums = torch.empty(n, nb, dtype=torch.int16)
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    for r in range(0, n, rows):
        sums[r : r + rows] = codes[r : r + rows].view(-1, nb, QK).sum(-1, dtype=torch.int16)
    d8 = d.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    s8 = sums.view(g, group, nb).transpose(1, 2).contiguous().view(n, nb)
    return qs, d8, s8


def deinterleave_q8_0(qs: torch.Tensor, d8: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_q8_0` (the block sums follow from the codes)."""
    n, nb = d8.shape
    g = n // group
    codes = qs.reshape(g, nb, 8, group, 4).permute(0, 3, 1, 2, 4).reshape(n, nb * QK)
    d = d8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    return codes, d


QUANTIZE_CHUNK = 1 << 22  # weights quantized at a time: the float temporaries stay ~16 MB for any matrix


def quantize_q8_0(
    weight: torch.Tensor, give_back: Callable[[torch.Tensor], object] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 rule: d = max|w| / 127 per block of 32, q = round(w / d).

    In chunks of rows (each row's blocks are independent, so the result is the same bits): a 32000 x 4096
    projection in 16 bits would otherwise make ~2 GB of fp32 temporaries. `give_back` is called with each chunk
    of `weight` once it is read (mapped_weights.release: a file-mapped weight is then never resident whole)."""
    n, k = weight.shape
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    codes = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // QK)
    for r in range(0, n, rows):
        g = weight[r : r + rows].detach().float().view(-1, k // QK, QK)
        dd = g.abs().amax(-1) / 127
        inv = torch.where(dd > 0, 1 / dd, torch.zeros_like(dd))
        codes[r : r + rows] = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(-1, k)
        d[r : r + rows] = dd
        if give_back is not None:
            give_back(weight[r : r + rows])
    return codes, d.half().float()  # the file stores d as fp16, and so does Q80Linear


def fuse(modules: list[nn.Module]) -> BlockLinear | None:
    """One block linear computing several projections of the same input (q/k/v, gate/up): one kernel call
    instead of three. The originals are rebound to row views of the fused buffers, so no weight is stored
    twice. None unless all are block linears of one kind and input size."""
    first = modules[0] if modules else None
    if not isinstance(first, BlockLinear) or any(
        type(m) is not type(first) or m.in_features != first.in_features for m in modules
    ):
        return None
    cls = type(first)
    if any(m.group != first.group or m.out_features % m.group for m in modules):
        return None  # interleaved groups of rows: only whole groups of one layout can be laid end to end
    fused = cls.__new__(cls)
    BlockLinear.__init__(fused, sum(m.out_features for m in modules), first.in_features)
    fused.group = first.group
    for name in cls.buffer_names:
        whole = torch.cat([getattr(m, name) for m in modules])
        fused.register_buffer(name, whole)
        offset = 0
        for m in modules:
            m._buffers[name] = whole[offset : offset + m.out_features]
            offset += m.out_features
    for m in (*modules, fused):
        m._bind()
    return fused

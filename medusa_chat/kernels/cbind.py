"""The C library as Python calls it: loaded once per instruction set (built by cbuild.py on first use), each
function's ctypes signature declared, and the weight stream's prefetch hints put in force (prefetch.py).

A machine without a compiler or without AVX2+FMA simply does not get the library (`available()` is False; the
CPU paths then fall back to torch's weight-only kernels). It runs on the OpenMP runtime torch already loaded
(same libgomp soname), so it shares torch's threads instead of adding a pool.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading

from medusa_chat import envvars
from medusa_chat.kernels import cbuild, isa_choice, prefetch
from medusa_chat.machine import cpu_flags

_LIBS: dict[str, ctypes.CDLL | None] = {}
_ERROR = ""
# One build at a time: `prebuild`'s thread and the first kernel user may ask for the same library at once.
_LOAD_LOCK = threading.RLock()


def declare(lib: ctypes.CDLL) -> None:
    """Every exported function's argument and result types (the C prototypes: csrc/*.h)."""
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


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library for `isa` (default: this CPU's best), building it on first use; None where it
    cannot run here."""
    global _ERROR
    if not envvars.enabled("MEDUSA_CHAT_QGEMM"):
        _ERROR = "disabled by MEDUSA_CHAT_QGEMM=0"
        return None
    cpu = cpu_flags()
    if not {"avx2", "fma"} <= cpu:
        _ERROR = "this CPU lacks AVX2/FMA"
        return None
    default = isa is None
    isa = isa or isa_choice.best_isa()  # this CPU's fastest path, measured once
    if isa not in _LIBS:
        with _LOAD_LOCK:
            if isa not in _LIBS:
                _LIBS[isa] = _open(isa)
    if default:
        prefetch.mark_default(isa)
    return _LIBS[isa]


def _open(isa: str) -> ctypes.CDLL | None:
    global _ERROR
    try:
        path = cbuild.library_file(isa)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _ERROR = str(err)
        return None
    declare(lib)
    prefetch.apply_prefetch(lib, isa, path.stem)
    return lib


def prebuild() -> None:
    """Start building (or opening) this CPU's kernel library in a background thread, so that a first start's
    compile (~8 s on 2 slow cores) overlaps the model's metadata reading instead of following it; the first
    user of the kernels then waits only for what is left of it (`load` holds the build lock)."""
    if not envvars.enabled("MEDUSA_CHAT_QGEMM") or _LIBS:
        return
    threading.Thread(target=load, name="medusa-chat-kernel-build", daemon=True).start()


def libraries() -> dict[str, ctypes.CDLL | None]:
    """The libraries loaded so far, per instruction set (None: that one could not be loaded)."""
    return dict(_LIBS)


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    load()
    return _ERROR

"""The C library as Python calls it: loaded once per instruction set (built by cbuild.py on first use), each
function's ctypes signature declared (cdecl.py), and the weight stream's prefetch hints put in force (prefetch.py).

A machine without a compiler or without AVX2+FMA simply does not get the library (`available()` is False; the
CPU paths then fall back to torch's weight-only kernels). It runs on the OpenMP runtime torch already loaded
(same libgomp soname), so it shares torch's threads instead of adding a pool.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading

from medusa_chat import envvars
from medusa_chat.errors import SettingError
from medusa_chat.kernels import cbuild, isa_choice, prefetch
from medusa_chat.kernels.cdecl import declare
from medusa_chat.machine import cpu_flags

_LIBS: dict[str, ctypes.CDLL | None] = {}
_ERROR = ""
# One build at a time: `prebuild`'s thread and the first kernel user may ask for the same library at once.
_LOAD_LOCK = threading.RLock()


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
    lib.mc_set_kq_scheme(KQUANT_SCHEMES[kquant_scheme()])
    return lib


# The K-quant activation schemes (csrc/kquants.c), by the names MEDUSA_CHAT_KQUANT_ACTIVATIONS takes, and the
# library's codes for them (kquants.h)
KQUANT_SCHEMES = {"32": 32, "256": 256, "nested": 1}


def kquant_scheme() -> str:
    """How K-quant products quantize their activations (csrc/kquants.c), from MEDUSA_CHAT_KQUANT_ACTIVATIONS
    (anything but a KQUANT_SCHEMES name is a ValueError): `32`, a scale per 32 values (the default); `256`, one
    per superblock (llama.cpp's Q8_K); `nested`, per 32 as integer multiples of a superblock step. The two
    superblock schemes sum a superblock's sub-blocks in integers (benchmarks/RESULTS.md has what each costs and
    its KL to the float model)."""
    text = envvars.value("MEDUSA_CHAT_KQUANT_ACTIVATIONS") or "32"
    if text not in KQUANT_SCHEMES:
        raise SettingError(f"MEDUSA_CHAT_KQUANT_ACTIVATIONS must be one of {', '.join(KQUANT_SCHEMES)} (got {text!r})")
    return text


def prebuild() -> None:
    """Start building (or opening) this CPU's kernel library in a background thread, so that a first start's
    compile (~8 s on 2 slow cores) overlaps the model's metadata reading instead of following it; the first
    user of the kernels then waits only for what is left of it (`load` holds the build lock)."""
    if not envvars.enabled("MEDUSA_CHAT_QGEMM") or _LIBS:
        return
    threading.Thread(target=_load_quietly, name="medusa-chat-kernel-build", daemon=True).start()


def _load_quietly() -> None:
    try:
        load()
    except SettingError:
        pass  # a bad MEDUSA_CHAT_* value: the first user of the kernels gets it again, as the app's one-line error


def libraries() -> dict[str, ctypes.CDLL | None]:
    """The libraries loaded so far, per instruction set (None: that one could not be loaded)."""
    return dict(_LIBS)


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    load()
    return _ERROR

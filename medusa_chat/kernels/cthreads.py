"""Thread control of the C library: how many threads its parallel regions use, and the duet mode (csrc/duet.c).

The outputs are the same bits whatever the count: the work is split by rows, column groups, heads and key
ranges, never inside one sum.
"""

from __future__ import annotations

from medusa_chat.kernels import cbind

DUET = -1  # set_threads(DUET): the caller alone, its block products shared with a helper it never waits for


def set_threads(n: int) -> None:
    """How many threads our kernels' parallel regions use (every built ISA's library; 0: the OpenMP runtime's
    default; DUET: the duet mode, csrc/duet.c)."""
    libs = cbind.libraries()
    for lib in libs.values() if libs else [cbind.load()]:
        if lib is not None:
            lib.mc_set_threads(int(n))


def duet_available() -> bool:
    """Can the duet mode run here (the kernel built, its helper thread started)?"""
    lib = cbind.load()
    return lib is not None and bool(lib.duet_available())


def quiesce() -> None:
    """Wait until the duet helper is out of any product (before the weights it may read are freed)."""
    for lib in cbind.libraries().values():
        if lib is not None:
            lib.duet_quiesce()


def get_threads() -> int:
    """The team size our kernels' regions use now (DUET in the duet mode; 0 where the kernel cannot run here)."""
    lib = cbind.load()
    return int(lib.mc_get_threads()) if lib is not None else 0

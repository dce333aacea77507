"""Checkpoint tensors through a memory map, and their pages given back once used.

A pickled checkpoint (`pytorch_model*.bin`, a heads `.pt`) opened with `torch.load(mmap=True, weights_only=True)`,
and a safetensors file opened with `safe_open`, give tensors that are views of one private mapping of the whole
file: nothing is read until a tensor is touched. But every page touched stays resident (and counts in the process'
RSS) until the last tensor of the file is freed, so converting a file tensor by tensor would still end with the
whole file in memory next to its converted copy. `release(t)` drops the pages of a tensor that has been used
(madvise MADV_DONTNEED): the kernel keeps them in its page cache, and a later touch reads them again from the
file, so the values never change; only memory that is still file-backed is dropped (never a heap copy).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import pickle
import sys
import zipfile
from pathlib import Path

import torch

MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


def load_pickle(path: Path, error: type[Exception]) -> tuple[object, bool]:
    """(the unpickled object of a torch.save file, whether its tensors are memory-mapped). Read with
    weights_only=True: a pickle naming anything but tensors and plain containers is refused, never executed.
    Any unreadable file becomes a one-line `error` naming it."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
        # A legacy (non-zip, torch < 1.6) pickle has no layout a map could serve: its tensors are read into
        # memory (still weights_only). Such files are rare and small enough; refusing them would refuse
        # checkpoints transformers loads.
        return torch.load(path, map_location="cpu", weights_only=True), False
    except pickle.UnpicklingError as err:
        raise error(
            f"{path} holds objects other than tensors; it was not loaded (pickles are read with "
            f"weights_only=True and never executed): {str(err).splitlines()[0]}"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise error(f"cannot read {path}: the file is truncated or corrupt ({first[:200]})") from err


def _file_mapping(lo: int, hi: int) -> bool:
    """Is [lo, hi) inside one private mapping of a file (not the heap, not an anonymous or shared mapping)?"""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                start, _, end = fields[0].partition("-")
                if int(start, 16) <= lo and hi <= int(end, 16):
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return fields[1].endswith("p") and path.startswith("/")
    except (OSError, ValueError, IndexError):
        pass
    return False


def release(t: torch.Tensor) -> int:
    """Drop the resident pages wholly inside tensor `t`'s bytes when they are a private file mapping (module doc);
    returns the bytes dropped (0 elsewhere: other systems, heap memory, a tensor under a page)."""
    global _libc
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.numel() == 0:
        return 0
    if t.is_contiguous():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    else:  # a strided view: the span of its storage
        s = t.untyped_storage()
        lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
    lo = (lo + _PAGE - 1) // _PAGE * _PAGE  # whole pages only: a neighbour's bytes are never touched
    hi = hi // _PAGE * _PAGE
    if hi <= lo or not _file_mapping(lo, hi):
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return hi - lo if _libc.madvise(lo, hi - lo, MADV_DONTNEED) == 0 else 0

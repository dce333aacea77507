"""The C library's functions as ctypes sees them: every exported function's argument and result types (the C
prototypes of csrc/*.h), declared on a loaded library by cbind.py, and by isa_choice.py on the libraries it times."""

from __future__ import annotations

import ctypes


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
    lib.mc_set_kq_scheme.argtypes = [i]
    lib.mc_set_kq_scheme.restype = None
    lib.mc_get_kq_scheme.restype = i
    lib.mc_set_prefetch.argtypes = [i, i, i]
    lib.mc_set_prefetch.restype = None
    lib.mc_get_prefetch.argtypes = [i, i]
    lib.mc_get_prefetch.restype = i
    for fn in ("q4_1_gemm_team", "q8_0_gemm_team"):
        getattr(lib, fn).argtypes = [p, i, i, p, p, p, i, p, p, p, p]
        getattr(lib, fn).restype = None
    lib.q4_k_gemm_team.argtypes = [p, i, i, p, i, p, p, p, p]
    lib.q4_k_gemm_team.restype = None

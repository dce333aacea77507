"""Row-invariant matmuls for batch-1 tree decoding on CUDA, in Triton: int4 weights (int4_quant.PackedInt4) and
16-bit weights (the lm_head), `y [M, N] = x [M, K] @ W.T`.

Why these exist: a tree step verifies up to 64 tokens at once and must (1) cost about what one token costs,
since at batch 1 the weights' bytes are the time, and (2) give every row the bits it would get alone, so that
the greedy reply equals the plain loop's token for token. bitsandbytes NF4 fails both on a GPU (more than one
row dequantizes the whole weight to 16 bits and calls a GEMM: a 64-node step costs 2.5x a plain one, and its
rows differ from the one-row GEMV's). cuBLAS picks its algorithm by shape, so a row's bits change with M.

How: each program owns BLOCK_N output columns (and, with SPLIT_K > 1, a fixed slice of K) and loops over K in
BLOCK_K steps. Per step it loads one weight tile, dequantizes it once, and multiplies it into every 16-row tile
of the input (up to ROW_TILES = 4 tiles, 64 rows, per program; larger M adds programs along grid axis 2).
Every row therefore goes through the same sequence of tensor-core dot products, with the same K order, whatever
M is: padding rows are zeros and never change another row's bits. With SPLIT_K > 1 the slices' fp32 partials
land in a workspace that a second kernel sums in slice order, deterministic and again independent of M. The
configuration (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) is a function of the weight's shape only, fixed at
load: never of M (which is why nothing here autotunes per call).

Runs under Triton's interpreter on a CPU (TRITON_INTERPRET=1): tests check the indexing, the packing and the
row-invariance there; speed is measured on a GPU (benchmarks/gpu_4bit.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from medusa_chat.kernels import triton_interpreter
from medusa_chat.kernels.int4_quant import PackedInt4

try:
    import triton
    import triton.language as tl

    if triton_interpreter.interpreting():
        triton_interpreter.make_dots_row_invariant()
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

ROW_TILE = 16  # rows per tensor-core tile: the smallest M a Triton dot takes
ROW_TILES = 4  # row tiles per program: 64 rows share one dequantized weight tile


def available() -> bool:
    """Triton is importable and can run here: a CUDA device, or its interpreter on a CPU."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Config:
    """One kernel configuration; a function of the weight's shape only (module docstring)."""

    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"

    @classmethod
    def parse(cls, name: str) -> Config | None:
        """The configuration `name()` wrote, or None for anything else (an old or hand-edited cache)."""
        import re

        found = re.fullmatch(r"n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)", name)
        return cls(*(int(v) for v in found.groups())) if found else None


# Tried by the tuner (benchmarks/gpu_4bit.py and the first-start choice, cuda_int4.choose_kernel). Compiled for
# sm_90 without a GPU (tests/cuda_compile.py), 64 rows (4 tiles): 32 columns x 64 K fits in registers (199, no
# spill); 64 x 64 spills 72-88 bytes with 4 warps, so it is offered with 8 warps too.
CANDIDATES = (
    Config(32, 64, 1, 4, 3),
    Config(32, 64, 2, 4, 3),
    Config(32, 64, 4, 4, 4),
    Config(16, 64, 4, 4, 4),
    Config(64, 64, 1, 8, 3),
    Config(64, 64, 4, 8, 3),
    Config(64, 32, 2, 4, 3),
)


def default_config(n: int, k: int, group: int | None = None) -> Config:
    """A sensible configuration before any measurement: no register spill at 64 rows, and enough programs
    (column blocks x K slices) to cover a large GPU at one row."""
    block_k = min(64, group or 64)
    programs = n // 32
    split = 1 if programs >= 256 else 2 if programs >= 128 else 4
    return Config(32, block_k, split, 4, 3)


if triton is not None:

    @triton.jit
    def _int4_kernel(
        x_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr,
        M, N, HALF_K, stride_xm, stride_om, stride_os,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        TILES: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        rows = pid_m * (TILES * 16) + tl.arange(0, 16)
        acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        steps = HALF_K // BLOCK_K
        per_split = tl.cdiv(steps, SPLIT_K)
        first = pid_s * per_split
        last = tl.minimum(first + per_split, steps)
        for step in range(first, last):
            k0 = step * BLOCK_K
            byte = tl.load(codes_ptr + (k0 + ks)[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0)
            g_lo = k0 // GROUP
            g_hi = (HALF_K + k0) // GROUP
            s_lo = tl.load(scales_ptr + g_lo * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            z_lo = tl.load(zeros_ptr + g_lo * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            s_hi = tl.load(scales_ptr + g_hi * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            z_hi = tl.load(zeros_ptr + g_hi * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            w_lo = ((byte & 15).to(tl.float32) - 8.0) * s_lo[None, :] + z_lo[None, :]
            w_hi = ((byte >> 4).to(tl.float32) - 8.0) * s_hi[None, :] + z_hi[None, :]
            w_lo = w_lo.to(x_ptr.dtype.element_ty)
            w_hi = w_hi.to(x_ptr.dtype.element_ty)
            # the same two dots, in the same order, for every 16-row tile
            x_off = rows[:, None] * stride_xm + (k0 + ks)[None, :]
            ok = rows[:, None] < M
            acc0 = tl.dot(
                tl.load(x_ptr + x_off, mask=ok, other=0.0), w_lo, acc0, input_precision=DOT_PRECISION
            )
            acc0 = tl.dot(tl.load(x_ptr + x_off + HALF_K, mask=ok, other=0.0), w_hi, acc0,
                          input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 1:
                x1 = x_off + 16 * stride_xm
                ok1 = rows[:, None] + 16 < M
                acc1 = tl.dot(
                    tl.load(x_ptr + x1, mask=ok1, other=0.0), w_lo, acc1, input_precision=DOT_PRECISION
                )
                acc1 = tl.dot(tl.load(x_ptr + x1 + HALF_K, mask=ok1, other=0.0), w_hi, acc1,
                              input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 2:
                x2 = x_off + 32 * stride_xm
                ok2 = rows[:, None] + 32 < M
                acc2 = tl.dot(
                    tl.load(x_ptr + x2, mask=ok2, other=0.0), w_lo, acc2, input_precision=DOT_PRECISION
                )
                acc2 = tl.dot(tl.load(x_ptr + x2 + HALF_K, mask=ok2, other=0.0), w_hi, acc2,
                              input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 3:
                x3 = x_off + 48 * stride_xm
                ok3 = rows[:, None] + 48 < M
                acc3 = tl.dot(
                    tl.load(x_ptr + x3, mask=ok3, other=0.0), w_lo, acc3, input_precision=DOT_PRECISION
                )
                acc3 = tl.dot(tl.load(x_ptr + x3 + HALF_K, mask=ok3, other=0.0), w_hi, acc3,
                              input_precision=DOT_PRECISION)  # fmt: skip
        _store_tiles(out_ptr, acc0, acc1, acc2, acc3, rows, cols, M, N, pid_s, stride_om, stride_os,
                     TILES, PARTIAL)  # fmt: skip

    @triton.jit
    def _dense_kernel(
        x_ptr, w_ptr, out_ptr,
        M, N, K, stride_wn, stride_xm, stride_om, stride_os,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        TILES: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The same loop for a 16-bit weight [N, K] read in place (the lm_head: no transposed copy)."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        rows = pid_m * (TILES * 16) + tl.arange(0, 16)
        acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(steps, SPLIT_K)
        first = pid_s * per_split
        last = tl.minimum(first + per_split, steps)
        for step in range(first, last):
            kk = step * BLOCK_K + ks
            k_ok = kk < K
            w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0).to(x_ptr.dtype.element_ty)  # fmt: skip
            x_off = rows[:, None] * stride_xm + kk[None, :]
            acc0 = tl.dot(tl.load(x_ptr + x_off, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0), w, acc0,
                          input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 1:
                acc1 = tl.dot(tl.load(x_ptr + x_off + 16 * stride_xm, mask=(rows[:, None] + 16 < M) & k_ok[None, :],
                                      other=0.0), w, acc1, input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 2:
                acc2 = tl.dot(tl.load(x_ptr + x_off + 32 * stride_xm, mask=(rows[:, None] + 32 < M) & k_ok[None, :],
                                      other=0.0), w, acc2, input_precision=DOT_PRECISION)  # fmt: skip
            if TILES > 3:
                acc3 = tl.dot(tl.load(x_ptr + x_off + 48 * stride_xm, mask=(rows[:, None] + 48 < M) & k_ok[None, :],
                                      other=0.0), w, acc3, input_precision=DOT_PRECISION)  # fmt: skip
        _store_tiles(out_ptr, acc0, acc1, acc2, acc3, rows, cols, M, N, pid_s, stride_om, stride_os,
                     TILES, PARTIAL)  # fmt: skip

    @triton.jit
    def _store_tiles(out_ptr, acc0, acc1, acc2, acc3, rows, cols, M, N, pid_s, stride_om, stride_os,
                     TILES: tl.constexpr, PARTIAL: tl.constexpr):  # fmt: skip
        base = out_ptr + pid_s * stride_os + cols[None, :]
        col_ok = cols[None, :] < N
        dtype = tl.float32 if PARTIAL else out_ptr.dtype.element_ty
        tl.store(base + rows[:, None] * stride_om, acc0.to(dtype), mask=(rows[:, None] < M) & col_ok)
        if TILES > 1:
            r = rows + 16
            tl.store(base + r[:, None] * stride_om, acc1.to(dtype), mask=(r[:, None] < M) & col_ok)
        if TILES > 2:
            r = rows + 32
            tl.store(base + r[:, None] * stride_om, acc2.to(dtype), mask=(r[:, None] < M) & col_ok)
        if TILES > 3:
            r = rows + 48
            tl.store(base + r[:, None] * stride_om, acc3.to(dtype), mask=(r[:, None] < M) & col_ok)

    @triton.jit
    def _sum_splits(ws_ptr, out_ptr, count, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = ws[0, i] + ws[1, i] + ... in slice order: deterministic, the same for every M."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < count
        acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
        for s in range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s * count + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _tiles(m: int) -> int:
    return min(ROW_TILES, max(1, -(-m // ROW_TILE)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (the CPU interpreter's tests) must not round through tf32; 16-bit inputs are exact anyway
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(kernel, m: int, n: int, cfg: Config, x: torch.Tensor, args: tuple, consts: dict) -> torch.Tensor:  # noqa: ANN001
    tiles = _tiles(m)
    row_programs = -(-m // (tiles * ROW_TILE))
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, row_programs)
    common = dict(
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, TILES=tiles,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,
    )  # fmt: skip
    if cfg.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        kernel[grid](x, *args[0], out, m, n, *args[1], x.stride(0), out.stride(0), 0, PARTIAL=False, **common)
        return out
    work = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    kernel[grid](x, *args[0], work, m, n, *args[1], x.stride(0), work.stride(1), work.stride(0), PARTIAL=True,
                 **common)  # fmt: skip
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 1024
    _sum_splits[(triton.cdiv(m * n, block),)](work, out, m * n, SPLIT_K=cfg.split_k, BLOCK=block)
    return out


def int4_matmul(x: torch.Tensor, w: PackedInt4, cfg: Config) -> torch.Tensor:
    """x [M, K] (16-bit on a GPU; fp32 under the interpreter) -> x @ W.T [M, N] in x's dtype."""
    if triton is None:
        raise RuntimeError("the int4 kernel needs triton (pip install triton)")
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"input has {k} features, the weight {w.in_features}")
    if cfg.block_k > w.group or w.group % cfg.block_k:
        raise ValueError(f"BLOCK_K {cfg.block_k} must divide the group size {w.group}")
    x = x.contiguous()
    half = k // 2
    return _launch(
        _int4_kernel, m, w.out_features, cfg, x, ((w.codes, w.scales, w.zeros), (half,)), {"GROUP": w.group}
    )


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T with the same row-invariant loop (16-bit weights: the lm_head)."""
    if triton is None:
        raise RuntimeError("the dense kernel needs triton (pip install triton)")
    m, k = x.shape
    n = weight.shape[0]
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x = x.contiguous()
    return _launch(_dense_kernel, m, n, cfg, x, ((weight,), (k, weight.stride(0))), {})

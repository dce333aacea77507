"""Candidate row-invariant GPU matrix products for tree decoding (NF4 in bitsandbytes' layout, and 16-bit), as
Triton kernels with one fixed tiling. Measured by nf4_tree_rows.py on an H200 and NOT used by the app.

The idea: a row's result never depends on the other rows or on how many there are (16-row tiles, fixed column
and depth blocks, no autotuning that could choose per row count), so a verification step would give every node
the bits a one-token step gives it; and an NF4 tree would read each 4-bit weight once per 16 rows instead of
bitsandbytes' dequantize-then-multiply path for more than a few rows.

Measured (benchmarks/RESULTS.md, "H200"): both kernels are row-invariant (7/7 projections bitwise at 1-64 rows,
where cuBLAS fp16 is 2/7 at 64 rows and bitsandbytes 0/7 from 8), and the NF4 one matches bitsandbytes'
dequantized weights (max error 0.002). But this NF4 kernel is 10x slower than bitsandbytes' one-row GEMV (a
gather from the code table and a scale load per weight), the 16-bit one 1.23x slower than cuBLAS at one row; and
in the engine fp16 greedy replies stayed 85% identical to the plain loop (attention and the graph's masked SDPA
differ too). The interpreter (TRITON_INTERPRET=1) runs them on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Triton ships with torch's CUDA wheels; a CPU install has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

BLOCK_M = 16  # rows per tile: the smallest tensor-core tile; a tree of <= 16 nodes reads each weight once
BLOCK_N = 32  # output columns per program: 128 programs for a 4096-wide projection (the H200 has 132 SMs)
BLOCK_KB = 64  # bytes of a packed NF4 row per depth step (128 weights); 16-bit kernel: 128 weights
# More rows than this (a prompt's prefill) go to the frameworks' kernels: only decoding steps must be
# row-invariant, a prefill is the same call in the plain loop and in tree decoding.
MAX_ROWS = 256


if triton is not None:

    @triton.jit
    def _nf4_kernel(
        x_ptr, q_ptr, absmax_ptr, code_ptr, y_ptr, M, N, stride_xm, stride_ym,
        K: tl.constexpr, QBLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr,
    ):  # fmt: skip
        # Weight element (n, k) is nibble k of row n in bitsandbytes' flat packing: byte n*K/2 + k/2, high nibble
        # for even k; its scale is absmax[(n*K + k) // QBLOCK]. The even and odd columns of x meet the high and
        # low nibbles in two products, so no nibble has to be interleaved.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rb = tl.arange(0, BKB)
        half_k: tl.constexpr = K // 2
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for b0 in range(0, half_k, BKB):
            kb = b0 + rb
            kmask = kb < half_k
            xmask = (rm[:, None] < M) & kmask[None, :]
            xrow = x_ptr + rm[:, None] * stride_xm + 2 * kb[None, :]
            xe = tl.load(xrow, mask=xmask, other=0.0)
            xo = tl.load(xrow + 1, mask=xmask, other=0.0)
            wmask = kmask[:, None] & (rn[None, :] < N)
            packed = tl.load(q_ptr + rn[None, :] * half_k + kb[:, None], mask=wmask, other=0).to(tl.int32)
            scale = tl.load(absmax_ptr + (rn[None, :] * K + 2 * kb[:, None]) // QBLOCK, mask=wmask, other=0.0)
            w_hi = (tl.load(code_ptr + (packed >> 4)) * scale).to(xe.dtype)
            w_lo = (tl.load(code_ptr + (packed & 15)) * scale).to(xe.dtype)
            acc = tl.dot(xe, w_hi, acc)
            acc = tl.dot(xo, w_lo, acc)
        ymask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ymask)

    @triton.jit
    def _half_kernel(
        x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
        K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + k[None, :],
                mask=(rm[:, None] < M) & (k[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + k[:, None],
                mask=(k[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(x, w, acc)
        ymask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ymask)


class _RowInvariantLinear:
    """`forward(x [..., K]) -> [..., N]`: up to MAX_ROWS rows through `_launch` (one fixed tiling), more rows
    through the module's own forward, then the bias."""

    out_features: int
    in_features: int

    def __init__(self, module: Any) -> None:
        self.bias = module.bias
        self.fallback = module.forward

    def _launch(self, rows: torch.Tensor, y: torch.Tensor, grid: tuple[int, int]) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS:
            return self.fallback(x)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m, n = rows.shape[0], self.out_features
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        self._launch(rows, y, (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M)))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], n)


class NF4Linear(_RowInvariantLinear):
    """For a bitsandbytes NF4 `Linear4bit`, on its packed weights (no copy of them; double-quantized scales are
    expanded once to fp32: 0.5 bit a weight)."""

    def __init__(self, module: Any) -> None:
        import bitsandbytes.functional as bnbf

        super().__init__(module)
        state = module.weight.quant_state
        self.out_features, self.in_features = (int(s) for s in state.shape)
        if state.quant_type != "nf4" or self.in_features % 2:
            raise ValueError("NF4Linear needs an NF4 weight with an even row length")
        self.packed = module.weight.data.view(-1)
        absmax = state.absmax
        if state.nested:  # as bitsandbytes' own dequantize_4bit does
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        self.absmax = absmax.float().contiguous()
        self.code = state.code.float().to(self.packed.device).contiguous()
        self.blocksize = int(state.blocksize)

    def _launch(self, rows: torch.Tensor, y: torch.Tensor, grid: tuple[int, int]) -> None:
        _nf4_kernel[grid](
            rows, self.packed, self.absmax, self.code, y, rows.shape[0], self.out_features, rows.stride(0),
            y.stride(0), K=self.in_features, QBLOCK=self.blocksize, BM=BLOCK_M, BN=BLOCK_N, BKB=BLOCK_KB,
        )  # fmt: skip


class HalfLinear(_RowInvariantLinear):
    """For a 16-bit `nn.Linear` (its weight, not a copy): the same tiles for any row count, unlike cuBLAS."""

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self.weight = module.weight
        self.out_features, self.in_features = self.weight.shape

    def _launch(self, rows: torch.Tensor, y: torch.Tensor, grid: tuple[int, int]) -> None:
        _half_kernel[grid](
            rows, self.weight, y, rows.shape[0], self.out_features, rows.stride(0), self.weight.stride(0),
            y.stride(0), K=self.in_features, BM=BLOCK_M, BN=BLOCK_N, BK=2 * BLOCK_KB,
        )  # fmt: skip

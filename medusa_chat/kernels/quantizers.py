"""The weight quantizers: GGUF's block rules (Q8_0, Q4_1: blocks of QK = 32 weights, the scales rounded to
fp16 as the file stores them) and one symmetric int8 scale per row (torch's weight-only int8 kernel).

Each row is quantized on its own, in chunks of rows, so a result never depends on how a matrix is cut and no
fp32 copy of a whole weight exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK = 32  # weights per block (GGUF Q4_0 / Q4_1 / Q8_0), and the int4 kernel's group size
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


def quantize_q4_1(
    weight: torch.Tensor,
    codes_dtype: torch.dtype = torch.int32,
    give_back: Callable[[torch.Tensor], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of 32 (GGUF Q4_1's rule): codes [N, K], scale and minimum [N, K / 32].

    In chunks of rows (each row's groups are quantized on their own: the same bits), so no fp32 copy of a whole
    weight exists: a 7B draft's 32,000 x 4,096 head in 16 bits would otherwise make ~0.5 GB of fp32 and its
    temporaries several times that. `codes_dtype` torch.uint8 keeps the codes at a byte each (Q41Linear takes
    them so); `give_back` is called with each chunk of `weight` once it is read (mapped_weights.release: a
    file-mapped weight is then never resident whole)."""
    n, k = weight.shape
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    codes = torch.empty(n, k, dtype=codes_dtype, device=weight.device)
    scale = torch.empty(n, k // QK, device=weight.device)
    low = torch.empty(n, k // QK, device=weight.device)
    for r in range(0, n, rows):
        g = weight[r : r + rows].detach().float().view(-1, k // QK, QK)
        lo, hi = g.amin(-1), g.amax(-1)
        sc = (hi - lo) / 15
        inv = torch.where(sc > 0, 1 / sc, torch.zeros_like(sc))
        codes[r : r + rows] = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(codes_dtype).view(-1, k)
        scale[r : r + rows], low[r : r + rows] = sc, lo
        if give_back is not None:
            give_back(weight[r : r + rows])
    # the file stores d and m as fp16 (and so does the block kernel, block_linears.py): round them as the file would
    return codes, scale.half().float(), low.half().float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale

"""Block-kernel linears built straight from a GGUF tensor's stored blocks (no float copy, no second rounding).

Minimal version: Q4_1 and Q8_0 (qgemm.Q41Linear / Q80Linear). The K-quant work replaces this module with one
covering Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K behind the same function.

The kernel's layout is a byte permutation of the file's blocks (qgemm.interleave_q4_1 / interleave_q8_0): a Q4_1
block's 16 code bytes hold elements j (low nibble) and j + 16 (high nibble), exactly the kernel's byte (j // 4,
row, j % 4); Q8_0 codes are bytes already; the fp16 scales are the file's bits. So the buffers are made by
reordering bytes, without unpacking the codes to integers (which took most of a load's time and ~6x the
tensor's bytes of temporary memory); tests check the result equals the unpacking path's bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


def block_linear_from_gguf(type_name: str, raw: Any, rows: int, cols: int) -> nn.Module | None:
    """A bias-free block linear [rows x cols] computing with the GGUF blocks `raw` (uint8 [rows, bytes_per_row],
    numpy or torch) exactly as stored; None where this type has no block kernel or the kernel cannot run here
    (the caller then dequantizes)."""
    from medusa_chat.kernels.qgemm import QK, available

    if type_name not in ("Q4_1", "Q8_0") or cols % QK or not available():
        return None
    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    return _q4_1(data, rows, cols) if type_name == "Q4_1" else _q8_0(data, rows, cols)


def _padded(data: np.ndarray, group: int) -> np.ndarray:
    """Zero blocks appended up to a whole group of rows (zero scales: weights never read back)."""
    pad = -data.shape[0] % group
    return np.concatenate([data, np.zeros((pad, data.shape[1]), np.uint8)]) if pad else data


def _scales(blocks: np.ndarray, at: int, group: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block [N, nb, size] in the kernel's order (per group of rows: block-
    major, then row) as an fp16 tensor [N, nb]."""
    n, nb = blocks.shape[:2]
    bits = np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.uint16).reshape(n // group, group, nb)
    return torch.from_numpy(np.ascontiguousarray(bits.transpose(0, 2, 1)).reshape(n, nb)).view(torch.float16)


def _q4_1(data: np.ndarray, rows: int, cols: int) -> nn.Module:
    from medusa_chat.kernels.qgemm import QK, BlockLinear, Q41Linear

    module = Q41Linear.__new__(Q41Linear)
    BlockLinear.__init__(module, rows, cols)
    g = module.group
    nb = cols // QK
    blocks = _padded(data, g).reshape(-1, nb, 20)  # d (fp16), m (fp16), 16 code bytes
    n = blocks.shape[0]
    qs = blocks[:, :, 4:].reshape(n // g, g, nb, 4, 4).transpose(0, 2, 3, 1, 4)  # [group, block, j, row, t]
    module.register_buffer("qs", torch.from_numpy(np.ascontiguousarray(qs).reshape(n, cols // 2)))
    module.register_buffer("d", _scales(blocks, 0, g))
    module.register_buffer("m", _scales(blocks, 2, g))
    module._bind()
    return module


def _q8_0(data: np.ndarray, rows: int, cols: int) -> nn.Module:
    from medusa_chat.kernels.qgemm import QK, BlockLinear, Q80Linear, load

    module = Q80Linear.__new__(Q80Linear)
    BlockLinear.__init__(module, rows, cols)
    g = module.group
    nb = cols // QK
    blocks = _padded(data, g).reshape(-1, nb, 34)  # d (fp16), 32 int8 codes
    n = blocks.shape[0]
    qs = np.ascontiguousarray(blocks[:, :, 2:].reshape(n // g, g, nb, 8, 4).transpose(0, 2, 3, 1, 4)).view(np.int8)
    module.register_buffer("qs", torch.from_numpy(qs.reshape(n, cols)))  # [group, block, j, row, t]
    module.register_buffer("d", _scales(blocks, 0, g))
    # each block's sum of codes, in the kernel's [group, block, row] order: summed over j and t
    sums = qs.sum(axis=(2, 4), dtype=np.int16)  # |sum| <= 32 * 127
    module.register_buffer("s", torch.from_numpy(sums.reshape(n, nb)))
    module._argmax = load().q8_0_gemm_argmax  # type: ignore[union-attr]  # BlockLinear checked the kernel
    module._bind()
    return module

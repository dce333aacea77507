"""Block-kernel linears built straight from a GGUF tensor's stored blocks (no float copy, no second rounding).

Minimal version: Q4_1 and Q8_0 (qgemm.Q41Linear / Q80Linear). The K-quant work replaces this module with one
covering Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K behind the same function.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn


def block_linear_from_gguf(type_name: str, raw: Any, rows: int, cols: int) -> nn.Module | None:
    """A bias-free block linear [rows x cols] computing with the GGUF blocks `raw` (uint8 [rows, bytes_per_row],
    numpy or torch) exactly as stored; None where this type has no block kernel or the kernel cannot run here
    (the caller then dequantizes)."""
    from medusa_chat.kernels.gguf_file import unpack_q4_1, unpack_q8_0
    from medusa_chat.kernels.qgemm import QK, Q41Linear, Q80Linear, available

    if type_name not in ("Q4_1", "Q8_0") or cols % QK or not available():
        return None
    data = raw.numpy() if hasattr(raw, "numpy") else np.asarray(raw)
    if type_name == "Q4_1":
        return Q41Linear(*unpack_q4_1(data, rows, cols))
    return Q80Linear(*unpack_q8_0(data, rows, cols))

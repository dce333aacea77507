"""Triton's CPU interpreter with dot products whose rows do not depend on their neighbours.

Under `TRITON_INTERPRET=1` a `tl.dot` is numpy's `matmul`, i.e. the host BLAS. Some BLAS builds give a row
different bits depending on where it sits in the tile (OpenBLAS with `OPENBLAS_CORETYPE=Haswell` does: its
micro-kernel handles edge rows in another order). The kernels' row-invariance is a property of *their* loop
structure (the same tiles, the same K order, whatever M is), which is what the interpreter is there to check;
the host BLAS's blocking is not part of it. So under the interpreter each dot is computed as an elementwise
product summed over K in one fixed order: every output row is a function of that row's inputs only, on any
machine. A kernel that changes its K order, tile offsets or masks with M still shows different bits.

On a GPU nothing here runs: the compiled kernels use the tensor cores.
"""

from __future__ import annotations

import os

import numpy as np


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _row_invariant_dot(a: np.ndarray, b: np.ndarray, out_dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `out_dtype`: products rounded to out_dtype, then summed over K in
    index order (a reduction over a non-innermost axis adds whole [N] slices one K at a time)."""
    products = np.multiply(a[..., :, :, None], b[..., None, :, :], dtype=out_dtype)
    return np.add.reduce(products, axis=-2, dtype=out_dtype)


def make_dots_row_invariant() -> bool:
    """Replace the interpreter's dot (idempotent). False where Triton or its interpreter is absent."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_dot, "row_invariant", False):
        return builder is not None
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001 - Triton's own
        a_data, b_data = a.data, b.data
        if a_data.dtype.kind != "f" or b_data.dtype.kind != "f" or a_data.dtype.itemsize == 1:
            return original(
                self, a, b, d, input_precision, max_num_imprecise_acc
            )  # int and fp8 dots as before
        out = _row_invariant_dot(a_data, b_data, d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot.row_invariant = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True

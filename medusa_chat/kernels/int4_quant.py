"""Group-wise 4-bit weights for the CUDA path: the quantizer and the packed layout the Triton kernel reads.

Scheme: asymmetric int4, one (scale, zero) pair per `group` consecutive input features of an output row,
`w ~= (q - 8) * scale + zero` with q in 0..15 (the formula torch's tinygemm int4 kernel uses, so one set of
codes serves both kernels). Round-to-nearest from the group's min and max, then a least-squares refit of
(scale, zero) to the codes, re-rounded, kept per group only where it lowers the squared error (HQQ-style
refinement in closed form: never worse than round-to-nearest, measured by `quantization_error`). The scale and
zero are rounded to their storage dtype *before* the final codes are chosen, so the codes are the best for the
values the kernel will actually read.

Packed layout (`PackedInt4`): `codes` uint8 [K/2, N], byte [i, n] holding q[n, i] in its low nibble and
q[n, i + K/2] in its high nibble. Column-major in N so a kernel tile [BLOCK_K, BLOCK_N] is one coalesced load;
the two halves of K share a byte so one load feeds two dot products without any nibble interleaving.
`scales` and `zeros` are [K/group, N] in the storage dtype (fp16 by default: bf16 keeps 8 mantissa bits, too
few for a zero point several scales away from 0).

This module knows tensors, not models: which weights are quantized is the model layer's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (128, 64, 32)  # tried largest first against the layout's divisibility; the caller may force one


def group_for(k: int, preferred: int = 64) -> int | None:
    """The group size for `k` input features: `preferred` when it divides K/2 (the packed layout keeps a group
    inside one half of K), else the next smaller one that does; None when none does (keep the weight 16-bit)."""
    if k % 2:
        return None
    for group in (preferred, *[g for g in GROUP_SIZES if g < preferred]):
        if (k // 2) % group == 0:
            return group
    return None


@dataclass
class PackedInt4:
    """A [N, K] weight as packed int4 codes with per-group scales and zeros (module docstring)."""

    codes: torch.Tensor  # uint8 [K/2, N]
    scales: torch.Tensor  # [K/group, N]
    zeros: torch.Tensor  # [K/group, N]
    group: int

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[0]) * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight the kernel computes with (reference for tests and for the KL measures)."""
        return dequantize(unpack_codes(self.codes), self.scales.T, self.zeros.T, self.group).to(dtype)


def _codes_for(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    # w [N, G', group], scale/zero [N, G', 1]: q = round((w - zero) / scale) + 8, clamped to 0..15
    return (torch.round((w - zero) / scale) + 8).clamp_(0, 15)


def quantize_int4(
    weight: torch.Tensor, group: int, *, refine: int = 2, storage: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (codes uint8 [N, K], scales [N, K/group], zeros [N, K/group]) in `storage` dtype.

    Computed in fp32 on the weight's device (a GPU quantizes a 7B model in seconds); temporaries are a few
    copies of this one weight, never of the model."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"group {group} does not divide the {k} input features")
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    lo, hi = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15).clamp_(min=1e-8)
    zero = lo + 8 * scale  # q = 0 -> lo, q = 15 -> hi
    q = _codes_for(w, scale, zero)
    err = ((q - 8) * scale + zero - w).pow_(2).sum(dim=2, keepdim=True)
    for _ in range(refine):
        # least squares of w on (q - 8) per group: slope = scale, intercept = zero
        c = q - 8
        c_mean, w_mean = c.mean(dim=2, keepdim=True), w.mean(dim=2, keepdim=True)
        var = (c - c_mean).pow(2).sum(dim=2, keepdim=True)
        cov = ((c - c_mean) * (w - w_mean)).sum(dim=2, keepdim=True)
        fit_scale = torch.where(var > 0, cov / var.clamp(min=1e-12), scale).clamp_(min=1e-8)
        fit_zero = w_mean - fit_scale * c_mean
        fit_q = _codes_for(w, fit_scale, fit_zero)
        fit_err = ((fit_q - 8) * fit_scale + fit_zero - w).pow_(2).sum(dim=2, keepdim=True)
        better = fit_err < err
        scale = torch.where(better, fit_scale, scale)
        zero = torch.where(better, fit_zero, zero)
        q = torch.where(better, fit_q, q)
        err = torch.minimum(err, fit_err)
    # the kernel reads scale and zero in `storage`: pick the codes for those rounded values
    scale = scale.to(storage).to(torch.float32)
    zero = zero.to(storage).to(torch.float32)
    q = _codes_for(w, scale, zero)
    return (
        q.reshape(n, k).to(torch.uint8),
        scale.reshape(n, k // group).to(storage),
        zero.reshape(n, k // group).to(storage),
    )


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """codes uint8 [N, K], scales/zeros [N, K/group] -> the fp32 weight [N, K] they stand for."""
    n, k = codes.shape
    c = codes.to(torch.float32).reshape(n, k // group, group) - 8
    w = c * scales.to(torch.float32)[..., None] + zeros.to(torch.float32)[..., None]
    return w.reshape(n, k)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (0..15) -> uint8 [K/2, N]: low nibble column i, high nibble column i + K/2."""
    n, k = codes.shape
    half = k // 2
    lo, hi = codes[:, :half], codes[:, half:]
    return (lo | (hi << 4)).T.contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: uint8 [K/2, N] -> [N, K]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.cat([lo, hi], dim=0).T.contiguous()


ROWS_PER_CHUNK = 2048  # quantized at a time: fp32 temporaries of a few times 2048 x K, not of the whole weight


def pack_int4(
    weight: torch.Tensor, group: int, *, refine: int = 2, storage: torch.dtype = torch.float16
) -> PackedInt4:
    """Quantize a [N, K] weight and lay it out for the Triton kernel, on the weight's device, a chunk of rows at
    a time (a 32000 x 4096 vocab projection would otherwise need ~4 GB of fp32 temporaries on the GPU)."""
    parts = [
        quantize_int4(weight[i : i + ROWS_PER_CHUNK], group, refine=refine, storage=storage)
        for i in range(0, weight.shape[0], ROWS_PER_CHUNK)
    ]
    codes, scales, zeros = (torch.cat(p) for p in zip(*parts, strict=True))
    return PackedInt4(
        codes=pack_codes(codes), scales=scales.T.contiguous(), zeros=zeros.T.contiguous(), group=group
    )


def quantization_error(weight: torch.Tensor, group: int, refine: int) -> float:
    """Relative squared error ||W - deq(Q(W))||^2 / ||W||^2 of this scheme on one weight."""
    codes, scales, zeros = quantize_int4(weight, group, refine=refine)
    w = weight.to(torch.float32)
    return float((dequantize(codes, scales, zeros, group) - w).pow(2).sum() / w.pow(2).sum())


def tinygemm_operands(packed: PackedInt4, inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The same codes for torch's CUDA tinygemm kernel (`torch.ops.aten._weight_int4pack_mm`): its packed weight
    and its bf16 scales_and_zeros [K/group, N, 2] (CUDA only: the packing op has no CPU kernel)."""
    codes = unpack_codes(packed.codes)  # [N, K]
    n, k = codes.shape
    # the op takes two codes per byte along K, the even column in the high nibble
    pairs = codes.reshape(n, k // 2, 2)
    as_bytes = ((pairs[..., 0] << 4) | pairs[..., 1]).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(as_bytes, inner_k_tiles)
    sz = torch.stack([packed.scales, packed.zeros], dim=2).to(torch.bfloat16).contiguous()
    return weight, sz

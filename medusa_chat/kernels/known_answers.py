"""Known answers at load: each block-kernel kind used on this machine is checked once per process against a
float64 reference on a small fixed input, beside the row-invariance check (cpu_linears.check_row_invariant).

Why: row invariance alone passes a kernel that is consistently wrong (a miscompiled build, an instruction that
behaves differently on a new CPU, a layout bug): every row would be wrong in the same way. Here the weights
come from fixed seeds, their float values from the format's definition computed independently of the
kernel's layout (gguf_file's unpackers and dequantizers, or the codes themselves), and the kernel's outputs
must lie within a bound of the exact product x @ W^T: the only approximation is the 8-bit activations, whose
error per output is at most sum over blocks of (dx / 2) * sum |w| (round to nearest, |x - dx q| <= dx / 2),
plus fp32 accumulation slack. A kernel that disagrees is refused with a one-line reason (DeviceError).
"""

from __future__ import annotations

import numpy as np
import torch

from medusa_chat.errors import DeviceError
from medusa_chat.kernels import qgemm

ROWS, OUT, IN = 5, 40, 512  # 40 outputs: two and a half groups (padding); 512: two K-quant superblocks
_RESULTS: dict[tuple[str, str], str] = {}  # (instruction set, kind) -> "" (agrees) or why not


def _random_k_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid K-quant (or Q4_0) bytes [rows, bytes per row]: every bit pattern of the codes and scales is a
    valid block, so they are random bytes; d and dmin are fp16 in a weight-like range."""
    from medusa_chat.kernels.gguf_file import BLOCK

    type_id = {"Q4_0": 2, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}[type_name]
    size, per = BLOCK[type_id]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    offsets = {"Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]
    for off in offsets:
        d = (rng.uniform(0.2, 1.0, (rows, cols // per)) * rng.choice([-1, 1], (rows, cols // per)) * 1e-3)
        raw[..., off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def known_case(kind: str) -> tuple[qgemm.BlockLinear, torch.Tensor]:
    """A module of `kind` with fixed weights, and those weights in float64 from the format's definition."""
    from medusa_chat.kernels.gguf_file import dequantize_k, unpack_k
    from medusa_chat.kernels.gguf_linears import K_CLASSES

    gen = torch.Generator().manual_seed(1234)
    if kind == "q4_1":
        codes = torch.randint(0, 16, (OUT, IN), generator=gen)
        d = (torch.rand(OUT, IN // 32, generator=gen) * 0.02).half().float()
        m = (-torch.rand(OUT, IN // 32, generator=gen) * 0.1).half().float()
        w = d.double().repeat_interleave(32, 1) * codes.double() + m.double().repeat_interleave(32, 1)
        return qgemm.Q41Linear(codes, d, m), w
    if kind == "q8_0":
        codes = torch.randint(-127, 128, (OUT, IN), generator=gen).to(torch.int8)
        d = (torch.rand(OUT, IN // 32, generator=gen) * 0.001).half().float()
        return qgemm.Q80Linear(codes, d), d.double().repeat_interleave(32, 1) * codes.double()
    type_name = kind.upper()
    raw = _random_k_blocks(type_name, OUT, IN, 1234)
    w = dequantize_k(type_name, unpack_k(type_name, raw, OUT, IN)).double()
    return K_CLASSES[type_name](OUT, IN, raw=raw), w


def known_input() -> torch.Tensor:
    """[ROWS, IN] fp32, fixed: a spread of magnitudes per block, a zero block, and an outlier."""
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(99)) * 2
    x[1, 64:96] = 0
    x[2, 300] = 50.0
    return x


def disagreement(kind: str) -> str:
    """"" when the kernel of `kind` computes the known answer on this machine, else why not (one line)."""
    lin, w = known_case(kind)
    x = known_input()
    with torch.inference_mode():
        y = lin(x).double()
    exact = x.double() @ w.t()
    xb = x.double().view(ROWS, IN // 32, 32)
    dx = xb.abs().amax(-1) / 127  # the activation blocks' step
    wabs = w.abs().view(OUT, IN // 32, 32).sum(-1)
    bound = (dx / 2) @ wabs.t() * 1.001 + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
    err = (y - exact).abs()
    if not bool(torch.isfinite(y).all()):
        return f"the {kind} block kernel gives non-finite outputs on a known input"
    worst = float((err / bound).max())
    if worst > 1.0:
        return (
            f"the {kind} block kernel disagrees with its float reference on a known input "
            f"(error {worst:.3g}x the 8-bit activations' bound)"
        )
    return ""


def check_known_answer(kind: str) -> None:
    """Raise DeviceError (one line) unless the `kind` kernel of this machine's build gives the known answer;
    checked once per process and build."""
    key = (qgemm.best_isa(), kind)
    if key not in _RESULTS:
        _RESULTS[key] = disagreement(kind)
    if _RESULTS[key]:
        raise DeviceError(_RESULTS[key] + "; it is not used (MEDUSA_CHAT_QGEMM=0 turns the block kernels off)")


def kernels_agree(kinds: tuple[str, ...]) -> str:
    """"" when every kind gives its known answer here, else the first one's reason."""
    for kind in kinds:
        try:
            check_known_answer(kind)
        except DeviceError as err:
            return str(err)
    return ""


def reset() -> None:
    """Forget the results (tests)."""
    _RESULTS.clear()

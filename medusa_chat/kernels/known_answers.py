"""Known answers at load: each block-kernel kind used on this machine is checked once per process against a
float64 reference on a small fixed input, beside the row-invariance check (cpu_linears.check_row_invariant).

Why: row invariance alone passes a kernel that is consistently wrong (a miscompiled build, an instruction that
behaves differently on a new CPU, a layout bug): every row would be wrong in the same way. Here the weights
come from fixed seeds and their float values from the format's definition, computed independently of the
kernel's layout (gguf_file's unpackers and dequantizers, or the codes themselves). The reference takes the
activations through the kernel's 8-bit rounding (per block of 32, or for the K-quants per block of the
library's scheme, 32 or 256: d = max|x| / 127 and q = round(x / d), both in fp32 as quantize_rows /
quantize_k_rows do them), then sums exactly in float64; so the tolerance only covers the kernel's fp32 factors
and accumulation (1e-5 of the sum of the terms' magnitudes), and an error of a part in a thousand in any output
shows. A kernel that disagrees is refused with a one-line reason (DeviceError).
"""

from __future__ import annotations

import numpy as np
import torch

from medusa_chat.errors import DeviceError
from medusa_chat.kernels import cbind
from medusa_chat.kernels.block_linears import BlockLinear, Q41Linear, Q80Linear
from medusa_chat.kernels.isa_choice import best_isa

ROWS, OUT, IN = 5, 40, 512  # 40 outputs: two and a half groups (padding); 512: two K-quant superblocks
_RESULTS: dict[tuple[str, str, int], str] = {}  # (instruction set, kind, K-quant scheme) -> "" or why not


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
        d = rng.uniform(0.2, 1.0, (rows, cols // per)) * rng.choice([-1, 1], (rows, cols // per)) * 1e-3
        raw[..., off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def known_case(cls: type[BlockLinear]) -> tuple[BlockLinear, torch.Tensor, torch.Tensor]:
    """A module of block-linear class `cls` with fixed weights; those weights in float64 from the format's
    definition; and the magnitudes of the kernel's terms per weight (|scale * q| + |minimum|: the
    accumulation error's scale). K-quant classes (gguf_linears) are built from the file's bytes."""
    from medusa_chat.kernels.gguf_file import unpack_k

    kind = cls.kind

    def per_weight(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.double().repeat_interleave(n, 1)

    gen = torch.Generator().manual_seed(1234)
    if kind == "q4_1":
        codes = torch.randint(0, 16, (OUT, IN), generator=gen)
        d = (torch.rand(OUT, IN // 32, generator=gen) * 0.02).half().float()
        m = (-torch.rand(OUT, IN // 32, generator=gen) * 0.1).half().float()
        scaled = per_weight(d, 32) * codes.double()
        return (
            Q41Linear(codes, d, m),
            scaled + per_weight(m, 32),
            scaled.abs() + per_weight(m, 32).abs(),
        )
    if kind == "q8_0":
        codes = torch.randint(-127, 128, (OUT, IN), generator=gen).to(torch.int8)
        d = (torch.rand(OUT, IN // 32, generator=gen) * 0.001).half().float()
        w = per_weight(d, 32) * codes.double()
        return Q80Linear(codes, d), w, w.abs()
    type_name = cls.type_name  # type: ignore[attr-defined]  # a gguf_linears.KQuantLinear
    raw = _random_k_blocks(type_name, OUT, IN, 1234)
    k = unpack_k(type_name, raw, OUT, IN)
    codes = torch.from_numpy(k["codes"].astype(np.float64))
    d = torch.from_numpy(k["d"].astype(np.float64))
    sc = torch.from_numpy(k["sc"].astype(np.float64))
    if type_name == "Q6_K":
        scaled = per_weight(per_weight(d, 16) * sc, 16) * (codes - 32)
        return cls(OUT, IN, raw=raw), scaled, scaled.abs()  # type: ignore[call-arg]
    dmin, m = (torch.from_numpy(k[n].astype(np.float64)) for n in ("dmin", "m"))
    scaled, low = per_weight(per_weight(d, 8) * sc, 32) * codes, per_weight(per_weight(dmin, 8) * m, 32)
    return cls(OUT, IN, raw=raw), scaled - low, scaled.abs() + low.abs()  # type: ignore[call-arg]


def known_input() -> torch.Tensor:
    """[ROWS, IN] fp32, fixed: a spread of magnitudes per block, a zero block, and an outlier."""
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(99)) * 2
    x[1, 64:96] = 0
    x[2, 300] = 50.0
    return x


def activations_as_the_kernel_rounds_them(x: torch.Tensor, scheme: str = "32") -> torch.Tensor:
    """x as the kernel's 8-bit activations stand for it, in float64 (csrc/kquants.c describes the schemes).
    "32" (team.c quantize_rows): per block of 32, fp32 d = max|x| / 127, q = x * (1 / d) rounded half to even,
    x -> d * q. "256" and "nested" (kquants.c quantize_k_rows): per superblock of 256, fp32 dk = max|x| / 2032
    and per sub-block of 32 an integer m (16, or nested: ceil(16 * max|x_sub| / max|x|) in fp32, in 1..16), q = x
    * (1 / (dk * m)) rounded half to even, x -> dk * m * q."""
    if scheme == "32":
        xb = x.view(x.shape[0], -1, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (xb * inv).round().clamp(-127, 127)
        return (q.double() * d.double()).view_as(x)
    xb = x.float().view(x.shape[0], -1, 8, 32)
    a = xb.abs().amax(-1, keepdim=True)
    big = a.amax(-2, keepdim=True)
    dk = big / 2032
    m = torch.full_like(a, 16.0)
    if scheme == "nested":
        m = torch.where(big != 0, torch.ceil(16 * a / big).clamp(1, 16), m)
    step = dk * m
    inv = torch.where(step != 0, 1 / step, torch.zeros_like(step))
    q = (xb * inv).round().clamp(-127, 127)
    return (q.double() * dk.double() * m.double()).view_as(x)


def kquant_scheme() -> str:
    """The loaded library's K-quant activation scheme (a cbind.KQUANT_SCHEMES name: csrc/kquants.c)."""
    lib = cbind.load()
    if lib is None:
        return "32"
    code = int(lib.mc_get_kq_scheme())
    return next(name for name, c in cbind.KQUANT_SCHEMES.items() if c == code)


def disagreement(cls: type[BlockLinear]) -> str:
    """Empty when the kernel of block-linear class `cls` computes the known answer on this machine, else why not (one line)."""
    kind = cls.kind
    lin, w, magnitude = known_case(cls)
    x = known_input()
    with torch.inference_mode():
        y = lin(x).double()
    kquant = bool(getattr(cls, "type_name", ""))  # a gguf_linears.KQuantLinear: the library's K-quant scheme
    xq = activations_as_the_kernel_rounds_them(x, kquant_scheme() if kquant else "32")
    exact = xq @ w.t()
    bound = 1e-5 * (xq.abs() @ magnitude.t()) + 1e-30
    if not bool(torch.isfinite(y).all()):
        return f"the {kind} block kernel gives non-finite outputs on a known input"
    worst = float(((y - exact).abs() / bound).max())
    if worst > 1.0:
        return (
            f"the {kind} block kernel disagrees with its float reference on a known input "
            f"(error {worst:.3g}x the tolerance)"
        )
    return ""


def check_known_answer(cls: type[BlockLinear]) -> None:
    """Raise DeviceError (one line) unless the kernel of block-linear class `cls` (its kind) in this machine's
    build gives the known answer; checked once per process and build."""
    key = (best_isa(), cls.kind, kquant_scheme())
    if key not in _RESULTS:
        _RESULTS[key] = disagreement(cls)
    if _RESULTS[key]:
        raise DeviceError(
            _RESULTS[key] + "; it is not used (MEDUSA_CHAT_QGEMM=0 turns the block kernels off)"
        )


def kernels_agree(classes: tuple[type[BlockLinear], ...]) -> str:
    """Empty when every class's kernel gives its known answer here, else the first one's reason."""
    for cls in classes:
        try:
            check_known_answer(cls)
        except DeviceError as err:
            return str(err)
    return ""


def reset() -> None:
    """Forget the results (tests)."""
    _RESULTS.clear()

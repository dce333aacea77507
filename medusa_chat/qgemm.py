"""GGUF-block linears (Q4_1, Q8_0) on the CPU with a small AVX2 kernel of our own (csrc/qgemm.c).

The kernel is compiled once with the system C compiler the first time it is needed (about a second) and kept
in the user cache dir; a machine without a compiler or without AVX2+FMA simply does not get these linears
(`available()` is False) and the CPU paths fall back to torch's weight-only kernels. It runs on the OpenMP
runtime torch already loaded (same libgomp soname), so it shares torch's threads instead of adding a pool.

Why a kernel: see csrc/qgemm.c. In short, a tree step reads each weight block once for all its rows, and the
weights are the file's own blocks (Q4_1 for the projections, Q8_0 for the embedding / lm_head), dequantized
exactly as the float model converted from the file has them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import nn

QK = 32
SOURCES = ("qgemm.c", "decoder.c")
HEADERS = ("simd.h",)
# -ffp-contract=off: no implicit a*b+c -> fma fusion, whose use could differ between a loop's vector body and
# its scalar remainder; every FMA in the kernels is an explicit intrinsic, so each element is computed alike.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR = ""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) found")
    with tempfile.TemporaryDirectory() as tmp:
        c_files = []
        for name in HEADERS:
            (Path(tmp) / name).write_text(resources.files("medusa_chat.csrc").joinpath(name).read_text())
        for name in SOURCES:
            c_file = Path(tmp) / name
            c_file.write_text(resources.files("medusa_chat.csrc").joinpath(name).read_text())
            c_files.append(str(c_file))
        so = Path(tmp) / "qgemm.so"
        cmd = [cc, *CFLAGS, *c_files, "-o", str(so)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the qgemm kernel failed: {done.stderr.strip()[:300]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(so, tmp_out)
        os.replace(tmp_out, out)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None where it cannot run here."""
    global _LIB, _TRIED, _ERROR
    if _TRIED:
        return _LIB
    _TRIED = True
    if os.environ.get("MEDUSA_CHAT_QGEMM", "1") == "0":
        _ERROR = "disabled by MEDUSA_CHAT_QGEMM=0"
        return None
    if not {"avx2", "fma"} <= _cpu_flags():
        _ERROR = "this CPU lacks AVX2/FMA"
        return None
    from medusa_chat.embedded import cache_root

    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for name in (*SOURCES, *HEADERS):
        h.update(resources.files("medusa_chat.csrc").joinpath(name).read_bytes())
    digest = h.hexdigest()[:16]
    path = cache_root() / "kernels" / f"qgemm-{digest}.so"
    try:
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _ERROR = str(err)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.q4_1_gemm.argtypes = [p, i, i, p, p, p, i, p, p, p, p]
    lib.q8_0_gemm.argtypes = [p, i, i, p, p, i, p, p, p, p]
    lib.q4_1_gemm.restype = lib.q8_0_gemm.restype = None
    lib.decoder_forward.argtypes = [p, i, p, p, p, p, i, i, p, p, i, p]
    lib.decoder_forward.restype = None
    lib.decoder_scratch_bytes.argtypes = [p, i, i]
    lib.decoder_scratch_bytes.restype = ctypes.c_size_t
    _LIB = lib
    return lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    load()
    return _ERROR


class BlockLinear(nn.Module):
    """A bias-free linear whose weight is stored as GGUF blocks; fp32 in, fp32 out (other dtypes converted)."""

    kind = ""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        if in_features % QK:
            raise ValueError(f"{self.kind} needs in_features divisible by {QK} (got {in_features})")
        lib = load()
        if lib is None:
            raise RuntimeError(f"the qgemm kernel cannot run here: {_ERROR}")
        self._fn = getattr(lib, f"{self.kind}_gemm")
        self.in_features, self.out_features = in_features, out_features

    def _call(self, x: int, m: int, y: int) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of a decoding step (7 calls per layer): no per-call allocation but the output.
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        if m > self._scratch_rows:
            self._grow_scratch(m)
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        self._call(x2.data_ptr(), m, y.data_ptr())  # type: ignore[attr-defined]
        return (
            y.view(*shape[:-1], self.out_features)
            if x.dtype == torch.float32
            else y.view(*shape[:-1], self.out_features).to(x.dtype)
        )

    _scratch_rows = 0

    def _bind(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        out = super()._apply(fn, recurse)
        self._bind()  # buffers may have moved: refresh the raw pointers
        return out

    def _grow_scratch(self, rows: int) -> None:
        """Scratch for the 8-bit activation blocks (codes, block scales, scaled sums), kept between calls."""
        rows = max(rows, 16)
        self._qx = torch.empty(rows * self.in_features, dtype=torch.int8)
        self._dx = torch.empty(2, rows * self.in_features // QK, dtype=torch.float32)
        self._scratch = (self._qx.data_ptr(), self._dx[0].data_ptr(), self._dx[1].data_ptr())
        self._scratch_rows = rows

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class Q41Linear(BlockLinear):
    """GGUF Q4_1: per 32 weights a scale d and a minimum m, w = d * q + m."""

    kind = "q4_1"

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """codes [N, K] in 0..15 (block element order), d and m [N, K / 32]."""
        n, k = codes.shape
        super().__init__(n, k)
        c = codes.to(torch.uint8).view(n, k // QK, QK)
        packed = c[..., :16] | (c[..., 16:] << 4)  # GGUF's nibble order
        self.register_buffer("qs", packed.reshape(n, k // 2).contiguous())
        self.register_buffer("d", d.float().contiguous())
        self.register_buffer("m", m.float().contiguous())
        self._bind()

    def _bind(self) -> None:
        # plain ints in __dict__: reading buffers through nn.Module.__getattr__ costs microseconds per call
        self._args = (
            self.in_features,
            self.qs.data_ptr(),
            self.d.data_ptr(),
            self.m.data_ptr(),
            self.out_features,
        )

    def _call(self, x: int, m: int, y: int) -> None:
        k, qs, d, mn, n = self._args
        self._fn(x, m, k, qs, d, mn, n, y, *self._scratch)

    def dequantized(self) -> torch.Tensor:
        q = self.qs.view(self.out_features, -1, 16)
        codes = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
        return (self.d[..., None] * codes + self.m[..., None]).view(self.out_features, self.in_features)


class Q80Linear(BlockLinear):
    """GGUF Q8_0: per 32 weights a scale d, w = d * q, q in -128..127."""

    kind = "q8_0"

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        n, k = codes.shape
        super().__init__(n, k)
        self.register_buffer("qs", codes.to(torch.int8).contiguous())
        self.register_buffer("d", d.float().contiguous())
        self._bind()

    def _bind(self) -> None:
        self._args = (self.in_features, self.qs.data_ptr(), self.d.data_ptr(), self.out_features)

    def _call(self, x: int, m: int, y: int) -> None:
        k, qs, d, n = self._args
        self._fn(x, m, k, qs, d, n, y, *self._scratch)

    def dequantized(self) -> torch.Tensor:
        w = self.d[..., None] * self.qs.view(self.out_features, -1, QK).float()
        return w.view(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> Q80Linear:
        return Q80Linear(self.qs.index_select(0, index), self.d.index_select(0, index))


def _q41_rows(self: Q41Linear, index: torch.Tensor) -> nn.Module:
    out = Q41Linear.__new__(Q41Linear)
    BlockLinear.__init__(out, len(index), self.in_features)
    out.register_buffer("qs", self.qs.index_select(0, index))
    out.register_buffer("d", self.d.index_select(0, index))
    out.register_buffer("m", self.m.index_select(0, index))
    out._bind()
    return out


Q41Linear.rows = _q41_rows  # type: ignore[attr-defined]


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 rule: d = max|w| / 127 per block of 32, q = round(w / d)."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // QK, QK)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k), d


def unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 bytes [rows, cols / 32 * 34] -> codes [rows, cols] int8, d [rows, cols / 32]."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q.copy()), torch.from_numpy(d)


def fuse(modules: list[nn.Module]) -> BlockLinear | None:
    """One block linear computing several projections of the same input (q/k/v, gate/up): one kernel call
    instead of three. The originals are rebound to row views of the fused buffers, so no weight is stored
    twice. None unless all are block linears of one kind and input size."""
    first = modules[0] if modules else None
    if not isinstance(first, BlockLinear) or any(
        type(m) is not type(first) or m.in_features != first.in_features for m in modules
    ):
        return None
    cls = type(first)
    fused = cls.__new__(cls)
    BlockLinear.__init__(fused, sum(m.out_features for m in modules), first.in_features)
    for name in ("qs", "d", "m") if cls is Q41Linear else ("qs", "d"):
        whole = torch.cat([getattr(m, name) for m in modules])
        fused.register_buffer(name, whole)
        offset = 0
        for m in modules:
            m._buffers[name] = whole[offset : offset + m.out_features]
            offset += m.out_features
    for m in (*modules, fused):
        m._bind()
    return fused

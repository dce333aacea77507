"""Linear modules over the CUDA kernels: `Int4Linear` (packed int4 weights: the Triton kernel or torch's tinygemm)
and `RowInvariantLinear` (a 16-bit weight through the Triton dense kernel: the lm_head). Both compute each
output row the same whether it is alone or among up to 64 (the kernels' docstrings say how; tinygemm's rows are
checked, not assumed: `rows_invariant`), and both are plain `nn.Module`s that the lean forward and the CUDA
graphs call like any projection. Plus `tune`: the kernel configuration of one weight shape, chosen by timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from medusa_chat.kernels.int4_quant import PackedInt4, pack_int4, tinygemm_operands
from medusa_chat.kernels.triton_matmul import CANDIDATES, Config, default_config, dense_matmul, int4_matmul

KERNELS = ("triton", "tinygemm")


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as group-wise int4 (int4_quant.py)."""

    def __init__(
        self,
        packed: PackedInt4,
        bias: torch.Tensor | None,
        kernel: str = "triton",
        act_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.act_dtype = act_dtype or (bias.dtype if bias is not None else torch.bfloat16)
        if kernel not in KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r} (use {' or '.join(KERNELS)})")
        self.in_features, self.out_features, self.group = (
            packed.in_features,
            packed.out_features,
            packed.group,
        )
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.config = default_config(self.out_features, self.in_features, self.group)
        self.kernel = kernel
        self._tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Module, group: int, device: torch.device, dtype: torch.dtype, kernel: str = "triton"
    ) -> Int4Linear:
        """Quantize `linear`'s weight on `device` (one weight's temporaries there, nothing more)."""
        weight = linear.weight.detach().to(device=device, dtype=dtype)
        packed = pack_int4(weight, group)
        del weight
        bias = linear.bias.detach().to(device=device, dtype=dtype) if linear.bias is not None else None
        return cls(packed, bias, kernel, act_dtype=dtype)

    @property
    def packed(self) -> PackedInt4:
        return PackedInt4(codes=self.codes, scales=self.scales, zeros=self.zeros, group=self.group)

    def use(self, kernel: str, config: Config | None = None) -> None:
        """Switch kernel (and configuration); the codes are the same for both kernels."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r}")
        self.kernel = kernel
        if config is not None:
            self.config = config
        if kernel == "tinygemm" and self._tinygemm is None:
            self._tinygemm = tinygemm_operands(self.packed)

    def nbytes(self) -> int:
        return self.packed.nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.kernel == "tinygemm":
            assert self._tinygemm is not None
            weight, sz = self._tinygemm
            y = torch.ops.aten._weight_int4pack_mm(rows.to(torch.bfloat16), weight, self.group, sz).to(
                x.dtype
            )
        else:
            y = int4_matmul(rows, self.packed, self.config)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int4 g{self.group}, {self.kernel} {self.config.name()}"


class RowInvariantLinear(nn.Module):
    """y = x @ W.T for a 16-bit weight, row-invariant (the lm_head). Holds the very Parameter it was given, so a
    weight tied to the embedding stays one tensor."""

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.config = Config(64, 64, 1, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = dense_matmul(x.reshape(-1, shape[-1]), self.weight, self.config)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def rows_invariant(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Does `linear` give every row of `x` [M, K] the bits it gives that row alone (and among the first half)?"""
    full = linear(x)
    half = linear(x[: max(1, x.shape[0] // 2)])
    return all(torch.equal(linear(x[i : i + 1])[0], full[i]) for i in (0, x.shape[0] - 1)) and torch.equal(
        half, full[: half.shape[0]]
    )


def time_call(fn: Callable[[], object], reps: int = 20) -> float:
    """Median seconds of fn() on the current CUDA device (events), or wall time on a CPU."""
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def tune(
    module: Int4Linear | RowInvariantLinear,
    rows: tuple[int, ...] = (1, 64),
    weights: tuple[float, ...] = (1.0, 1.0),
    candidates: tuple[Config, ...] = CANDIDATES,
    reps: int = 10,
) -> tuple[Config, dict[str, list[float]]]:
    """The configuration with the least weighted time over `rows` (a plain step and a tree step) for this
    module's shape, and every candidate's times. A configuration that does not fit the weight is skipped."""
    device = module.codes.device if isinstance(module, Int4Linear) else module.weight.device
    dtype = module.act_dtype if isinstance(module, Int4Linear) else module.weight.dtype
    xs = {m: torch.randn(m, module.in_features, device=device, dtype=dtype) for m in rows}
    kept = module.config
    results: dict[str, list[float]] = {}
    best, best_cost = kept, float("inf")
    if isinstance(module, Int4Linear):  # a K block never spans two groups: narrower where the group is
        candidates = tuple(dict.fromkeys(replace(c, block_k=min(c.block_k, module.group)) for c in candidates))
    for cfg in candidates:
        if isinstance(module, Int4Linear) and module.group % cfg.block_k:
            continue
        module.config = cfg
        try:
            times = [time_call(lambda m=m: module(xs[m]), reps) for m in rows]
        except Exception:  # noqa: BLE001 - a configuration this GPU cannot compile is simply not a candidate
            continue
        results[cfg.name()] = times
        cost = sum(w * t for w, t in zip(weights, times, strict=True))
        if cost < best_cost:
            best, best_cost = cfg, cost
    module.config = best if best_cost < float("inf") else kept
    return module.config, results

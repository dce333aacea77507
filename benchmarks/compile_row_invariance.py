"""Feasibility check for a compiled tree step (issue 12, item 3; not built yet): does inductor give every row of
a static-shape batch the bits it gives that row alone?

A compiled tree step can only be bitwise equal to the compiled plain step if each node's row is computed the
same way whether the step has 1 row or N. This times nothing: it compiles two of the step's pieces at static
shapes, masked attention over a fixed-length key row (how a static-shape step would attend: every node's row
laid out as the plain step lays it out, masked beyond its own length) and RMSNorm, for N = 1, 3, 4, 8 rows, and
compares each row with the same row computed alone. On the 2-core AMD EPYC of this project (torch 2.13, fp32
and bf16, 2 threads) every row matched for both. The projections are the open part: a compiled `F.linear` in
fp32 is not row-invariant (rows of a 3/4/8-row batch differ from the row alone, as eager MKL's), and the
oneDNN-packed linear the exact eager path uses (`cpu_linears.PackedLinear`) does not lower in inductor
(LoweringException). So a compiled step needs its projections outside the graph or a row-invariant GEMM that
inductor can call; then the static KV layout, recompile counting and the compile cache.

    python benchmarks/compile_row_invariance.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q [N, H, hd], k/v [L, hd], valid [N, L] -> [N, H, hd]: softmax over a fixed-length masked key row."""
    s = (q[:, :, None, :] * k[None, None, :, :]).sum(-1) * q.shape[-1] ** -0.5
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return (p[..., None] * v[None, None]).sum(-2)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--keys", type=int, default=512, help="fixed key-row length (default: %(default)s)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    heads, hd, hidden = 9, 64, 576
    attend_c = torch.compile(attend, dynamic=False)
    norm_c = torch.compile(rms_norm, dynamic=False)
    k, v = torch.randn(args.keys, hd, dtype=dtype), torch.randn(args.keys, hd, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    all_ok = True
    for n in (1, 3, 4, 8):
        q = torch.randn(n, heads, hd, dtype=dtype)
        valid = torch.zeros(n, args.keys, dtype=torch.bool)
        for i in range(n):
            valid[i, : 300 + i] = True  # rows of different lengths, as tree nodes of different depths
        x = torch.randn(n, hidden, dtype=dtype)
        t0 = time.perf_counter()
        together, normed = attend_c(q, k, v, valid), norm_c(x, w)
        took = time.perf_counter() - t0
        att_ok = all(
            torch.equal(attend_c(q[i : i + 1], k, v, valid[i : i + 1])[0], together[i]) for i in range(n)
        )
        norm_ok = all(torch.equal(norm_c(x[i : i + 1], w)[0], normed[i]) for i in range(n))
        all_ok = all_ok and att_ok and norm_ok
        print(
            f"{n} rows: attention row-invariant {att_ok}, RMSNorm row-invariant {norm_ok} (first call {took:.1f} s)"
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}: {'OK' if all_ok else 'NOT row-invariant'}"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Why NF4 tree steps cost 2-2.7x a one-token step on a GPU, and what a row-by-row 4-bit GEMV would cost.

bitsandbytes runs a one-token input through its fused 4-bit GEMV and a multi-token input (a tree's rows) by
dequantizing the whole weight to 16 bits and multiplying: the step then reads the weights at 4 bits and writes
and reads them again at 16. A tree of N rows can instead run the GEMV once per row: the weight (a 7B layer's
projection is 8-23 MB at 4 bits) stays in the 60 MB L2 between the rows, and every row's result is the one-token
step's own, bit for bit, so greedy tree decoding matches plain decoding in the projections.

Times the 32 layers' seven projections of a 7B-shaped Llama (distinct NF4 weights per layer, 3.9 GB), replayed as
one CUDA graph, for N rows five ways: bnb's default (`Linear4bit(x[N])`), row by row (`Linear4bit(x[i:i+1])`
for each i), the candidate row-invariant Triton NF4 kernel (row_invariant_gemm.py), fp16 `F.linear` (cuBLAS) and
the Triton 16-bit kernel; checks whether each way's rows equal its one-row results bit for bit.

    python benchmarks/nf4_tree_rows.py --out nf4_tree_rows.json     # one GPU, ~1 min
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]  # q k v o, gate up, down: (out, in)


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of `fn` recorded as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    import bitsandbytes as bnb
    from row_invariant_gemm import HalfLinear, NF4Linear  # beside this file

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--out", type=Path, default=Path("nf4_tree_rows.json"))
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    fp16, nf4 = [], []
    for _ in range(args.layers):
        for o, i in SHAPES:
            w = torch.randn(o, i, device=dev, dtype=torch.float16) * 0.02
            fp16.append(w)
            q = bnb.nn.Linear4bit(
                i,
                o,
                bias=False,
                compute_dtype=torch.float16,
                quant_type="nf4",
                compress_statistics=False,
                device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=False, module=q
            ).to(dev)
            q.eval()
            nf4.append(q)
    tri = [NF4Linear(q).forward for q in nf4]
    tri_half = [HalfLinear(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")) for w in fp16]
    for h, w in zip(tri_half, fp16, strict=True):
        h.weight, h.bias = w, None
    tri_half_fwd = [(h.in_features, h.forward) for h in tri_half]
    xs = {i: torch.randn(64, i, device=dev, dtype=torch.float16) for i in (4096, 11008)}
    result: dict = {"device": torch.cuda.get_device_name(), "layers": args.layers, "rows": {}}
    for n in [int(r) for r in args.rows.split(",")]:
        ins = {k: v[:n].clone() for k, v in xs.items()}

        def default(ins: dict = ins) -> None:
            for q in nf4:
                q(ins[q.in_features])

        def by_row(ins: dict = ins, n: int = n) -> None:
            for q in nf4:
                x = ins[q.in_features]
                for r in range(n):
                    q(x[r : r + 1])

        def half(ins: dict = ins) -> None:
            for w in fp16:
                F.linear(ins[w.shape[1]], w)

        def triton_nf4(ins: dict = ins) -> None:
            for q, f in zip(nf4, tri, strict=True):
                f(ins[q.in_features])

        def triton_half(ins: dict = ins) -> None:
            for k, f in tri_half_fwd:
                f(ins[k])

        def same_rows(fns: list, ins: dict = ins, n: int = n) -> str:
            same = 0
            for k, f in fns[:7]:
                x = ins[k]
                same += int(torch.equal(f(x), torch.cat([f(x[r : r + 1]) for r in range(n)])))
            return f"{same}/7 projections"

        with torch.inference_mode():
            row = {
                "nf4_default_ms": graph_time(default) * 1e3,
                "nf4_by_row_ms": graph_time(by_row) * 1e3 if n <= 8 else None,
                "nf4_triton_ms": graph_time(triton_nf4) * 1e3,
                "fp16_ms": graph_time(half) * 1e3,
                "fp16_triton_ms": graph_time(triton_half) * 1e3,
                "nf4_default_rows_bitwise_one_row": same_rows([(q.in_features, q) for q in nf4]),
                "nf4_triton_rows_bitwise_one_row": same_rows(
                    [(q.in_features, f) for q, f in zip(nf4, tri, strict=True)]
                ),
                "fp16_rows_bitwise_one_row": same_rows(
                    [(w.shape[1], lambda x, w=w: F.linear(x, w)) for w in fp16]
                ),
                "fp16_triton_rows_bitwise_one_row": same_rows(tri_half_fwd),
            }
            # the Triton NF4 product against bitsandbytes' dequantized weight times x (fp32 reference)
            q0 = nf4[0]
            import bitsandbytes.functional as bnbf

            ref = ins[4096].float() @ bnbf.dequantize_4bit(q0.weight.data, q0.weight.quant_state).float().T
            row["nf4_triton_max_abs_err_vs_dequant_fp32"] = float(
                (tri[0](ins[4096]).float() - ref).abs().max()
            )
        result["rows"][n] = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        print(n, result["rows"][n], flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

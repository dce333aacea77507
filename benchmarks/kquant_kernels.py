"""Time the GGUF block kinds on the CPU block kernel at 1B-model shapes: Q4_K, Q5_K, Q6_K and Q4_0 (as stored in
a GGUF, gguf_linears.py) side by side with the kernel's Q4_1 and Q8_0, for 1, 2 and 4 rows.

    PYTHONPATH=. python benchmarks/kquant_kernels.py [--rows 1,2,4] [--seconds 0.5] [--threads N]
    PYTHONPATH=. python benchmarks/kquant_kernels.py --stream 8 --kinds Q4_K,Q4_1 --rows 1,2,4,8 --prefetch t0,t1

Per shape (out x in) and row count it prints ms per call of each kind and the ratio to its natural baseline
(Q4_K / Q5_K / Q4_0 vs Q4_1, Q6_K vs Q8_0), then each kind's resident bytes per weight next to the file's,
and the resident memory and time of building the largest shape from the file's bytes. Weights are random
valid blocks (cost, not accuracy). A busy machine gives noisy numbers: measure on a quiet one.

--stream LAYERS times instead one pass over LAYERS layers of the 1.17B's projections per kind (q, k, v, o, gate,
up, down: 8 layers of Q4_K are ~200 MB, so the weights come from DRAM as in a real step, not from the L3 as a
repeated call's do), for each row count and each prefetch hint (csrc/qblock.h) in turn, rounds interleaved;
the median ms per pass and its ratio to the 1-row pass of the same hint, and t0's pass over each hint's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from medusa_chat.kernels import cbind, cthreads, isa_choice, prefetch
from medusa_chat.kernels.gguf_file import BLOCK
from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632), (49152, 2048)]  # (out, in) of TinyLlama-1.1B's shapes
KINDS = ["Q4_1", "Q4_0", "Q4_K", "Q5_K", "Q8_0", "Q6_K"]
BASELINE = {"Q4_0": "Q4_1", "Q4_K": "Q4_1", "Q5_K": "Q4_1", "Q6_K": "Q8_0"}
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
FACTORS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_bytes(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of `type_name` [rows, bytes per row]: random codes / scales, fp16 factors ~1e-3."""
    size, per = BLOCK[TYPE_IDS[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    if type_name == "Q8_0":
        raw[..., 2:] = np.clip(raw[..., 2:].view(np.int8), -127, 127).view(np.uint8)
    for off in FACTORS[type_name]:
        d = (rng.standard_normal((rows, cols // per)) * 1e-3).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def time_call(lin: torch.nn.Module, x: torch.Tensor, seconds: float) -> float:
    """Median ms per call over batches of calls lasting ~seconds in all."""
    with torch.inference_mode():
        for _ in range(3):
            lin(x)
        t0 = time.perf_counter()
        lin(x)
        once = max(time.perf_counter() - t0, 1e-6)
        per_batch = max(1, int(seconds / 5 / once))
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(per_batch):
                lin(x)
            samples.append((time.perf_counter() - t0) / per_batch * 1e3)
    return float(np.median(samples))


def resident_bits_per_weight(lin: torch.nn.Module) -> float:
    total = sum(b.numel() * b.element_size() for b in lin.buffers())
    return total * 8 / (lin.in_features * lin.out_features)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per (shape, kind, rows)")
    ap.add_argument("--threads", type=int, default=0, help="the kernel's team size (0: default)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="OUTxIN,...")
    ap.add_argument("--stream", type=int, default=0, metavar="LAYERS", help="time passes over LAYERS layers")
    ap.add_argument("--kinds", default="Q4_K,Q4_1", help="--stream: the kinds")
    ap.add_argument("--prefetch", default="t0,t1", help="--stream: the prefetch hints (t0, t1, t2, off)")
    ap.add_argument("--rounds", type=int, default=7, help="--stream: rounds")
    args = ap.parse_args()
    if not cbind.available():
        raise SystemExit(f"the block kernel cannot run here: {cbind.unavailable_reason()}")
    cthreads.set_threads(args.threads)
    if args.stream:
        stream(args)
        return
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"block kernel: {isa_choice.best_isa()}, {cthreads.get_threads()} threads; ms per call (ratio to baseline)")
    header = "shape         rows " + " ".join(f"{k:>16}" for k in KINDS)
    print(header)
    bits: dict[str, float] = {}
    for n, k in shapes:
        mods = {}
        for kind in KINDS:
            mods[kind] = block_linear_from_gguf(kind, random_bytes(kind, n, k), n, k)
            bits[kind] = resident_bits_per_weight(mods[kind])
        for r in rows:
            x = torch.randn(r, k, generator=torch.Generator().manual_seed(r))
            ms = {kind: time_call(mods[kind], x, args.seconds) for kind in KINDS}
            cells = []
            for kind in KINDS:
                base = BASELINE.get(kind)
                ratio = f"({ms[kind] / ms[base]:.2f}x)" if base else "(base) "
                cells.append(f"{ms[kind]:7.3f} {ratio:>8}")
            print(f"{n:>5}x{k:<6} {r:>5} " + " ".join(f"{c:>16}" for c in cells))
        del mods
    print("\nresident bits per weight (the kernel's buffers) vs the GGUF file's:")
    for kind in KINDS:
        size, per = BLOCK[TYPE_IDS[kind]]
        print(f"  {kind}: {bits[kind]:.4f} vs {size * 8 / per:.4f} ({bits[kind] / (size * 8 / per):.3f}x)")
    n, k = max(shapes, key=lambda s: s[0] * s[1])
    print(f"\nbuilding {n}x{k} from the file's bytes (resident growth over the raw bytes, wall time):")
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        raw = random_bytes(kind, n, k)
        before = rss_bytes()
        t0 = time.perf_counter()
        lin = block_linear_from_gguf(kind, raw, n, k)
        took = time.perf_counter() - t0
        grown = rss_bytes() - before
        print(f"  {kind}: +{grown / 2**20:.0f} MiB for {raw.nbytes / 2**20:.0f} MiB of blocks, {took:.2f} s")
        del lin, raw


LAYER_SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]


def stream(args: argparse.Namespace) -> None:
    """Passes over --stream layers of the 1.17B's projections per kind, rows x prefetch hints interleaved."""
    rows = [int(r) for r in args.rows.split(",")]
    hints = args.prefetch.split(",")
    before = prefetch.prefetch_choice().get("hints") or "t0"
    print(f"block kernel: {isa_choice.best_isa()}, {cthreads.get_threads()} threads; {args.stream} layers of the 1.17B")
    print(f"prefetch hints measured for this machine: {before}")
    try:
        for kind in args.kinds.split(","):
            mods = [
                block_linear_from_gguf(kind, random_bytes(kind, n, k, seed=layer), n, k)
                for layer in range(args.stream)
                for n, k in LAYER_SHAPES
            ]
            mb = sum(b.numel() * b.element_size() for m in mods for b in m.buffers()) / 1e6
            xs = {r: torch.randn(r, 5632, generator=torch.Generator().manual_seed(r)) for r in rows}
            times: dict[tuple[str, int], list[float]] = {}
            with torch.inference_mode():
                for rnd in range(args.rounds + 1):  # round 0 warms up
                    for hint in hints:
                        prefetch.set_prefetch(hint)
                        for r in rows:
                            t0 = time.perf_counter()
                            for m in mods:
                                m(xs[r][:, : m.in_features])
                            if rnd:
                                times.setdefault((hint, r), []).append(time.perf_counter() - t0)
            print(f"\n{kind}: {mb:.0f} MB per pass; ms per pass (ratio to 1 row) [t0 / this]")
            for hint in hints:
                one = np.median(times[(hint, rows[0])])
                cells = []
                for r in rows:
                    ms = np.median(times[(hint, r)])
                    vs = f" [{np.median(times[('t0', r)]) / ms:.2f}x]" if "t0" in hints and hint != "t0" else ""
                    cells.append(f"{r}: {ms * 1e3:7.2f} ({ms / one:.2f}x){vs}")
                print(f"  {hint:>4}  " + "   ".join(cells))
            del mods
    finally:
        prefetch.set_prefetch(before)


if __name__ == "__main__":
    main()

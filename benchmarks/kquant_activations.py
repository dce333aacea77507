"""The two K-quant activation schemes side by side in one process (csrc/kquants.c: a scale per 32 activations,
the default, or per superblock of 256, llama.cpp's Q8_K; MEDUSA_CHAT_KQUANT_ACTIVATIONS): a GGUF's whole tree
step at each size, the schemes alternating within every round (the kernel library's switch, mc_set_kq_block),
so that both see the same machine state.

    PYTHONPATH=. python benchmarks/kquant_activations.py --model llama-1b-Q4_K_M.gguf --sizes 1,2,4 --json out.json
    MEDUSA_CHAT_QGEMM_ISA=avx2 PYTHONPATH=. python benchmarks/kquant_activations.py --model ...   # the AVX2 path

Per scheme and size: the median step (ms) over rounds and its ratio to the same scheme's 1-node step; per size the
median over rounds of (per-32 step / per-256 step) (> 1: per-256 faster). The steps are timed, not checked: the
schemes give different values (their fidelity: `medusa-chat bench --fidelity`, with the variable set).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file with K-quant tensors")
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5, help="steps per size, scheme and round (their median is kept)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch

    from medusa_chat.bench.runs import repo_path
    from medusa_chat.kernels import cbind, isa_choice
    from medusa_chat.machine import cpu_model
    from medusa_chat.model.loading import load_model
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency, prefilled_engines, timing_prefix

    lib = cbind.load()
    assert lib is not None, cbind.unavailable_reason()
    loaded = load_model(model=args.model, quant="auto", device="cpu")
    with torch.inference_mode():
        engines = prefilled_engines(loaded, sizes, Tree.named(f"chain-{max(sizes)}"), timing_prefix(loaded, 256, 0), True)
    steps: dict[tuple[int, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for block in (32, 256) if r % 2 == 0 else (256, 32):
                lib.mc_set_kq_block(block)
                lat = measure_step_latency(loaded, sizes, engines=engines, reps=args.reps, threads=args.threads)
                for n in sizes:
                    steps.setdefault((block, n), []).append(lat[n]["median_s"])
    finally:
        lib.mc_set_kq_block(cbind.kquant_block())
    doc: dict[str, Any] = {
        "cpu": cpu_model(), "isa": isa_choice.best_isa(), "model": repo_path(args.model), "threads": args.threads,
        "rounds": args.rounds, "reps": args.reps, "schemes": {},
    }  # fmt: skip
    for block in (32, 256):
        one = statistics.median(steps[(block, 1)])
        doc["schemes"][str(block)] = {
            str(n): {
                "median_ms": round(statistics.median(steps[(block, n)]) * 1e3, 3),
                "vs_1_node": round(statistics.median(steps[(block, n)]) / one, 3),
            }
            for n in sizes
        }
    doc["per32_over_per256"] = {
        str(n): round(statistics.median(a / b for a, b in zip(steps[(32, n)], steps[(256, n)], strict=True)), 3)
        for n in sizes
    }
    print(f"{doc['cpu']}, {doc['isa']}, {args.threads} threads, {args.rounds} rounds")
    for block in (32, 256):
        cells = "  ".join(
            f"{n}: {c['median_ms']:.2f} ms ({c['vs_1_node']:.2f}x)" for n, c in doc["schemes"][str(block)].items()
        )
        print(f"  per {block:>3}: {cells}")
    print("  per-32 / per-256 step: " + "  ".join(f"{n}: {v:.3f}" for n, v in doc["per32_over_per256"].items()))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

"""The K-quant activation schemes side by side in one process (csrc/kquants.c: a scale per 32 activations, the
default; per superblock of 256, llama.cpp's Q8_K; nested, per 32 as integer multiples of a superblock step;
MEDUSA_CHAT_KQUANT_ACTIVATIONS): a GGUF's whole tree step at each size, the schemes taking turns within every round
(the kernel library's switch, mc_set_kq_scheme), so that all see the same machine state.

    PYTHONPATH=. python benchmarks/kquant_activations.py --model llama-1b-Q4_K_M.gguf --sizes 1,2,4 --json out.json
    MEDUSA_CHAT_QGEMM_ISA=avx2 PYTHONPATH=. python benchmarks/kquant_activations.py --model ...   # the AVX2 path

Per scheme and size: the median step (ms) over rounds and its ratio to the same scheme's 1-node step; per size and
superblock scheme the median over rounds of (per-32 step / its step) (> 1: faster than per 32). The steps are timed, not checked: the
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
    ap.add_argument("--schemes", default="32,256,nested", help="which (32 first: the others' ratios are to it)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    schemes = args.schemes.split(",")

    import torch

    from medusa_chat.bench.runs import repo_path
    from medusa_chat.kernels import cbind, isa_choice
    from medusa_chat.machine import cpu_model
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency, prefilled_engines, timing_prefix

    lib = cbind.load()
    assert lib is not None, cbind.unavailable_reason()
    loaded = load_model(model=args.model, quant="auto", device="cpu")
    with torch.inference_mode():
        engines = prefilled_engines(loaded, sizes, Tree.named(f"chain-{max(sizes)}"), timing_prefix(loaded, 256, 0), True)
    steps: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for scheme in schemes[r % len(schemes) :] + schemes[: r % len(schemes)]:  # the order rotates
                lib.mc_set_kq_scheme(cbind.KQUANT_SCHEMES[scheme])
                lat = measure_step_latency(loaded, sizes, engines=engines, reps=args.reps, threads=args.threads)
                for n in sizes:
                    steps.setdefault((scheme, n), []).append(lat[n]["median_s"])
    finally:
        lib.mc_set_kq_scheme(cbind.KQUANT_SCHEMES[cbind.kquant_scheme()])
    doc: dict[str, Any] = {
        "cpu": cpu_model(), "isa": isa_choice.best_isa(), "model": repo_path(args.model), "threads": args.threads,
        "rounds": args.rounds, "reps": args.reps, "schemes": {},
    }  # fmt: skip
    for scheme in schemes:
        one = statistics.median(steps[(scheme, 1)])
        doc["schemes"][scheme] = {
            str(n): {
                "median_ms": round(statistics.median(steps[(scheme, n)]) * 1e3, 3),
                "vs_1_node": round(statistics.median(steps[(scheme, n)]) / one, 3),
            }
            for n in sizes
        }
    base = schemes[0]
    doc["ratios_to_" + base] = {
        scheme: {
            str(n): round(statistics.median(a / b for a, b in zip(steps[(base, n)], steps[(scheme, n)], strict=True)), 3)
            for n in sizes
        }
        for scheme in schemes[1:]
    }
    print(f"{doc['cpu']}, {doc['isa']}, {args.threads} threads, {args.rounds} rounds")
    for scheme in schemes:
        cells = "  ".join(
            f"{n}: {c['median_ms']:.2f} ms ({c['vs_1_node']:.2f}x)" for n, c in doc["schemes"][scheme].items()
        )
        print(f"  {scheme:>6}: {cells}")
    for scheme, ratios in doc["ratios_to_" + base].items():
        print(f"  {base} / {scheme} step: " + "  ".join(f"{n}: {v:.3f}" for n, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

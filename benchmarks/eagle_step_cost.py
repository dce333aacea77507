"""What a published-layout EAGLE-1 draft costs a CPU step: the step times at a few tree sizes with the draft in C
(csrc/eagle.c: its layer in Q4_1 blocks, the backbone's own block lm_head as its head: the rows of its first
8,192 token ids, or the whole head; a step's drafting in one call) and, side by side in the same process, with
the PyTorch drafter (the draft's layer in fp32, read again at
every depth).

    python benchmarks/eagle_step_cost.py --model ../models/llama-1b/llama-1b-Q4_K_M.gguf \
        --hf-files ../models/llama-1b/hf --sizes 1,4,8

A random draft of the backbone's shape is written in SafeAILab's EAGLE-1 layout (config.json + model.safetensors:
fc over cat(embedding, feature) with its bias, one decoder layer `layers.0.*` without an input norm, no lm_head:
the backbone's). Random weights measure cost only, not acceptance; the step timed is the engine's own
(`measure_step_latency`, the calibration's harness).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.eagle_helpers writes the draft


def measure(
    model: str, heads: str, quant: str, sizes: list[int], reps: int, native: bool, whole_head: bool = False
) -> dict[str, Any]:
    import medusa_chat.engine.eagle_drafter as eagle_drafter
    from medusa_chat.model.forward.native_eagle import EAGLE1_DRAFT_VOCAB
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency

    real = eagle_drafter.native_eagle_for
    if not native:
        eagle_drafter.native_eagle_for = lambda *a, **k: None  # the PyTorch drafter
    os.environ["MEDUSA_CHAT_EAGLE_DRAFT_VOCAB"] = "0" if whole_head else str(EAGLE1_DRAFT_VOCAB)
    try:
        t0 = time.perf_counter()
        loaded = load_model(model=model, heads=heads, quant=quant, device="cpu")
        load_s = time.perf_counter() - t0
        lat = measure_step_latency(loaded, sizes, tree=Tree.named("mc_sim_7b_63"), reps=reps)
    finally:
        eagle_drafter.native_eagle_for = real
    from medusa1_step_cost import step_ratios

    return {
        "drafter": ("C, whole head" if whole_head else "C") if native else "PyTorch",
        "load_s": round(load_s, 1),
        "sizes": step_ratios(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file or an HF model folder")
    ap.add_argument("--hf-files", help="the model's config.json folder (for a GGUF: its shape)")
    ap.add_argument("--quant", default="int4", help="int4 | int8 (the CPU block paths)")
    ap.add_argument("--format", default="eagle", choices=["eagle", "eagle3"], help="the draft written")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    cfg_dir = Path(args.hf_files or args.model)
    cfg = json.loads((cfg_dir / "config.json").read_text())
    os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
    from tests.eagle_helpers import write_random_eagle

    version = 3 if args.format == "eagle3" else 1
    configs = ((True, False), (True, True), (False, False)) if version == 1 else ((True, False), (False, False))
    with tempfile.TemporaryDirectory(prefix="eagle-cost-") as tmp:
        heads = str(write_random_eagle(Path(tmp) / args.format, cfg, version=version))
        runs = [
            measure(args.model, heads, args.quant, sizes, args.reps, native, whole) for native, whole in configs
        ]
    print(f"{'drafter':>14} " + " ".join(f"{n:>5}-node ms  ratio" for n in sizes))
    for r in runs:
        cells = " ".join(f"{r['sizes'][n]['median_ms']:>11.2f} {r['sizes'][n]['ratio']:>6.2f}" for n in sizes)
        print(f"{r['drafter']:>14} {cells}")
    from medusa_chat.bench.runs import repo_path

    model = repo_path(args.model)  # repo-relative, as every result JSON keeps paths
    doc = {"model": model, "format": args.format, "quant": args.quant, "cpu_count": os.cpu_count(), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

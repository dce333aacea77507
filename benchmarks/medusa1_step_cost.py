"""What Medusa-1 heads cost a CPU step: the 1-, 2- and 4-node (and any other) step times side by side and their
ratios to the plain (1-node) step, with the heads on the block kernel (model/forward/block_heads.py: Q8_0 blocks, only the
heads the tree reaches, drafted in C) and, with --compare-fp32, the old fp32 PyTorch heads (every head, every step).

    python benchmarks/medusa1_step_cost.py --model ../models/llama-1b/hf --heads ../models/llama-1b/medusa1
    python benchmarks/medusa1_step_cost.py --model ... --heads ... --sizes 1,2,3,4,8 --quant int8 --compare-fp32
    python benchmarks/medusa1_step_cost.py --tiny          # a small random Llama + 4 v1 heads written here

The step timed is the engine's own (`measure_step_latency`: propose with its drafting, verify, accept, commit,
the calibration's harness), round-robin over the sizes. Random weights measure cost only, not acceptance.
Target: at the 1.17B Llama shape with 4 heads, the 2-node step <= 1.35x the plain step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def _tiny_model(root: Path, hidden: int, layers: int, vocab: int, num_heads: int) -> tuple[str, str]:
    """A random Llama (saved with save_pretrained, the embedded model's tokenizer) and random v1 heads."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from medusa_chat.model.sources.embedded import embedded_model_dir
    from tests.tinymodels import random_heads_state, write_heads

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), vocab_size=vocab, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "model")
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tok.save_pretrained(root / "model")
    state = random_heads_state(num_heads, 1, own_lm_head=True, hidden=hidden, vocab=vocab)
    write_heads(root / "heads", state, base_model=str(root / "model"))
    return str(root / "model"), str(root / "heads")


def measure(model: str, heads: str, quant: str, sizes: list[int], reps: int) -> dict[str, Any]:
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency

    t0 = time.perf_counter()
    loaded = load_model(model=model, heads=heads, quant=quant, device="cpu")
    load_s = time.perf_counter() - t0
    info = loaded.info()["heads"]
    base = Tree.named("mc_sim_7b_63")
    base = Tree.from_paths([p for p in base.paths if len(p) <= loaded.heads.num_heads], name=base.name)
    lat = measure_step_latency(loaded, sizes, tree=base, reps=reps)
    return {
        "quant": quant,
        "heads": {k: info[k] for k in ("count", "format", "dtype", "drafter", "bytes")},
        "shared_lm_heads": getattr(loaded.heads, "shared_lm_heads", None),
        "load_s": round(load_s, 1),
        "sizes": step_ratios(lat),
    }


def step_ratios(lat: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """{size: its median step in ms and its ratio to the 1-node step} of a measure_step_latency result."""
    plain = lat[1]["median_s"]
    return {
        n: {"median_ms": round(v["median_s"] * 1e3, 2), "ratio": round(v["median_s"] / plain, 3)}
        for n, v in lat.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder")
    ap.add_argument("--heads", help="Medusa-1 heads folder")
    ap.add_argument("--tiny", action="store_true", help="write a small random Llama + heads and use them")
    ap.add_argument("--shape", default="1024,8,32768,4", help="--tiny: hidden,layers,vocab,heads")
    ap.add_argument("--quant", default="int4", help="int4 | int8 (the CPU block paths)")
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--compare-fp32", action="store_true", help="also time the fp32 PyTorch heads")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    tmp = None
    if args.tiny:
        tmp = tempfile.TemporaryDirectory(prefix="medusa1-cost-")
        hidden, layers, vocab, nh = (int(x) for x in args.shape.split(","))
        args.model, args.heads = _tiny_model(Path(tmp.name), hidden, layers, vocab, nh)
    if not args.model or not args.heads:
        ap.error("give --model and --heads, or --tiny")
    os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
    runs = {"block": measure(args.model, args.heads, args.quant, sizes, args.reps)}
    if args.compare_fp32:
        os.environ["MEDUSA_CHAT_BLOCK_HEADS"] = "0"
        runs["fp32"] = measure(args.model, args.heads, args.quant, sizes, args.reps)
    print(f"{'heads':>14} " + " ".join(f"{n:>5}-node ms  ratio" for n in sizes))
    for name, r in runs.items():
        cells = " ".join(f"{r['sizes'][n]['median_ms']:>11.2f} {r['sizes'][n]['ratio']:>6.2f}" for n in sizes)
        print(f"{name + ' ' + r['heads']['dtype']:>14} {cells}")
    doc = {"model": args.model, "heads": args.heads, "cpu_count": os.cpu_count(), "runs": runs}
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

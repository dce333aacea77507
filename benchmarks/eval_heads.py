"""Heads side by side on the same cached positions: top-1 / top-5 per head and the chain's expected tokens per
step (what a 3-node chain or a fitted tree would accept), e.g. the shipped heads against a fine-tuned set:

    python benchmarks/eval_heads.py --heads assets/smollm2-135m --heads runs/gen/heads \
        --cache runs/gen/a/hidden:0.05 --eval-only-cache runs/gen/bench_pd.pt

`--cache DIR:FRAC` evaluates the FRAC held-out split (by prompt, as `cpu_train_hydra.py` splits it);
`--eval-only-cache` a PositionData .pt (e.g. bench replies from `cache_positions.py --bench-json`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from medusa_chat.model.sources.embedded import embedded_model_dir
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.training.evaluate import evaluate_heads
from medusa_chat.training.positions import PositionData, heldout_mask, load_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", action="append", required=True)
    ap.add_argument("--cache", action="append", default=[], metavar="DIR:FRAC")
    ap.add_argument("--eval-only-cache", action="append", default=[], metavar="FILE")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # the plain fp32 backbone (no CPU kernels swapped in): its lm_head and embeddings are what heads train on
    backbone = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    lm_w = backbone.get_output_embeddings().weight.detach()
    embed = backbone.get_input_embeddings().weight.detach()
    sets: dict[str, PositionData] = {}
    for spec in args.cache:
        folder, _, frac = spec.rpartition(":")
        data = load_cache(sorted(Path(folder).glob("shard-*.pt")))
        sets[f"{folder} held-out"] = data.subset(heldout_mask(data.sample, float(frac)))
    for f in args.eval_only_cache:
        d = torch.load(f, weights_only=True)
        sets[f] = PositionData(d["hidden"], d["targets"], d["sample"])
    for name, data in sets.items():
        print(f"{name}: {len(data)} positions")
        for h in args.heads:
            heads = load_heads_file(Path(h))[0].float()
            ev = evaluate_heads(heads, lm_w, data, torch.device("cpu"), embed_weight=embed)
            chain = ev["chain_top1_conditional"]
            chain2 = 1 + chain[0] + chain[0] * chain[1]  # a 2-deep chain: the 3-node budget's sure shape
            best = 1 + sum(math.prod(chain[: i + 1]) for i in range(len(chain)))
            print(
                f"  {h:>28}: top1 {ev['top1']} top5 {ev['top5']} | chain of 2: {chain2:.3f}, "
                f"of {len(chain)}: {best:.3f} tokens/step"
            )


if __name__ == "__main__":
    main()

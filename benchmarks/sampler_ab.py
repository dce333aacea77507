"""Sampling at T=0.7 (top_p 1, the typical rule and the plain loop), `acceptance.sample` by the inverse CDF (the
default) against torch.multinomial, alternating in one process; the embedded model, its calibrated tree, 10
Vicuna-bench first turns, <= 64 tokens, wall tok/s.

    python benchmarks/sampler_ab.py
"""

import json
import time
from pathlib import Path

import torch

from medusa_chat.engine import acceptance
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.loading import load_model
from medusa_chat.tuning.tree_choice import choose_tree


def multinomial(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(acceptance.nucleus(probs, top_p), 1, generator=generator)[0]


loaded = load_model(quant="int4", device="cpu")
tree, _ = choose_tree(loaded)
med, plain = MedusaEngine(loaded, tree), MedusaEngine(loaded, plain_tree())
lines = Path("benchmarks/data/vicuna_bench_question.jsonl").read_text().splitlines()
prompts = [loaded.build_prompt([{"role": "user", "content": json.loads(line)["turns"][0]}]) for line in lines[:10]]
inverse_cdf = acceptance.sample
res: dict[tuple[str, str], list[float]] = {}
for _round in range(2):
    for variant, sampler in (("inverse_cdf", inverse_cdf), ("multinomial", multinomial)):
        acceptance.sample = sampler
        for name, e in (("medusa", med), ("plain", plain)):
            n, dt = 0, 0.0
            for i, p in enumerate(prompts):
                s = GenerationSettings(max_new_tokens=64, temperature=0.7, seed=i, accept="typical")
                t = time.perf_counter()
                ev = list(e.generate(p, s))
                dt += time.perf_counter() - t
                n += len(ev[-1].token_ids)
            res.setdefault((variant, name), []).append(n / dt)
for k, v in res.items():
    print(k, " ".join(f"{x:.1f}" for x in v), "tok/s")
for variant in ("inverse_cdf", "multinomial"):
    ratios = zip(res[(variant, "medusa")], res[(variant, "plain")], strict=True)
    print(variant, "medusa/plain", " ".join(f"{m / p:.2f}x" for m, p in ratios))

"""Sampling with top_p < 1 (T=0.7, top_p 0.95, exact acceptance), the nucleus from each row's head (the default on a
CPU, engine/acceptance.py) against the full sort of 49k probabilities, alternating in one process; the embedded
model, its calibrated tree and the plain loop, 10 Vicuna-bench first turns, <= 64 tokens, wall tok/s.

    python benchmarks/nucleus_ab.py
"""

import json
import time
from pathlib import Path

from medusa_chat.engine import acceptance
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.loading import load_model
from medusa_chat.tuning.tree_choice import choose_tree

loaded = load_model(quant="int4", device="cpu")
tree, _ = choose_tree(loaded)
med, plain = MedusaEngine(loaded, tree), MedusaEngine(loaded, plain_tree())
lines = Path("benchmarks/data/vicuna_bench_question.jsonl").read_text().splitlines()
qs = [json.loads(line)["turns"][0] for line in lines[:10]]
prompts = [loaded.build_prompt([{"role": "user", "content": q}]) for q in qs]
fast = acceptance._nucleus_from_head
res = {}
for _round in range(2):
    for variant in ("head", "full"):
        acceptance._nucleus_from_head = fast if variant == "head" else (lambda p, t: None)
        for name, e in (("medusa", med), ("plain", plain)):
            n, dt = 0, 0.0
            for i, p in enumerate(prompts):
                s = GenerationSettings(max_new_tokens=64, temperature=0.7, top_p=0.95, seed=i, accept="exact")
                t = time.perf_counter()
                ev = list(e.generate(p, s))
                dt += time.perf_counter() - t
                n += len(ev[-1].token_ids)
            res.setdefault((variant, name), []).append(n / dt)
for k, v in res.items():
    print(k, " ".join(f"{x:.1f}" for x in v), "tok/s")
for variant in ("head", "full"):
    ratios = zip(res[(variant, "medusa")], res[(variant, "plain")], strict=True)
    print(variant, "medusa/plain", " ".join(f"{m / p:.2f}x" for m, p in ratios))

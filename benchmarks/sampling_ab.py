"""The samplers' costs side by side, alternating in one process: the embedded model, its calibrated tree and the
plain loop, 10 Vicuna-bench first turns, <= 64 tokens, two rounds, wall tok/s.

    python benchmarks/sampling_ab.py nucleus   # T=0.7, top_p 0.95, exact: the nucleus from each row's head (the
                                               # default on a CPU) against the full sort of 49k probabilities
    python benchmarks/sampling_ab.py sampler   # T=0.7, top_p 1, typical: `sample` by the inverse CDF (the
                                               # default) against torch.multinomial
"""

import json
import sys
import time
from pathlib import Path

import torch

from medusa_chat.engine import acceptance
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.sources.loading import load_model
from medusa_chat.tuning.tree_choice import choose_tree


def multinomial(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(acceptance.nucleus(probs, top_p), 1, generator=generator)[0]


EXPERIMENTS = {  # name: (settings, [(variant, attribute of `acceptance`, its value)])
    "nucleus": (
        {"temperature": 0.7, "top_p": 0.95, "accept": "exact"},
        [("head", "_nucleus_from_head", acceptance._nucleus_from_head), ("full sort", "_nucleus_from_head", None)],
    ),
    "sampler": (
        {"temperature": 0.7, "top_p": 1.0, "accept": "typical"},
        [("inverse CDF", "sample", acceptance.sample), ("multinomial", "sample", multinomial)],
    ),
}


def main(which: str) -> None:
    settings, variants = EXPERIMENTS[which]
    loaded = load_model(quant="int4", device="cpu")
    tree, _ = choose_tree(loaded)
    engines = (("medusa", MedusaEngine(loaded, tree)), ("plain", MedusaEngine(loaded, plain_tree())))
    lines = (Path(__file__).parent / "data" / "vicuna_bench_question.jsonl").read_text().splitlines()
    prompts = [loaded.build_prompt([{"role": "user", "content": json.loads(x)["turns"][0]}]) for x in lines[:10]]
    res: dict[tuple[str, str], list[float]] = {}
    for _round in range(2):
        for variant, name, value in variants:
            setattr(acceptance, name, value if value is not None else (lambda probs, top_p: None))
            for method, engine in engines:
                n, dt = 0, 0.0
                for i, p in enumerate(prompts):
                    t = time.perf_counter()
                    events = list(engine.generate(p, GenerationSettings(max_new_tokens=64, seed=i, **settings)))
                    dt += time.perf_counter() - t
                    n += len(events[-1].token_ids)
                res.setdefault((variant, method), []).append(n / dt)
        for _, name, value in variants[:1]:
            setattr(acceptance, name, value)
    for (variant, method), speeds in res.items():
        print(f"{variant:>12} {method:>6}: " + " / ".join(f"{x:.1f}" for x in speeds) + " tok/s")
    for variant, _, _ in variants:
        ratios = zip(res[(variant, "medusa")], res[(variant, "plain")], strict=True)
        print(f"{variant:>12} Medusa / plain loop: " + " / ".join(f"{m / p:.2f}x" for m, p in ratios))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sampler")

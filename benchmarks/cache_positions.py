"""Hidden-state caches for `benchmarks/cpu_train_hydra.py`, from a distillation folder or a bench JSON.

    python benchmarks/cache_positions.py --store runs/gen/a            # -> runs/gen/a/hidden/shard-*.pt
    python benchmarks/cache_positions.py --bench-json out.json --out runs/gen/bench_pd.pt

The second form turns `medusa-chat bench --json` replies (the engine's greedy replies to the bench prompts)
into positions that `cpu_train_hydra.py --eval-only-cache` only evaluates: never trained on, never used to
fit the tree; a diagnosis of how well heads transfer to the benchmark's prompts. Hidden states come from a
bf16 copy of the backbone, as for the training data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from medusa_chat.model.sources.loading import load_model
from medusa_chat.training.distill import make_logger
from medusa_chat.training.positions import cache_hidden_states, hidden_states_for
from medusa_chat.training.store import DistillStore, atomic_torch_save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, help="a distillation folder (writes STORE/hidden)")
    ap.add_argument("--bench-json", type=Path, help="a `medusa-chat bench --json` file")
    ap.add_argument("--out", type=Path, help="with --bench-json: the PositionData .pt to write")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model()  # the model folder and chat template
    model = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.bfloat16).eval()
    log = make_logger()
    with torch.inference_mode():
        if args.store:
            store = DistillStore.open(args.store)
            paths = cache_hidden_states(model, store, args.store / "hidden", log=log)
            log(f"{len(paths)} shards cached under {args.store / 'hidden'}")
        if args.bench_json:
            if args.out is None:
                raise SystemExit("--bench-json needs --out")
            bench = json.loads(args.bench_json.read_text())
            samples = []
            for i, p in enumerate(bench["prompts"]):
                ids = loaded.build_prompt([{"role": "user", "content": p["prompt"]}])
                samples.append((i, ids + list(p["token_ids"]), len(ids)))
            pd = hidden_states_for(model, samples)
            atomic_torch_save({"hidden": pd.hidden, "targets": pd.targets, "sample": pd.sample}, args.out)
            log(f"{len(pd)} positions from {len(samples)} bench replies -> {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Greedy replies as token ids, to check that a change keeps them byte for byte: the embedded model (or --model)
with its default heads and default tree, on the first prompts of Vicuna-bench, per numeric path.

    # in a checkout of the version before (git worktree add ../before REV), then in this one:
    cd ../before && python /path/to/benchmarks/replies_identity.py --out before.json
    python benchmarks/replies_identity.py --out after.json --compare before.json

The script imports medusa_chat from the current folder (the checkout it runs in), so one copy of it serves both
versions. With --compare: per path, how many replies are identical, written beside the ids in --out and printed.
Tree calibration is off (MEDUSA_CHAT_AUTO_CALIBRATE=0), so both versions verify the same default tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
sys.path.insert(0, os.getcwd())

PROMPTS = Path(__file__).resolve().parent / "data" / "vicuna_bench_question.jsonl"


def replies(model: str, quant: str, prompts: list[str], tokens: int) -> list[list[int]]:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings
    try:
        from medusa_chat.model.sources.loading import load_model
    except ImportError:  # a version from before model/ was split into sources/ and forward/
        from medusa_chat.model.loading import load_model  # type: ignore[no-redef]

    loaded = load_model(model, quant=quant, device="cpu")
    engine = MedusaEngine(loaded, loaded.default_tree)
    out = []
    for text in prompts:
        ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        *_, summary = engine.generate(list(ids), GenerationSettings(max_new_tokens=tokens))
        out.append(list(summary.token_ids))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--quants", default="none,int8,int4")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a file this script wrote for another version")
    args = ap.parse_args()
    with open(args.prompts, encoding="utf-8") as f:
        prompts = [json.loads(line)["turns"][0] for line in f if line.strip()][: args.limit]
    doc: dict = {"model": args.model, "prompts": len(prompts), "max_new_tokens": args.tokens, "ids": {}}
    for quant in args.quants.split(","):
        doc["ids"][quant] = replies(args.model, quant, prompts, args.tokens)
        print(f"{quant}: {sum(map(len, doc['ids'][quant]))} tokens", flush=True)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            other = json.load(f)["ids"]
        doc["identical"] = {
            q: f"{sum(a == b for a, b in zip(ids, other[q], strict=True))}/{len(ids)}" for q, ids in doc["ids"].items() if q in other
        }
        print("identical replies:", doc["identical"])
    Path(args.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

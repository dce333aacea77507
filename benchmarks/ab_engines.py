"""Engine configurations side by side in one process: each prompt's greedy reply by every configuration in
rotation (so a slow spell of a shared machine hits them alike), replies checked identical to the plain loop,
decode tokens/s and tokens per step per configuration, and each one's ratio to the plain loop.

    python benchmarks/ab_engines.py --configs static3,shaped3,shaped3+runs
    python benchmarks/ab_engines.py --configs shaped2,shaped3,shaped4 --start 0 --limit 20

A configuration is `static` (the calibrated tree's fixed layout) or `shaped` (trees shaped per step by the draft,
drafters.confident_paths), then the node budget, then `+runs` for lookup runs of up to lookup.LOOKUP_RUN
guesses (`+runsN`: up to N; without it lookup guesses go on the tree's own chain only), then `@alt` to run it
with the heads of `--alt-heads PATH` (e.g. newly trained heads against the shipped ones, in one process). The
embedded model with no flags (int4 on a CPU).

    python benchmarks/ab_engines.py --configs shaped3+runs,shaped3+runs@alt --alt-heads runs/gen/heads
    python benchmarks/ab_engines.py --configs shaped4,shaped4@alt --alt-heads runs/eagle3 --quant none
"""

from __future__ import annotations

import argparse
from pathlib import Path

from medusa_chat.bench.runs import read_prompts
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.engine.lookup import LOOKUP_RUN
from medusa_chat.events import GenerationSettings
from medusa_chat.model.sources.loading import load_model

PROMPTS = Path(__file__).resolve().parent / "data" / "vicuna_bench_question.jsonl"


def engine_for(loaded, spec: str) -> MedusaEngine:  # noqa: ANN001 - a LoadedModel
    base, _, extra = spec.removesuffix("@alt").partition("+")
    if not base.startswith(("static", "shaped")) or not extra.startswith("runs") and extra:
        raise SystemExit(f"unknown configuration {spec!r}: static|shaped, a node count, optionally +runs[N]")
    size = int(base.removeprefix("static").removeprefix("shaped"))
    engine = MedusaEngine(loaded, loaded.default_tree.prefix(size), shaped=base.startswith("shaped"))
    engine.lookup_run = (int(extra.removeprefix("runs") or LOOKUP_RUN)) if extra else 0
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="static3,shaped3,shaped3+runs")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--alt-heads", default=None, help="heads folder for configurations ending in @alt")
    parser.add_argument(
        "--quant",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="numeric path of both models (default: the app's choice; EAGLE-3 drafts need none)",
    )
    args = parser.parse_args()
    loaded = load_model(quant=args.quant)
    alt = load_model(heads=args.alt_heads, quant=args.quant) if args.alt_heads else None
    engines = {"plain": MedusaEngine(loaded, plain_tree())}
    for spec in args.configs.split(","):
        if spec.endswith("@alt") and alt is None:
            raise SystemExit(f"{spec} needs --alt-heads")
        engines[spec] = engine_for(alt if spec.endswith("@alt") else loaded, spec)
    prompts = read_prompts(args.prompts)[args.start : args.start + args.limit]
    totals = {k: [0, 0, 0.0] for k in engines}  # decode tokens, steps, decode seconds
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0)
    for i, text in enumerate(prompts):
        ids = loaded.build_prompt([{"role": "user", "content": text}])
        names = list(engines)
        names = names[i % len(names) :] + names[: i % len(names)]
        replies = {}
        for name in names:
            engine = engines[name]
            engine.reset()
            summary = list(engine.generate(ids, settings))[-1]
            replies[name] = summary.token_ids
            t = totals[name]
            t[0], t[1], t[2] = t[0] + summary.new_tokens - 1, t[1] + summary.steps, t[2] + summary.decode_s
        if any(r != replies["plain"] for r in replies.values()):
            raise SystemExit(f"prompt {args.start + i + 1}: a reply differs from the plain loop's")
    plain = totals["plain"][0] / totals["plain"][2]
    print(f"{len(prompts)} prompts, every reply identical to the plain loop's")
    for name, (tokens, steps, seconds) in totals.items():
        rate = tokens / seconds
        print(f"{name:>16}: {rate:7.1f} tok/s, {tokens / steps:.3f} tokens/step, {rate / plain:.3f}x plain")


if __name__ == "__main__":
    main()

"""Decode speed as a conversation grows: the plain loop and Medusa (the tree a chat gets) at several context lengths.

`medusa-chat bench` starts every prompt fresh (40-50 tokens), but a chat's context grows turn by turn, and every
step's attention reads the whole KV cache. This builds multi-turn prompts of about the asked lengths from the
Vicuna-bench questions (user turns, and earlier questions as stand-in assistant turns), then decodes each
greedily with the plain loop and with Medusa, alternating their order over `--runs` runs, and prints the median
decode tokens/s, Medusa's ratio, and whether the outputs are identical (they must be).

    python benchmarks/long_context.py [--contexts 100,1000,2000] [--runs 3] [--max-new 128]

llama.cpp's numbers at the same depths come from `llama-bench -p 0 -n 128 -t 2 -d 0,1000,2000` (README).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.model.sources.loading import load_model
from medusa_chat.tuning.first_start import resolve_tree

QUESTIONS = Path(__file__).resolve().parent / "data" / "vicuna_bench_question.jsonl"


def conversation(loaded, questions: list[str], target: int) -> list[int]:  # noqa: ANN001 - a LoadedModel
    """Prompt ids of a multi-turn conversation at least `target` tokens long (or a single question)."""
    messages: list[dict[str, str]] = []
    ids = loaded.build_prompt([{"role": "user", "content": questions[0]}])
    i = 0
    while len(ids) < target:
        n = len(questions)
        messages += [
            {"role": "user", "content": questions[i % n]},
            {"role": "assistant", "content": questions[(i + 7) % n] * 2},
        ]
        i += 1
        ids = loaded.build_prompt([*messages, {"role": "user", "content": questions[(i + 3) % n]}])
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="100,1000,2000", help="context lengths in tokens (comma list)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    args = parser.parse_args()

    loaded = load_model(args.model)
    questions = [json.loads(line)["turns"][0] for line in args.questions.read_text().splitlines() if line]
    tree, source = resolve_tree(loaded, progress=print)  # the tree a chat gets with no flags
    print(f"tree: {tree.name} ({tree.size} nodes, {source})")
    engines = {"plain": MedusaEngine(loaded, plain_tree()), "medusa": MedusaEngine(loaded, tree)}
    settings = GenerationSettings(temperature=0.0, max_new_tokens=args.max_new)
    for target in (int(x) for x in args.contexts.split(",")):
        ids = conversation(loaded, questions, target)
        runs: dict[str, list[ReplySummary]] = {name: [] for name in engines}
        for r in range(args.runs):
            for name in list(engines) if r % 2 else list(engines)[::-1]:
                engines[name].reset()
                *_, summary = engines[name].generate(ids, settings)
                runs[name].append(summary)
        rate = {name: statistics.median(s.decode_tokens_per_s for s in runs[name]) for name in engines}
        print(
            f"context {len(ids)} tokens: plain {rate['plain']:.1f} tok/s, Medusa {rate['medusa']:.1f} tok/s "
            f"({runs['medusa'][0].tokens_per_step:.2f} tokens/step) -> {rate['medusa'] / rate['plain']:.2f}x, "
            f"identical: {runs['plain'][0].token_ids == runs['medusa'][0].token_ids}",
            flush=True,
        )


if __name__ == "__main__":
    main()

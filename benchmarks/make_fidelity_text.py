"""Write medusa_chat/data/fidelity_text.txt: the held-out prompts (benchmarks/data/heldout_prompts.jsonl) and the
embedded model's float greedy replies (`--quant none`, 128 tokens at most), as plain text.

    .venv/bin/python benchmarks/make_fidelity_text.py

The text is what `medusa-chat bench --fidelity` and the `--quant auto` choice score every numeric path on
(teacher-forced against the float model, medusa_chat/fidelity.py)."""

from __future__ import annotations

from pathlib import Path

from medusa_chat.bench.runs import read_prompts
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.model.sources.loading import load_model

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    model = load_model(quant="none")
    engine = MedusaEngine(model, tree=plain_tree())
    parts = []
    for prompt in read_prompts(ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"):
        ids = model.build_prompt([{"role": "user", "content": prompt}])
        settings = GenerationSettings(max_new_tokens=128, context_lookup=False)
        reply = next(i for i in engine.generate(ids, settings) if isinstance(i, ReplySummary)).text
        parts.append(f"User: {prompt}\nAssistant: {reply.strip()}\n\n")
    out = ROOT / "medusa_chat" / "data" / "fidelity_text.txt"
    out.write_text("".join(parts), encoding="utf-8")
    print(f"wrote {out} ({sum(len(p) for p in parts)} characters)")


if __name__ == "__main__":
    main()

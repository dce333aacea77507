"""Greedy replies for self-distillation from the app's own engine (`train-heads --generator engine`).

The engine with no flags is what users run: on a CPU the embedded model's default numeric path (e.g. int4 from
its GGUF blocks) decoded with the shipped heads' tree, bitwise its own plain loop. Its replies are therefore
exactly the tokens the heads must predict at run time, and it decodes one reply at a time faster per CPU-second
than batched transformers `generate` on a small CPU (benchmarks/RESULTS.md). Hidden states for training still
come from the float backbone (positions.py), as for every other generator.
"""

from __future__ import annotations

from typing import Any


class EngineReplies:
    """`generate(list of prompt ids) -> [(reply ids ending with EOS when finished, finished)]`, one by one."""

    def __init__(self, loaded: Any, max_new_tokens: int, tree: Any = None) -> None:
        """`loaded`: a LoadedModel (model.loading); `tree`: the tree to decode with (default: the one every
        entry point resolves, calibration included)."""
        from medusa_chat.engine.engine import MedusaEngine
        from medusa_chat.events import GenerationSettings
        from medusa_chat.tuning.first_start import resolve_tree

        self.loaded = loaded
        self.tree, self.tree_source = (tree, "given") if tree is not None else resolve_tree(loaded)
        self.engine = MedusaEngine(loaded, self.tree)
        self.settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0)
        self.eos = list(loaded.eos_token_ids)
        self.steps = 0  # verification steps so far (tokens / steps = the draft's mean acceptance)

    @classmethod
    def load(cls, model: str, max_new_tokens: int) -> EngineReplies:
        """The model as the app loads it with no flags (default numeric path and heads)."""
        from medusa_chat.model.sources.loading import load_model

        return cls(load_model(model), max_new_tokens)

    def describe(self) -> str:
        return f"engine: {self.tree.size}-node tree ({self.tree_source}){self.engine.tree_note}"

    def __call__(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        out = []
        for p in prompts:
            self.engine.reset()
            summary: Any = list(self.engine.generate(p, self.settings))[-1]
            reply = list(summary.token_ids)
            done = summary.stop_reason == "eos"
            if done and (not reply or reply[-1] not in self.eos):
                reply.append(self.eos[0])  # training replies end with EOS when finished
            self.steps += int(summary.steps)
            out.append((reply, done))
        return out

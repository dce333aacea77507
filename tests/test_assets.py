"""The heads shipped in assets/ for the embedded model: layout, size budget, fitted tree, and losslessness."""

from __future__ import annotations

import json

import pytest

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.sources.registry import EMBEDDED_HEADS_DIR
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


def test_shipped_heads_are_lossless_and_accept_tokens(embedded_model) -> None:
    loaded = embedded_model  # load_model("smollm2-135m"): the default numeric path of this machine
    assert loaded.heads.num_heads == 5 and loaded.heads.format == "hydra"
    per_step = _plain_loop_replies_and_tokens_per_step(loaded, MedusaEngine(loaded, loaded.default_tree.prefix(32)))
    # trained heads really let steps accept guesses (random heads give ~1.0)
    assert sum(per_step) / len(per_step) > 1.4, per_step


def test_shipped_medusa1_heads_are_the_published_layout_with_a_draft_vocabulary() -> None:
    """`--heads medusa-1`: ResBlocks on the shared lm_head (the v2 layout TGI reads: only `{h}.{l}.linear.*` in
    the heads file) and the draft vocabulary in a file of its own beside it."""
    from safetensors import safe_open

    from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE, read_draft_vocab
    from medusa_chat.model.sources.registry import SHIPPED_HEADS, resolve

    folder = SHIPPED_HEADS["medusa-1"]
    assert resolve(heads="medusa-1").heads == str(folder.resolve())
    config = json.loads((folder / "config.json").read_text())
    assert config["version"] == "2" and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    with safe_open(str(folder / "medusa_lm_head.safetensors"), "pt") as f:
        keys = set(f.keys())
    heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
    names = {f"{h}.{i}.linear.{w}" for h in range(heads) for i in range(layers) for w in ("weight", "bias")}
    assert keys == names
    ids = read_draft_vocab(folder / DRAFT_VOCAB_FILE)
    assert ids is not None and ids.numel() == 8192 and int(ids.max()) < config["vocab_size"]
    tree = Tree.load(folder / "tree.json")
    assert tree.size == 64 and tree.depth <= heads


def test_shipped_medusa1_heads_are_lossless_and_accept_tokens(embedded_model) -> None:
    from medusa_chat.engine.drafters import MedusaDrafter
    from medusa_chat.model.sources.loading import with_heads

    loaded = with_heads(embedded_model, "medusa-1")  # the heads loaded and fitted as `--heads medusa-1` does
    info = loaded.info()["heads"]
    assert info["format"] == "v2" and info["count"] == 5 and info["draft_vocab"] == 8192
    engine = MedusaEngine(loaded, loaded.default_tree.prefix(16))
    if loaded.heads.block_kind:  # the CPU block path drafts with the heads' own drafter
        assert isinstance(engine.drafter, MedusaDrafter) and engine.drafter.draft_vocab is not None
    per_step = _plain_loop_replies_and_tokens_per_step(loaded, engine)
    assert sum(per_step) / len(per_step) > 1.3, per_step


def _plain_loop_replies_and_tokens_per_step(loaded, engine: MedusaEngine) -> list[float]:
    """Three short greedy replies: each must be the engine's plain loop's bit for bit, whatever the numeric path;
    returns their tokens per step."""
    plain = MedusaEngine(loaded, plain_tree())
    per_step = []
    for text in ["Name three primary colors.", "How do I boil an egg?", "Write a haiku about autumn."]:
        prompt = loaded.build_prompt([{"role": "user", "content": text}])
        summary = list(engine.generate(prompt, GenerationSettings(max_new_tokens=40)))[-1]
        ref = list(plain.generate(prompt, GenerationSettings(max_new_tokens=40)))[-1].token_ids
        assert summary.token_ids == ref, text
        per_step.append(summary.tokens_per_step)
    return per_step


def test_shipped_eagle3_draft_is_the_published_layout_and_drafts_in_c(request) -> None:
    """`--heads eagle3`: SafeAILab's EAGLE-3 layout (config.json + model.safetensors with `fc`, `midlayer.*`,
    `norm`, `lm_head` over the draft vocabulary, d2t/t2d); on the CPU default it drafts in C, every greedy reply is
    the plain loop's, and it accepts tokens (a random draft gives ~1.0)."""
    from safetensors import safe_open

    from medusa_chat.model.sources.loading import with_heads
    from medusa_chat.model.sources.registry import SHIPPED_HEADS, resolve

    folder = SHIPPED_HEADS["eagle3"]
    assert resolve(heads="eagle3").heads == str(folder.resolve())
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == 8192 and config["hidden_size"] == 576 and config["num_hidden_layers"] == 1
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight"} <= keys
    loaded = with_heads(request.getfixturevalue("embedded_model"), "eagle3")  # (after the layout checks)
    assert loaded.info()["heads"]["format"] == "eagle3"
    engine = MedusaEngine(loaded, loaded.default_tree.prefix(4))
    if loaded.quant in ("int4", "int8"):  # the native C step: the C drafter, draft-shaped trees
        assert engine.drafter.native is not None and engine.draft_shaped
    per_step = _plain_loop_replies_and_tokens_per_step(loaded, engine)
    assert sum(per_step) / len(per_step) > 1.4, per_step

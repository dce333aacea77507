"""Hydra heads (heads.py, HydraDrafter in engine/drafters.py): the format, the depth-by-depth drafter, and the engine
with them -- greedy output must still be plain greedy decoding, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medusa_chat.engine.drafters import HydraDrafter
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import HeadsError
from medusa_chat.events import GenerationSettings
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads, heads_from_state_dict
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.training.pipeline import HEADS_FILE, save_heads
from medusa_chat.training.train_heads import warm_start_
from medusa_chat.tree import Tree, tree_levels
from tests.test_decoding import assert_lossless, run
from tests.tinymodels import block_loaded, tiny_loaded, training_prompts

TREES = ["mc_sim_7b_63", "zephyr_stage2", "chain-1", "chain-4"]


def _random_medusa(hidden: int = 32, vocab: int = 100, k: int = 3, layers: int = 2) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(hidden, vocab, k, layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    return heads


def test_hydra_with_a_zero_cell_is_exactly_the_medusa_heads_it_starts_from() -> None:
    medusa = _random_medusa()
    hydra = HydraHeads(32, 100, 3, 2, torch.arange(100))
    warm_start_(hydra, medusa)
    h, emb = torch.randn(5, 32), torch.randn(5, 3, 32)
    assert torch.equal(hydra.features_teacher_forced(h, emb), medusa.features(h))
    with torch.no_grad():  # once the cell is trained, the draft tokens change the guesses
        hydra.draft.linear.weight.normal_(0, 0.1)
    assert not torch.allclose(hydra.features_teacher_forced(h, emb), medusa.features(h))


def test_hydra_folder_roundtrip_and_bad_files(tmp_path: Path) -> None:
    hydra = HydraHeads(32, 100, 3, 2, torch.tensor([5, 7, 1, 99]))
    warm_start_(hydra, _random_medusa())
    with torch.no_grad():
        hydra.draft.linear.weight.normal_(0, 0.1)
    cfg = save_heads(hydra, tmp_path, "tiny")
    assert cfg["version"] == "hydra" and cfg["draft_vocab_size"] == 4
    loaded, path, config = load_heads_file(tmp_path)
    assert isinstance(loaded, HydraHeads) and loaded.format == "hydra" and config == cfg
    assert loaded.draft_vocab.tolist() == [5, 7, 1, 99]
    for key, value in hydra.state_dict().items():
        want = value.half().float() if value.is_floating_point() else value
        assert torch.equal(loaded.state_dict()[key], want), key
    assert loaded.vocab_index(100)[[5, 7, 1, 99, 0]].tolist() == [0, 1, 2, 3, -2]

    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    for missing in ("draft_vocab", "draft.linear.bias"):
        broken = tmp_path / f"no-{missing}"
        broken.mkdir()
        save_file({k: v for k, v in sd.items() if k != missing}, str(broken / HEADS_FILE))
        (broken / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(HeadsError, match="incomplete Hydra heads"):
            load_heads_file(broken)
    with pytest.raises(ValueError, match="draft_vocab"):
        heads_from_state_dict({**sd, "draft_vocab": sd["draft_vocab"].float()})


def test_tree_levels_cover_every_node_once() -> None:
    tree = Tree.named("mc_sim_7b_63")
    levels = tree_levels(tree, torch.device("cpu"))
    assert len(levels) == tree.depth
    seen = [0]
    prev_nodes = [0]
    for level in levels:
        children = level.child_nodes.tolist()
        seen += children
        internal = [prev_nodes[r] for r in level.internal_rows.tolist()]
        for c, slot, row, rank in zip(
            children,
            level.child_slot.tolist(),
            level.child_parent_row.tolist(),
            level.child_rank.tolist(),
            strict=True,
        ):
            assert tree.parents[c] == internal[slot] == prev_nodes[row] and tree.ranks[c] == rank
        assert level.top_k == max(level.child_rank.tolist()) + 1
        prev_nodes = children
    assert sorted(seen) == list(range(tree.size))


def test_drafter_fills_each_node_from_its_own_path() -> None:
    """Against a slow reference: a node's token is the rank-r guess of head d-1 on the state that folded in the
    tokens on the node's path (root first)."""
    loaded = tiny_loaded("llama", heads="hydra")
    heads = loaded.heads
    tree = Tree.named("mc_sim_7b_63")
    buf = tree.buffers("cpu", torch.float32)
    drafter = HydraDrafter(heads, loaded.backbone)
    embed = loaded.backbone.get_input_embeddings()
    w = loaded.backbone.get_output_embeddings().weight[heads.draft_vocab]
    torch.manual_seed(3)
    for _ in range(3):
        hidden, root = torch.randn(1, 64), torch.randint(0, 512, (1,))
        with torch.no_grad():
            tokens = drafter.propose(root, hidden, buf).tolist()
            assert tokens[0] == int(root)
            for node in range(1, tree.size):
                path = tree.path_nodes(node)
                state = hidden
                for n in path[:-1]:
                    state = heads.draft(state, embed(torch.tensor([tokens[n]])))
                d = tree.depths[node] - 1
                x = state
                for block in heads[d]:
                    x = block(x)
                top = (x @ w.T).topk(tree.ranks[node] + 1).indices[0]
                assert tokens[node] == int(heads.draft_vocab[top[tree.ranks[node]]]), node


def test_drafter_on_the_block_kernel_runs_8bit_heads_and_stays_lossless() -> None:
    """With an int8/int4 backbone on the block kernel, the drafter runs a Q8_0 copy of the heads' linears (the
    loaded heads are untouched), its cell and ResBlocks in C; each node still comes from its own path, and
    greedy output is still exactly the plain loop's."""
    from medusa_chat.kernels.cpu_linears import BlockLinearWithBias

    loaded = block_loaded("int8")
    heads = loaded.heads
    drafter = HydraDrafter(heads, loaded.backbone)
    quantized = [m for m in drafter.heads.modules() if isinstance(m, BlockLinearWithBias)]
    assert len(quantized) == 1 + heads.num_heads * heads.num_layers  # the cell and every ResBlock
    assert not any(isinstance(m, BlockLinearWithBias) for m in heads.modules())
    tree = Tree.named("mc_sim_7b_63")
    buf = tree.buffers("cpu", torch.float32)
    embed = loaded.backbone.get_input_embeddings()
    torch.manual_seed(4)
    # the C cell and ResBlocks (native_hydra.NativeHydra) compute what the quantized modules compute
    native = drafter.native
    assert native is not None
    with torch.no_grad():
        s, e = torch.randn(5, 64), embed(torch.randint(0, 512, (5,)))
        assert torch.allclose(native.cell(s, e), drafter.heads.draft(s, e), atol=1e-5, rtol=1e-5)
        for k in range(heads.num_heads):
            assert torch.allclose(
                native.head_features(k, s), drafter.heads.head_features(k, s), atol=1e-5, rtol=1e-5
            )
    # the whole draft runs as one C call (hydra_draft) and gives what the per-depth loop gives, for any tree
    assert drafter.native_draft is not None
    with torch.no_grad():
        for t in (Tree.named("mc_sim_7b_63"), Tree.named("mc_sim_7b_63").prefix(6), Tree.named("chain-4")):
            name = f"{t.name}[:{t.size}]"
            b = t.buffers("cpu", torch.float32)
            for seed in range(3):
                torch.manual_seed(seed)
                hidden, root = torch.randn(1, 64), torch.randint(0, 512, (1,))
                in_c = drafter.propose(root, hidden, b)
                drafter.native_draft = None
                try:
                    in_python = drafter.propose(root, hidden, b)
                finally:
                    drafter.native_draft = native.draft
                assert torch.equal(in_c, in_python), (name, seed)
    with torch.no_grad():
        hidden, root = torch.randn(1, 64), torch.randint(0, 512, (1,))
        tokens = drafter.propose(root, hidden, buf).tolist()
        for node in range(1, tree.size):
            state = hidden
            for n in tree.path_nodes(node)[:-1]:
                state = native.cell(state, embed(torch.tensor([tokens[n]])))
            x = native.head_features(tree.depths[node] - 1, state)
            top = drafter.project(x).topk(tree.ranks[node] + 1).indices[0]
            assert tokens[node] == int(heads.draft_vocab[top[tree.ranks[node]]]), node
    prompt = training_prompts()[0][:12]
    _, medusa = run(MedusaEngine(loaded, tree), prompt, max_new_tokens=24)
    _, plain = run(MedusaEngine(loaded, plain_tree()), prompt, max_new_tokens=24)
    assert medusa.token_ids == plain.token_ids and medusa.tokens_per_step > 1.0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("tree_name", TREES)
def test_greedy_with_hydra_heads_is_lossless(arch: str, tree_name: str) -> None:
    loaded = tiny_loaded(arch, heads="hydra")
    engine = MedusaEngine(loaded, Tree.named(tree_name))
    assert engine.drafter is not None
    outcomes = []
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(3, loaded.vocab_size, (length,), generator=g).tolist()
        outcomes.append(assert_lossless(loaded, engine, prompt, 40))
    for prompt in training_prompts()[:3]:
        outcomes.append(assert_lossless(loaded, engine, prompt, 40))
    assert outcomes.count("exact") >= 5


def test_hydra_heads_accept_more_than_the_medusa_heads_they_started_from() -> None:
    """The reason for the format: on the data both were trained on, knowing the path's tokens pays."""
    tree = Tree.named("mc_sim_7b_63")
    per_format = {}
    for fmt in ("v2", "hydra"):
        engine = MedusaEngine(tiny_loaded("llama", heads=fmt), tree)
        per_format[fmt] = [
            run(engine, p, max_new_tokens=64)[1].tokens_per_step for p in training_prompts()[:6]
        ]
    assert sum(per_format["hydra"]) > sum(per_format["v2"]) + 0.3 * 6, per_format


def test_typical_acceptance_with_hydra_heads_is_seeded_and_stops() -> None:
    engine = MedusaEngine(tiny_loaded("llama", heads="hydra"), Tree.named("mc_sim_7b_63"))
    prompt = training_prompts()[0]
    a = run(engine, prompt, max_new_tokens=48, temperature=0.7, seed=5)[1]
    b = run(engine, prompt, max_new_tokens=48, temperature=0.7, seed=5)[1]
    assert a.token_ids == b.token_ids and a.new_tokens == 48 and a.tokens_per_step > 1.0
    stop = __import__("threading").Event()
    stop.set()
    items = list(engine.generate(prompt, GenerationSettings(max_new_tokens=48), stop=stop))
    assert items[-1].stop_reason == "stopped"


def test_hydra_heads_for_a_larger_vocabulary_are_refused() -> None:
    from medusa_chat.model.sources.heads_files import check_heads_fit

    heads = HydraHeads(32, 0, 2, 1, torch.tensor([3, 900]))
    check_heads_fit(heads, {"hidden_size": 32, "vocab_size": 1000}, "x", "tiny")
    with pytest.raises(HeadsError, match="trained for another model"):
        check_heads_fit(heads, {"hidden_size": 32, "vocab_size": 512}, "x", "tiny")

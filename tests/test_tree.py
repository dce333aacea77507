"""Tree layouts: validation, growth order, and the buffers a decoding step reads."""

from __future__ import annotations

import json

import pytest
import torch

from medusa_chat.errors import TreeError
from medusa_chat.tree import Tree, published_trees


@pytest.mark.parametrize("name", sorted(published_trees()))
def test_published_trees_are_in_growth_order(name: str) -> None:
    tree = Tree.named(name)
    assert tree.size == 64 and tree.depth in (3, 4)
    # Every prefix is itself a tree: each node's parent comes before it.
    assert all(parent < node for node, parent in enumerate(tree.parents) if node)
    # from_paths kept the published order (no re-sort needed).
    assert [list(p) for p in tree.paths] == published_trees()[name]


def test_buffers_mask_positions_and_candidates() -> None:
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 1]])
    buf = tree.buffers("cpu", torch.float32, top_k=3)
    visible = buf.attn_bias == 0
    # node 3 = [0, 0]: sees root, [0], itself; not [1] or [1, 0].
    assert visible[3].tolist() == [True, True, False, True, False, False]
    assert visible[4].tolist() == [True, False, True, False, True, False]
    assert buf.depth.tolist() == [0, 1, 1, 2, 2, 2]
    # flat = [root, head0 top-3, head1 top-3]: [1, 0] is head1 rank 0 -> 1 + 3 + 0.
    assert buf.candidate_index.tolist() == [0, 1, 2, 4, 4, 5]
    # only nodes with children get logits; each node's parent is named by its slot among them
    assert buf.internal.tolist() == [0, 1, 2]
    assert buf.parent_slot.tolist() == [0, 0, 0, 1, 2, 1]
    # leaves: [1,0] (node 4), [0,0] (node 3), [0,1] (node 5); rows root..leaf padded with N=6.
    assert sorted(buf.leaf_paths.tolist()) == [[0, 1, 3], [0, 1, 5], [0, 2, 4]]


def test_root_only_tree_is_plain_decoding() -> None:
    tree = Tree.chain(0)
    buf = tree.buffers("cpu", torch.float32)
    assert tree.size == 1 and buf.leaf_paths.tolist() == [[0]]


def test_prefix_is_a_valid_tree_and_growth_order_is_restored() -> None:
    tree = Tree.named("mc_sim_7b_63")
    for n in (1, 2, 8, 16, 33, 64):
        sub = tree.prefix(n)
        assert sub.size == n
        Tree.from_paths([list(p) for p in sub.paths])  # validates parents
    shuffled = Tree.from_paths([[0, 0, 0], [0], [0, 0], [1]])
    assert shuffled.paths == ((0,), (1,), (0, 0), (0, 0, 0))


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0, 0]], "has no parent"),
        ([[0], [0]], "duplicate"),
        ([[0], [-1]], "negative"),
    ],
)
def test_invalid_trees_are_refused(paths: list[list[int]], message: str) -> None:
    with pytest.raises(TreeError, match=message):
        Tree.from_paths(paths)


def test_tree_deeper_than_heads_is_refused() -> None:
    with pytest.raises(TreeError, match="only 3 Medusa heads"):
        Tree.named("mc_sim_7b_63").check_fits(num_heads=3)
    with pytest.raises(TreeError, match="top-k"):
        Tree.from_paths([[0], [5]]).check_fits(num_heads=4, top_k=3)


def test_tree_files_and_unknown_name(tmp_path) -> None:
    path = tmp_path / "mine.json"  # the form fit-tree / train-heads write (tree.json)
    path.write_text(json.dumps({"name": "mine", "paths": [[0], [1], [0, 0]]}))
    assert Tree.named(str(path)).paths == ((0,), (1,), (0, 0))
    path.write_text(json.dumps([[0], [0, 1]]))  # a bare list of paths also works
    assert Tree.load(path).size == 3
    with pytest.raises(TreeError, match="unknown tree"):
        Tree.named("no-such-tree")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TreeError, match="cannot read"):
        Tree.load(tmp_path / "bad.json")


@pytest.mark.parametrize("seed", range(6))
def test_host_greedy_walk_accepts_as_much_as_the_device_rule(seed: int) -> None:
    """greedy_path (host lists, the engine's small-tree greedy step) against best_path(greedy_node_ok(...)) (the
    device rule): random trees, tokens and argmaxes over a 3-token vocabulary, so siblings often share a token
    and many paths are accepted at once."""
    from medusa_chat.engine.acceptance import best_path, greedy_node_ok, greedy_path

    g = torch.Generator().manual_seed(seed)
    for name in ("mc_sim_7b_63", "vicuna_7b_stage2", "chain-5"):
        tree = Tree.named(name).prefix(int(torch.randint(2, 17, (1,), generator=g)))
        buf = tree.buffers("cpu", torch.float32)
        for _ in range(40):
            tokens = torch.randint(0, 3, (tree.size,), generator=g)
            top = torch.randint(0, 3, (tree.size,), generator=g)
            parent = torch.tensor([0, *tree.parents[1:]])  # every node's row holds an argmax here
            _, count = best_path(greedy_node_ok(top, tokens, parent), buf.leaf_paths)
            path = greedy_path(tokens.tolist(), top.tolist(), tree.children)
            assert len(path) == int(count) + 1
            assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:], strict=False))
            assert all(int(tokens[b]) == int(top[a]) for a, b in zip(path, path[1:], strict=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_is_argmax_including_ties(dtype: torch.dtype) -> None:
    """The engine's greedy token (`max(dim).indices`, faster on a CPU) is `argmax`'s: the first maximal index,
    on rows with many exact ties (values from a small set), on 1-D and 2-D logits."""
    from medusa_chat.engine.acceptance import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for vocab in (7, 49152):
        rows = torch.randint(0, 4, (64, vocab), generator=g).to(dtype)  # every row has ties at its maximum
        rows[5] = 0.0  # the whole row tied
        rows[6, vocab // 2] = float("inf")
        assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))
        for r in range(8):
            assert torch.equal(greedy_tokens(rows[r]), rows[r].argmax(dim=-1))
    spread = torch.randn(16, 49152, generator=g)
    assert torch.equal(greedy_tokens(spread), spread.argmax(dim=-1))

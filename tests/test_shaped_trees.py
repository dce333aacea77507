"""Trees shaped per step by the draft's confidence (drafters.confident_paths; hydra.c, hydra_draft_shaped) and
runs of context-lookup guesses (lookup.LOOKUP_RUN): whatever shape a step's tree takes, greedy output must
still be the plain loop's, token for token."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from medusa_chat.engine.drafters import confident_paths
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.engine.lookup import LOOKUP_RUN, ContextLookup
from medusa_chat.tree import Tree
from tests.test_decoding import run
from tests.tinymodels import block_loaded, tiny_loaded, training_prompts


def _path_p(probs: list[list[float]], path: tuple[int, ...]) -> float:
    d, r = len(path) - 1, path[-1]
    return math.prod(row[0] for row in probs[:d]) * probs[d][r]


def _sorted_probs(g: torch.Generator, depth: int, k: int) -> list[list[float]]:
    rows = []
    for _ in range(depth):
        p = torch.rand(k + 2, generator=g)
        p = (p / p.sum()).sort(descending=True).values[:k]
        rows.append(p.tolist())
    return rows


def test_confident_paths_spends_the_nodes_where_the_draft_is_sure() -> None:
    # sure of its first guess: depth; unsure: the runner-up beats the unsure guess's own child
    assert confident_paths([[0.9, 0.05], [0.8, 0.1]], 3) == ((0,), (0, 0))
    assert confident_paths([[0.4, 0.3], [0.5, 0.2]], 3) == ((0,), (1,))
    # 0.6 (0,), 0.54 (0, 0), 0.3 (1,), 0.27 (0, 0, 0) beat 0.108 (0, 0, 1); growth order
    probs = [[0.6, 0.3, 0.05], [0.9, 0.05, 0.01], [0.5, 0.2, 0.1]]
    assert confident_paths(probs, 5) == ((0,), (1,), (0, 0), (0, 0, 0))
    # ties go to the shallower node
    assert confident_paths([[0.5, 0.5], [1.0, 0.0]], 3) == ((0,), (1,))
    assert confident_paths([[0.9]], 1) == ()
    with pytest.raises(ValueError):
        confident_paths([[0.9, 0.1]], 4)


@pytest.mark.parametrize(("depth", "k", "size"), [(2, 2, 3), (3, 3, 4), (3, 3, 6), (4, 2, 5), (2, 3, 7)])
def test_confident_paths_is_the_most_probable_tree_of_its_size(depth: int, k: int, size: int) -> None:
    """Among every tree of `size` nodes built from the candidates (each node's parent in the tree), the chosen
    one has the largest total path probability: the expected number of its nodes on the true path."""
    g = torch.Generator().manual_seed(depth * 100 + k * 10 + size)
    cands = [(0,) * d + (r,) for d in range(depth) for r in range(k)]
    for _ in range(25):
        probs = _sorted_probs(g, depth, k)
        chosen = confident_paths(probs, size)
        tree = Tree.from_paths(list(chosen))  # a valid tree: every node's parent is in it
        assert tree.size == size and list(chosen) == sorted(chosen, key=lambda p: (len(p), p))
        best = max(
            sum(_path_p(probs, p) for p in subset)
            for subset in itertools.combinations(cands, size - 1)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)
        )
        assert sum(_path_p(probs, p) for p in chosen) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_the_c_drafter_shapes_the_tree_by_the_python_rule(quant: str) -> None:
    """hydra_draft_shaped's tree and tokens are confident_paths applied to the draft's own spine: the cell, the
    ResBlocks and the projection run step by step in Python, a softmax over the draft vocabulary."""
    loaded = block_loaded(quant)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(4))
    drafter = engine.drafter
    assert engine.draft_shaped and drafter is not None and drafter.native is not None
    native, embed = drafter.native, loaded.backbone.get_input_embeddings()
    vocab = drafter.draft_vocab
    checked = 0
    for depth, k, size in ((2, 2, 3), (3, 3, 4), (3, 3, 6)):
        for seed in range(6):
            torch.manual_seed(seed)
            hidden, root = torch.randn(1, 64), torch.randint(0, 512, (1,))
            with torch.no_grad():
                probs, tokens = [], []
                state = native.cell(hidden, embed(root))
                for d in range(depth):
                    logits = drafter.project(native.head_features(d, state))[0, : len(vocab)]
                    p, idx = torch.softmax(logits.double(), -1).topk(k)
                    probs.append(p.tolist())
                    tokens.append(vocab[idx].tolist())
                    state = native.cell(state, embed(vocab[idx[:1]]))
                codes, got = native.draft_shaped(root, hidden, depth, k, size)
            ranked = sorted(
                (_path_p(probs, (0,) * d + (r,)) for d in range(depth) for r in range(k)), reverse=True
            )
            if ranked[size - 2] - ranked[size - 1] < 1e-4:  # a near-tie: float rounding may pick either
                continue
            want = confident_paths(probs, size)
            assert tuple((0,) * (c // k) + (c % k,) for c in codes) == want, (depth, k, size, seed)
            assert got.tolist() == [int(root)] + [tokens[len(p) - 1][p[-1]] for p in want]
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("size", [3, 4, 6])
def test_shaped_trees_are_lossless_and_change_shape(quant: str, size: int) -> None:
    loaded = block_loaded(quant)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(size))
    plain = MedusaEngine(loaded, plain_tree())
    assert engine.draft_shaped and not MedusaEngine(loaded, engine.tree, shaped=False).draft_shaped
    shapes: set[tuple[int, ...]] = set()
    prompts = [p[:20] for p in training_prompts()[:4]]
    g = torch.Generator().manual_seed(size)
    prompts += [torch.randint(3, loaded.vocab_size, (12,), generator=g).tolist() for _ in range(2)]
    for prompt in prompts:
        events, summary = run(engine, prompt, max_new_tokens=40, context_lookup=False)
        assert summary.token_ids == run(plain, prompt, max_new_tokens=40)[1].token_ids
        for ev in events[1:]:
            assert ev.tree is not None and len(ev.tree.tokens) == size
            assert ev.tree.tokens[0] == summary.token_ids[ev.new_tokens_total - len(ev.token_ids) - 1]
            shapes.add(tuple(ev.tree.parents))
    assert len(shapes) >= 2, shapes  # the shape really follows the draft
    # sampled replies take shaped trees too, and stay reproducible from their seed
    a = run(engine, prompts[0], max_new_tokens=32, temperature=0.8, seed=3)[1]
    b = run(engine, prompts[0], max_new_tokens=32, temperature=0.8, seed=3)[1]
    assert a.token_ids == b.token_ids and a.new_tokens == 32


def test_lookup_records_how_much_it_matched() -> None:
    lk = ContextLookup([5, 1, 2, 3, 4, 9, 7, 1, 2, 3, 4])
    assert lk.continuation(3) == [9, 7, 1] and lk.matched == 4
    lk = ContextLookup([1, 2, 8, 3, 1, 2])
    assert lk.continuation(2) == [8, 3] and lk.matched == 2
    assert ContextLookup([1, 2, 3]).continuation(2) == [] and ContextLookup([1, 2, 3]).matched == 0


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_a_long_lookup_match_verifies_the_whole_run_and_stays_lossless(quant: str) -> None:
    """Where the context's last 4 tokens occurred before, a step verifies up to LOOKUP_RUN lookup tokens in one
    chain (more than the tree's own chain), and greedy output is still the plain loop's. The tiny model's greedy
    replies fall into loops: the lookup then predicts them."""
    loaded = tiny_loaded("llama", heads="hydra") if quant == "none" else block_loaded(quant)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(3))
    plain = MedusaEngine(loaded, plain_tree())
    chain = len(engine.buffers.chain)
    assert LOOKUP_RUN > chain
    runs, steps = 0, {}
    for prompt in [p[:16] for p in training_prompts()[:6]]:
        ref = run(plain, prompt, max_new_tokens=64)[1].token_ids
        for lookup_run in (LOOKUP_RUN, 0):
            engine.lookup_run = lookup_run
            events, summary = run(engine, prompt, max_new_tokens=64)
            assert summary.token_ids == ref
            long = [ev for ev in events[1:] if ev.tree is not None and len(ev.tree.lookup_nodes) > chain]
            if lookup_run:
                runs += len(long)
                assert all(
                    ev.tree.parents == list(range(-1, len(ev.tree.tokens) - 1)) for ev in long
                )  # chains
            else:
                assert not long
            steps[lookup_run] = steps.get(lookup_run, 0) + summary.steps
    assert runs > 0 and steps[LOOKUP_RUN] < steps[0], (runs, steps)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_exact_sampling_on_shaped_trees_is_the_plain_loop_with_the_same_seed(quant: str) -> None:
    """The exact rule keeps the model's sampling law whatever the drafts are, as long as they depend only on
    emitted tokens, which a shape chosen from the draft's own confidence does: with the same seed, a sampled
    reply on shaped trees (and lookup runs) is the plain loop's sampled reply, token for token."""
    loaded = block_loaded(quant)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(4))
    plain = MedusaEngine(loaded, plain_tree())
    assert engine.draft_shaped
    shapes: set[tuple[int, ...]] = set()
    multi = 0
    for seed in range(4):
        prompt = training_prompts()[seed][:16]
        kw = dict(temperature=0.3, top_p=0.95, seed=seed, accept="exact")
        events, got = run(engine, prompt, max_new_tokens=40, **kw)
        assert got.token_ids == run(plain, prompt, max_new_tokens=40, **kw)[1].token_ids, seed
        shapes |= {tuple(ev.tree.parents) for ev in events[1:] if ev.tree is not None}
        multi += sum(len(ev.token_ids) > 1 for ev in events[1:])
    assert len(shapes) >= 2 and multi > 5, (shapes, multi)

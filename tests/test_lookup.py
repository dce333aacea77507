"""Context lookup drafts (lookup.py): the index, and replies that stay the plain loop's while lookup guesses
are verified and accepted on the tree's main chain."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.engine.lookup import ContextLookup
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent, TreeView
from medusa_chat.tree import Tree
from tests.tinymodels import tiny_loaded, training_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops (conftest)


def _naive(seq: list[int], count: int, lo: int = 2, hi: int = 4) -> list[int]:
    """The definition, by scanning: the latest earlier occurrence of the longest suffix of lo..hi tokens."""
    for k in range(hi, lo - 1, -1):
        if len(seq) <= k:
            continue
        for j in range(len(seq) - k - 1, -1, -1):
            if seq[j : j + k] == seq[-k:]:
                return seq[j + k : j + k + count]
    return []


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    lk = ContextLookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    assert lk.continuation(2) == [9, 2]  # "1 2 3" (3 tokens) beats the later "2 3 -> 7"
    lk = ContextLookup([5, 2, 3, 9, 4, 2, 3, 7, 8, 2, 3])
    assert lk.continuation(3) == [7, 8, 2]  # "2 3" twice: the latest
    assert ContextLookup([1, 2, 3, 4]).continuation(2) == []  # the suffix only occurs as itself
    assert ContextLookup([1, 2, 5, 2]).continuation(2) == []  # one matching token is not enough
    assert ContextLookup([7, 7, 7]).continuation(4) == [7]  # overlapping repeats: what followed, no further
    with pytest.raises(ValueError):
        ContextLookup(min_match=3, max_match=2)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_equals_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    seq = [rng.randrange(6) for _ in range(8)]
    lk = ContextLookup(seq)
    for _ in range(200):
        assert lk.continuation(3) == _naive(seq, 3)
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        seq += new
        lk.extend(new)
    assert lk.tokens == seq


def _events(engine: MedusaEngine, prompt: list[int], **kw) -> tuple[list[StepEvent], ReplySummary]:
    items = list(engine.generate(prompt, GenerationSettings(max_new_tokens=64, **kw)))
    return [e for e in items[:-1] if e.tree is not None], items[-1]


def _lookup_accepted(events: list[StepEvent]) -> int:
    """Lookup-drafted nodes that the backbone accepted, over a reply."""
    return sum(len(set(e.tree.lookup_nodes) & set(e.accepted_nodes)) for e in events if e.tree)


def _main_chain(tree: TreeView) -> list[int]:
    """The nodes of the rank-0 path below the root."""
    chain, node = [], 0
    while True:
        node = next((i for i, p in enumerate(tree.parents) if p == node and tree.ranks[i] == 0), -1)
        if node < 0:
            return chain
        chain.append(node)


# a prompt that repeats itself, and prompts the heads know: lookup fires on both
PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9], *training_prompts()[:3]]


@pytest.mark.parametrize("tree", [Tree.chain(2), Tree.chain(4), Tree.named("mc_sim_7b_63").prefix(8)])
def test_greedy_with_lookup_is_the_plain_loop_and_lookup_guesses_are_accepted(tree: Tree) -> None:
    loaded = tiny_loaded("llama")
    plain = MedusaEngine(loaded, plain_tree())
    engine = MedusaEngine(loaded, tree)
    accepted, steps_with, steps_without = 0, 0, 0
    for prompt in PROMPTS:
        ref = _events(plain, prompt)[1].token_ids
        on_events, on = _events(engine, prompt)
        off_events, off = _events(engine, prompt, context_lookup=False)
        assert on.token_ids == ref == off.token_ids, f"{tree.name}, prompt {prompt[:4]}"
        assert all(not e.tree.lookup_nodes for e in off_events if e.tree)
        # lookup guesses sit on the step's main chain only (the tree's own, or a longer run's: LOOKUP_RUN)
        assert all(set(e.tree.lookup_nodes) <= set(_main_chain(e.tree)) for e in on_events if e.tree)
        accepted += _lookup_accepted(on_events)
        steps_with, steps_without = steps_with + on.steps, steps_without + off.steps
    assert accepted > 10, accepted  # the lookup path really ran and its guesses were verified and kept
    assert steps_with <= steps_without, (steps_with, steps_without)


def test_exact_sampling_with_lookup_is_the_plain_loop_with_the_same_seed(make_loaded_model) -> None:
    """The exact rule's law does not depend on the drafts as long as they depend only on emitted tokens:
    same seed, same reply as the plain loop, with lookup guesses accepted along the way."""
    loaded = make_loaded_model("llama")  # the planted model: each token's successor is peaked
    plain, engine = MedusaEngine(loaded, plain_tree()), MedusaEngine(loaded, Tree.chain(3))
    # a prompt that already walked the successor cycle once and starts again: lookup knows what comes next
    walk = _events(plain, [40])[1].token_ids[:16]
    prompt = [40, *walk, 40, walk[0]]
    accepted = 0
    for seed in range(4):
        kw = dict(temperature=0.5, top_p=0.95, seed=seed, accept="exact")
        events, got = _events(engine, prompt, **kw)
        assert got.token_ids == _events(plain, prompt, **kw)[1].token_ids, seed
        accepted += _lookup_accepted(events)
    assert accepted > 4, accepted


def test_the_chain_buffers_follow_the_top_1_path() -> None:
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    buf = tree.buffers("cpu", torch.float32)
    assert buf.chain == [1, 3, 6]
    assert buf.chain_index.tolist() == [1, 3, 6]
    assert plain_tree().buffers("cpu", torch.float32).chain == []


def test_typical_acceptance_never_uses_lookup_guesses() -> None:
    """Typical acceptance keeps any plausible guess: lookup guesses would tilt sampled replies towards repeating
    earlier text, so that mode drafts with the heads only, whatever the setting says."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.chain(3))
    for seed in range(3):
        events, _ = _events(engine, PROMPTS[0], temperature=0.7, seed=seed, accept="typical")
        assert events and all(not e.tree.lookup_nodes for e in events if e.tree)
    events, _ = _events(engine, PROMPTS[0])  # the same prompt, greedy: lookup guesses are used
    assert any(e.tree.lookup_nodes for e in events if e.tree)

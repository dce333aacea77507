"""The native step's thread count (qgemm.set_threads, engine/threads.py) changes no output bit: the kernels split
work by rows, column groups, heads and key ranges, never inside one sum, so greedy replies with 1 and 2 threads
are the same tokens, and Medusa's equal the plain loop's either way."""

from __future__ import annotations

import pytest

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import qgemm
from medusa_chat.tree import Tree
from tests.tinymodels import block_loaded, training_prompts


def _reply(engine: MedusaEngine, prompt: list[int], n: int = 32) -> list[int]:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


@pytest.fixture
def restore_threads():
    yield
    qgemm.set_threads(0)


def test_the_team_size_really_applies(restore_threads) -> None:
    if not qgemm.available():
        pytest.skip(qgemm.unavailable_reason())
    for n in (1, 2, 3):
        qgemm.set_threads(n)
        assert qgemm.get_threads() == n
        assert qgemm.load().mc_team_probe() == n  # the clause holds on the OpenMP runtime really loaded


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_one_and_two_threads_decode_the_same_tokens(quant: str, restore_threads) -> None:
    model = block_loaded(quant)
    prompts = training_prompts()[:2] + [[5, 9, 17, 33, 65, 129, 257, 7, 11]]
    replies = {}
    for n in (1, 2):
        qgemm.set_threads(n)
        plain = MedusaEngine(model, plain_tree())
        tree = MedusaEngine(model, Tree.named("mc_sim_7b_63"))
        replies[n] = [(_reply(plain, p), _reply(tree, p)) for p in prompts]
    assert replies[1] == replies[2]
    for ref, got in replies[1]:
        assert got == ref  # Medusa's greedy reply is the plain loop's

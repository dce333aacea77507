"""The GPU step as a CUDA graph (medusa_chat/model/forward/graph_step.py): what can be checked without a GPU, is, here.

The graph records a static-shape body (whole-window KV buffer, device-side start slot, in-graph positions, cache
slots and tree mask). That body runs eagerly on a CPU (`capture=False`) and must give what the engine gives
without it: in float64, where rounding cannot flip a greedy token, replies are compared token for token with the
eager engine and with the plain loop, for chains and branching trees, greedy and sampled, across cache buckets
and past the graphs' cache. The recording itself runs only on CUDA (the last test; `benchmarks/gpu_checks.sh`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from medusa_chat.engine import graphs
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.engine.graphs import wants_graphs
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.model.forward.graph_step import MIN_BUCKET, bucket_for
from medusa_chat.tree import Tree
from tests.tinymodels import moved, tiny_loaded


@pytest.fixture(scope="module")
def loaded64():
    return moved(tiny_loaded("llama"), "cpu", torch.float64)


def _reply(engine: MedusaEngine, prompt: list[int], **settings) -> list[int]:
    *_, summary = engine.generate(prompt, GenerationSettings(**settings))
    assert isinstance(summary, ReplySummary)
    return summary.token_ids


def _graph_engine(loaded, tree: Tree) -> MedusaEngine:
    engine = MedusaEngine(loaded, tree)
    engine.use_graphs(capture=False)
    return engine


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize(
    "tree", [Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(16), Tree.named("mc_sim_7b_63")]
)
def test_the_static_step_gives_the_eager_engines_replies(loaded64, tree: Tree) -> None:
    graph, eager, plain = (
        _graph_engine(loaded64, tree),
        MedusaEngine(loaded64, tree),
        MedusaEngine(loaded64, plain_tree()),
    )
    for prompt in _prompts(4, 12):
        want = _reply(plain, prompt, max_new_tokens=40)
        assert _reply(eager, prompt, max_new_tokens=40) == want
        assert _reply(graph, prompt, max_new_tokens=40) == want
    assert graph.graph is not None and graph.graph_note == ""  # every first replay passed its check


def test_the_static_step_samples_like_the_eager_engine(loaded64) -> None:
    tree = Tree.named("mc_sim_7b_63").prefix(16)
    graph, eager = _graph_engine(loaded64, tree), MedusaEngine(loaded64, tree)
    for seed, prompt in enumerate(_prompts(3, 10, seed=1)):
        for mode in ("typical", "exact"):
            kw = dict(max_new_tokens=30, temperature=0.8, seed=seed, accept=mode)
            assert _reply(graph, prompt, **kw) == _reply(eager, prompt, **kw)


def test_a_growing_reply_records_one_graph_per_bucket(loaded64) -> None:
    tree = Tree.chain(3)
    engine = _graph_engine(loaded64, tree)
    prompt = _prompts(1, MIN_BUCKET - 40)[0]
    reply = _reply(engine, prompt, max_new_tokens=120)  # crosses from the 256 bucket into 512
    assert len(reply) == 120
    assert engine.graph is not None
    assert set(engine.graph._graphs) == {(tree.size, MIN_BUCKET), (tree.size, 2 * MIN_BUCKET)}
    assert engine.graph.captures == 2
    assert _reply(engine, prompt, max_new_tokens=120) == reply  # the second reply reuses both
    assert engine.graph.captures == 2


def test_buckets_are_powers_of_two_within_the_cache() -> None:
    assert bucket_for(1, 4096) == MIN_BUCKET
    assert bucket_for(MIN_BUCKET, 4096) == MIN_BUCKET
    assert bucket_for(MIN_BUCKET + 1, 4096) == 2 * MIN_BUCKET
    assert bucket_for(3000, 4096) == 4096
    assert bucket_for(3000, 3500) == 3500


def test_a_conversation_past_the_graphs_cache_goes_on_eagerly(loaded64, monkeypatch) -> None:
    monkeypatch.setattr(graphs, "GRAPH_CACHE_LIMIT", 300)
    tree = Tree.chain(3)
    engine, plain = _graph_engine(loaded64, tree), MedusaEngine(loaded64, plain_tree())
    prompt = _prompts(1, 260, seed=2)[0]
    assert _reply(engine, prompt, max_new_tokens=80) == _reply(plain, prompt, max_new_tokens=80)
    assert engine.graph is None and "outgrew" in engine.graph_note


def test_graphs_are_wanted_for_a_lean_forward_unless_turned_off(loaded64, monkeypatch) -> None:
    runner = MedusaEngine(loaded64, plain_tree()).runner
    assert wants_graphs(loaded64, runner)
    monkeypatch.setenv("MEDUSA_CHAT_COMPILE", "0")
    assert not wants_graphs(loaded64, runner)
    monkeypatch.delenv("MEDUSA_CHAT_COMPILE")
    measured_slower = copy.copy(loaded64)
    measured_slower.graph_step = False
    assert not wants_graphs(measured_slower, runner)
    # a CPU engine never records graphs (its default is the native C step)
    assert MedusaEngine(loaded64, plain_tree()).graph is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorded_graphs_give_the_eager_gpu_replies() -> None:
    loaded = moved(tiny_loaded("llama"), "cuda", torch.float64)  # float64: rounding cannot flip a token
    for tree in (Tree.chain(3), Tree.named("mc_sim_7b_63")):
        graph = MedusaEngine(loaded, tree)
        assert graph.graph is not None and graph.graph.capture
        eager = MedusaEngine(loaded, tree, graphs=False)
        for prompt in _prompts(3, 12):
            assert _reply(graph, prompt, max_new_tokens=40) == _reply(eager, prompt, max_new_tokens=40)
        assert graph.graph is not None, graph.graph_note
        assert graph.graph.captures >= 1

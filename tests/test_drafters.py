"""The drafter interface (engine/drafters.py, Drafter): every kind implements all of it, and the engine calls it
without asking which kind it has."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from medusa_chat.engine import drafters
from medusa_chat.engine.drafters import (
    ROOT_ONLY,
    Drafter,
    EagleDrafter,
    HydraDrafter,
    LookupDrafter,
    MedusaDrafter,
    MedusaGuesses,
)

ENGINE_DIR = Path(drafters.__file__).resolve().parent
KINDS = [MedusaGuesses, MedusaDrafter, HydraDrafter, EagleDrafter, LookupDrafter]


def _members(cls: type) -> set[str]:
    names = {n for n in vars(cls) if not n.startswith("_")}
    return names | set(getattr(cls, "__annotations__", {}))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_drafter_kind_implements_the_whole_interface(kind: type) -> None:
    wanted = _members(Drafter)
    have = {n for n in wanted if hasattr(kind, n) or n in inspect.signature(kind.__init__).parameters}
    # attributes set per instance (a drafter's name) are checked on the instances the engine tests build
    missing = wanted - have - {"name"}
    assert not missing, f"{kind.__name__} lacks {sorted(missing)}"
    for name in wanted:
        method = getattr(Drafter, name, None)
        if callable(method):
            got = len(inspect.signature(getattr(kind, name)).parameters)
            assert got == len(inspect.signature(method).parameters), f"{kind.__name__}.{name}: {got} parameters"


def test_the_root_only_drafter_drafts_nothing() -> None:
    import torch

    from medusa_chat.tree import Tree

    buf = Tree.chain(0).buffers(torch.device("cpu"), torch.float32)
    root = torch.tensor([7])
    logits, draft = ROOT_ONLY.logits_and_draft(lambda h: h @ torch.eye(4), torch.ones(1, 4), 1)
    assert draft is None and logits.shape == (4,)
    assert ROOT_ONLY.propose(root, None, buf).tolist() == [7]
    assert not ROOT_ONLY.fills_tree and not ROOT_ONLY.shapes_trees and not ROOT_ONLY.reads_features


def test_the_engine_asks_no_drafter_its_kind() -> None:
    """engine.py, trees.py and graphs.py call the interface: no isinstance on a drafter or heads kind, no drafter
    class or heads class by name."""
    kinds = {k.__name__ for k in KINDS} | {"EagleDraft", "HydraHeads", "MedusaHeads"}
    for name in ("engine.py", "trees.py", "graphs.py"):
        tree = ast.parse((ENGINE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not named & kinds, f"{name}:{node.lineno} asks a drafter's kind"
            if isinstance(node, ast.Name) and node.id in kinds - {"MedusaHeads"}:
                raise AssertionError(f"{name}:{node.lineno} names {node.id}")

"""Sparse candidate trees: layouts, validation, and the device buffers one tree needs.

A tree is a list of paths. Path `[r1, ..., rd]` is a node at depth d whose token is the rank-`rd` guess of
head d-1 (rank 0 = top-1); the root (depth 0, the empty path) is the backbone's own next token. Trees are
kept in *growth order*: every path's parent comes before it, so every prefix of the list is itself a tree and
"tree size N" simply means "the first N nodes" (root included).

`TreeBuffers` holds everything a decoding step needs about the tree, built once on the device:
the ancestor mask, per-node depth (position offset), each node's index into the flat candidate vector
`[root, head0 top-k, head1 top-k, ...]`, each node's parent as a slot among the nodes with children (only
those need logits), and one row per leaf listing the nodes on its path (padded with the sentinel index N,
which `best_path` treats as "not accepted").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

import torch

from medusa_chat.errors import TreeError

Path_ = tuple[int, ...]


def published_trees() -> dict[str, list[list[int]]]:
    """The layouts published with the Medusa reference implementation (63 nodes + root each)."""
    text = resources.files("medusa_chat.data").joinpath("medusa_trees.json").read_text()
    return json.loads(text)


@dataclass
class SizeChoices:
    """What a CPU calibration tells the engine's tree sizer (engine/tree_sizer.py): the sizes it may use
    (ascending, 1 = plain steps), the size its estimate chose (the start), and each size's tokens per step on the
    calibration's replies."""

    sizes: list[int]
    start: int
    tokens_per_step: dict[int, float]


@dataclass(frozen=True)
class Tree:
    """An immutable, validated tree layout in growth order (root excluded from `paths`)."""

    paths: tuple[Path_, ...]
    name: str = "custom"
    # The prefix sizes its steps may verify, chosen as replies run, where a calibration timed them (tuning's
    # calibrated_tree); None: every step verifies the whole tree. Not part of the layout: trees compare without it.
    sizes: SizeChoices | None = field(default=None, compare=False)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]], name: str = "custom") -> Tree:
        seen: set[Path_] = {()}
        ordered: list[Path_] = []
        for raw in paths:
            p = tuple(int(r) for r in raw)
            if not p:
                continue  # the root is implicit
            if any(r < 0 for r in p):
                raise TreeError(f"tree {name!r}: negative rank in path {list(p)}")
            if p in seen:
                raise TreeError(f"tree {name!r}: duplicate path {list(p)}")
            seen.add(p)
            ordered.append(p)
        for p in ordered:
            if p[:-1] not in seen:
                raise TreeError(f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])} in the tree")
        # A set that is valid but not in growth order is re-sorted so that parents come first.
        index = {p: i for i, p in enumerate(ordered)}
        if any(len(p) > 1 and index[p[:-1]] > index[p] for p in ordered):
            ordered.sort(key=lambda p: (len(p), p))
        return cls(tuple(ordered), name)

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """A single branch of top-1 guesses: depth 0 is plain decoding."""
        return cls(tuple((0,) * d for d in range(1, depth + 1)), name=f"chain-{depth}")

    @classmethod
    def named(cls, name: str) -> Tree:
        trees = published_trees()
        if name in trees:
            return cls.from_paths(trees[name], name=name)
        if name.startswith("chain-") and name[6:].isdigit():
            return cls.chain(int(name[6:]))
        path = Path(name).expanduser()
        if path.is_file():
            return cls.load(path)
        raise TreeError(
            f"unknown tree {name!r}: use one of {', '.join(sorted(trees))}, chain-N, or a JSON file of paths"
        )

    @classmethod
    def load(cls, path: str | Path) -> Tree:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise TreeError(f"cannot read tree file {path}: {err}") from err
        paths = data.get("paths") if isinstance(data, dict) else data
        if not isinstance(paths, list):
            raise TreeError(f"tree file {path}: expected a list of paths or {{'paths': [...]}}")
        return cls.from_paths(paths, name=path.stem)

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of tokens verified per step (root included)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        return max((max(p) for p in self.paths), default=0)

    def prefix(self, size: int) -> Tree:
        """The first `size` nodes (root included) of this tree; still a valid tree by growth order."""
        if size < 1:
            raise TreeError(f"tree size must be >= 1 (got {size})")
        return Tree(self.paths[: size - 1], name=f"{self.name}[:{size}]" if size < self.size else self.name)

    def check_fits(self, num_heads: int | None, top_k: int | None = None) -> None:
        """TreeError unless the tree suits `num_heads` heads; None: a model without heads, whose only drafter,
        context lookup, fills one chain (any depth)."""
        if num_heads is None:
            if any(any(p) for p in self.paths):
                raise TreeError(
                    f"tree {self.name!r} branches, but this model has no Medusa heads: context lookup drafts "
                    "one chain of guesses; use --tree chain-N"
                )
            return
        if self.depth > num_heads:
            raise TreeError(
                f"tree {self.name!r} is {self.depth} deep but the model has only {num_heads} Medusa heads; "
                f"use --tree-size to take a smaller part of it or a tree with depth <= {num_heads}"
            )
        if top_k is not None and self.max_rank >= top_k:
            raise TreeError(f"tree {self.name!r} uses rank {self.max_rank} but top-k is only {top_k}")

    # ---- derived structure (host side) --------------------------------------------------------------------
    @cached_property
    def parents(self) -> list[int]:
        index = {(): 0} | {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index[p[:-1]] for p in self.paths]

    @cached_property
    def depths(self) -> list[int]:
        return [0] + [len(p) for p in self.paths]

    @cached_property
    def ranks(self) -> list[int]:
        """Each node's rank in its head's top-k (root: 0)."""
        return [0] + [p[-1] for p in self.paths]

    @cached_property
    def children(self) -> list[list[int]]:
        """Each node's children, in tree order."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for node, parent in enumerate(self.parents[1:], start=1):
            out[parent].append(node)
        return out

    @cached_property
    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(self.size) if i not in has_child]

    def path_nodes(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def buffers(
        self, device: torch.device | str, dtype: torch.dtype, top_k: int | None = None
    ) -> TreeBuffers:
        return TreeBuffers.build(self, torch.device(device), dtype, top_k or self.max_rank + 1)


@dataclass
class TreeLevel:
    """One depth of a tree, for drafters that fill it depth by depth (Hydra heads): the nodes at depth d + 1
    are the children of some nodes at depth d. Rows refer to the nodes at a depth in tree order."""

    internal_rows: torch.Tensor  # [I] rows (among depth-d nodes) that have children: they get logits
    child_nodes: torch.Tensor  # [C] node indices at depth d + 1, in tree order (= the rows of depth d + 1)
    child_slot: torch.Tensor  # [C] each child's parent, as a position in internal_rows
    child_parent_row: torch.Tensor  # [C] each child's parent, as a row among the depth-d nodes
    child_rank: torch.Tensor  # [C] each child's rank in its parent's top-k
    top_k: int


def tree_levels(tree: Tree, device: torch.device) -> list[TreeLevel]:
    at_depth: list[list[int]] = [[] for _ in range(tree.depth + 1)]
    for node, d in enumerate(tree.depths):
        at_depth[d].append(node)
    levels = []
    for d in range(tree.depth):
        row = {node: i for i, node in enumerate(at_depth[d])}
        children = at_depth[d + 1]
        internal = sorted({tree.parents[c] for c in children}, key=row.__getitem__)
        slot = {node: i for i, node in enumerate(internal)}

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        levels.append(
            TreeLevel(
                internal_rows=t([row[p] for p in internal]),
                child_nodes=t(children),
                child_slot=t([slot[tree.parents[c]] for c in children]),
                child_parent_row=t([row[tree.parents[c]] for c in children]),
                child_rank=t([tree.ranks[c] for c in children]),
                top_k=max(tree.ranks[c] for c in children) + 1,
            )
        )
    return levels


@dataclass
class TreeBuffers:
    """Device tensors for one tree, built once and reused every step."""

    tree: Tree
    top_k: int
    attn_bias: (
        torch.Tensor
    )  # [N, N] additive: 0 where a node may attend (itself + ancestors), dtype-min elsewhere
    depth: torch.Tensor  # [N] long: position offset of each node
    candidate_index: torch.Tensor  # [N] long: index into flat [root, head0 top-k, head1 top-k, ...]
    leaf_paths: torch.Tensor  # [num_leaves, depth + 1] long, node indices root..leaf, padded with N
    internal: torch.Tensor  # [I] long: nodes with children (only their logits are needed to verify)
    parent_slot: torch.Tensor  # [N] long: position of each node's parent in `internal` (root: 0, unused)
    levels: list[TreeLevel]  # depth by depth, for drafters that need the parent's token (Hydra)
    chain: list[int]  # the main chain: the rank-0 child of the root, its rank-0 child, ... (host side)
    chain_index: torch.Tensor  # [len(chain)] long: the same nodes on the device

    @classmethod
    def build(cls, tree: Tree, device: torch.device, dtype: torch.dtype, top_k: int) -> TreeBuffers:
        n = tree.size
        visible = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            visible[i, tree.path_nodes(i)] = True
        attn_bias = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype)
        attn_bias.masked_fill_(visible, 0.0)
        cand = [0] + [1 + (len(p) - 1) * top_k + p[-1] for p in tree.paths]
        rows = [tree.path_nodes(leaf) for leaf in tree.leaves]
        width = tree.depth + 1
        leaf_paths = torch.full((len(rows), width), n, dtype=torch.long)
        for r, nodes in enumerate(rows):
            leaf_paths[r, : len(nodes)] = torch.tensor(nodes)
        internal = sorted(set(tree.parents[1:]))
        slot = {node: i for i, node in enumerate(internal)}
        parent_slot = [0] + [slot[p] for p in tree.parents[1:]]
        index = {p: i + 1 for i, p in enumerate(tree.paths)}
        chain: list[int] = []
        while (0,) * (len(chain) + 1) in index:
            chain.append(index[(0,) * (len(chain) + 1)])
        return cls(
            tree=tree,
            top_k=top_k,
            attn_bias=attn_bias.to(device),
            depth=torch.tensor(tree.depths, dtype=torch.long, device=device),
            candidate_index=torch.tensor(cand, dtype=torch.long, device=device),
            leaf_paths=leaf_paths.to(device),
            internal=torch.tensor(internal, dtype=torch.long, device=device),
            parent_slot=torch.tensor(parent_slot, dtype=torch.long, device=device),
            levels=tree_levels(tree, device),
            chain=chain,
            chain_index=torch.tensor(chain, dtype=torch.long, device=device),
        )

"""The trees an engine verifies, and their masks: the engine's tree and its buffers, smaller prefixes of it near
the end of the context window, chains of context-lookup guesses, and trees shaped per step by the draft.

Everything here is built once per tree (or per shape) and reused every step; MedusaEngine holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from medusa_chat.model.tree_plan import TreePlan
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.engine.drafters import HydraDrafter, MedusaDrafter
    from medusa_chat.model.heads import MedusaHeads
    from medusa_chat.model.runner import BackboneRunner

# How `info`, `ask` and `bench` say that the tree's shape follows the draft (MedusaEngine.draft_shaped)
SHAPED_NOTE = ", shaped per step by the draft"
EAGLE_NOTE = ", shaped per step by the EAGLE draft (EAGLE-2 dynamic tree)"
EAGLE_NATIVE_NOTE = ", shaped per step by the EAGLE draft (drafted in C)"


class StepTrees:
    """The tree part of MedusaEngine (its base class): which tree, prefix, chain or shape a step verifies."""

    device: torch.device
    dtype: torch.dtype
    heads: MedusaHeads | None
    runner: BackboneRunner
    _drafter: HydraDrafter | MedusaDrafter | None

    def set_tree(self, tree: Tree) -> None:
        if tree.size > 1:
            tree.check_fits(self.heads.num_heads if self.heads is not None else None)
        self.tree = tree
        self.buffers: TreeBuffers = tree.buffers(self.device, self.dtype)
        # the prefix this tree's calibration found best while the native step runs on one thread (None: the same)
        one = getattr(self.model, "single_thread_trees", {}).get(tree.size)
        self._one_thread_size: int | None = one if one is not None and one < tree.size else None
        self.drafter = self._drafter if tree.size > 1 else None
        # On a CPU the lean forward attends exactly per node (TreePlan: bitwise the plain loop). On a GPU the
        # per-node key rows would copy the KV cache once per node (64 x a 7B cache), so there the whole tree
        # block goes through one masked SDPA call: fast, and equal to plain decoding up to rounding near-ties.
        self._exact = self.runner.lean is not None and self.device.type == "cpu"
        self.plan = TreePlan.build(tree.parents, tree.depths, self.device) if self._exact else None
        # Smaller prefixes of the tree, used only near the end of the context window (`tree_for_room`); each
        # size is built once per tree, not per step.
        self._prefixes: dict[int, tuple[Tree, TreeBuffers, TreePlan | None]] = {
            tree.size: (tree, self.buffers, self.plan)
        }
        # Trees shaped per step by the draft's confidence (confident_paths), with this tree's node count and
        # depth: where the C drafter gives the spine's probabilities and the step attends exactly (a CPU). Each
        # shape's buffers are built once, on first use (a 3-node budget has two shapes, a 5-node one nine).
        native = getattr(self.drafter, "native_draft", None) is not None
        # (a big published tree is wider than the spine's alternatives can make it, and stays as it is)
        k = min(tree.size - 1, 8)
        shapes = native and self._exact and 2 < tree.size <= tree.depth * k + 1
        self._shape_spine = (tree.depth, k) if shapes else None
        self._shapes: dict[tuple[int, ...], tuple[Tree, TreeBuffers, TreePlan | None]] = {}  # by node codes
        self._chains: dict[int, tuple[Tree, TreeBuffers, TreePlan | None]] = {}  # lookup runs, by length
        n = tree.size
        # Mask rows for the tree, as wide as the cache may get: prefix columns 0, tree block in place.
        self._mask = torch.full((1, 1, n, 0), 0.0, dtype=self.dtype, device=self.device)
        self._mask_prefix = 0  # columns [0, _mask_prefix) are known to be zero (visible prefix)

    def tree_for_room(self, room: int) -> tuple[Tree, TreeBuffers, TreePlan | None]:
        """The tree to verify when only `room` positions are left in the context window: the whole tree, or its
        first `room` nodes (a node at depth d sits at position start + d, and d < room for the first `room`
        nodes, so no position reaches the window's end). The prefix keeps the full tree's top-k, because the
        heads' guesses were laid out for it (`candidate_index`)."""
        size = max(1, min(self.tree.size, room))
        state = self._prefixes.get(size)
        if state is None:
            tree = self.tree.prefix(size)
            buf = tree.buffers(self.device, self.dtype, self.buffers.top_k)
            plan = TreePlan.build(tree.parents, tree.depths, self.device) if self._exact else None
            state = self._prefixes[size] = (tree, buf, plan)
        return state

    @property
    def draft_shaped(self) -> bool:
        """Does each step's tree take its shape from the draft's confidence (`confident_paths`)? Where the C
        drafter runs (a CPU with the block kernel), with Hydra or block-quantized Medusa heads and a tree of 3 nodes
        or more."""
        return self._shape_spine is not None and self.shaped

    @property
    def tree_note(self) -> str:
        """What `info`, `ask` and `bench` add to the tree's source: SHAPED_NOTE for draft-shaped trees, else ""."""
        eagle = getattr(self, "_eagle", None)
        if eagle is not None:  # an EAGLE draft: EAGLE-2's dynamic tree, or the static tree (eagle_drafter.py)
            if self.draft_shaped:  # the C drafter's trees, on the draft's top-1 spine (native_eagle.py)
                return EAGLE_NATIVE_NOTE
            return EAGLE_NOTE if eagle.dynamic and self.shaped else ", drafted by the EAGLE draft"
        return SHAPED_NOTE if self.draft_shaped else ""

    def _lookup_chain(self, length: int) -> tuple[Tree, TreeBuffers, TreePlan | None]:
        """A chain of `length` nodes below the root, for a run of context-lookup guesses (built once per length)."""
        state = self._chains.get(length)
        if state is None:
            state = self._chains[length] = self._exact_step_state(Tree.chain(length))
        return state

    def _exact_step_state(self, tree: Tree) -> tuple[Tree, TreeBuffers, TreePlan]:
        """Buffers and plan of a per-step tree on the exact CPU step (lookup chains, draft-shaped trees)."""
        return (
            tree,
            tree.buffers(self.device, self.dtype),
            TreePlan.build(tree.parents, tree.depths, self.device),
        )

    def _confident_tree(
        self, root: torch.Tensor, hidden: torch.Tensor, size: int
    ) -> tuple[Tree, TreeBuffers, TreePlan | None, torch.Tensor]:
        """This step's tree of `size` nodes shaped by the draft's confidence (confident_paths, in C) and its
        tokens [N]."""
        assert self._shape_spine is not None and self.drafter is not None and self.drafter.native is not None
        depth, k = self._shape_spine
        codes, tokens = self.drafter.native.draft_shaped(root, hidden, depth, k, size)
        state = self._shapes.get(codes)
        if state is None:
            paths = [(0,) * (c // k) + (c % k,) for c in codes]
            tree = Tree.from_paths(paths, name=f"{self.tree.name} (draft-shaped)")
            state = self._shapes[codes] = self._exact_step_state(tree)
        return (*state, tokens)

    def _tree_mask(self, start: int, buf: TreeBuffers | None = None) -> torch.Tensor:
        """Additive mask [1, 1, n, start + n] for the tree of `buf` (default: the engine's tree, n = its size, or
        a prefix of it): every node sees the whole prefix, then its tree ancestors.

        The buffer is reused across steps: only the columns that became prefix since the last step are
        zeroed and the n x n tree block is copied in, so the cost does not grow with the conversation.
        """
        buf = buf or self.buffers
        n = buf.tree.size
        width = start + n
        if self._mask.shape[-1] < width:
            grown = torch.full(
                (1, 1, self.tree.size, max(width, 2 * self._mask.shape[-1], 256)),
                0.0,
                dtype=self.dtype,
                device=self.device,
            )
            self._mask = grown
            self._mask_prefix = 0
        if start > self._mask_prefix:
            self._mask[..., self._mask_prefix : start] = 0.0
        # a prefix's rows and columns are the first n of the full tree's (growth order), so one buffer serves all
        self._mask[0, 0, :n, start:width] = buf.attn_bias
        self._mask_prefix = start
        return self._mask[..., :n, :width]

    def causal_mask(self, start: int, count: int) -> torch.Tensor:
        """Additive mask [1, 1, count, start + count]: `count` new tokens see the cache's first `start` entries
        and each other causally (a prefill, or plain decoding one token at a time)."""
        q = torch.arange(count, device=self.device)[:, None]
        k = torch.arange(count, device=self.device)[None, :]
        block = torch.zeros(count, start + count, dtype=self.dtype, device=self.device)
        block[:, start:].masked_fill_(k > q, torch.finfo(self.dtype).min)
        return block[None, None]

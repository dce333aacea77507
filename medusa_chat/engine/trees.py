"""The trees an engine verifies, and their masks: the engine's tree and its buffers, smaller prefixes of it near
the end of the context window, chains of context-lookup guesses, and trees shaped per step by the draft.

Everything here is built once per tree (or per shape) and reused every step; MedusaEngine holds a TreeBuilder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from medusa_chat.engine.tree_sizer import TreeSizer
from medusa_chat.model.forward.tree_plan import TreePlan
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.engine.drafters import Drafter
    from medusa_chat.engine.lookup import ContextLookup
    from medusa_chat.model.forward.heads import MedusaHeads
    from medusa_chat.model.forward.runner import BackboneRunner
    from medusa_chat.model.sources.loaded import LoadedModel

# How `info`, `ask` and `bench` say that the tree's shape follows the draft (MedusaEngine.draft_shaped)
SHAPED_NOTE = ", shaped per step by the draft"
EAGLE_NOTE = ", shaped per step by the EAGLE draft (EAGLE-2 dynamic tree)"
EAGLE_NATIVE_NOTE = ", shaped per step by the EAGLE draft (drafted in C)"


@dataclass
class StepTree:
    """What one step verifies: a tree (the engine's, a prefix of it, a lookup chain, a shape the draft chose), its
    buffers and exact-attention plan, the context lookup's guesses for its main chain, and its tokens where they
    are known before the step (a lookup run, a draft-shaped tree; None: the step's drafter proposes them)."""

    tree: Tree
    buf: TreeBuffers
    plan: TreePlan | None
    guess: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None

    def with_tokens(self, tokens: torch.Tensor | None, guess: list[int] | None = None) -> StepTree:
        return replace(self, tokens=tokens, guess=self.guess if guess is None else guess)


class TreeBuilder:
    """Which tree, prefix, chain or shape a step verifies, and the masks its forward attends with; MedusaEngine
    holds one (`engine.trees`) and asks it for each step's tree."""

    def __init__(
        self,
        model: LoadedModel,
        runner: BackboneRunner,
        dtype: torch.dtype,
        drafter: Drafter,
        root_only: Drafter,
        shaped: bool = True,
        adaptive: bool = True,
    ) -> None:
        self.model = model
        self.device = model.device
        self.dtype = dtype
        self.heads: MedusaHeads | None = model.heads
        self.runner = runner
        self.shaped = shaped
        self.adaptive = adaptive  # False: every step verifies the whole tree, even a calibrated one (tree_sizer.py)
        self._drafter = drafter  # the model's drafter
        self._root_only = root_only  # a root-only tree's, which drafts nothing (drafters.ROOT_ONLY)

    def set_tree(self, tree: Tree) -> None:
        if tree.size > 1:
            tree.check_fits(self.heads.num_heads if self.heads is not None else None)
        self.tree = tree
        self.buffers: TreeBuffers = tree.buffers(self.device, self.dtype)
        # the prefix this tree's calibration found best while the native step runs on one thread (None: the same)
        one = getattr(self.model, "single_thread_trees", {}).get(tree.size)
        self.one_thread_size: int | None = one if one is not None and one < tree.size else None
        # On a CPU the lean forward attends exactly per node (TreePlan: bitwise the plain loop). On a GPU the
        # per-node key rows would copy the KV cache once per node (64 x a 7B cache), so there the whole tree
        # block goes through one masked SDPA call: fast, and equal to plain decoding up to rounding near-ties.
        self.exact = self.runner.lean is not None and self.device.type == "cpu"
        # the prefix size each step verifies, measured as replies run (tree_sizer.py), where this tree came from a
        # CPU calibration that timed its prefixes (None: every step verifies the whole tree)
        choices = tree.sizes if self.adaptive else None
        self.sizer: TreeSizer | None = None
        self.sized: int | None = None  # the size the sizer gave the step being run
        if choices is not None and self.exact and tree.size > 1:
            self.sizer = TreeSizer(choices)
        # this tree's drafter: the model's, or for a root-only tree (the plain loop) none (drafters.ROOT_ONLY)
        self.drafter: Drafter = self._drafter if tree.size > 1 else self._root_only
        self.plan = TreePlan.build(tree.parents, tree.depths, self.device) if self.exact else None
        # Smaller prefixes of the tree, used only near the end of the context window (`tree_for_room`); each
        # size is built once per tree, not per step.
        self._prefixes: dict[int, StepTree] = {tree.size: StepTree(tree, self.buffers, self.plan)}
        # Trees shaped per step by the draft's confidence (confident_paths), with this tree's node count and
        # depth: where the C drafter gives the spine's probabilities and the step attends exactly (a CPU). Each
        # shape's buffers are built once, on first use (a 3-node budget has two shapes, a 5-node one nine).
        # (a big published tree is wider than the spine's alternatives can make it, and stays as it is)
        k = min(tree.size - 1, 8)
        shapes = self.drafter.shapes_trees and self.exact and 2 < tree.size <= tree.depth * k + 1
        self._shape_spine = (tree.depth, k) if shapes else None
        self._shapes: dict[tuple[int, ...], StepTree] = {}  # by node codes
        self._chains: dict[int, StepTree] = {}  # lookup runs, by length
        n = tree.size
        # Mask rows for the tree, as wide as the cache may get: prefix columns 0, tree block in place.
        self._mask = torch.full((1, 1, n, 0), 0.0, dtype=self.dtype, device=self.device)
        self._mask_prefix = 0  # columns [0, _mask_prefix) are known to be zero (visible prefix)

    def tree_for_room(self, room: int) -> StepTree:
        """The tree to verify when only `room` positions are left in the context window: the whole tree, or its
        first `room` nodes (a node at depth d sits at position start + d, and d < room for the first `room`
        nodes, so no position reaches the window's end). The prefix keeps the full tree's top-k, because the
        heads' guesses were laid out for it (`candidate_index`)."""
        size = max(1, min(self.tree.size, room))
        state = self._prefixes.get(size)
        if state is None:
            tree = self.tree.prefix(size)
            buf = tree.buffers(self.device, self.dtype, self.buffers.top_k)
            plan = TreePlan.build(tree.parents, tree.depths, self.device) if self.exact else None
            state = self._prefixes[size] = StepTree(tree, buf, plan)
        return state

    @property
    def draft_shaped(self) -> bool:
        """Does each step's tree take its shape from the draft's confidence (`confident_paths`)? Where the C
        drafter runs (a CPU with the block kernel), with Hydra or block-quantized Medusa heads and a tree of 3 nodes
        or more."""
        return self._shape_spine is not None and self.shaped

    @property
    def tree_note(self) -> str:
        """What `info`, `ask` and `bench` add to the tree's source: SHAPED_NOTE for draft-shaped trees, an EAGLE
        draft's own notes (eagle_drafter.py), else ""."""
        return self._drafter.tree_note(self.draft_shaped, self.dynamic_trees)

    @property
    def dynamic_trees(self) -> bool:
        """Does the drafter draft a tree of its own each step (EAGLE-2's dynamic tree, eagle_drafter.py)?"""
        return self.shaped and self._drafter.dynamic(self.tree)

    def step_state(self, tree: Tree) -> StepTree:
        """Buffers and plan of a per-step tree (lookup chains, draft-shaped trees), built once per tree by the
        callers: the exact per-node plan on the exact CPU step."""
        plan = TreePlan.build(tree.parents, tree.depths, self.device) if self.exact else None
        return StepTree(tree, tree.buffers(self.device, self.dtype), plan)

    def lookup_chain(self, length: int) -> StepTree:
        """A chain of `length` nodes below the root, for a run of context-lookup guesses (built once per length)."""
        state = self._chains.get(length)
        if state is None:
            state = self._chains[length] = self.step_state(Tree.chain(length))
        return state

    def confident_tree(self, root: torch.Tensor, draft: torch.Tensor | None, size: int) -> StepTree:
        """This step's tree of `size` nodes shaped by the draft's confidence (confident_paths, in C), its tokens
        set."""
        assert self._shape_spine is not None
        depth, k = self._shape_spine
        codes, tokens = self.drafter.draft_shaped(root, draft, depth, k, size)
        state = self._shapes.get(codes)
        if state is None:
            paths = [(0,) * (c // k) + (c % k,) for c in codes]
            state = self._shapes[codes] = self.step_state(Tree.from_paths(paths, name=f"{self.tree.name} (draft-shaped)"))
        return state.with_tokens(tokens)

    def for_step(
        self,
        root: torch.Tensor,
        guesses: torch.Tensor | None,
        room: int,
        lookup: ContextLookup | None,
        runs: int,
        one_thread: bool,
    ) -> StepTree:
        """This step's tree, buffers and plan, the lookup's guesses for its main chain, and its tokens where
        they are known already (a lookup run, a draft-shaped or dynamic tree; else None: the step proposes them).
        `room`: positions left in the context window; `runs`: the longest lookup run a step may verify instead
        (lookup.LOOKUP_RUN, 0 for none); `one_thread`: the native step runs on one thread now (threads.py)."""
        # On one thread (the governor's answer to a busy machine) a tree row costs more of a step: the calibrated
        # one-thread size, a prefix of the tree (first_start.py via tree_choice, `single_thread_trees`)
        size = self.tree.size
        self.sized = None  # the size the sizer chose for this step (None: not the sizer's step to time)
        if self.one_thread_size and one_thread:
            size = self.one_thread_size
        elif self.sizer is not None:  # the prefix with the most tokens per second as measured now (tree_sizer.py)
            size = self.sized = self.sizer.size()
        # near the end of the context window a prefix of the tree still fits: the reply runs to the end
        at = self.tree_for_room(min(room, size))
        full = at.tree.size == size  # (not cut by the window's end)
        if lookup is not None and at.buf.chain:
            whole = full and runs > len(at.buf.chain)
            guess = lookup.continuation(runs if whole else len(at.buf.chain))
            if whole and lookup.matched == lookup.max_match and len(at.buf.chain) < len(guess) < room:
                # a long match: the text is being copied, so the step verifies the lookup's whole run (a
                # chain of its tokens, nothing drafted) instead of the tree's few chain nodes
                tokens = torch.cat([root, torch.tensor(guess, dtype=root.dtype, device=root.device)])
                at = self.lookup_chain(len(guess)).with_tokens(tokens)
            at = at.with_tokens(at.tokens, guess[: len(at.buf.chain)])
        if not self.drafter.fills_tree and len(at.guess) + 1 < at.buf.tree.size:
            # no heads (lookup_only.py): the step verifies the nodes the lookup filled, the root alone without a
            # guess (a plain step), never nodes nobody drafted
            at = self.tree_for_room(len(at.guess) + 1).with_tokens(None, at.guess)
        if self.draft_shaped and not at.guess and full and size > 2:
            at = self.confident_tree(root, guesses, size)
        elif not at.guess and at.tree is self.tree and self.dynamic_trees:
            at = self.drafter.dynamic_tree(root, self.tree, self.step_state)  # EAGLE-2's dynamic tree
        return at

    def mask(self, start: int, buf: TreeBuffers | None = None) -> torch.Tensor:
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

    def forget_masks(self) -> None:
        """A fresh (empty) cache: no prefix column of the mask buffer is known to be zero any more."""
        self._mask_prefix, self._mask = 0, self._mask[..., :0]

    def causal_mask(self, start: int, count: int) -> torch.Tensor:
        """Additive mask [1, 1, count, start + count]: `count` new tokens see the cache's first `start` entries
        and each other causally (a prefill, or plain decoding one token at a time)."""
        q = torch.arange(count, device=self.device)[:, None]
        k = torch.arange(count, device=self.device)[None, :]
        block = torch.zeros(count, start + count, dtype=self.dtype, device=self.device)
        block[:, start:].masked_fill_(k > q, torch.finfo(self.dtype).min)
        return block[None, None]

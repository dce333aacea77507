"""Drafters: where a step's tree tokens come from. One interface (`Drafter`), one implementation per kind:

    MedusaGuesses   Medusa heads' guesses from the step's own lm_head call (the bonus row's), laid out by the tree
    MedusaDrafter   Medusa-1 / Medusa-2 heads on the CPU block kernel, after the root is known, only the heads the
                    tree reaches (in C where the kernel runs)
    HydraDrafter    Hydra heads, depth by depth from the root
    EagleDrafter    an EAGLE-1/2/3 draft with its own KV cache, fed the backbone's features (eagle_drafter.py)
    LookupDrafter   context lookup alone (a model without heads), and every root-only tree: nothing of its own;
                    the engine puts the lookup's guesses (lookup.py) on the tree's main chain, as it does for
                    every drafter

`make_drafter` picks the implementation for a model; the engine calls it without asking which it has. Trees
shaped per step by a draft's confidence: `confident_paths`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from medusa_chat.engine.eagle_drafter import EagleDrafter
from medusa_chat.engine.trees import SHAPED_NOTE, StepTree
from medusa_chat.errors import HeadsError
from medusa_chat.kernels.cpu_linears import block_q4_rows, block_quantized_copy, linear_rows
from medusa_chat.model.forward.block_heads import drafter_name
from medusa_chat.model.forward.eagle import EagleDraft
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.model.forward.runner import BackboneRunner

LmHead = Callable[[torch.Tensor], torch.Tensor]


class Drafter(Protocol):
    """What the engine asks of a drafter. A step's "draft" is whatever the drafter kept from the last accepted
    node for the next step's `propose`: the heads' guesses (MedusaGuesses), that node's hidden state (the
    drafters that draft after the root is known), or None."""

    name: str  # what `info`, `ask` and `bench` call it ("medusa-1", "hydra", "eagle3", "none", ...)
    # it reads every backbone forward's features and keeps state of its own (`saw`, `record`, `commit`): no CUDA
    # graphs, no cache copied from another engine
    reads_features: bool
    needs_logits: bool  # its next draft comes out of the lm_head call with the bonus row (`logits_and_draft`)
    fills_tree: bool  # False: it drafts nothing, so a step verifies only the context lookup's guesses
    shapes_trees: bool  # it can draft a tree shaped by its confidence (`draft_shaped`)

    def logits_and_draft(
        self, lm_head: LmHead, hidden: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """From the last accepted node's hidden state [1, H]: the next-token logits [V] (fp32) and the draft."""
        ...

    def draft_from(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The draft from the last accepted node's hidden state [1, H], for drafters with `needs_logits` False."""
        ...

    def propose(self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
        """The tree's tokens [N], root [1] first."""
        ...

    def draft_shaped(
        self, root: torch.Tensor, draft: torch.Tensor | None, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """A tree of `size` nodes on the top-1 spine of depth x top-k (`confident_paths`): (codes d * k + r, tokens)."""
        ...

    def dynamic(self, tree: Tree) -> bool:
        """Does it draft a tree of its own per step (`dynamic_tree`) in place of `tree`?"""
        ...

    def dynamic_tree(
        self, root: torch.Tensor, tree: Tree, step_state: Callable[[Tree], StepTree]
    ) -> StepTree:
        """This step's tree with `tree`'s node count and depth, its tokens set (`step_state`: a tree's buffers)."""
        ...

    def saw(self, hidden: torch.Tensor) -> None:
        """After every backbone forward: its last hidden states [T, H]."""
        ...

    def record(self, start: int, ids: torch.Tensor) -> None:
        """After a prefill: positions start .. start + len(ids) - 1 hold `ids` [T], their features the forward's."""
        ...

    def commit(self, start: int, nodes: list[int], tokens: list[int]) -> None:
        """After a step: its accepted `nodes` (rows of its forward, root first) now sit at positions start ..,
        `tokens` the step's tree tokens by node."""
        ...

    def tree_note(self, draft_shaped: bool, dynamic: bool) -> str:
        """What `info`, `ask` and `bench` add to the tree's source."""
        ...


class DrafterBase:
    """The defaults of the interface: a drafter whose next draft is the last accepted node's hidden state, that
    reads no features and shapes no trees."""

    name = "none"
    reads_features = False
    needs_logits = False
    fills_tree = True
    shapes_trees = False

    def logits_and_draft(
        self, lm_head: LmHead, hidden: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return lm_head(hidden)[0].float(), self.draft_from(hidden)

    def draft_from(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return hidden

    def propose(self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
        raise NotImplementedError

    def draft_shaped(
        self, root: torch.Tensor, draft: torch.Tensor | None, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        raise ValueError(f"the {self.name} drafter shapes no trees")

    def dynamic(self, tree: Tree) -> bool:
        return False

    def dynamic_tree(
        self, root: torch.Tensor, tree: Tree, step_state: Callable[[Tree], StepTree]
    ) -> StepTree:
        raise ValueError(f"the {self.name} drafter drafts no dynamic trees")

    def saw(self, hidden: torch.Tensor) -> None:
        pass

    def record(self, start: int, ids: torch.Tensor) -> None:
        pass

    def commit(self, start: int, nodes: list[int], tokens: list[int]) -> None:
        pass

    def tree_note(self, draft_shaped: bool, dynamic: bool) -> str:
        return SHAPED_NOTE if draft_shaped else ""


def laid_out(root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
    """The tree's tokens [N] from the heads' flat top-k guesses (head-major), laid out by the tree."""
    if draft is None and buf.tree.size > 1:
        # No heads (lookup_only.py) and no lookup guess: only a timed trial step (calibration) gets here, as
        # replies verify just the nodes the lookup filled; any tokens time the same, the root's are at hand.
        return root.expand(buf.tree.size).clone()
    flat = torch.cat([root, draft]) if draft is not None else root
    return flat[buf.candidate_index]


class LookupDrafter(DrafterBase):
    """Context lookup alone: a model without heads (model/sources/lookup_only.py), and any root-only tree. It drafts no
    node: the engine puts the lookup's guesses on the tree's chain, and a step verifies only those."""

    fills_tree = False

    def __init__(self, name: str = "none") -> None:
        self.name = name

    def draft_from(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def propose(self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
        return laid_out(root, None, buf)


ROOT_ONLY = LookupDrafter()  # the drafter of a root-only tree (the plain loop): no draft


class MedusaGuesses(DrafterBase):
    """Medusa heads (float, any device) guessing from the hidden state of the last accepted node, in the same
    lm_head call as the bonus row where the heads share the lm_head (v2); the tree lays the guesses out."""

    needs_logits = True

    def __init__(self, heads: MedusaHeads, name: str) -> None:
        self.heads, self.name = heads, name

    def logits_and_draft(
        self, lm_head: LmHead, hidden: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return next_logits_and_guesses(lm_head, self.heads, hidden, top_k)

    def draft_from(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None  # (the guesses need the lm_head: `logits_and_draft`)

    def propose(self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
        return laid_out(root, draft, buf)


def next_logits_and_guesses(
    lm_head: LmHead,
    heads: MedusaHeads | None,
    hidden: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the hidden state [1, H] of the last accepted node: the backbone's next-token logits [V] (fp32) and
    the heads' top-k guesses [K * top_k] (head-major), or None without heads (a root-only tree).

    With shared-lm_head (v2) heads both come from ONE lm_head call over 1 + K rows: on a memory-bound
    device the vocab projection costs a full read of its weight however few rows it has.
    """
    if heads is None or isinstance(heads, (HydraHeads, EagleDraft)):  # they draft after the root is known
        return lm_head(hidden)[0].float(), None
    if heads.own_lm_head:
        logits = lm_head(hidden)[0].float()
        head_logits = heads(hidden[0], lm_head)
    else:
        rows = torch.cat([hidden, heads.features(hidden[0]).to(hidden.dtype)])
        both = lm_head(rows)
        logits, head_logits = both[0].float(), both[1:]
    return logits, head_logits.topk(top_k, dim=-1).indices.flatten()


class NativeDrafter(DrafterBase):
    """A drafter with a C twin on the block kernel where it runs: the whole draft in one C call (`native_draft`),
    and trees shaped by the draft's confidence (`native.draft_shaped`)."""

    native: Any = None  # NativeHydra / the Medusa heads' C drafter (model/forward/native_hydra.py, block_heads.py)
    native_draft: Any = None  # the same drafting loop as `propose`, all depths in one C call

    @property
    def shapes_trees(self) -> bool:  # type: ignore[override]
        return self.native_draft is not None

    def draft_shaped(
        self, root: torch.Tensor, draft: torch.Tensor | None, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        assert self.native is not None and draft is not None
        return self.native.draft_shaped(root, draft, depth, k, size)


class HydraDrafter(NativeDrafter):
    """Fills a tree depth by depth with Hydra heads (heads.py): a node's children are the top-k of head d on
    the state that folded in every token on the node's path, starting from the root (the bonus token).

    Per step: one cell + ResBlocks + draft-vocabulary projection + top-k per depth, on the nodes of that depth
    that have children; the index buffers come from the tree (`TreeBuffers.levels`, built once per tree), the
    projection is built once per model, everything stays on the device.
    The projection is the lm_head's draft-vocabulary rows, in the backbone's dtype (packed for oneDNN like
    the lm_head where the lean forward packs), so a depth reads ~1/6 of the full lm_head.
    """

    name = "hydra"

    def __init__(self, heads: HydraHeads, backbone: torch.nn.Module) -> None:
        self.heads = heads
        self.embed = backbone.get_input_embeddings()
        lm_head = backbone.get_output_embeddings()
        weight = getattr(lm_head, "weight", None)
        if weight is not None and not weight.is_floating_point():
            raise HeadsError(
                "Hydra heads need a floating-point lm_head; this backbone's is quantized by bitsandbytes: load "
                "it with --quant none, or use v1/v2 Medusa heads"
            )
        device = backbone.get_input_embeddings().weight.device
        vocab = heads.draft_vocab.to(device)
        # the lm_head's draft-vocabulary rows, in the lm_head's own kind (dense, packed, int8) and dtype
        self.project = linear_rows(lm_head, vocab)
        self.proj_dtype = backbone.get_input_embeddings().weight.dtype
        self.draft_vocab = vocab
        self.dtype = next(heads.parameters()).dtype
        from medusa_chat.kernels.block_linears import BlockLinear

        if isinstance(lm_head, BlockLinear) and self.dtype == torch.float32:
            # the backbone runs on the block kernel (int8/int4 on a CPU): so do the heads' linears (8 bits), and
            # the draft-vocabulary projection in 4 bits (Q4_1 of the lm_head's rows): it is read once per tree
            # depth, from DRAM after the backbone's weights went through the caches (5 MB in Q8_0, 2.9 in Q4_1)
            self.heads = block_quantized_copy(heads)
            self.project = block_q4_rows(self.project)
            from medusa_chat.model.forward.native_hydra import native_hydra_for

            self.native = native_hydra_for(self.heads)
            if self.native is not None and self.native.bind_draft(self.project, vocab, self.embed):
                self.native_draft = self.native.draft

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, buf: TreeBuffers) -> torch.Tensor:
        """root [1] (token id), hidden [1, H] (last accepted node) -> the tree's tokens [N], root first."""
        if self.native_draft is not None:
            return self.native_draft(root, hidden, buf)
        tokens = root.new_zeros(buf.tree.size)
        tokens[:1] = root
        cell = self.native.cell if self.native is not None else self.heads.draft
        features = self.native.head_features if self.native is not None else self.heads.head_features
        state = cell(hidden.to(self.dtype), self.embed(root))  # depth 0: the root only
        for d, level in enumerate(buf.levels):
            x = features(d, state.index_select(0, level.internal_rows))
            top = self.project(x.to(self.proj_dtype)).topk(level.top_k, dim=-1).indices
            child = self.draft_vocab[top[level.child_slot, level.child_rank]]
            tokens.index_copy_(0, level.child_nodes, child)
            if d + 1 < len(buf.levels):
                state = cell(state.index_select(0, level.child_parent_row), self.embed(child))
        return tokens


class MedusaDrafter(NativeDrafter):
    """Medusa-1 / Medusa-2 heads on the block kernel (model/forward/block_heads.py) drafting a step's tree after the root
    is known, like HydraDrafter, from the last accepted node's hidden state: only the heads the tree reaches (depth
    d needs heads 0 .. d - 1), only their top-k, in one C call where the kernel runs (`native_draft`), and for
    trees shaped by the draft (`native.draft_shaped`) with the heads' probabilities.

    Why not the heads' guesses from the step's own lm_head call (`next_logits_and_guesses`): Medusa-1 heads have
    their own full-vocabulary projections, so every head costs a projection read however small the tree; here a
    2-node tree reads one head. `draft_vocab`: project onto these token ids only (rows of each projection), as
    Hydra's draft vocabulary does; None: the whole vocabulary.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        backbone: torch.nn.Module,
        name: str,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        from medusa_chat.model.forward.block_heads import head_projection, native_medusa_for

        self.heads, self.name = heads, name
        lm_head = backbone.get_output_embeddings()
        projections = [head_projection(heads, k, lm_head) for k in range(heads.num_heads)]
        if draft_vocab is not None:
            rows: dict[int, torch.nn.Module] = {}  # one row copy per distinct projection (v2 heads share one)
            projections = [rows.setdefault(id(p), linear_rows(p, draft_vocab)) for p in projections]
        self.projections, self.draft_vocab = projections, draft_vocab
        self.native = native_medusa_for(heads, projections, draft_vocab)
        self.native_draft = self.native.draft if self.native is not None else None

    def top(self, hidden: torch.Tensor, depth: int, k: int) -> torch.Tensor:
        """Heads 0 .. depth - 1 on hidden [1, H]: their top-k token ids [depth * k], head-major (module calls)."""
        out = []
        for d in range(depth):
            x = hidden.float()
            for block in self.heads[d][: self.heads.num_layers]:
                x = block(x)
            top = self.projections[d](x)[0].topk(k).indices
            out.append(top if self.draft_vocab is None else self.draft_vocab[top])
        return torch.cat(out)

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, buf: TreeBuffers) -> torch.Tensor:
        """root [1] (token id), hidden [1, H] (last accepted node) -> the tree's tokens [N], root first."""
        if self.native_draft is not None:
            return self.native_draft(root, hidden, buf)
        tokens = self.top(hidden, buf.tree.depth, buf.top_k)
        return torch.cat([root.view(1), tokens.to(root.dtype)])[buf.candidate_index]


def make_drafter(heads: Any, backbone: torch.nn.Module, runner: BackboneRunner, source: str = "") -> Drafter:
    """The drafter for a model's heads: EagleDrafter for an EAGLE draft, HydraDrafter for Hydra heads,
    MedusaDrafter for block-quantized Medusa heads (the CPU block path), MedusaGuesses for other Medusa heads,
    LookupDrafter without heads."""
    if isinstance(heads, EagleDraft):
        return EagleDrafter(heads, backbone, runner)
    name = drafter_name(heads, source)
    if heads is None:
        return LookupDrafter(name)
    if isinstance(heads, HydraHeads):
        return HydraDrafter(heads, backbone)
    if getattr(heads, "block_kind", ""):
        return MedusaDrafter(heads, backbone, name, heads.draft_vocab_ids)
    return MedusaGuesses(heads, name)


def confident_paths(probs: list[list[float]], size: int) -> tuple[tuple[int, ...], ...]:
    """The tree of `size` nodes (root included) the draft is most confident in: EAGLE-2's dynamic tree (Li et al.
    2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees") on the Hydra draft's spine.

    probs[d][r]: the draft's probability of its rank-r token at depth d below the top-1 spine (the spine is the
    rank-0 tokens). Candidate (d, r) is the path (0,) * d + (r,), with path probability probs[0][0] * ... *
    probs[d - 1][0] * probs[d][r]; the tree is the size - 1 most probable candidates. A candidate is never more
    probable than its parent (a spine node, one depth up: a product of probabilities <= 1) nor than its
    lower-ranked sibling, and ties go to the shallower node, then the lower rank, so the chosen set is always a
    tree. Returned in growth order (depth, then ranks), as Tree wants them.

    Why: a static tree spends its nodes where the heads are right on average; per step the draft knows more. When
    the first guess is unsure, its runner-up beats the guess's own child (which needs the unsure guess right
    too); when it is sure, depth wins. Measured with this project's heads on its 2-core CPU, 3 nodes, all 80
    Vicuna-bench prompts side by side (benchmarks/ab_engines.py): 1.708 -> 1.753 tokens per step, 1.273x ->
    1.305x the plain loop (the draft costs 13 us more a step).
    """
    cands: list[tuple[float, int, int]] = []
    spine = 1.0
    for d, row in enumerate(probs):
        for r, p in enumerate(row):
            cands.append((-(spine * p), d, r))
        spine *= row[0] if row else 0.0
    if len(cands) < size - 1:
        raise ValueError(f"confident_paths: {len(cands)} candidates for a tree of {size} nodes")
    cands.sort()
    return tuple(sorted(((0,) * d + (r,) for _, d, r in cands[: size - 1]), key=lambda p: (len(p), p)))

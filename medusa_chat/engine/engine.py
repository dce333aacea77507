"""The Medusa decoding loop, top to bottom.

    prefill(prompt)                        -> first token (root) + the heads' top-k guesses
    repeat:
        propose   tree tokens = [root, guesses picked by the tree layout]          (gather, on device)
        verify    one backbone forward over all N tree tokens, ancestor-only mask   (the only big compute)
        accept    longest tree path the backbone agrees with (greedy/typical/exact)  (vectorised, on device)
        commit    keep the accepted tokens' KV entries in place, drop the rest      (one index_select)
        bonus     the backbone's own next token after the accepted path = next root (no extra forward)
        guesses   heads on the hidden state of the last accepted node only (same lm_head call as the bonus);
                  Hydra heads instead draft at the next propose, depth by depth from the root (HydraDrafter)
        lookup    where the context's last 2-4 tokens occurred before, what followed them then goes on the
                  tree's main chain instead of the heads' guesses (lookup.py; host side, O(1) per step);
                  after a 4-token match the step verifies a chain of up to LOOKUP_RUN lookup tokens instead
        shape     on a CPU with the C drafter, the tree's N nodes are the N - 1 the draft is most confident
                  in (confident_paths: EAGLE-2's dynamic tree on the Hydra spine), not a fixed layout

One host sync per step (to learn how many tokens were accepted), tree buffers built once per tree, and a
preallocated KV cache whose accepted entries are compacted in place: nothing per step grows with the
conversation.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from medusa_chat.engine.acceptance import (  # re-exported: the rules used to live here
    best_path,
    greedy_node_ok,
    greedy_path,
    greedy_tokens,
    make_acceptor,
    sample,
    typical_node_ok,
)
from medusa_chat.engine.lookup import ContextLookup
from medusa_chat.errors import HeadsError, PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent, TreeView
from medusa_chat.kernels.cpu_linears import block_q4_rows, block_quantized_copy, linear_rows
from medusa_chat.model.graph_step import GraphStep, allocate_cache, graphs_enabled
from medusa_chat.model.heads import HydraHeads, MedusaHeads
from medusa_chat.model.lean_forward import LeanForward
from medusa_chat.model.runner import BackboneRunner
from medusa_chat.model.tree_plan import TreePlan
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.model.loading import LoadedModel


# ------------------------------------------------------------------------------------------------------------
# KV cache: one preallocated buffer for all layers, compacted in place
# ------------------------------------------------------------------------------------------------------------
class _BufferLayer(DynamicLayer):
    """A cache layer that is a view into TreeKVCache's shared buffer (no torch.cat per step)."""

    def __init__(self, owner: TreeKVCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0


class TreeKVCache(Cache):
    """Keys and values of every layer in one tensor `[layers, 2, 1, kv_heads, capacity, head_dim]`.

    Each forward writes its new entries after `length` (all layers see the same `length`; the last layer's
    write advances it). Accepting a tree path is one `index_select` + copy over all layers at once. Capacity
    grows by doubling, so the amortised cost per token is constant.

    Exact tree attention (lean_forward.TreePlan) also keeps per-node key rows `[layers, 2, N - 1, kv_heads,
    capacity, head_dim]`: a copy of the prefix for each non-root node, then the node's path. The prefix part is
    synced incrementally (`rows_synced`): a step copies only what was committed since the previous one.
    """

    def __init__(self, num_layers: int, capacity: int = 1024) -> None:
        super().__init__(layers=[_BufferLayer(self, i) for i in range(num_layers)])
        self.num_layers = num_layers
        self.capacity = capacity
        self.length = 0  # committed entries (visible to the next forward)
        self.buffer: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.rows_synced = 0  # prefix entries already copied into every row

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[-2]
        start, end = self.length, self.length + n
        if self.buffer is None or self.buffer.dtype != k.dtype or self.buffer.device != k.device:
            shape = (self.num_layers, 2, *k.shape[:2], max(self.capacity, end), k.shape[-1])
            self.buffer = k.new_zeros(shape)
            self.rows = None
        elif end > self.buffer.shape[-2]:
            self._grow(end)
        self.buffer[layer, 0, :, :, start:end] = k
        self.buffer[layer, 1, :, :, start:end] = v
        if layer == self.num_layers - 1:
            self.length = end
        return self.buffer[layer, 0, :, :, :end], self.buffer[layer, 1, :, :, :end]

    def reserve(
        self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The whole buffer, allocated or grown so that slots [0, end) exist: the native step
        (block_forward.py) writes its entries into it itself and then advances `length`."""
        buf = self.buffer
        if buf is None or buf.dtype != dtype or buf.device != device or buf.shape[3] != kv_heads:
            shape = (self.num_layers, 2, 1, kv_heads, max(self.capacity, end), head_dim)
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
            self.rows = None
        elif end > buf.shape[-2]:
            self._grow(end)
        return self.buffer

    def _grow(self, needed: int) -> None:
        old = self.buffer
        new_cap = max(needed, 2 * old.shape[-2])
        self.buffer = old.new_zeros((*old.shape[:-2], new_cap, old.shape[-1]))
        self.buffer[..., : old.shape[-2], :] = old

    def tree_rows(self, layer: int, start: int, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value rows [N - 1, kv_heads, >= start + depth + 1, head_dim] of the tree written at `start`:
        row r = prefix [0, start) then the tree entries of `plan.paths[r]` (root .. node)."""
        buf = self.buffer
        rows_n, cap = plan.size - 1, buf.shape[-2]
        # Rows are interchangeable (each holds the same prefix; a step writes its node's path after it), so a
        # smaller plan (a prefix of the tree near the end of the context window, or a smaller tree) uses the
        # first rows of the buffer it finds: only more rows or more capacity reallocate.
        if self.rows is None or self.rows.shape[2] < rows_n or self.rows.shape[-2] != cap:
            old, keep = self.rows, self.rows_synced
            count = max(rows_n, old.shape[2] if old is not None else 0)
            self.rows = buf.new_empty((self.num_layers, 2, count, buf.shape[3], cap, buf.shape[-1]))
            if old is not None and old.shape[2] == count and keep:
                self.rows[..., :keep, :] = old[..., :keep, :]
            else:
                self.rows_synced = 0
        every = self.rows[layer]
        if self.rows_synced < start:  # committed since the last step: append it to every row's prefix
            every[:, :, :, self.rows_synced : start] = buf[layer, :, :, :, self.rows_synced : start]
        rows = every[:, :rows_n]
        # the node's path: [2, kv_heads, N - 1, depth + 1, head_dim] -> rows[..., start : start + depth + 1]
        path = buf[layer, :, 0].index_select(-2, (start + plan.paths).flatten())
        path = path.view(2, buf.shape[3], rows_n, plan.depth + 1, buf.shape[-1]).transpose(1, 2)
        rows[:, :, :, start : start + plan.depth + 1] = path
        if layer == self.num_layers - 1:
            self.rows_synced = start
        return rows[0], rows[1]

    def keep(self, start: int, nodes: list[int], on_device: torch.Tensor | None = None) -> None:
        """After a tree forward written at `start`: keep the entries of tree nodes `nodes` (host list; the same
        indices on the device in `on_device`, if at hand) as positions start..start+len(nodes)-1 and drop the
        rest of the tree. Nodes 0, 1, .. (a chain, the plain loop) are in place already: nothing to copy."""
        count = len(nodes)
        if self.buffer is not None and nodes != list(range(count)):
            index = (
                on_device[:count] if on_device is not None else torch.tensor(nodes, device=self.buffer.device)
            )
            picked = self.buffer.index_select(-2, index + start)
            self.buffer[..., start : start + count, :] = picked
        self.length = start + count

    def crop(self, length: int) -> None:  # type: ignore[override]
        self.length = min(self.length, length)
        self.rows_synced = min(self.rows_synced, self.length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


# ------------------------------------------------------------------------------------------------------------
# The backbone call: lean forward where supported (see lean_forward.py), else the transformers forward
# ------------------------------------------------------------------------------------------------------------


def next_logits_and_guesses(
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    heads: MedusaHeads | None,
    hidden: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the hidden state [1, H] of the last accepted node: the backbone's next-token logits [V] (fp32) and
    the heads' top-k guesses [K * top_k] (head-major), or None without heads (a root-only tree).

    With shared-lm_head (v2) heads both come from ONE lm_head call over 1 + K rows: on a memory-bound
    device the vocab projection costs a full read of its weight however few rows it has.
    """
    if heads is None or isinstance(heads, HydraHeads):  # Hydra heads draft after the root is known
        return lm_head(hidden)[0].float(), None
    if heads.own_lm_head:
        logits = lm_head(hidden)[0].float()
        head_logits = heads(hidden[0], lm_head)
    else:
        rows = torch.cat([hidden, heads.features(hidden[0]).to(hidden.dtype)])
        both = lm_head(rows)
        logits, head_logits = both[0].float(), both[1:]
    return logits, head_logits.topk(top_k, dim=-1).indices.flatten()


class HydraDrafter:
    """Fills a tree depth by depth with Hydra heads (heads.py): a node's children are the top-k of head d on
    the state that folded in every token on the node's path, starting from the root (the bonus token).

    Per step: one cell + ResBlocks + draft-vocabulary projection + top-k per depth, on the nodes of that depth
    that have children; the index buffers come from the tree (`TreeBuffers.levels`, built once per tree), the
    projection is built once per model, everything stays on the device.
    The projection is the lm_head's draft-vocabulary rows, in the backbone's dtype (packed for oneDNN like
    the lm_head where the lean forward packs), so a depth reads ~1/6 of the full lm_head.
    """

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
        from medusa_chat.kernels.qgemm import BlockLinear

        if isinstance(lm_head, BlockLinear) and self.dtype == torch.float32:
            # the backbone runs on the block kernel (int8/int4 on a CPU): so do the heads' linears (8 bits), and
            # the draft-vocabulary projection in 4 bits (Q4_1 of the lm_head's rows): it is read once per tree
            # depth, from DRAM after the backbone's weights went through the caches (5 MB in Q8_0, 2.9 in Q4_1)
            self.heads = block_quantized_copy(heads)
            self.project = block_q4_rows(self.project)
            from medusa_chat.model.block_forward import native_hydra_for

            self.native = native_hydra_for(self.heads)
            if self.native is not None and self.native.bind_draft(self.project, vocab, self.embed):
                self.native_draft = self.native.draft

    native = None  # NativeHydra (block_forward.py): the cell and ResBlocks in C, on the block kernel
    native_draft = None  # the same drafting loop as `propose`, all depths in one C call (NativeHydra.draft)

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


# How `info`, `ask` and `bench` say that the tree's shape follows the draft (MedusaEngine.draft_shaped)
SHAPED_NOTE = ", shaped per step by the draft"

# The longest run of context-lookup guesses one step verifies, where the context's last `max_match` (4) tokens
# occurred before (the text is being copied: a name, code, a list's scaffolding, a quoted sentence). Measured on
# this project's 2-core CPU (40 Vicuna-bench replies, the backbone's greedy continuations): after a 4-token match
# the lookup's next 1 / 2 / 3 / 4 tokens were all right 78 / 61 / 48 / 39% of the time, after a 2-token match 54
# / 31 / 23 / 17%, so the long chain pays only after the long match, and a weak match keeps the tree's chain (2
# nodes by default). Three: root + 3 guesses are 4 rows, one tile of the block kernel; a 5th row starts a second
# tile (~0.6 ms there against ~0.2-0.4 for the 2nd-4th). Side by side (benchmarks/ab_engines.py, all 80 prompts):
# runs of 3 / 4 / 6 gave 1.345x / 1.334x / 1.321x the plain loop, no runs 1.331x; at 1000-2000 tokens of
# conversation 3 and 4 were even (1.40x / 1.39x, 1.89x / 1.86x), no runs 1.27x / 1.83x.
LOOKUP_RUN = 3

# The graphs' cache is allocated whole for the context window, up to this many tokens (Llama-2-7B in fp16: 0.5 GB
# per 1k tokens); a longer conversation continues on the eager step, whose cache grows as needed.
GRAPH_CACHE_LIMIT = 4096


def wants_graphs(model: Any, runner: BackboneRunner) -> bool:
    """Should this engine replay its steps as CUDA graphs: a lean forward to record (not the transformers one,
    whose cache and mask logic run on the host), not turned off (MEDUSA_CHAT_COMPILE=0), and not measured
    slower by the calibration (`model.graph_step` False)."""
    return (
        isinstance(runner.lean, LeanForward)
        and graphs_enabled()
        and getattr(model, "graph_step", None) is not False
    )


def propose(
    root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers, drafter: HydraDrafter | None
) -> torch.Tensor:
    """The tree's tokens [N]. `draft` is the Medusa heads' flat top-k guesses, or for Hydra heads the last
    accepted node's hidden state (their guesses depend on the root, known only now)."""
    if drafter is not None and draft is not None:
        return drafter.propose(root, draft, buf)
    flat = torch.cat([root, draft]) if draft is not None else root
    return flat[buf.candidate_index]


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


@dataclass
class StepResult:
    """One verification step after its host sync: what was accepted (host) and what the next step needs."""

    tokens: list[int]  # the tree's tokens, by node
    accepted: list[int]  # the accepted path's nodes, root first (len = accepted candidates + 1)
    bonus: int  # the backbone's own next token after the path: the next root
    bonus_on_device: torch.Tensor  # the same, [1] on the device
    path: torch.Tensor | None  # the accepted path on the device (padded), when the rule computed it there
    draft: torch.Tensor | None  # the next draft: Medusa guesses, or for Hydra the last accepted node's state


# ------------------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------------------
class MedusaEngine:
    """Batch-1 Medusa tree decoding on a loaded backbone + heads. One reply at a time."""

    def __init__(
        self, model: LoadedModel, tree: Tree | None = None, graphs: bool = True, shaped: bool = True
    ) -> None:
        self.model = model
        self.shaped = shaped and os.environ.get("MEDUSA_CHAT_SHAPED_TREES", "1") != "0"
        self.lookup_run = LOOKUP_RUN  # 0: lookup guesses only on the tree's own chain
        self.backbone = model.backbone
        self.runner = BackboneRunner(model.backbone)
        self.lm_head = self.runner.lm_head
        self.heads = model.heads
        self.device = model.device
        self.dtype = model.backbone.get_input_embeddings().weight.dtype  # activations' dtype (NF4 too)
        self.context_limit = model.context_limit
        self.cache = TreeKVCache(model.backbone.config.num_hidden_layers)
        self.cached_ids: list[int] = []  # tokens whose KV entries are in the cache, in order
        self._token_text: dict[int, str] = {}
        # Hydra heads draft each tree depth by depth after the root is known (built once: a projection copy)
        self._hydra = HydraDrafter(self.heads, self.backbone) if isinstance(self.heads, HydraHeads) else None
        # On a GPU the verification step is replayed as a CUDA graph where that is measured faster
        # (graph_step.py; `model.graph_step` from the device's calibration; MEDUSA_CHAT_COMPILE=0: never)
        self._graph: GraphStep | None = None
        self.graph_note = ""
        if graphs and self.device.type == "cuda" and wants_graphs(model, self.runner):
            try:
                self._graph = self._new_graph(capture=True)
            except torch.cuda.OutOfMemoryError:  # the whole-window cache does not fit: the eager cache grows
                self.cache = TreeKVCache(model.backbone.config.num_hidden_layers)
                self.graph_note = "CUDA graphs off: no room for their whole-window KV cache"
        self.set_tree(tree or model.default_tree)

    def _new_graph(self, capture: bool) -> GraphStep:
        """A GraphStep over this engine's cache, which gets its whole buffer now (graphs hold its address)."""
        cfg = self.backbone.config
        lean = self.runner.lean
        capacity = min(self.context_limit, GRAPH_CACHE_LIMIT)
        allocate_cache(
            self.cache, cfg.num_hidden_layers, lean.kv_heads, lean.head_dim, capacity, self.dtype, self.device
        )
        return GraphStep(lean, self.lm_head, self.cache, capacity, capture=capture)

    # ---- tree ---------------------------------------------------------------------------------------------
    def set_tree(self, tree: Tree) -> None:
        if tree.size > 1:
            tree.check_fits(self.heads.num_heads if self.heads is not None else 0)
        self.tree = tree
        self.buffers: TreeBuffers = tree.buffers(self.device, self.dtype)
        self.drafter = self._hydra if tree.size > 1 else None
        # On a CPU the lean forward attends exactly per node (TreePlan: bitwise the plain loop). On a GPU the
        # per-node key rows would copy the KV cache once per node (64 x a 7B cache), so there the whole tree
        # block goes through one masked SDPA call: fast, and equal to plain decoding up to rounding near-ties.
        self._exact = self.runner.lean is not None and self.device.type == "cpu"
        self.plan = TreePlan.build(tree.parents, tree.depths, self.device) if self._exact else None
        # Smaller prefixes of the tree, used only near the end of the context window (`_tree_for_room`); each
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

    def _tree_for_room(self, room: int) -> tuple[Tree, TreeBuffers, TreePlan | None]:
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
        drafter runs (a CPU with the block kernel), with Hydra heads and a tree of 3 nodes or more."""
        return self._shape_spine is not None and self.shaped

    @property
    def tree_note(self) -> str:
        """What `info`, `ask` and `bench` add to the tree's source: SHAPED_NOTE for draft-shaped trees, else ""."""
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
        self, root: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[Tree, TreeBuffers, TreePlan | None, torch.Tensor]:
        """This step's tree shaped by the draft's confidence (confident_paths, in C) and its tokens [N]."""
        assert self._shape_spine is not None and self.drafter is not None and self.drafter.native is not None
        depth, k = self._shape_spine
        codes, tokens = self.drafter.native.draft_shaped(root, hidden, depth, k, self.tree.size)
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

    def _prefill_mask(self, start: int, count: int) -> torch.Tensor:
        q = torch.arange(count, device=self.device)[:, None]
        k = torch.arange(count, device=self.device)[None, :]
        block = torch.zeros(count, start + count, dtype=self.dtype, device=self.device)
        block[:, start:].masked_fill_(k > q, torch.finfo(self.dtype).min)
        return block[None, None]

    # ---- model calls --------------------------------------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor | TreePlan
    ) -> torch.Tensor:
        return self.runner.forward(ids, positions, attend, self.cache)

    def _graph_step(
        self, tokens: torch.Tensor, start: int, buf: TreeBuffers
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (hidden, logits) from its CUDA graph, or (_, None) where graphs cannot serve it (then the
        eager step runs). A newly recorded graph's first replay is checked against the eager step first: one
        that disagrees, or that fails to record, turns graphs off for this engine, with a note."""
        graph = self._graph
        assert graph is not None
        if start + buf.tree.size > graph.capacity:  # past the preallocated cache: the eager step grows it
            self._graphs_off(f"the conversation outgrew the graphs' cache ({graph.capacity} tokens)")
            return tokens, None
        before = graph.captures
        try:
            hidden, logits = graph.run(tokens, start, buf)
        except (RuntimeError, ValueError) as err:  # a kernel that cannot be recorded, out of memory
            self.cache.length = start
            self._graphs_off(f"a CUDA graph could not be recorded ({err})")
            return tokens, None
        if graph.captures != before:  # a new graph: does it compute the eager step, and faster?
            hidden, logits = hidden.clone(), logits.clone()
            replay_s = self._timed(lambda: graph.run(tokens, start, buf))[0] if graph.capture else 0.0
            self.cache.length = start
            attend = self._tree_mask(start, buf)
            eager_s, eager = self._timed(lambda: self._forward(tokens, start + buf.depth, attend))
            scale = float(eager.abs().max()) or 1.0
            if float((eager - hidden).abs().max()) > 1e-2 * scale or not torch.equal(
                greedy_tokens(self.lm_head(eager)), greedy_tokens(logits)
            ):
                self._graphs_off("a recorded CUDA graph did not reproduce the eager step")
                return eager, None
            if graph.capture and replay_s >= eager_s:
                self._graphs_off(f"measured slower ({replay_s * 1e3:.2f} ms vs {eager_s * 1e3:.2f} ms eager)")
                return eager, None
        return hidden, logits

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(wall time, result) of fn() on this engine's device (synchronized before and after on a GPU)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0, out

    def _greedy_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """greedy_tokens(lm_head(hidden)): the block kernel's fused argmax where the lm_head is its Q8_0 linear
        (the same values compared in place, no logits written: qgemm.c, q8_0_gemm_argmax), else the logits."""
        fused = getattr(self.lm_head, "argmax", None)
        top = fused(hidden) if fused is not None else None
        return top if top is not None else greedy_tokens(self.lm_head(hidden))

    def _graphs_off(self, why: str) -> None:
        self._graph = None
        self.graph_note = f"CUDA graphs off: {why}; the eager step goes on"

    def _next_logits_and_guesses(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(next-token logits [V], draft): Medusa guesses, or for Hydra heads the hidden state they start from."""
        heads = self.heads if self.tree.size > 1 else None
        logits, guesses = next_logits_and_guesses(self.lm_head, heads, hidden, self.buffers.top_k)
        return logits, (hidden if self.drafter is not None else guesses)

    def _text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.model.tokenizer.decode([token])
        return text

    # ---- one step -----------------------------------------------------------------------------------------
    def step(
        self,
        root: torch.Tensor,
        draft: torch.Tensor | None,
        start: int,
        acceptor: Any,
        produced: int,
        buf: TreeBuffers | None = None,
        plan: TreePlan | None = None,
        lookup_guess: list[int] | None = None,
        tokens: torch.Tensor | None = None,
    ) -> StepResult:
        """One decoding step: propose -> verify -> accept -> bonus, then the step's one host sync.

        Returns what was accepted (host lists) and what the next step starts from (device tensors); the caller
        commits (`cache.keep`). `generate` and the calibration that times steps both run this, so what is
        timed is what a reply pays. `buf` / `plan`: a prefix of the tree (near the end of the
        context window, `_tree_for_room`); by default the whole tree. `lookup_guess`: context-lookup guesses for
        the tree's main chain (lookup.py), host ints; they replace the drafter's tokens there. `tokens`: the
        tree's tokens when the caller drafted them already (a draft-shaped tree, `_confident_tree`).
        """
        if buf is None:
            buf, plan = self.buffers, self.plan
        # one lm_head call for every node: small trees whose next draft needs no lm_head (Hydra or none)
        logits_once = buf.tree.size <= 16 and (self.drafter is not None or buf.tree.size == 1)
        # propose: node 0 is the root; node i is the guess of head depth-1 at the node's rank
        if tokens is None:
            tokens = self._propose(root, draft, buf, lookup_guess)
        # verify: one forward over the N tree tokens (on a GPU a replayed CUDA graph of it: graph_step.py)
        step_logits = None
        if self._graph is not None:
            hidden, step_logits = self._graph_step(tokens, start, buf)
        if step_logits is None:
            attend = plan if plan is not None else self._tree_mask(start, buf)
            hidden = self._forward(tokens, start + buf.depth, attend)
        # accept: nodes with children need full-vocab logits to judge their children, the last accepted node
        # one more row for the bonus. Small trees without v2 heads get every row in one lm_head call (on a CPU
        # the lm_head is the biggest single read of a step, and a few more rows cost little); big trees only
        # the rows they need (about a third of a published tree), the bonus row after acceptance.
        if logits_once and acceptor.mode == "greedy":
            # Greedy needs only each node's argmax: one pass over all the rows' logits, no copies of logit rows.
            # A node is accepted iff its token is its parent's argmax; the bonus is the last accepted node's.
            # The sync brings the tree's tokens and argmaxes (2N ints) to the host, where walking a tree of <= 16
            # nodes costs microseconds: a dozen tiny device ops for the same walk cost ~0.3 ms a step on a CPU.
            top = self._greedy_rows(hidden) if step_logits is None else greedy_tokens(step_logits)
            n = buf.tree.size
            host = torch.cat([tokens, top]).tolist()  # the step's one host sync
            tree_tokens, tops = host[:n], host[n:]
            accepted = greedy_path(tree_tokens, tops, buf.tree.children)
            last = accepted[-1]
            draft = hidden[last : last + 1] if self.drafter is not None else None
            return StepResult(tree_tokens, accepted, tops[last], top[last : last + 1], None, draft)
        if logits_once or step_logits is not None:
            logits = (self.lm_head(hidden) if step_logits is None else step_logits).float()
            parent_logits = logits.index_select(0, buf.internal)
        else:
            parent_logits = self.lm_head(hidden[buf.internal]).float()
        # judge every node against its parent by the reply's rule, then the path / bonus code all share
        ok, logp = acceptor.judge(parent_logits, tokens, buf, produced)
        path, count = best_path(ok, buf.leaf_paths, logp)
        last = path.gather(0, count.view(1))
        if logits_once or (step_logits is not None and self.drafter is not None):
            last_logits = logits.index_select(0, last)[0]
            draft = hidden.index_select(0, last) if self.drafter is not None else None
        else:
            last_logits, draft = self._next_logits_and_guesses(hidden.index_select(0, last))
        bonus = acceptor.bonus(last_logits, last, count)
        n, width = buf.tree.size, path.shape[0]
        host = torch.cat([tokens, path, count[None].to(tokens.dtype), bonus]).tolist()  # the one host sync
        accepted = host[n : n + host[n + width] + 1]
        return StepResult(host[:n], accepted, host[-1], bonus, path, draft)

    def _propose(
        self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers, lookup_guess: list[int] | None
    ) -> torch.Tensor:
        """The tree's tokens [N]: the drafter's guesses, with the lookup's on the main chain where it has some."""
        chain = buf.chain[: len(lookup_guess)] if lookup_guess else []
        if not chain:
            return propose(root, draft, buf, self.drafter)
        guess = torch.tensor(lookup_guess[: len(chain)], dtype=root.dtype, device=root.device)
        if len(chain) == buf.tree.size - 1:  # the tree is that chain: the lookup fills it, nothing to draft
            return torch.cat([root, guess])
        tokens = propose(root, draft, buf, self.drafter)
        return tokens.index_copy_(0, buf.chain_index[: len(chain)], guess)

    # ---- one reply ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        settings: GenerationSettings | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[StepEvent | ReplySummary]:
        settings = settings or GenerationSettings()
        settings.validate()
        if not prompt_ids:
            raise PromptError("the prompt is empty: type a message first")
        if len(prompt_ids) + 1 >= self.context_limit:
            raise PromptError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context window is {self.context_limit}: "
                "shorten it or start a new conversation"
            )
        greedy = settings.temperature <= 0
        generator = None
        if not greedy:
            generator = torch.Generator(device=self.device)
            seed = (
                settings.seed if settings.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
            generator.manual_seed(seed)
        # the acceptance rule (greedy / typical / exact, acceptance.py); exact draws the reply's uniforms here
        acceptor = make_acceptor(
            settings, generator, self.device, settings.max_new_tokens + self.tree.depth + 1
        )
        eos = set(self.model.eos_token_ids)
        stop_strings = tuple(s for s in (*settings.stop_strings, *self.model.stop_strings) if s)
        # The reply ends at max_new_tokens or where prompt + reply fill the context window, whichever is first.
        room = self.context_limit - len(prompt_ids)
        limit = min(settings.max_new_tokens, room)
        t0 = time.perf_counter()

        # ---- prefill: reuse the cached prefix of the previous reply when the prompt extends it ----
        reused = 0
        for a, b in zip(self.cached_ids, prompt_ids[:-1], strict=False):  # keep >= 1 token to prefill
            if a != b:
                break
            reused += 1
        self.cache.crop(reused)
        del self.cached_ids[reused:]
        new = torch.tensor(prompt_ids[reused:], dtype=torch.long, device=self.device)
        positions = torch.arange(reused, len(prompt_ids), device=self.device)
        hidden = self._forward(new, positions, self._prefill_mask(reused, len(new)))[-1:]
        self.cached_ids.extend(prompt_ids[reused:])
        root_logits, guesses = self._next_logits_and_guesses(hidden)
        root = acceptor.first(root_logits)
        first = int(root.item())
        prefill_s = time.perf_counter() - t0
        message = ""

        reply, stop_reason = _keep_until_end([first], 0, eos, limit)
        stop_reason = _limit_reason(stop_reason, len(reply), settings.max_new_tokens)
        detok = StreamDecoder(self.model.tokenizer)
        # Streamed text that could be the start of a stop string is held back until a later step settles it.
        text, held, hit = _release(detok.push(reply), stop_strings, final=bool(stop_reason))
        stop_reason = "stop_string" if hit else stop_reason
        yield StepEvent(0, list(reply), text, [], None, prefill_s, 1, prefill_s, 0.0, 0.0)
        steps, accepted_lengths = 0, []
        # the context's n-gram index for lookup guesses (prompt + reply so far; the root is the last token).
        # Not under typical acceptance: that rule keeps any plausible guess, so lookup guesses would make
        # sampled replies repeat earlier text more often than the model does (greedy and exact: no such effect).
        use_lookup = settings.context_lookup and self.tree.size > 1 and settings.accept_mode != "typical"
        lookup = ContextLookup([*prompt_ids, first]) if use_lookup else None
        # runs of lookup guesses longer than the tree's chain: where a step's tree is free (the exact CPU step)
        runs = self.lookup_run if self._exact and self._graph is None else 0
        decode_t0 = time.perf_counter()

        # ---- decode: one tree verification per step ----
        while not stop_reason:
            if stop is not None and stop.is_set():
                stop_reason = "stopped"
                break
            start = self.cache.length
            room = self.context_limit - start
            # near the end of the context window a prefix of the tree still fits: the reply runs to the end
            tree, buf, plan = self._tree_for_room(room)
            step_t0 = time.perf_counter()
            guess: list[int] = []
            tokens = None
            if lookup is not None and buf.chain:
                whole = tree is self.tree and runs > len(buf.chain)
                guess = lookup.continuation(runs if whole else len(buf.chain))
                if whole and lookup.matched == lookup.max_match and len(buf.chain) < len(guess) < room:
                    # a long match: the text is being copied, so the step verifies the lookup's whole run (a
                    # chain of its tokens, nothing drafted) instead of the tree's few chain nodes
                    tree, buf, plan = self._lookup_chain(len(guess))
                    tokens = torch.cat([root, torch.tensor(guess, dtype=root.dtype, device=root.device)])
                guess = guess[: len(buf.chain)]
            if self.draft_shaped and not guess and tree is self.tree:
                tree, buf, plan, tokens = self._confident_tree(root, guesses)
            done = self.step(root, guesses, start, acceptor, len(reply), buf, plan, guess, tokens)
            tree_tokens, path_nodes, accepted = done.tokens, done.accepted, len(done.accepted) - 1
            # commit: root + accepted candidates enter the cache; the bonus becomes the next root
            self.cache.keep(start, path_nodes, done.path)
            self.cached_ids.extend(tree_tokens[n] for n in path_nodes)
            root, guesses = done.bonus_on_device, done.draft
            new_tokens = [tree_tokens[n] for n in path_nodes[1:]] + [done.bonus]
            steps += 1
            accepted_lengths.append(accepted)
            # EOS and the length limit can only be in the new tokens: O(new tokens) per step, not O(reply).
            new_tokens, stop_reason = _keep_until_end(new_tokens, len(reply), eos, limit)
            reply.extend(new_tokens)
            if lookup is not None:
                lookup.extend(new_tokens)
            stop_reason = _limit_reason(stop_reason, len(reply), settings.max_new_tokens)
            delta, held, hit = _release(held + detok.push(new_tokens), stop_strings, final=bool(stop_reason))
            stop_reason = "stop_string" if hit else stop_reason
            now = time.perf_counter()
            decode_s = now - decode_t0
            yield StepEvent(
                step=steps,
                token_ids=new_tokens,
                text=delta,
                accepted_nodes=path_nodes,
                tree=TreeView(
                    tokens=tree_tokens,
                    texts=[self._text(t) for t in tree_tokens],
                    parents=tree.parents,
                    depths=tree.depths,
                    ranks=tree.ranks,
                    lookup_nodes=buf.chain[: len(guess)] if guess else [],
                ),
                step_time_s=now - step_t0,
                new_tokens_total=len(reply),
                elapsed_s=now - t0,
                decode_tokens_per_s=(len(reply) - 1) / decode_s if decode_s > 0 else 0.0,
                tokens_per_step=(len(reply) - 1) / steps,
            )

        decode_s = time.perf_counter() - decode_t0
        decode_tokens = len(reply) - 1
        text = self._detok(reply)  # once per reply: the exact full decode (the stream's deltas add up to it)
        if stop_strings:
            cut = _stop_string_cut(text, stop_strings)
            text = text if cut is None else text[:cut]
        if held and text.endswith(held):
            # Stopped by the flag between two steps: no step is left to release the held text in, and a
            # stopped reply keeps exactly what was shown (as a reply whose stream is abandoned does).
            text = text[: -len(held)]
        if stop_reason == "context_limit":
            message = f"stopped at the model's context window ({self.context_limit} tokens)"
        yield ReplySummary(
            text=text,
            token_ids=reply,
            new_tokens=len(reply),
            steps=steps,
            tokens_per_step=decode_tokens / steps if steps else 0.0,
            decode_tokens_per_s=decode_tokens / decode_s if steps and decode_s > 0 else 0.0,
            time_to_first_token_s=prefill_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prompt_tokens=len(prompt_ids),
            reused_prefix_tokens=reused,
            accept_mode=settings.accept_mode,
            stop_reason=stop_reason,
            tree_size=self.tree.size,
            message=message,
            accepted_lengths=accepted_lengths,
        )

    # ---- helpers ------------------------------------------------------------------------------------------
    def _detok(self, ids: list[int]) -> str:
        text = self.model.tokenizer.decode(ids, skip_special_tokens=True)
        # An incomplete multi-byte character decodes as U+FFFD: hold it back until the next token completes it.
        return text[:-1] if text.endswith("\ufffd") else text

    def reset(self) -> None:
        """Forget the cached prefix (e.g. after a model-level change)."""
        self.cache.crop(0)
        self.cached_ids.clear()


class StreamDecoder:
    """Incremental detokenization in O(new tokens) per step (the TGI/vLLM method).

    Decoding the whole reply every step would cost O(reply) per step. Instead decode a short window twice:
    from `prefix` to the previous end and from `prefix` to the new end, and emit the difference. Starting the
    window a step back keeps SentencePiece's leading spaces and multi-token characters right; an incomplete
    UTF-8 character (U+FFFD at the end) is held back until a later token completes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, or half a character)
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def _keep_until_end(new: list[int], done: int, eos: set[int], max_new: int) -> tuple[list[int], str]:
    """The new tokens up to and including an EOS, within the reply's length limit; and why it ends ("")."""
    kept: list[int] = []
    for t in new:
        if done + len(kept) >= max_new:
            return kept, "max_new_tokens"
        kept.append(t)
        if t in eos:
            return kept, "eos"
    return kept, "max_new_tokens" if done + len(kept) >= max_new else ""


def _limit_reason(reason: str, made: int, max_new: int) -> str:
    """`_keep_until_end` reports any length limit as "max_new_tokens"; a reply shorter than max_new_tokens
    that hit it was stopped by the context window."""
    return "context_limit" if reason == "max_new_tokens" and made < max_new else reason


def _release(pending: str, stop_strings: tuple[str, ...], final: bool) -> tuple[str, str, bool]:
    """Split the not yet streamed text into (stream now, hold back, a stop string was found).

    A stop string can span two steps ("US" then "ER:"); streaming its first half would show text the final
    reply cuts off. So the longest end of `pending` that could still grow into a stop string is held back;
    the next step's text is appended to it and settles it (released, or cut with the stop string). `final`
    (the reply ends this step for another reason) releases everything. Everything before a stop string was
    released or held in an earlier step, so searching `pending` (held + new text) finds the same first
    occurrence as searching the whole reply, at O(new text + longest stop string) per step.
    """
    if not stop_strings:
        return pending, "", False
    cut = _stop_string_cut(pending, stop_strings)
    if cut is not None:
        return pending[:cut], "", True
    keep = 0 if final else partial_stop_suffix(pending, stop_strings)
    return pending[: len(pending) - keep], pending[len(pending) - keep :], False


def partial_stop_suffix(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string (0 if none): what a
    stream holds back until the next step settles it (the engine's and the HTTP API's streams)."""
    best = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _stop_string_cut(text: str, stop_strings: tuple[str, ...]) -> int | None:
    cuts = [i for s in stop_strings if s and (i := text.find(s)) >= 0]
    return min(cuts) if cuts else None


def plain_tree() -> Tree:
    """Root-only tree: the engine's own plain (one token per step) loop, used as a baseline."""
    return Tree.chain(0)


__all__ = [
    "MedusaEngine",
    "TreeKVCache",
    "best_path",
    "greedy_node_ok",
    "next_logits_and_guesses",
    "plain_tree",
    "sample",
    "typical_node_ok",
]

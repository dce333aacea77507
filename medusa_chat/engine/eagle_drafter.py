"""EagleDrafter: a step's tree from an EAGLE draft (model/forward/eagle.py), depth by depth, with the draft's own KV cache.

The draft reads pairs (feature of position i, embedding of token i + 1). Position i's feature is the backbone's
(EAGLE-1/2: its last hidden state after the final norm; EAGLE-3: the inputs of layers 2, N/2, N-3), so the draft's
cache can only hold pairs whose next token is committed. Per step:

    extend   the pairs the draft has not seen yet, the last one (last context feature, the root) included: one
             causal call; its last output predicts the root's children. The root's pair is recomputed next
             step (then with a committed token), so whatever the engine crops, the draft never keeps a stale pair.
    depths   one draft call per depth over that depth's nodes, each fed its parent's draft output and its own
             token, at position start + depth, attending to the context and its tree ancestors (their entries sit
             after the context in the draft's cache, dropped after the step).
    commit   the accepted nodes' features (stashed from the verification's forward) enter the feature buffer.

Static trees (`propose`) use the tree's own layout (TreeBuffers.levels, as Hydra); EAGLE-2's dynamic tree
(`dynamic_tree`) expands the top-k frontier by joint confidence and keeps the N - 1 most probable candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.engine.trees import EAGLE_NATIVE_NOTE, EAGLE_NOTE, StepTree
from medusa_chat.model.forward.eagle import EagleDraft, tap_features
from medusa_chat.model.forward.native_eagle import NativeEagle, native_eagle_for
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.model.forward.runner import BackboneRunner

# EAGLE-2's expansion width, capped by the tree's size (EAGLE-2 uses 10 for 60-node trees); the dynamic tree
# drafts `depth` levels of this many frontier nodes and keeps the N - 1 most probable of all their children.
DYNAMIC_TOP_K = 8
# Candidates one depth deeper lose this much log-probability on ties, so a child never outranks its parent and
# the kept set is always a tree (a parent whose child has probability 1.0 would otherwise tie with it).
_DEPTH_TIE = 1e-4


class EagleDrafter:
    """Drafts a step's tree with an EAGLE draft (the `Drafter` interface of drafters.py); state: the context's
    features and token ids, and the draft's KV cache over pairs 0 .. `seen` - 1 (`seen` <= context length - 1)."""

    reads_features = True  # (every backbone forward's: `saw`, `record`)
    needs_logits = False
    fills_tree = True

    def __init__(self, draft: EagleDraft, backbone: Any, runner: BackboneRunner) -> None:
        self.draft = draft
        self.name = draft.format
        self.embed = backbone.get_input_embeddings()
        self.dtype = self.embed.weight.dtype  # the backbone's activations
        self.full_head = runner.lm_head  # EAGLE-1/2 project with the backbone's lm_head
        self.vocab = draft.vocab_map()  # EAGLE-3: draft index -> token id
        # where the backbone runs the native C step, the whole draft of a step is one C call (native_eagle.py)
        self.native: NativeEagle | None = None
        if runner.native:
            self.native = native_eagle_for(draft, self.embed, self.full_head)
        if self.native is None and draft.fc.weight.device.type == "cpu" and draft.fc.weight.dtype != torch.float32:
            draft.float()  # the PyTorch drafter on a CPU: fp32 (a draft is loaded in its file's 16 bits)
        self.cache = draft.new_cache()
        dev = draft.fc.weight.device
        # (fp32 on a CPU whatever the draft's dtype: the C drafter reads them, and its draft may be kept in 16 bits)
        feats_dtype = torch.float32 if dev.type == "cpu" else draft.fc.weight.dtype
        self.feats = torch.zeros(0, draft.feature_size, dtype=feats_dtype, device=dev)
        self.ids = torch.zeros(0, dtype=torch.long, device=dev)
        self.known = 0  # positions whose feature and token are recorded
        self.seen = 0  # pairs in the draft's cache
        self._last: torch.Tensor | None = None  # the last backbone forward's features [T, F]
        self.tapped = tap_features(backbone, runner.lean) if draft.version == 3 else []
        self.min = torch.finfo(draft.fc.weight.dtype).min
        self._mbuf = torch.zeros(0, 0, dtype=draft.fc.weight.dtype, device=dev)  # `_mask`'s reused buffer
        self._dirty = (0, 0)  # its columns holding the last tree block (the rest are 0: visible context)
        self._shapes: dict[tuple[tuple[int, ...], ...], StepTree] = {}

    @property
    def shapes_trees(self) -> bool:
        """The C drafter shapes trees on its spine (trees.py, draft_shaped)."""
        return self.native is not None

    def dynamic(self, tree: Tree) -> bool:
        """Does each step draft EAGLE-2's dynamic tree in place of `tree`? For trees of 3 nodes or more that the
        expansion can fill."""
        if self.native is not None:  # the C drafter shapes trees on its spine (trees.py, draft_shaped)
            return False
        k = min(tree.size - 1, DYNAMIC_TOP_K)
        fits = tree.size - 1 <= k + (tree.depth - 1) * k * k
        return tree.size > 2 and fits

    def tree_note(self, draft_shaped: bool, dynamic: bool) -> str:
        if draft_shaped:  # the C drafter's trees, on the draft's top-1 spine (native_eagle.py)
            return EAGLE_NATIVE_NOTE
        return EAGLE_NOTE if dynamic else ", drafted by the EAGLE draft"

    def logits_and_draft(
        self, lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return lm_head(hidden)[0].float(), hidden

    def draft_from(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return hidden

    # ---- features from the backbone -----------------------------------------------------------------------
    def saw(self, hidden: torch.Tensor) -> None:
        """After each backbone forward: stash its features [T, F] (the next `record` keeps some rows)."""
        self._last = torch.cat(self.tapped, dim=-1) if self.draft.version == 3 else hidden

    def record(self, start: int, ids: torch.Tensor) -> None:
        """After a prefill: positions start .. start + len(ids) - 1 now hold `ids` [T], their features the stashed
        rows."""
        self._keep(start, ids, None)

    def commit(self, start: int, nodes: list[int], tokens: list[int]) -> None:
        """After a step: the accepted nodes' features and tokens, for the next draft."""
        assert self._last is not None
        rows = torch.tensor(nodes, device=self._last.device)
        ids = torch.tensor([tokens[n] for n in nodes], device=self._last.device)
        self._keep(start, ids, rows)

    def _keep(self, start: int, ids: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Positions start .. start + len(ids) - 1 now hold `ids` [T] (committed), their features the stashed rows
        (`rows` of them, else all). Pairs from start - 1 on read tokens that may have changed: dropped."""
        assert self._last is not None
        feats = self._last if rows is None else self._last.index_select(0, rows)
        end = start + ids.shape[0]
        if self.feats.shape[0] < end:
            grow = max(end, 2 * self.feats.shape[0], 256)
            feats_buf = self.feats.new_zeros(grow, self.feats.shape[1])
            ids_buf = self.ids.new_zeros(grow)
            feats_buf[: self.known] = self.feats[: self.known]
            ids_buf[: self.known] = self.ids[: self.known]
            self.feats, self.ids = feats_buf, ids_buf
        self.feats[start:end] = feats.to(self.feats.dtype)
        self.ids[start:end] = ids
        self.known = end
        self.seen = min(self.seen, max(start - 1, 0))

    def pairs(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The pairs the draft has not seen yet, the root's last, as the C drafter reads them: (features [n, F]
        fp32, next tokens [n] int64, the first one's position)."""
        first, p = self.seen, self.known
        feats = self.feats[first:p].float().contiguous()
        nxt = torch.cat([self.ids[first + 1 : p], root.view(1).to(self.ids.dtype)]).to(torch.int64).contiguous()
        return feats, nxt, first

    def draft_shaped(
        self, root: torch.Tensor, draft: torch.Tensor | None, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """A tree of `size` nodes shaped by the C draft's confidence (NativeEagle.draft_shaped): (codes, tokens)."""
        assert self.native is not None
        shaped = self.native.draft_shaped(*self.pairs(root), depth, k, size)
        self.seen = self.known - 1  # the root's pair is recomputed next step, with a committed token
        return shaped

    # ---- the draft ----------------------------------------------------------------------------------------
    def _extend(self, root: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Pairs seen .. P - 1 into the draft's cache (the last one with the root): (P, the root's output [1, h])."""
        p = self.known
        first = self.seen
        dev = root.device
        nxt = torch.cat([self.ids[first + 1 : p], root.view(1)])
        rows = p - first
        slots = torch.arange(first, p, device=dev)
        mask = torch.zeros(rows, p, dtype=self.feats.dtype, device=dev)
        mask[:, first:] = torch.full((rows, rows), self.min, dtype=mask.dtype, device=dev).triu(1)
        self.cache.ensure(p + 64)
        out = self.draft(self.feats[first:p], self.embed(nxt), slots, self.cache, slots, mask, True)
        self.seen = p - 1  # the root's pair is recomputed next step, with a committed token
        return p, out[-1:]

    def _mask(self, start: int, block: torch.Tensor) -> torch.Tensor:
        """Additive mask [R, start + B]: the context's columns [0, start) visible, then the tree `block` [R, B]. One
        buffer for every step: only the last block's columns are zeroed again, nothing grows with the context."""
        rows, width = block.shape[0], start + block.shape[1]
        if self._mbuf.shape[0] < rows or self._mbuf.shape[1] < width:
            cols = max(width, 2 * self._mbuf.shape[1], 256)
            self._mbuf = self._mbuf.new_zeros(max(rows, self._mbuf.shape[0]), cols)
            self._dirty = (0, 0)
        self._mbuf[:, self._dirty[0] : self._dirty[1]] = 0.0
        self._mbuf[:rows, start:width] = block
        self._dirty = (start, width)
        return self._mbuf[:rows, :width]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.draft.version == 3:
            return self.draft.lm_head(self.draft.norm(out))
        return self.full_head(out.to(self.dtype)).float()

    def _tokens(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.vocab is None else self.vocab[index]

    def _call(self, parent_out: torch.Tensor, tokens: torch.Tensor, pos: int, slots: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
        self.cache.ensure(mask.shape[-1])
        positions = torch.full_like(slots, pos)
        return self.draft(parent_out, self.embed(tokens), positions, self.cache, slots, mask, False)

    def propose(self, root: torch.Tensor, hidden: torch.Tensor | None, buf: TreeBuffers) -> torch.Tensor:
        """root [1] -> the tree's tokens [N] for the engine's (static) tree: node j's pair sits at draft slot
        P - 1 + j (the root's pair is the context's last), masked by the tree's own attention bias."""
        if self.native is not None and buf.tree.size > 1:
            tokens = self.native.draft(*self.pairs(root), root, buf)
            self.seen = self.known - 1  # the root's pair is recomputed next step, with a committed token
            return tokens
        p, state = self._extend(root)
        n = buf.tree.size
        tokens = root.new_zeros(n)
        tokens[:1] = root
        mask = self._mask(p - 1, buf.attn_bias)  # [N, P - 1 + N], rows by node
        for d, level in enumerate(buf.levels):
            x = state.index_select(0, level.internal_rows)
            top = self._logits(x).topk(level.top_k, dim=-1).indices
            child = self._tokens(top[level.child_slot, level.child_rank])
            tokens.index_copy_(0, level.child_nodes, child)
            if d + 1 < len(buf.levels):
                rows = mask.index_select(0, level.child_nodes)
                state = self._call(state.index_select(0, level.child_parent_row), child, p + d,
                                   p - 1 + level.child_nodes, rows)
        return tokens

    def dynamic_tree(
        self, root: torch.Tensor, tree: Tree, step_state: Callable[[Tree], StepTree]
    ) -> StepTree:
        """EAGLE-2's dynamic tree with `tree`'s node count N and depth D: depth 1 is the root's top-k; each further
        depth runs the draft on the k most probable frontier nodes (joint probability) and scores their top-k
        children; the tree is the N - 1 most probable candidates. One host sync (the kept ids). `step_state`: a
        tree's buffers and plan for the engine's step (built once per shape)."""
        base = tree
        n, depth = base.size, base.depth
        k = min(n - 1, DYNAMIC_TOP_K)
        p, out = self._extend(root)
        dev = root.device
        logp = torch.log_softmax(self._logits(out).float(), dim=-1)[0]
        score, index = logp.topk(k)
        toks = self._tokens(index)
        all_tokens, all_scores = [toks], [score]
        all_parent = [torch.full((k,), -1, dtype=torch.long, device=dev)]
        ranks = torch.arange(k, device=dev)
        all_rank = [ranks]
        front_ids, front_score, front_tok = ranks, score, toks
        front_out = out.expand(k, -1)
        anc = torch.eye(k, dtype=torch.bool, device=dev)  # frontier rows x tree slots so far
        count = k
        for d in range(1, depth):
            slots = p + (d - 1) * k + ranks
            mask = self._mask(p, torch.where(anc, 0.0, self.min))
            out = self._call(front_out, front_tok, p - 1 + d, slots, mask)
            logp = torch.log_softmax(self._logits(out).float(), dim=-1)
            value, index = logp.topk(k, dim=-1)
            cand = (front_score[:, None] + value - _DEPTH_TIE).flatten()
            toks = self._tokens(index).flatten()
            all_tokens.append(toks)
            all_scores.append(cand)
            all_parent.append(front_ids.repeat_interleave(k))
            all_rank.append(ranks.repeat(k))
            if d + 1 < depth:
                keep = cand.topk(k).indices
                row = keep // k
                front_ids, front_score, front_tok = count + keep, cand[keep], toks[keep]
                front_out = out.index_select(0, row)
                anc = torch.cat([anc.index_select(0, row), torch.eye(k, dtype=torch.bool, device=dev)], dim=1)
            count += k * k
        scores = torch.cat(all_scores)
        chosen = scores.topk(n - 1).indices
        host = torch.cat([chosen, torch.cat(all_parent), torch.cat(all_rank), torch.cat(all_tokens)]).tolist()
        total = scores.shape[0]
        kept, parent = host[: n - 1], host[n - 1 : n - 1 + total]
        rank, token = host[n - 1 + total : n - 1 + 2 * total], host[n - 1 + 2 * total :]
        paths: dict[int, tuple[int, ...]] = {}

        def path(c: int) -> tuple[int, ...]:
            if c not in paths:
                paths[c] = (path(parent[c]) if parent[c] >= 0 else ()) + (rank[c],)
            return paths[c]

        by_path = {path(c): token[c] for c in kept}
        key = tuple(sorted(by_path, key=lambda q: (len(q), q)))
        state = self._shapes.get(key)
        if state is None:
            state = self._shapes[key] = step_state(Tree.from_paths(list(key), name=f"{base.name} (EAGLE-2 dynamic)"))
        tokens = torch.tensor([0] + [by_path[q] for q in state.tree.paths], dtype=root.dtype, device=dev)
        tokens[:1] = root
        return state.with_tokens(tokens)


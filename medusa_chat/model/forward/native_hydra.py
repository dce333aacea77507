"""The Hydra heads drafted in C (csrc/hydra.c): the cell, the ResBlocks and a whole step's draft, on the Q8_0
copy of the heads (block_heads.py). Drafts only: a reply never depends on them."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from medusa_chat import envvars
from medusa_chat.model.forward.block_forward import blin_struct
from medusa_chat.model.forward.draft_structs import Q8Lin, embed_struct

_i = ctypes.c_int


class NativeHydra:
    """The Hydra heads' cell and ResBlocks (heads.py) as one C call each (csrc/hydra.c), on the Q8_0
    copy of the heads that `block_quantized_copy` makes: per tree depth 2 calls instead of ~20 PyTorch ops.
    Drafts only: the output never depends on them."""

    def __init__(self, quantized_heads: Any, lib: ctypes.CDLL) -> None:
        from medusa_chat.kernels.cpu_linears import BlockLinearWithBias

        def q8(module: Any) -> Q8Lin:
            if not isinstance(module, BlockLinearWithBias) or module.bias is None:
                raise TypeError(
                    "NativeHydra needs the block-quantized heads (cpu_linears.block_quantized_copy)"
                )
            b = module.block
            return Q8Lin(b.qs.data_ptr(), b.d.data_ptr(), b.s.data_ptr(), module.bias.data_ptr())

        self.lib, self._heads = lib, quantized_heads  # keeps the buffers alive
        self._plans: dict[int, tuple[Any, torch.Tensor, int, int]] = {}  # per tree: hydra_draft's index plan
        self.hidden = int(quantized_heads.hidden_size)
        self._cell = q8(quantized_heads.draft.linear)
        self._blocks = []
        for k in range(int(quantized_heads.num_heads)):  # (iterating the ModuleList would include `draft`)
            head = quantized_heads[k]
            arr = (Q8Lin * len(head))(*(q8(block.linear) for block in head))
            self._blocks.append((len(head), arr))
        self._rows = 0
        self._grow(8)
        self._head_ptrs = (ctypes.POINTER(Q8Lin) * len(self._blocks))(
            *(ctypes.cast(arr, ctypes.POINTER(Q8Lin)) for _, arr in self._blocks)
        )
        self._head_counts = (_i * len(self._blocks))(*(n for n, _ in self._blocks))
        self._proj: tuple[Any, ...] | None = None
        self._work = torch.empty(0)
        self._codes = torch.empty(0, dtype=torch.int32)

    def bind_draft(self, project: Any, draft_vocab: torch.Tensor, embed: Any) -> bool:
        """Set up `draft` (the whole draft in one C call) for this projection and token embedding; False when it
        cannot run them (the projection is not a block linear, or the embedding is neither an fp32 table nor
        the lm_head's Q8_0 blocks), and `draft` stays unused."""
        from medusa_chat.kernels.block_linears import BlockLinear

        bound = embed_struct(embed)
        if not isinstance(project, BlockLinear) or bound is None:
            return False
        emb, keep = bound
        vocab = draft_vocab.to(torch.int64).contiguous()
        # the modules / tensors keep the buffers the C structs point to alive
        self._proj = (project, blin_struct(project), vocab, emb, keep)
        return True

    def _plan(self, buf: Any) -> tuple[Any, torch.Tensor, int, int]:
        """hydra_draft's int32 index plan for a tree (built once per TreeBuffers): per depth I, C, K and the
        TreeLevel index lists; plus the most rows any depth has."""
        plan = self._plans.get(id(buf))
        if plan is None or plan[0] is not buf:
            flat: list[int] = []
            rows = 1
            for level in buf.levels:
                if level.top_k > 64:  # hydra_draft's top-k buffer
                    raise ValueError("hydra_draft supports top-k up to 64 per depth")
                i, c = len(level.internal_rows), len(level.child_nodes)
                flat += [i, c, level.top_k, *level.internal_rows.tolist(), *level.child_nodes.tolist()]
                flat += [
                    *level.child_slot.tolist(),
                    *level.child_rank.tolist(),
                    *level.child_parent_row.tolist(),
                ]
                rows = max(rows, i, c)
            plan = self._plans[id(buf)] = (buf, torch.tensor(flat, dtype=torch.int32), len(buf.levels), rows)
        return plan

    def draft(self, root: torch.Tensor, hidden: torch.Tensor, buf: Any) -> torch.Tensor:
        """The tree's tokens [N] (root first) drafted in one C call (decoder.c, hydra_draft); `bind_draft` first."""
        project, blin, vocab, emb, _ = self._proj  # type: ignore[misc]
        _, plan, levels, rows = self._plan(buf)
        if rows > self._rows:
            self._grow(rows)
        h = self.hidden
        need = 8 * rows * h + rows * project.out_features + rows * 64
        if self._work.numel() < need:
            self._work = torch.empty(need)
        hidden = hidden.float().contiguous()
        root = root.to(torch.int64).contiguous()
        tokens = torch.empty(buf.tree.size, dtype=torch.int64)
        self.lib.hydra_draft(
            h, ctypes.byref(self._cell), self._head_ptrs, self._head_counts, ctypes.byref(blin),
            vocab.data_ptr(), ctypes.byref(emb), hidden.data_ptr(), root.data_ptr(), plan.data_ptr(), levels,
            tokens.data_ptr(), self._work.data_ptr(), rows, *self._scratch,
        )  # fmt: skip
        return tokens

    def draft_shaped(
        self, root: torch.Tensor, hidden: torch.Tensor, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """A tree of `size` nodes shaped by the draft's confidence (decoder.c, hydra_draft_shaped; the rule is
        drafters.confident_paths): (codes, tokens). codes: d * k + r of each chosen node, the rank-r token at
        depth d below the draft's top-1 spine, in growth order; tokens [size]: the root, then those nodes' tokens
        (a fresh tensor). `bind_draft` first."""
        project, blin, vocab, emb, _ = self._proj  # type: ignore[misc]
        if not 1 <= k <= min(64, len(vocab)) or depth * k > 8 * 64 or not 1 < size <= depth * k + 1:
            raise ValueError(f"draft_shaped: no {size}-node tree from depth {depth} x top-{k}")
        h = self.hidden
        need = 8 * h + project.out_features + 2 * depth * k + 64
        if self._work.numel() < need:
            self._work = torch.empty(need)
        if self._codes.numel() < size:
            self._codes = torch.empty(size, dtype=torch.int32)
        hidden = hidden.float().contiguous()
        root = root.to(torch.int64).contiguous()
        tokens = torch.empty(size, dtype=torch.int64)
        n = self.lib.hydra_draft_shaped(
            h, ctypes.byref(self._cell), self._head_ptrs, self._head_counts, ctypes.byref(blin), len(vocab),
            vocab.data_ptr(), ctypes.byref(emb), hidden.data_ptr(), root.data_ptr(), depth, k, size,
            self._codes.data_ptr(), tokens.data_ptr(), self._work.data_ptr(), *self._scratch,
        )  # fmt: skip
        return tuple(self._codes[:n].tolist()), tokens

    def _grow(self, rows: int) -> None:
        h = self.hidden
        self._cat = torch.empty(rows, 2 * h)
        self._tmp = torch.empty(rows, h)
        self._qx = torch.empty(2 * rows * 2 * h, dtype=torch.int8)
        self._dx = torch.empty(2, rows * 2 * h // 32)
        self._scratch = (self._qx.data_ptr(), self._dx[0].data_ptr(), self._dx[1].data_ptr())
        self._rows = rows

    def head_features(self, k: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        m = x.shape[0]
        if m > self._rows:
            self._grow(m)
        y = torch.empty_like(x)
        n, arr = self._blocks[k]
        self.lib.hydra_resblocks(
            m, self.hidden, n, arr, x.data_ptr(), y.data_ptr(), self._tmp.data_ptr(), *self._scratch
        )
        return y

    def cell(self, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        state, emb = state.float().contiguous(), emb.float().contiguous()
        m = state.shape[0]
        if m > self._rows:
            self._grow(m)
        out = torch.empty_like(state)
        self.lib.hydra_cell(
            m, self.hidden, ctypes.byref(self._cell), state.data_ptr(), emb.data_ptr(), out.data_ptr(),
            self._cat.data_ptr(), self._tmp.data_ptr(), *self._scratch,
        )  # fmt: skip
        return out


def native_hydra_for(quantized_heads: Any) -> NativeHydra | None:
    """The C drafter pieces where the block kernel runs here and the heads have the expected shapes; else None."""
    if not envvars.enabled("MEDUSA_CHAT_NATIVE"):
        return None
    from medusa_chat.kernels.cbind import load

    lib = load()
    if lib is None or int(quantized_heads.hidden_size) % 32:
        return None
    try:
        return NativeHydra(quantized_heads, lib)
    except TypeError:
        return None

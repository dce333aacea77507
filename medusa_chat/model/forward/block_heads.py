"""Medusa-1 / Medusa-2 heads on the CPU block kernel: their linears as GGUF blocks, drafted in one C call.

Published Medusa-1 heads (and the heads inside Medusa-2 checkpoints) are, per head, ResBlocks (`linear` H x H with
a bias, SiLU, residual) and their OWN full-vocabulary lm_head. In fp32 PyTorch a step read every head's projection
(at a 1.17B Llama shape with 4 heads: 1.6 GB a step, a 2-node step cost 5.7x a plain one). Here, at load:

- `block_medusa_heads` swaps the heads' linears in place (the float weights are dropped as each is replaced, and
  the pages of weights still mapped from the heads file are given back, mapped_weights.release): the
  ResBlocks become Q8_0 block linears with their bias (cpu_linears.BlockLinearWithBias), each own lm_head a Q8_0
  (or, asked for, Q4_1) block linear -- or the backbone's own lm_head module where the head's quantizes to
  exactly the backbone's Q8_0 blocks (a head initialised from the backbone's lm_head and never trained apart:
  one copy in memory, not two);
- `NativeMedusa` drafts through csrc/medusa.c: per step only the heads the tree reaches (depth d needs heads
  0 .. d - 1), only their top-k, and for trees shaped by the draft (drafters.confident_paths) the heads'
  probabilities too, all in one call.

Drafts only choose which tokens the backbone verifies: the output is the plain loop's whatever they guess.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from medusa_chat import envvars
from medusa_chat.kernels.block_linears import BlockLinear, Q41Linear, Q80Linear
from medusa_chat.kernels.cbind import load
from medusa_chat.kernels.cpu_linears import BlockLinearWithBias
from medusa_chat.kernels.quantizers import QK, quantize_q4_1, quantize_q8_0
from medusa_chat.model.forward.block_forward import BLin, blin_struct
from medusa_chat.model.forward.draft_structs import Q8Lin
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads
from medusa_chat.model.mapped_weights import release

_p, _i = ctypes.c_void_p, ctypes.c_int
LM_HEAD_KINDS = ("q8_0", "q4_1")


class _MHead(ctypes.Structure):  # medusa.c MHead
    _fields_ = [("n_blocks", _i), ("blocks", ctypes.POINTER(Q8Lin)), ("proj", BLin), ("vocab", _p)]


def can_block(heads: MedusaHeads | None, backbone: Any) -> bool:
    """Do these heads go on the block kernel? Medusa heads (not Hydra: HydraDrafter makes its own copy) in a float
    on a CPU whose backbone lm_head is a block linear (the int8 / int4 CPU paths), with H a multiple of 32
    (MEDUSA_CHAT_BLOCK_HEADS=0: never, the fp32 heads stay as they are)."""
    if not isinstance(heads, MedusaHeads) or isinstance(heads, HydraHeads) or getattr(heads, "block_kind", ""):
        return False  # (an EAGLE draft is not Medusa heads: it runs as loaded)
    if not envvars.enabled("MEDUSA_CHAT_BLOCK_HEADS"):  # the fp32 PyTorch heads (for comparisons)
        return False
    lm_head = backbone.get_output_embeddings()
    w = heads[0][0].linear.weight
    return (
        isinstance(lm_head, BlockLinear)
        and w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.float16, torch.bfloat16)  # (as in the file: quantized from it)
        and int(heads.hidden_size) % QK == 0
        and load() is not None
    )


def _same_blocks(a: Q80Linear, b: Any) -> bool:
    return (
        isinstance(b, Q80Linear)
        and a.group == b.group
        and (a.out_features, a.in_features) == (b.out_features, b.in_features)
        and torch.equal(a.d, b.d)
        and torch.equal(a.qs, b.qs)
    )


def block_medusa_heads(
    heads: MedusaHeads, backbone: Any, lm_head_kind: str = "q8_0", share: bool = True
) -> dict[str, Any]:
    """Swap `heads`' linears for block linears in place (module doc); returns {"lm_head": kind, "shared": [head
    indices whose lm_head is the backbone's module]}. `heads.block_kind` records the kind afterwards.
    share=False: every head keeps a projection of its own (to measure the quantization itself)."""
    if lm_head_kind not in LM_HEAD_KINDS:
        raise ValueError(f"lm_head_kind must be one of {LM_HEAD_KINDS}, not {lm_head_kind!r}")
    backbone_head = backbone.get_output_embeddings()
    shared: list[int] = []
    with torch.no_grad():
        for k, head in enumerate(heads):
            for block in head[: heads.num_layers]:
                lin = block.linear
                # (a weight still mapped from its file gives its pages back chunk by chunk as it is read)
                block.linear = BlockLinearWithBias(Q80Linear(*quantize_q8_0(lin.weight, release)), lin.bias)
                del lin  # the fp32 weight goes now, not after all heads are built
            if not heads.own_lm_head:
                continue
            weight = head[heads.num_layers].weight
            q8 = Q80Linear(*quantize_q8_0(weight, release))
            if share and _same_blocks(q8, backbone_head):
                head[heads.num_layers] = backbone_head
                shared.append(k)
            elif lm_head_kind == "q4_1":
                head[heads.num_layers] = Q41Linear(*quantize_q4_1(weight, torch.uint8))
            else:
                head[heads.num_layers] = q8
            release(weight)  # (read again by the Q4_1 quantizer)
            del weight, q8
    heads.block_kind = "q8_0" if not heads.own_lm_head else lm_head_kind
    heads.shared_lm_heads = shared
    return {"lm_head": heads.block_kind, "shared": shared}


def drafter_name(heads: MedusaHeads | None, source: str = "") -> str:
    """Which drafter heads make: "hydra", "medusa-2" (heads from a Medusa-2 checkpoint), "medusa-1" (a heads file,
    v1 or v2 layout), or "none"."""
    if heads is None:
        return "none"
    if not isinstance(heads, MedusaHeads):  # an EAGLE draft (model/forward/eagle.py): "eagle" | "eagle3"
        return str(getattr(heads, "format", "draft"))
    if isinstance(heads, HydraHeads):
        return "hydra"
    return "medusa-2" if "medusa-2" in source else "medusa-1"


def heads_footprint(heads: MedusaHeads, backbone: Any) -> tuple[int, int, str]:
    """(weights, bytes, dtype) of the heads for `info`: block heads count their blocks' logical weights and the
    bytes of their buffers, not a shared lm_head's (the backbone's, counted there); float heads their parameters."""
    kind = getattr(heads, "block_kind", "")
    if not kind:
        params = list(heads.parameters())
        dtype = str(params[0].dtype).removeprefix("torch.") if params else "none"
        return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params), dtype
    shared = backbone.get_output_embeddings()
    weights = nbytes = 0
    for m in heads.modules():
        if m is shared:
            continue
        if isinstance(m, BlockLinear):
            weights += m.in_features * m.out_features
        nbytes += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
        weights += sum(b.numel() for n, b in m.named_buffers(recurse=False) if n == "bias")
    return weights, nbytes, kind


def head_projection(heads: MedusaHeads, k: int, backbone_lm_head: nn.Module) -> nn.Module:
    """Head k's vocabulary projection: its own lm_head (v1) or the backbone's (v2)."""
    return heads[k][heads.num_layers] if heads.own_lm_head else backbone_lm_head


class NativeMedusa:
    """Block-quantized Medusa heads drafted by csrc/medusa.c (module doc). `projections[k]`: head k's vocabulary
    projection (a block linear); `draft_vocab`: the token ids of its rows when it projects onto a subset of the
    vocabulary (None: the whole vocabulary)."""

    def __init__(
        self,
        heads: MedusaHeads,
        projections: list[nn.Module],
        lib: ctypes.CDLL,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        def q8(module: Any) -> Q8Lin:
            if not isinstance(module, BlockLinearWithBias) or not isinstance(module.block, Q80Linear):
                raise TypeError("NativeMedusa needs block-quantized heads (block_heads.block_medusa_heads)")
            b = module.block
            bias = module.bias if module.bias is not None else torch.zeros(b.out_features)
            self._keep.append(bias)
            return Q8Lin(b.qs.data_ptr(), b.d.data_ptr(), b.s.data_ptr(), bias.data_ptr())

        self.lib, self.hidden = lib, int(heads.hidden_size)
        self._keep: list[Any] = [heads, projections]
        vocab = None if draft_vocab is None else draft_vocab.to(torch.int64).contiguous()
        self._keep.append(vocab)
        structs = []
        for k in range(int(heads.num_heads)):
            proj = projections[k]
            if not isinstance(proj, BlockLinear):
                raise TypeError(f"head {k}'s projection is not a block linear")
            if vocab is not None and proj.out_features != len(vocab):
                raise ValueError("the draft vocabulary must list one token per projection row")
            blocks = heads[k][: heads.num_layers]
            arr = (Q8Lin * len(blocks))(*(q8(b.linear) for b in blocks))
            self._keep.append(arr)
            structs.append(
                _MHead(
                    len(blocks),
                    ctypes.cast(arr, ctypes.POINTER(Q8Lin)),
                    blin_struct(proj),
                    vocab.data_ptr() if vocab is not None else None,
                )
            )
        self._heads = (_MHead * len(structs))(*structs)
        self.num_heads = len(structs)
        self._rows = max(p.out_features for p in projections)
        self._work = torch.empty(3 * self.hidden + self._rows + 2 * 8 * 64 + 64)
        self._qx = torch.empty(2 * self.hidden, dtype=torch.int8)
        self._dx = torch.empty(2, self.hidden // QK + 1)
        self._scratch = (self._qx.data_ptr(), self._dx[0].data_ptr(), self._dx[1].data_ptr())
        self._codes = torch.empty(8 * 64, dtype=torch.int32)

    def top(
        self, hidden: torch.Tensor, depth: int, k: int, probs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Heads 0 .. depth - 1 on hidden [1, H]: their top-k tokens [depth * k] (head-major) and, with `probs`,
        their softmax probabilities [depth * k]."""
        if not 1 <= depth <= self.num_heads or not 1 <= k <= 64:
            raise ValueError(f"medusa_draft: no top-{k} of {depth} heads (the heads are {self.num_heads})")
        hidden = hidden.float().contiguous()
        tokens = torch.empty(depth * k, dtype=torch.int64)
        p = torch.empty(depth * k) if probs else None
        self.lib.medusa_draft(
            self.hidden, self._heads, depth, k, hidden.data_ptr(), tokens.data_ptr(),
            p.data_ptr() if p is not None else None, self._work.data_ptr(), *self._scratch,
        )  # fmt: skip
        return tokens, p

    def draft(self, root: torch.Tensor, hidden: torch.Tensor, buf: Any) -> torch.Tensor:
        """The static tree's tokens [N] (root first): only the heads its depth reaches, their top `buf.top_k`."""
        tokens, _ = self.top(hidden, buf.tree.depth, buf.top_k)
        return torch.cat([root.to(torch.int64).view(1), tokens])[buf.candidate_index]

    def draft_shaped(
        self, root: torch.Tensor, hidden: torch.Tensor, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """As NativeHydra.draft_shaped (codes d * k + r in growth order, tokens [size]), on the heads' top-1 spine."""
        if not 1 <= k <= 64 or depth * k > 8 * 64 or not 1 < size <= depth * k + 1 or depth > self.num_heads:
            raise ValueError(f"draft_shaped: no {size}-node tree from depth {depth} x top-{k}")
        hidden = hidden.float().contiguous()
        root = root.to(torch.int64).contiguous()
        tokens = torch.empty(size, dtype=torch.int64)
        n = self.lib.medusa_draft_shaped(
            self.hidden, self._heads, depth, k, size, hidden.data_ptr(), root.data_ptr(), self._codes.data_ptr(),
            tokens.data_ptr(), self._work.data_ptr(), *self._scratch,
        )  # fmt: skip
        return tuple(self._codes[:n].tolist()), tokens


def native_medusa_for(
    heads: MedusaHeads, projections: list[nn.Module], draft_vocab: torch.Tensor | None = None
) -> NativeMedusa | None:
    """The C drafter for block-quantized heads where the kernel runs here; else None (Python drafts them)."""
    if not envvars.enabled("MEDUSA_CHAT_NATIVE"):
        return None
    lib = load()
    if lib is None:
        return None
    try:
        return NativeMedusa(heads, projections, lib, draft_vocab)
    except TypeError:
        return None

"""An EAGLE-3 draft on the block kernel: each step's tree drafted in one C call (csrc/eagle.c).

The draft (model/eagle.py) is one decoder layer plus a draft-vocabulary head, about 10 M parameters; in PyTorch
a tree depth cost ~40 small ops, more than a whole backbone step of the embedded model takes on two cores. Here
its linears are Q4_1 blocks (as the Hydra drafter's projection: 4 bits rank guesses as well; measured on the
embedded model's draft: the same tokens per step as Q8_0, the draft 20% faster), its KV cache is fp32 in buffers
of its own, and a step's extend + spine + tree choice is one call.

The state the call reads (the context's features and tokens, how many pairs the draft has seen) stays with
engine/eagle_drafter.py, which records it after every backbone forward. Drafts only choose what the backbone
verifies: replies are the plain loop's whatever this computes.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.model.block_forward import _BLin, _blin, _Embed, embed_struct

if TYPE_CHECKING:
    from medusa_chat.engine.eagle_drafter import EagleDrafter
    from medusa_chat.model.eagle import EagleDraft
    from medusa_chat.tree import TreeBuffers

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
MAX_TOP_K = 64  # eagle3_draft_shaped's per-depth top-k and D x K <= 512 (drafting.h, confident_select)
EXTEND_ROWS = 64  # csrc/eagle.c: the rows of one extend block


class _EDraft(ctypes.Structure):  # csrc/eagle.c EDraft
    _fields_ = [
        ("H", _i),
        ("F", _i),
        ("n_heads", _i),
        ("n_kv", _i),
        ("head_dim", _i),
        ("inter", _i),
        ("V", _i),
        ("eps_in", _f),
        ("eps_hidden", _f),
        ("eps_post", _f),
        ("eps_final", _f),
        ("in_norm", _p),
        ("hidden_norm", _p),
        ("post_norm", _p),
        ("final_norm", _p),
        ("fc", _BLin),
        ("qkv", _BLin),
        ("o", _BLin),
        ("gate_up", _BLin),
        ("down", _BLin),
        ("head", _BLin),
        ("vocab", _p),
        ("embed", _Embed),
    ]


class NativeEagle3:
    """The C drafter for one EAGLE-3 draft and backbone embedding; `state` is the engine's EagleDrafter."""

    def __init__(self, draft: EagleDraft, lib: ctypes.CDLL, emb: tuple[_Embed, Any]) -> None:
        """`emb`: the backbone's token embedding as the C code reads it (block_forward.embed_struct)."""
        from medusa_chat.kernels.cpu_linears import quantize_q4_1
        from medusa_chat.kernels.qgemm import Q41Linear

        layer = draft.midlayer
        attn, mlp = layer.self_attn, layer.mlp

        def q4(*weights: torch.Tensor) -> Any:
            return Q41Linear(*quantize_q4_1(torch.cat([w.detach().float() for w in weights])))

        self.lib = lib
        self.hidden = int(draft.hidden_size)
        self.fc = q4(draft.fc.weight)
        self.qkv = q4(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        self.o = q4(attn.o_proj.weight)
        self.gate_up = q4(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down = q4(mlp.down_proj.weight)
        self.head = q4(draft.lm_head.weight)
        self.vocab = draft.vocab_map().to(torch.int64).contiguous()
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, draft.norm]
        self._norms = [n.weight.detach().float().contiguous() for n in norms]
        self._embed_keep = emb[1]
        self.n_kv, self.head_dim = int(draft.kv_heads), int(draft.head_dim)
        self.inter = int(mlp.gate_proj.out_features)
        self.feature_size = int(draft.feature_size)
        self.model = _EDraft(
            self.hidden, self.feature_size, int(draft.q_heads), self.n_kv, self.head_dim, self.inter,
            self.vocab.shape[0], *(float(n.eps) for n in norms), *(w.data_ptr() for w in self._norms),
            _blin(self.fc), _blin(self.qkv), _blin(self.o), _blin(self.gate_up), _blin(self.down),
            _blin(self.head), self.vocab.data_ptr(), emb[0],
        )  # fmt: skip
        self._ref = ctypes.byref(self.model)
        self.inv_freq = draft.inv_freq.float()
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self._k = self._v = torch.empty(self.n_kv, 0, self.head_dim)
        self._work = torch.empty(0)
        self._work_for = (0, 0)  # (extend rows, positions) `_work` is sized for
        self._rows = 0
        self._codes = torch.empty(0, dtype=torch.int32)
        self._layouts: dict[int, tuple[Any, int, torch.Tensor]] = {}  # static trees' candidate index (`draft`)
        self.state: EagleDrafter | None = None

    def _ensure(self, rows: int, width: int, depth: int, k: int) -> None:
        """Buffers for `rows` extend rows, `width` positions and depth x k candidates, grown by doubling."""
        if width > self._cos.shape[0]:
            n = max(width, 2 * self._cos.shape[0], 1024)
            angles = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None]
            angles = torch.cat([angles, angles], dim=-1)
            self._cos, self._sin = angles.cos().contiguous(), angles.sin().contiguous()
        cap = self._k.shape[1]
        if width > cap:
            n = max(width, 2 * cap, 256)
            keys, values = torch.zeros(self.n_kv, n, self.head_dim), torch.zeros(self.n_kv, n, self.head_dim)
            keys[:, :cap], values[:, :cap] = self._k, self._v
            self._k, self._v = keys, values
        rows = min(rows, EXTEND_ROWS)  # (a long extend goes through the C call in blocks of this many rows)
        if rows > self._rows:
            widest = max(self.feature_size, 2 * self.hidden, self.inter)
            self._qx = torch.empty(2 * rows * widest, dtype=torch.int8)
            self._dx = torch.empty(2, rows * widest // 32 + 1)
            self._rows = rows
        if rows > self._work_for[0] or width > self._work_for[1]:  # (the size only grows: not asked every step)
            rows, width = max(rows, self._work_for[0]), max(width, 2 * self._work_for[1], 256)
            self._work = torch.empty(int(self.lib.eagle3_work_floats(self._ref, rows, width)))
            self._work_for = (rows, width)
        if self._codes.numel() < depth * k + 1:
            self._codes = torch.empty(depth * k + 1, dtype=torch.int32)

    def _draft(self, root: torch.Tensor, depth: int, k: int, size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """One C call: (nodes chosen, node tokens [size], candidate tokens [depth * k])."""
        st = self.state
        assert st is not None
        first, p = st.seen, st.known
        feats = st.feats[first:p].float().contiguous()
        nxt = torch.cat([st.ids[first + 1 : p], root.view(1).to(st.ids.dtype)]).to(torch.int64).contiguous()
        n = p - first
        self._ensure(n, p + depth, depth, k)
        tokens = torch.empty(size, dtype=torch.int64)
        cands = torch.empty(depth * k, dtype=torch.int64)
        chosen = self.lib.eagle3_draft_shaped(
            self._ref, n, feats.data_ptr(), nxt.data_ptr(), first, self._cos.data_ptr(), self._sin.data_ptr(),
            self._k.data_ptr(), self._v.data_ptr(), self._k.shape[1], depth, k, size, self._codes.data_ptr(),
            tokens.data_ptr(), cands.data_ptr(), self._work.data_ptr(), self._qx.data_ptr(), self._dx[0].data_ptr(),
            self._dx[1].data_ptr(),
        )  # fmt: skip
        st.seen = p - 1  # the root's pair is recomputed next step, with a committed token
        return chosen, tokens, cands

    def draft_shaped(
        self, root: torch.Tensor, hidden: torch.Tensor, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """A tree of `size` nodes shaped by the draft's confidence, as NativeHydra.draft_shaped: (codes, tokens)."""
        if not 1 <= k <= min(MAX_TOP_K, self.vocab.shape[0]) or depth * k > 8 * 64 or not 1 < size <= depth * k + 1:
            raise ValueError(f"draft_shaped: no {size}-node tree from depth {depth} x top-{k}")
        n, tokens, _ = self._draft(root, depth, k, size)
        return tuple(self._codes[:n].tolist()), tokens

    def draft(self, root: torch.Tensor, hidden: torch.Tensor, buf: TreeBuffers) -> torch.Tensor:
        """A static tree's tokens [N], root first: the spine's candidates fill the nodes (0,) * d + (r,); a node
        off the spine (the draft did not run on its parent) gets the candidate of its depth and rank, a guess the
        verification may reject like any other."""
        tree = buf.tree
        if tree.size == 1:
            return root.view(1).to(torch.int64)
        layout = self._layouts.get(id(buf))
        if layout is None or layout[0] is not buf:  # built once per tree: (buf, k, candidate index per node)
            depth = tree.depth
            k = min(max(p[-1] for p in tree.paths) + 1, MAX_TOP_K, self.vocab.shape[0], 8 * 64 // depth)
            index = torch.tensor([(len(p) - 1) * k + min(p[-1], k - 1) for p in tree.paths])
            layout = self._layouts[id(buf)] = (buf, k, index)
        _, k, index = layout
        cands = self._draft(root, tree.depth, k, 2)[2]
        return torch.cat([root.view(1).to(torch.int64), cands.index_select(0, index)])


def native_eagle3_for(draft: EagleDraft, embed: Any) -> NativeEagle3 | None:
    """The C drafter where the block kernel runs here, the draft is EAGLE-3 on the CPU and the embedding is one the C
    code reads (a Q8_0 BlockEmbedding or an fp32 table); else None (the PyTorch drafter runs)."""
    if os.environ.get("MEDUSA_CHAT_NATIVE", "1") == "0" or draft.version != 3:
        return None
    if draft.fc.weight.device.type != "cpu" or draft.hidden_size % 32 or draft.feature_size % 32:
        return None
    from medusa_chat.kernels.qgemm import load

    lib = load()
    emb = embed_struct(embed)
    if lib is None or emb is None or draft.midlayer.mlp.gate_proj.out_features % 32:
        return None
    return NativeEagle3(draft, lib, emb)

"""An EAGLE draft on the block kernel: each step's tree drafted in one C call (csrc/eagle.c).

The draft (model/forward/eagle.py) is one decoder layer plus a head: EAGLE-3's own draft-vocabulary head (the shipped
draft: about 10 M parameters), or for EAGLE-1/2 the backbone's lm_head, read in the block form the native step
already holds. In PyTorch a tree depth cost ~40 small ops, more than a whole backbone step of the embedded model
takes on two cores, and a published EAGLE-1 draft for a 7B model is ~0.25 B parameters in fp32, read again at
every depth. Here its linears are Q4_1 blocks (as the Hydra drafter's projection: 4 bits rank guesses as well; measured on the
embedded model's draft: the same tokens per step as Q8_0, the draft 20% faster), its KV cache is fp32 in buffers
of its own, and a step's extend + spine + tree choice is one call.

The state the call reads (the context's features and tokens, how many pairs the draft has seen) stays with
the engine's drafter (engine/eagle_drafter.py), which records it after every backbone forward and passes the
pairs the draft has not seen yet to each call. Drafts only choose what the backbone
verifies: replies are the plain loop's whatever this computes.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat import envvars
from medusa_chat.errors import SettingError
from medusa_chat.model.forward.block_forward import BLin, blin_struct, trim_heap
from medusa_chat.model.forward.draft_structs import EmbedStruct, embed_struct
from medusa_chat.model.mapped_weights import release

if TYPE_CHECKING:
    from medusa_chat.model.forward.eagle import EagleDraft
    from medusa_chat.tree import TreeBuffers

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# EAGLE-1/2 drafts project with the backbone's whole lm_head; drafted in C, each spine depth reads only these
# first token ids' rows of it (a copy of those rows: 1/6 of a 49,152-token head). BPE and SentencePiece
# vocabularies are numbered roughly by merge order / score, so low ids are the common tokens. Measured with the
# embedded model's Medusa-1 heads (which take a draft vocabulary the same way), 10 Vicuna-bench turns, 8-node tree,
# no context lookup: 1.641 tokens/step with the full vocabulary, 1.603 with the first 8,192 ids, 1.636 with the
# 8,192 most frequent reply tokens: a draft_vocab.safetensors beside the draft (train-heads writes one) lists
# those instead. MEDUSA_CHAT_EAGLE_DRAFT_VOCAB sets a count of first ids (0: the whole head) over either.
EAGLE1_DRAFT_VOCAB = 8192
MAX_TOP_K = 64  # eagle_draft_shaped's per-depth top-k and D x K <= 512 (drafting.h, confident_select)
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
        ("fc", BLin),
        ("qkv", BLin),
        ("o", BLin),
        ("gate_up", BLin),
        ("down", BLin),
        ("head", BLin),
        ("vocab", _p),
        ("embed", EmbedStruct),
        ("version", _i),
        ("fc_bias", _p),
        ("qkv_bias", _p),
    ]


class _DraftBlocks:
    """A draft's weights as the C code reads them: its linears in Q4_1 blocks, the head (EAGLE-3's own, or rows of
    the backbone's block lm_head), fp32 norms and biases. Built once per draft and head and kept on the draft
    (`blocks_for`): every engine on the model (the calibration makes several) drafts from the same blocks."""

    def __init__(self, draft: EagleDraft, lm_head: Any, draft_vocab: int) -> None:
        from medusa_chat.kernels.block_linears import Q41Linear
        from medusa_chat.kernels.quantizers import quantize_q4_1

        layer = draft.midlayer if draft.version == 3 else draft.layers[0]
        attn, mlp = layer.self_attn, layer.mlp

        def q4(*weights: torch.Tensor) -> Any:
            # byte codes, and each chunk of a file-mapped weight's pages given back as it is read (re-read
            # from the file if the PyTorch draft is ever used)
            parts = [quantize_q4_1(w, torch.uint8, release) for w in weights]
            lin = Q41Linear(*(torch.cat(t) if len(t) > 1 else t[0] for t in zip(*parts, strict=True)))
            del parts
            trim_heap()  # (the temporaries of one weight at a time: glibc keeps them resident otherwise)
            return lin

        def bias(*mods: Any) -> torch.Tensor | None:
            if mods[0].bias is None:
                return None
            return torch.cat([m.bias.detach().float() for m in mods]).contiguous()

        self.fc = q4(draft.fc.weight)
        self.qkv = q4(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        self.o = q4(attn.o_proj.weight)
        self.gate_up = q4(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down = q4(mlp.down_proj.weight)
        vocab = draft.vocab_map()
        if draft.version == 3:
            self.head = q4(draft.lm_head.weight)
        else:  # draft_vocab < 0: the ids listed beside the draft
            if draft_vocab < 0:
                vocab = draft.draft_vocab_ids
            else:
                vocab = torch.arange(draft_vocab) if 0 < draft_vocab < int(lm_head.out_features) else None
            self.head = lm_head.rows(vocab) if vocab is not None else lm_head
        self.vocab = vocab.to(torch.int64).contiguous() if vocab is not None else None
        self.norms = (
            [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, draft.norm]
            if draft.version == 3 else [None, None, layer.post_attention_layernorm, None]
        )  # fmt: skip
        self.norm_weights = [n.weight.detach().float().contiguous() if n is not None else None for n in self.norms]
        self.fc_bias = bias(draft.fc)
        self.qkv_bias = bias(attn.q_proj, attn.k_proj, attn.v_proj)
        self.inter = int(mlp.gate_proj.out_features)

    @staticmethod
    def blocks_for(draft: EagleDraft, lm_head: Any) -> _DraftBlocks:
        n = eagle1_draft_vocab(draft) if draft.version != 3 else 0
        key = (id(lm_head), n)
        kept = draft.__dict__.get("_native_blocks")
        if kept is None or kept[0] != key:
            kept = (key, _DraftBlocks(draft, lm_head, n))
            draft.__dict__["_native_blocks"] = kept  # (not a submodule: no state-dict entry, no device moves)
        return kept[1]


def eagle1_draft_vocab(draft: EagleDraft) -> int:
    """How many of the first token ids an EAGLE-1 head drafts among (MEDUSA_CHAT_EAGLE_DRAFT_VOCAB; 0: all); -1:
    the draft vocabulary listed beside the draft (used unless the variable is set)."""
    raw = envvars.value("MEDUSA_CHAT_EAGLE_DRAFT_VOCAB")
    if raw is None:
        return -1 if draft.draft_vocab_ids is not None else EAGLE1_DRAFT_VOCAB
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise SettingError(f"MEDUSA_CHAT_EAGLE_DRAFT_VOCAB must be a token count >= 0 (0: the whole vocabulary), not {raw!r}")
    return n


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeEagle:
    """The C drafter for one EAGLE draft and backbone embedding. Each call takes the pairs the draft's KV cache
    (kept here) has not seen yet: (features [n, F] fp32, next tokens [n] int64, the first pair's position)."""

    def __init__(self, draft: EagleDraft, lib: ctypes.CDLL, emb: tuple[EmbedStruct, Any], lm_head: Any = None) -> None:
        """`emb`: the backbone's token embedding as the C code reads it (draft_structs.embed_struct); `lm_head`:
        the backbone's block lm_head, EAGLE-1's head."""
        self.lib = lib
        b = self.blocks = _DraftBlocks.blocks_for(draft, lm_head)
        self.head, self.vocab, self.V = b.head, b.vocab, int(b.head.out_features)
        self.hidden = int(draft.hidden_size)
        self._embed_keep = emb[1]
        self.n_kv, self.head_dim = int(draft.kv_heads), int(draft.head_dim)
        self.inter = b.inter
        self.feature_size = int(draft.feature_size)
        self.model = _EDraft(
            self.hidden, self.feature_size, int(draft.q_heads), self.n_kv, self.head_dim, self.inter, self.V,
            *(float(n.eps) if n is not None else 0.0 for n in b.norms), *(_ptr(w) for w in b.norm_weights),
            blin_struct(b.fc), blin_struct(b.qkv), blin_struct(b.o), blin_struct(b.gate_up), blin_struct(b.down), blin_struct(b.head),
            _ptr(b.vocab), emb[0], draft.version, _ptr(b.fc_bias), _ptr(b.qkv_bias),
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
            self._work = torch.empty(int(self.lib.eagle_work_floats(self._ref, rows, width)))
            self._work_for = (rows, width)
        if self._codes.numel() < depth * k + 1:
            self._codes = torch.empty(depth * k + 1, dtype=torch.int32)

    def draft_pairs(
        self, feats: torch.Tensor, nxt: torch.Tensor, first: int, depth: int, k: int, size: int
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """One C call over the unseen pairs (the last one's next token is the root): (nodes chosen, node tokens
        [size], candidate tokens [depth * k]). The cache then holds pairs 0 .. first + n - 2 (the root's pair is
        recomputed next step, with a committed token)."""
        n = feats.shape[0]
        p = first + n
        self._ensure(n, p + depth, depth, k)
        tokens = torch.empty(size, dtype=torch.int64)
        cands = torch.empty(depth * k, dtype=torch.int64)
        chosen = self.lib.eagle_draft_shaped(
            self._ref, n, feats.data_ptr(), nxt.data_ptr(), first, self._cos.data_ptr(), self._sin.data_ptr(),
            self._k.data_ptr(), self._v.data_ptr(), self._k.shape[1], depth, k, size, self._codes.data_ptr(),
            tokens.data_ptr(), cands.data_ptr(), self._work.data_ptr(), self._qx.data_ptr(), self._dx[0].data_ptr(),
            self._dx[1].data_ptr(),
        )  # fmt: skip
        return chosen, tokens, cands

    def draft_shaped(
        self, feats: torch.Tensor, nxt: torch.Tensor, first: int, depth: int, k: int, size: int
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """A tree of `size` nodes shaped by the draft's confidence, as NativeHydra.draft_shaped: (codes, tokens)."""
        if not 1 <= k <= min(MAX_TOP_K, self.V) or depth * k > 8 * 64 or not 1 < size <= depth * k + 1:
            raise ValueError(f"draft_shaped: no {size}-node tree from depth {depth} x top-{k}")
        n, tokens, _ = self.draft_pairs(feats, nxt, first, depth, k, size)
        return tuple(self._codes[:n].tolist()), tokens

    def draft(
        self, feats: torch.Tensor, nxt: torch.Tensor, first: int, root: torch.Tensor, buf: TreeBuffers
    ) -> torch.Tensor:
        """A static tree's tokens [N], root first: the spine's candidates fill the nodes (0,) * d + (r,); a node
        off the spine (the draft did not run on its parent) gets the candidate of its depth and rank, a guess the
        verification may reject like any other."""
        tree = buf.tree
        if tree.size == 1:
            return root.view(1).to(torch.int64)
        layout = self._layouts.get(id(buf))
        if layout is None or layout[0] is not buf:  # built once per tree: (buf, k, candidate index per node)
            depth = tree.depth
            k = min(max(p[-1] for p in tree.paths) + 1, MAX_TOP_K, self.V, 8 * 64 // depth)
            index = torch.tensor([(len(p) - 1) * k + min(p[-1], k - 1) for p in tree.paths])
            layout = self._layouts[id(buf)] = (buf, k, index)
        _, k, index = layout
        cands = self.draft_pairs(feats, nxt, first, tree.depth, k, 2)[2]
        return torch.cat([root.view(1).to(torch.int64), cands.index_select(0, index)])


def native_eagle_for(draft: EagleDraft, embed: Any, lm_head: Any = None) -> NativeEagle | None:
    """The C drafter where the block kernel runs here, the draft is on the CPU (EAGLE-3, or EAGLE-1/2 with one
    layer and the backbone's lm_head a block linear), and the embedding one the C code reads (a Q8_0
    BlockEmbedding, an fp32 table, or any other through its own lookup called back: a GGUF file's K-quant or F16
    rows); else None (the PyTorch drafter runs)."""
    from medusa_chat.kernels.block_linears import BlockLinear
    from medusa_chat.kernels.cbind import load

    if not envvars.enabled("MEDUSA_CHAT_NATIVE"):
        return None
    if draft.version != 3 and (len(draft.layers) != 1 or not isinstance(lm_head, BlockLinear)):
        return None
    if draft.fc.weight.device.type != "cpu" or draft.hidden_size % 32 or draft.feature_size % 32:
        return None
    lib = load()
    emb = embed_struct(embed, callback=True)
    if lib is None or emb is None or draft.blocks[0].mlp.gate_proj.out_features % 32:
        return None
    return NativeEagle(draft, lib, emb, lm_head)

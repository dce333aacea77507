"""Medusa heads: K small residual MLPs on the backbone's last hidden state.

Head k at position t guesses the token at t + 2 + k (head 0 = the token after next). Two published layouts:

- "v1": every head ends in its own vocab projection (`{h}.{L}.weight [V, H]`).
- "v2": heads hold only their ResBlocks and reuse the backbone's `lm_head` (TGI's layout; small files).

The module's state dict uses exactly the published key names (`{h}.{l}.linear.weight`, ...), so a saved file
is readable by the reference implementation and by TGI/vLLM-style servers.

A third layout is this project's own, "hydra" (`HydraHeads`): v2 heads whose guesses also depend on the draft
tokens before them (Hydra, Ankner et al. 2024), projected onto a frequent-token draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ResBlock(nn.Module):
    """y = x + SiLU(W x + b). Initialised with W = 0 so a fresh head starts as the identity (paper init)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """A ModuleList of heads, so `state_dict()` keys are the published ones: `0.0.linear.weight`, ...

    `own_lm_head=True` is the v1 layout (a projection per head); False is v2 (pass the backbone's lm_head to
    `forward`).
    """

    block_kind = ""  # the CPU block kernel's format of the heads' projections once quantized (block_heads.py)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int = 1,
        own_lm_head: bool = False,
    ) -> None:
        heads = []
        for _ in range(num_heads):
            layers: list[nn.Module] = [ResBlock(hidden_size) for _ in range(num_layers)]
            if own_lm_head:
                layers.append(nn.Linear(hidden_size, vocab_size, bias=False))
            heads.append(nn.Sequential(*layers))
        super().__init__(heads)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.own_lm_head = own_lm_head
        # Token ids the drafter projects onto (heads_files.DRAFT_VOCAB_FILE); None: the whole vocabulary.
        self.draft_vocab_ids: torch.Tensor | None = None

    @property
    def format(self) -> str:
        return "v1" if self.own_lm_head else "v2"

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [K, ..., H]: each head's ResBlock output (before any vocab projection)."""
        w = getattr(self[0][0].linear, "weight", None)  # block-quantized heads (block_heads.py) take fp32
        hidden = hidden.to(w.dtype if w is not None else torch.float32)
        outs = []
        for head in self:
            x = hidden
            for block in head[: self.num_layers]:
                x = block(x)
            outs.append(x)
        return torch.stack(outs)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """[..., H] -> logits [K, ..., V]. v2 heads need the backbone's `lm_head`."""
        feats = self.features(hidden)
        if self.own_lm_head:
            return torch.stack([head[self.num_layers](f) for head, f in zip(self, feats, strict=True)])
        if lm_head is None:
            raise ValueError("v2 Medusa heads share the backbone's lm_head: pass lm_head=")
        w = getattr(
            lm_head, "weight", None
        )  # packed / int8 CPU lm_heads have none: they take any float input
        # One projection for all heads at once; cast to the lm_head's dtype (it may be 16-bit on GPU).
        return lm_head(feats.to(w.dtype if w is not None and w.is_floating_point() else feats.dtype))

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Paper init for v1: every head's projection starts as a copy of the backbone's lm_head."""
        if not self.own_lm_head:
            return
        with torch.no_grad():
            for head in self:
                head[self.num_layers].weight.copy_(lm_head.weight.float())

    def config_dict(self, base_model: str) -> dict:
        """The Hub `config.json` for these heads (the reference's keys; `version: "2"` marks the v2 layout)."""
        cfg = {
            "base_model_name_or_path": base_model,
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
        if not self.own_lm_head:
            cfg["version"] = "2"
        return cfg


class TokenCell(nn.Module):
    """Folds one draft token into a running state: u' = u + SiLU(W [u ; e / rms(e)] + b).

    W = 0 at initialisation, so a fresh cell is the identity and Hydra heads start as the Medusa heads they
    are initialised from. The embedding is RMS-normalised so its scale matches the final-norm hidden state.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, state: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        e = embedding.to(state.dtype)
        e = e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(e.dtype)
        return state + F.silu(self.linear(torch.cat([state, e], dim=-1)))


class HydraHeads(MedusaHeads):
    """Sequentially dependent heads (Hydra): head k also sees the draft tokens x_{t+1} .. x_{t+1+k}.

    Medusa head k must guess x_{t+2+k} without knowing the tokens in between, so its guesses for later
    positions are marginals over every possible path; on the tree, the path *is* known. With u_0 = h_t:

        u_{k+1} = cell(u_k, embed(x_{t+1+k}))          one shared TokenCell (small: 2H x H)
        logits_k = lm_head[draft_vocab](ResBlocks_k(u_{k+1}))

    x_{t+1} is the root (the backbone's own next token), so even head 0 knows the token before its target.
    `draft_vocab` is a frequency-ranked subset of the vocabulary (FR-Spec style): the heads then run one small
    projection per tree depth instead of a full-vocabulary one, and training is as much cheaper. Tokens
    outside it are never guessed; verification is unchanged, so output is exactly what plain decoding gives.

    The ResBlocks keep the v2 key names (`{h}.{l}.linear.weight`); the cell is `draft.linear.*` and the
    vocabulary `draft_vocab`. With the cell's weight at zero this computes exactly v2 Medusa heads.
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, draft_vocab: torch.Tensor
    ) -> None:
        super().__init__(hidden_size, vocab_size, num_heads, num_layers, own_lm_head=False)
        self.draft = TokenCell(hidden_size)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.int64).clone())

    @property
    def format(self) -> str:
        return "hydra"

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_vocab.numel())

    def head_features(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Head k's ResBlocks on a state that already folded in the tokens before its target."""
        for block in self[k]:
            state = block(state)
        return state

    def step(self, k: int, state: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One depth: fold the token before head k's target into `state`; return (new state, head k features)."""
        state = self.draft(state, embedding)
        return state, self.head_features(k, state)

    def features_teacher_forced(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Training/evaluation: hidden [B, H], embeddings [B, K, H] of the true x_{t+1..t+K} -> [K, B, H]."""
        state = hidden.to(self[0][0].linear.weight.dtype)
        outs = []
        for k in range(self.num_heads):
            state, x = self.step(k, state, embeddings[:, k])
            outs.append(x)
        return torch.stack(outs)

    def vocab_index(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] long: each token's index in `draft_vocab`, -2 for tokens outside it (never guessed)."""
        index = torch.full((vocab_size,), -2, dtype=torch.long, device=self.draft_vocab.device)
        index[self.draft_vocab] = torch.arange(self.draft_vocab_size, device=self.draft_vocab.device)
        return index

    def config_dict(self, base_model: str) -> dict:
        cfg = super().config_dict(base_model)
        cfg["version"] = "hydra"
        cfg["draft_vocab_size"] = self.draft_vocab_size
        return cfg


HYDRA_KEYS = ("draft.linear.weight", "draft.linear.bias", "draft_vocab")


def infer_layout(state_dict: dict[str, torch.Tensor]) -> tuple[int, int, bool, int, int | None]:
    """Read (num_heads, num_layers, own_lm_head, hidden_size, vocab_size) from published keys.

    The head count is read from the keys, never from config.json (the v1 configs on the Hub say 2 heads while
    the file holds 5).
    """
    heads: dict[int, set[str]] = {}
    for key in state_dict:
        if key in HYDRA_KEYS:
            continue
        first, _, rest = key.partition(".")
        if not first.isdigit() or not rest:
            raise ValueError(f"unexpected key {key!r} (expected '<head>.<layer>.…')")
        heads.setdefault(int(first), set()).add(rest)
    if not heads:
        raise ValueError("no head weights in the state dict")
    num_heads = max(heads) + 1
    if sorted(heads) != list(range(num_heads)):
        raise ValueError(f"head indices are not contiguous: {sorted(heads)}")
    keys0 = heads[0]
    num_layers = len({k.split(".")[0] for k in keys0 if k.endswith(".linear.weight")})
    own = f"{num_layers}.weight" in keys0
    for h, keys in heads.items():
        if keys != keys0:
            raise ValueError(f"head {h} has different tensors than head 0: {sorted(keys ^ keys0)}")
    if num_layers == 0:
        raise ValueError("heads have no ResBlock ('<head>.0.linear.weight' missing)")
    hidden = state_dict["0.0.linear.weight"].shape[1]
    vocab = state_dict[f"0.{num_layers}.weight"].shape[0] if own else None
    return num_heads, num_layers, own, hidden, vocab


def heads_from_state_dict(
    state_dict: dict[str, torch.Tensor], vocab_size: int | None = None, keep_dtype: bool = False
) -> MedusaHeads:
    """Build MedusaHeads (or HydraHeads, when the Hydra tensors are there) matching `state_dict`; load strictly.

    keep_dtype: Medusa heads keep the file's float dtype (the loader quantizes them tensor by tensor from it, so
    the fp32 copies of all heads never exist at once); else fp32."""
    num_heads, num_layers, own, hidden, vocab = infer_layout(state_dict)
    hydra = [k for k in HYDRA_KEYS if k in state_dict]
    if hydra:
        if len(hydra) != len(HYDRA_KEYS) or own:
            raise ValueError(f"incomplete Hydra heads: has {hydra} of {list(HYDRA_KEYS)}")
        dv = state_dict["draft_vocab"]
        if dv.dim() != 1 or dv.is_floating_point() or dv.numel() == 0:
            raise ValueError("draft_vocab must be a 1-D integer tensor of token ids")
        if state_dict["draft.linear.weight"].shape != (hidden, 2 * hidden):
            raise ValueError(f"draft cell weight has shape {tuple(state_dict['draft.linear.weight'].shape)}")
        heads = HydraHeads(hidden, vocab_size or 0, num_heads, num_layers, dv)
        heads.load_state_dict(
            {k: (v if k == "draft_vocab" else v.float()) for k, v in state_dict.items()}, strict=True
        )
        return heads
    # Made on the meta device and given the file's tensors (as fp32): no randomly initialised copy
    # first. Published Medusa-1 heads carry a full-vocabulary projection each (4.4 GB in fp32 for Vicuna-7B's 5).
    with torch.device("meta"):
        heads = MedusaHeads(hidden, vocab or vocab_size or 0, num_heads, num_layers, own_lm_head=own)
    heads.load_state_dict(state_dict if keep_dtype else _as_fp32(state_dict), strict=True, assign=True)
    return heads


def _as_fp32(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict in fp32 (tensors already fp32 are kept, not copied)."""
    return {k: v if v.dtype == torch.float32 else v.float() for k, v in state_dict.items()}

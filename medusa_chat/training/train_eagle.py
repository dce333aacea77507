"""EAGLE draft training (EAGLE-1, and EAGLE-3) on a frozen backbone, from self-distilled replies (see distill.py).

The draft is model/eagle.py's `EagleDraft` (version 1): `fc` Linear(2h -> h) over cat(embedding of token t + 1,
feature t), one Llama decoder layer without input_layernorm, the backbone's lm_head (frozen, shared, not saved).
The feature is the backbone's last hidden state after its final norm: what the engine's drafter reads.

Data: one backbone pass over each whole sample (prompt + reply), every position's feature cached in fp16
(`cache_eagle_features`, positions.hidden_states_for with the sample starting at position 0): the draft attends
over the prompt at decode time, so it must see it in training too. Losses only count where a decoding step would
use the prediction (the chain's root at or after the first reply token).

Loss (EAGLE): smooth L1 between the draft's output at pair t and the backbone's feature t + 1, plus
`ce_weight` x cross-entropy of the lm_head over the draft's output against the distilled token t + 2.

Training-time test (`unroll` > 1): at decode time depth d + 1 reads the draft's own output of depth d, not a
backbone feature. Step j of the unroll feeds every position s the previous step's output at s - 1 (with the
true token s + 1: a tree path is only extended past accepted tokens) and attends to the backbone-fed entries of
positions <= s - j plus its own chain's earlier unrolled entries (one per step, a diagonal in each block), which
is exactly what the drafter's KV cache holds at depth j + 1. Step j's loss weighs `step_decay ** j`.

EAGLE-3 (`draft_vocab` given): the features are the hidden states entering layers 2, N/2 and N-3 (cached in
bf16), `fc` Linear(3h -> h) reads them and the draft's own outputs are fed back without it; the draft predicts over
its own vocabulary (the most frequent reply tokens, d2t/t2d maps; its head starts from the backbone's rows of
them) with cross-entropy only (no feature loss, as EAGLE-3).

Evaluation (`evaluate_eagle`): the same unroll on held-out samples gives, for every decoding step's root, the
rank of the true token at each depth with the draft fed its own outputs: per-depth top-1/top-5, conditional
chain accuracy, and the joint rank-tuple table fit_tree grows static trees from.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from medusa_chat.atomic import atomic_write_bytes, atomic_write_json
from medusa_chat.model.eagle import EagleDraft, _rotate_half
from medusa_chat.model.native_eagle import EAGLE1_DRAFT_VOCAB
from medusa_chat.training.evaluate import MAX_RANK, joint_path_probs
from medusa_chat.training.positions import cache_shards, heldout_mask, hidden_states_for
from medusa_chat.training.store import DistillStore, Log, atomic_torch_save
from medusa_chat.training.train_heads import TrainSettings, WarmupCosine, _Progress, use_bf16

EAGLE_FILE = "model.safetensors"
MAX_UNROLL = 7  # EAGLE-3 unrolls ~7 steps; the cached targets reach 8 tokens past a feature


# ---------------------------------------------------------------------------------------------------------
# data: whole-sample features
# ---------------------------------------------------------------------------------------------------------
@dataclass
class EagleData:
    """Samples as sequences of pairs. Pair t of a sample: feature t (hidden [N, h], fp16) and the ids of tokens
    t + 1 .. t + 1 + M (targets [N, 1 + M], -1 past the end); `sample` [N] the prompt index; `lengths` the pairs
    per sample (rows are contiguous per sample, in that order); `first_pair` the first pair whose prediction a
    decoding step uses (reply_start - 1: the last prompt token's feature with the first reply token)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    sample: torch.Tensor
    lengths: torch.Tensor
    first_pair: torch.Tensor

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.lengths, 0) - self.lengths

    @property
    def positions(self) -> int:
        """Pairs whose prediction a decoding step uses (the trained positions)."""
        return int((self.lengths - self.first_pair).clamp_min(0).sum())

    def select(self, which: torch.Tensor) -> EagleData:
        """The samples at indices `which` (a bool mask over samples or an index tensor)."""
        idx = which.nonzero().flatten() if which.dtype == torch.bool else which
        off, ln = self.offsets[idx], self.lengths[idx]
        spans = [torch.arange(int(o), int(o + n)) for o, n in zip(off, ln, strict=True)]
        rows = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
        return EagleData(
            self.hidden[rows], self.targets[rows], self.sample[rows], ln.clone(), self.first_pair[idx].clone()
        )

    def split(self, holdout: float) -> tuple[EagleData, EagleData]:
        """(train, held-out) by prompt, the same deterministic split as the heads' (positions.heldout_mask)."""
        mask = heldout_mask(self.sample[self.offsets] if len(self) else self.sample, holdout)
        return self.select(~mask), self.select(mask)

    def batch(self, idx: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Samples `idx` right-padded to the longest: features [B, L, h] (fp32), next tokens [B, L], targets
        [B, L, M] (token t + 2 + k; -1 none), use [B, L] (a decoding step uses the pair's prediction)."""
        off, ln, fp = self.offsets, self.lengths, self.first_pair
        width = int(max(int(ln[i]) for i in idx))
        b, h, m = len(idx), self.hidden.shape[1], self.targets.shape[1] - 1
        feats = torch.zeros(b, width, h)
        nxt = torch.zeros(b, width, dtype=torch.long)
        tgt = torch.full((b, width, m), -1, dtype=torch.long)
        use = torch.zeros(b, width, dtype=torch.bool)
        for r, i in enumerate(idx):
            o, n = int(off[i]), int(ln[i])
            feats[r, :n] = self.hidden[o : o + n].float()
            nxt[r, :n] = self.targets[o : o + n, 0].long().clamp_min(0)
            tgt[r, :n] = self.targets[o : o + n, 1:].long()
            use[r, int(fp[i]) : n] = True
        return feats.to(device), nxt.to(device), tgt.to(device), use.to(device)


def eagle_samples(store: DistillStore, shard: Any) -> tuple[list[tuple[int, list[int], int]], dict[int, int]]:
    d = store.load_shard(shard)
    samples, starts = [], {}
    for i, (ids, rs) in enumerate(zip(d["ids"], d["reply_start"], strict=True)):
        # reply_start = 1: hidden_states_for then keeps every position's feature (pairs 0 .. len - 2)
        samples.append((shard.first + i, ids, 1))
        starts[shard.first + i] = int(rs)
    return samples, starts


def cache_eagle_features(
    model: Any,
    store: DistillStore,
    cache_dir: Path,
    batch_tokens: int = 8192,
    log: Log = print,
    deadline: float | None = None,
    taps: tuple[int, ...] | None = None,
) -> list[Path]:
    """Every position's backbone feature (after the final norm; with `taps`, EAGLE-3's inputs of those layers,
    in bf16: the residual stream's massive activations overflow fp16) for each data shard that has none yet, one
    file per shard (resumable; a killed run leaves no partial file)."""
    store_dtype = torch.float16 if taps is None else torch.bfloat16

    def compute(info: Any) -> tuple[dict[str, torch.Tensor], int, int]:
        samples, starts = eagle_samples(store, info)
        pd = hidden_states_for(model, samples, batch_tokens, store_dtype=store_dtype, taps=taps)
        order, counts = torch.unique_consecutive(pd.sample, return_counts=True)
        first = torch.tensor([max(starts[int(s)] - 1, 0) for s in order.tolist()], dtype=torch.int32)
        tensors = {
            "hidden": pd.hidden,
            "targets": pd.targets,
            "sample": pd.sample,
            "lengths": counts.to(torch.int32),
            "first_pair": first,
        }
        return tensors, len(pd), sum(len(ids) for _, ids, _ in samples)

    return cache_shards(store, cache_dir, "feature", compute, log, deadline)


def eagle_features(
    model: Any,
    store: DistillStore,
    cache_dir: Path,
    device: torch.device,
    log: Log = print,
    deadline: float | None = None,
    taps: tuple[int, ...] | None = None,
) -> EagleData:
    """The data's features cached (`cache_eagle_features`, in batches sized for `device`) and loaded on the host:
    training moves its batches to the device one at a time."""
    batch_tokens = 65536 if device.type == "cuda" else 4096
    paths = cache_eagle_features(model, store, cache_dir, batch_tokens, log=log, deadline=deadline, taps=taps)
    return load_eagle_cache(paths)


def load_eagle_cache(paths: list[Path]) -> EagleData:
    if not paths:
        raise ValueError("no feature cache to load: generate data first")
    parts = [torch.load(p, weights_only=True) for p in paths]
    return EagleData(
        torch.cat([d["hidden"] for d in parts]),
        torch.cat([d["targets"] for d in parts]),
        torch.cat([d["sample"] for d in parts]),
        torch.cat([d["lengths"] for d in parts]).long(),
        torch.cat([d["first_pair"] for d in parts]).long(),
    )


# ---------------------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------------------
def draft_config(
    backbone_config: Any, base_model: str = "", draft_vocab: int | None = None
) -> dict[str, Any]:
    """The draft's config.json: a one-layer Llama config with the backbone's shapes (SafeAILab's layout; EAGLE-3
    adds `draft_vocab_size`)."""
    cfg = getattr(backbone_config, "text_config", None) or backbone_config
    h, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    rope = getattr(cfg, "rope_theta", None)
    if rope is None:  # transformers 5 keeps it in rope_parameters
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": int(cfg.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or h // heads),
        "num_hidden_layers": 1,
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": float(rope),
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 2048)),
        "torch_dtype": "float16",
        "base_model_name_or_path": base_model,
        **(
            {"draft_vocab_size": int(draft_vocab), "architectures": ["LlamaForCausalLMEagle3"]}
            if draft_vocab
            else {}
        ),
    }


def new_draft(
    config: dict[str, Any],
    seed: int = 0,
    lm_weight: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
) -> EagleDraft:
    """A fresh draft from its config.json dict (the loader's own parsing: what is trained is what loads). With
    `draft_vocab_size` an EAGLE-3 draft over the tokens `draft_ids`: its maps d2t/t2d, its lm_head started from
    the backbone's rows of those tokens (`lm_weight`); else EAGLE-1."""
    from medusa_chat.model.eagle import _config

    torch.manual_seed(seed)
    cfg = _config(config, "draft config")
    if "draft_vocab_size" not in cfg:
        return EagleDraft(cfg, 1, layers=1).float().train()
    if draft_ids is None or lm_weight is None or len(draft_ids) != cfg["draft_vocab_size"]:
        raise ValueError("an EAGLE-3 draft needs its draft vocabulary and the backbone's lm_head")
    draft = EagleDraft(cfg, 3, feature_size=3 * cfg["hidden_size"]).float()
    ids = draft_ids.sort().values  # draft index i is token i + d2t[i]: ascending ids, as SafeAILab's maps
    with torch.no_grad():
        draft.d2t.copy_(ids - torch.arange(len(ids)))
        draft.t2d.zero_()
        draft.t2d[ids] = True
        draft.lm_head.weight.copy_(lm_weight.detach().float()[ids])
    return draft.train()


def warm_start_eagle(draft: EagleDraft, init: EagleDraft) -> None:
    """Copy a trained draft's weights into the fresh `draft` (fp32): to go on training it, on more data or for
    more epochs. A ValueError naming the first difference when the two are not the same kind and shape (another
    backbone's draft, EAGLE-1 for EAGLE-3, another draft vocabulary)."""
    if init.version != draft.version:
        raise ValueError(f"cannot warm-start an EAGLE-{draft.version} draft from an EAGLE-{init.version} draft")
    own, given = draft.state_dict(), init.state_dict()
    if set(own) != set(given):
        raise ValueError(f"the trained draft's layout differs: keys {sorted(set(own) ^ set(given))[:4]}")
    for key, value in own.items():
        if tuple(given[key].shape) != tuple(value.shape):
            raise ValueError(
                f"the trained draft does not fit this backbone: {key} is {list(given[key].shape)}, "
                f"this draft's is {list(value.shape)}"
            )
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in given.items()})


def draft_index(draft: EagleDraft) -> torch.Tensor:
    """EAGLE-3: token id -> draft index (-1 outside the draft vocabulary)."""
    t2d = draft.t2d
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)


def draft_logits(draft: EagleDraft, out: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
    """The draft's logits over its vocabulary: EAGLE-1 the backbone's lm_head, EAGLE-3 its norm and own head."""
    if draft.version == 3:
        return draft.lm_head(draft.norm(out))
    return F.linear(out.to(lm_weight.dtype), lm_weight)


def _attend(
    draft: EagleDraft,
    x: torch.Tensor,
    emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The draft's one layer over a batch [B, L, h] (EAGLE-1: the fused input `x`, no input norm; EAGLE-3: `x`
    through hidden_norm beside the embedding through input_layernorm, 2h into q/k/v), attending to the keys of
    `past` steps and its own under the additive `mask` [L, (len(past) + 1) L]. Returns (output, keys, values)."""
    layer = draft.blocks[0]
    attn, hd = layer.self_attn, draft.head_dim
    b, n, _ = x.shape
    h = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], dim=-1) if draft.version == 3 else x
    q = attn.q_proj(h).view(b, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(b, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(b, n, -1, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    keys = torch.cat([p[0] for p in past] + [k], dim=2)
    values = torch.cat([p[1] for p in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask.to(q.dtype), enable_gqa=draft.q_heads != draft.kv_heads
    )
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


def unroll_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """Additive mask [n, (step + 1) n] of unroll step `step`: query s sees the backbone-fed keys u <= s - step and,
    in block i (1 <= i <= step), its own chain's key s - step + i (the drafter's cache at depth step + 1)."""
    s = torch.arange(n, device=device)[:, None]
    u = torch.arange(n, device=device)[None, :]
    blocks = [u <= s - step] + [u == s - step + i for i in range(1, step + 1)]
    vis = torch.cat(blocks, dim=1)
    return torch.where(vis, 0.0, torch.finfo(torch.float32).min)


def unrolled_outputs(
    draft: EagleDraft,
    feats: torch.Tensor,
    emb: torch.Tensor,
    steps: int,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """The draft's outputs [B, L, h] for unroll steps 0 .. steps - 1 (see the module docstring). Step j's row s is
    the depth-(j + 1) prediction of the chain whose root pair is s - j; rows s < j are meaningless. `noise`:
    EAGLE's uniform feature noise (the drafter reads a quantized backbone's features and its own inexact ones),
    drawn from `generator` on the host so that a resumed run draws the same."""
    b, n, _ = feats.shape
    pos = torch.arange(n, device=feats.device, dtype=torch.float32)
    angles = pos[:, None] * draft.inv_freq.to(feats.device)[None]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]
    if noise > 0:
        u = torch.rand(feats.shape, generator=generator).to(feats.device, feats.dtype)
        feats = feats + (u - 0.5) * (2 * noise)
    hidden, past, outs = feats, [], []
    for j in range(steps):
        if (
            draft.version == 3
        ):  # fc reads the backbone's three features; the draft's own are fed back as they are
            x = draft.fc(hidden) if j == 0 else hidden
        else:
            x = draft.fc(torch.cat([emb, hidden], dim=-1))
        out, k, v = _attend(draft, x, emb, cos, sin, past, unroll_mask(n, j, feats.device))
        outs.append(out)
        past.append((k, v))
        hidden = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # row s reads step j's output at s - 1
    return outs


def step_rows(use: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
    """[B, L] rows of unroll step `step` that count: the chain's root pair (s - step) is one a decoding step uses
    and the token to predict exists."""
    valid = torch.zeros_like(use)
    if step < use.shape[1]:
        valid[:, step:] = use[:, : use.shape[1] - step]
    return valid & (targets[..., 0] >= 0)


# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------
@dataclass
class EagleSettings:
    unroll: int = 3  # training-time test steps (1 = EAGLE-1's plain teacher forcing)
    epochs: float = 4.0
    batch_tokens: int = 4096  # pairs per batch, padding included
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.03
    ce_weight: float = 0.1  # EAGLE-1: SmoothL1(feature) + 0.1 CE
    step_decay: float = 0.8  # loss weight of unroll step j
    noise: float = 0.1  # uniform feature noise half-width (EAGLE-1: 0.1)
    ce_frac: float = 0.25  # share of rows whose cross-entropy is computed each step (all when evaluating)
    grad_clip: float = 0.5
    seed: int = 0
    checkpoint_every: int = 100
    bf16: bool | None = None

    def check(self) -> None:
        if not 1 <= self.unroll <= MAX_UNROLL:
            raise ValueError(f"--unroll must be between 1 and {MAX_UNROLL}, not {self.unroll}")
        if self.epochs <= 0 or self.lr <= 0 or self.batch_tokens < 1:
            raise ValueError("epochs, learning rate and batch size must be positive")
        if not 0 < self.ce_frac <= 1:
            raise ValueError(f"the cross-entropy row share must be in (0, 1], not {self.ce_frac}")
        if self.ce_weight < 0 or self.noise < 0:
            raise ValueError("the loss weight and the feature noise cannot be negative")


@dataclass
class EagleResult:
    steps: int
    total_steps: int
    seconds: float
    stopped_early: bool
    bf16: bool
    train_top1: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    epoch_heldout_loss: list[float] = field(default_factory=list)


def make_batches(data: EagleData, batch_tokens: int, seed: int) -> list[list[int]]:
    """Samples grouped by length (little padding) into batches of <= batch_tokens padded pairs, in a seeded order."""
    order = torch.argsort(data.lengths, stable=True).tolist()
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, int(data.lengths[i]))
        if cur and w * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, w = [], int(data.lengths[i])
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    return [batches[i] for i in perm]


def batch_losses(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed: torch.Tensor,
    batch: tuple[torch.Tensor, ...],
    settings: EagleSettings,
    noise: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """(weighted loss, per-step top-1 over counted rows) of one batch. EAGLE-1: feature regression + weighted
    cross-entropy over the full vocabulary; EAGLE-3: cross-entropy over its draft vocabulary only (a target
    outside it is left out of the loss and counted a miss)."""
    feats, nxt, tgt, use = batch
    emb = F.embedding(nxt, embed).to(feats.dtype)
    v3 = draft.version == 3
    outs = unrolled_outputs(draft, feats, emb, settings.unroll, 0.0 if v3 else noise, generator)
    want = torch.cat([feats[:, 1:], feats[:, :1]], dim=1)  # the backbone's next feature (last row: no target)
    index = draft_index(draft) if v3 else None
    total = feats.new_zeros(())
    top1 = []
    for j, out in enumerate(outs):
        rows = step_rows(use, tgt, j)
        if not bool(rows.any()):
            top1.append(0.0)
            continue
        o = out[rows]
        t = tgt[..., 0][rows]
        if index is not None:
            t = index[t]
            logits = draft_logits(draft, o, lm_weight).float()
            top1.append(float((logits.argmax(-1) == t).float().mean()))
            if bool((t >= 0).any()):
                total = total + settings.step_decay**j * F.cross_entropy(logits[t >= 0], t[t >= 0])
            continue
        reg = F.smooth_l1_loss(o.float(), want[rows].float())
        if generator is not None and settings.ce_frac < 1:
            # the full-vocabulary projection is most of a step's cost on a CPU: an unbiased row sample of it
            pick = torch.rand(o.shape[0], generator=generator).to(o.device) < settings.ce_frac
            pick[0] = True
            o, t = o[pick], t[pick]
        logits = F.linear(o.to(lm_weight.dtype), lm_weight).float()
        ce = F.cross_entropy(logits, t)
        total = total + settings.step_decay**j * (reg + settings.ce_weight * ce)
        top1.append(float((logits.argmax(-1) == t).float().mean()))
    return total, top1


def train_eagle(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    train: EagleData,
    settings: EagleSettings,
    device: torch.device,
    checkpoint: Path | None = None,
    resume: bool = False,
    heldout: EagleData | None = None,
    deadline: float | None = None,
    log: Log = print,
    stop_after_steps: int | None = None,
) -> EagleResult:
    """Train `draft` in place. Resumable from `checkpoint` (same settings and data); stops by `deadline` (the
    cosine schedule is shortened once to fit, after a warm-up measurement, as train_heads does); with `heldout`,
    the held-out loss is measured at each epoch end and the best epoch's weights are kept.
    `stop_after_steps` simulates an interruption (tests)."""
    settings.check()
    if len(train) == 0:
        raise ValueError("no training samples: generate data first")
    bf16 = use_bf16_eagle(settings, device)
    draft.to(device).float().train()
    lm_w = lm_weight.detach().to(device, torch.bfloat16 if bf16 else torch.float32)
    embed = embed_weight.detach().to(device, torch.float32)
    batches_per_epoch = len(make_batches(train, settings.batch_tokens, 0))
    plan = WarmupCosine.planned(int(round(settings.epochs * batches_per_epoch)), settings.warmup_frac)

    opt = torch.optim.AdamW(
        draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    key = {**asdict(settings), "pairs": len(train.hidden), "samples": len(train)}
    state: dict[str, Any] = {
        "step": 0,
        "best_loss": math.inf,
        "best_epoch": None,
        "epoch_losses": [],
        "best": None,
    }
    if resume and checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, weights_only=True, map_location=device)
        if ck["key"] == key:
            draft.load_state_dict(ck["draft"])
            opt.load_state_dict(ck["opt"])
            plan.total = int(ck["total"])
            state.update(
                step=int(ck["step"]),
                best_loss=float(ck["best_loss"]),
                best_epoch=ck["best_epoch"],
                epoch_losses=list(ck["epoch_losses"]),
                best=ck.get("best"),
            )
            log(f"resuming EAGLE training at step {state['step']}/{plan.total}")
        else:
            log("checkpoint is for other settings or data: training from scratch")

    def save_ck() -> None:
        if checkpoint is not None:
            atomic_torch_save(
                {
                    "key": key,
                    "draft": draft.state_dict(),
                    "opt": opt.state_dict(),
                    "total": plan.total,
                    **{k: state[k] for k in ("step", "best_loss", "best_epoch", "epoch_losses")},
                    "best": state["best"],
                },
                checkpoint,
            )

    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    ema = [0.0] * settings.unroll
    bar = _Progress(plan.total, "train eagle", log)
    t0, t_meas, stopped = time.time(), None, False
    cur_epoch, batches = -1, []
    try:
        while state["step"] < plan.total:
            step = state["step"]
            epoch, off = divmod(step, batches_per_epoch)
            if epoch != cur_epoch:  # the same order after a resume
                batches, cur_epoch = (
                    make_batches(train, settings.batch_tokens, settings.seed * 7919 + epoch),
                    epoch,
                )
            batch = train.batch(batches[off], device)
            with amp:
                noise_gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
                loss, top1 = batch_losses(draft, lm_w, embed, batch, settings, settings.noise, noise_gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), settings.grad_clip)
            for grp in opt.param_groups:  # schedule set by hand: survives resumes and a shortened plan
                grp["lr"] = settings.lr * plan(step)
            opt.step()
            state["step"] = step = step + 1
            ema = [0.9 * e + 0.1 * a for e, a in zip(ema, top1, strict=True)]
            if step == 3:
                t_meas = time.time()
            elif deadline is not None and t_meas is not None and step == 13:
                per = (time.time() - t_meas) / 10
                fit = int((deadline - time.time()) / per * 0.92)
                if step + fit < plan.total:
                    plan.total = max(step + 1, step + fit)
                    log(f"time budget: training shortened to {plan.total} steps ({per:.2f} s/step)")
            bar.update(
                step, f"loss {loss.item():.3f} top1 " + " ".join(f"{a:.2f}" for a in ema), total=plan.total
            )
            end_of_epoch = step % batches_per_epoch == 0 or step == plan.total
            if end_of_epoch and heldout is not None and len(heldout):
                hl = heldout_loss(draft, lm_w, embed, heldout, settings, device, bf16)
                state["epoch_losses"].append(round(hl, 5))
                if hl < state["best_loss"]:
                    state["best_loss"], state["best_epoch"] = hl, math.ceil(step / batches_per_epoch)
                    state["best"] = {k: v.detach().clone() for k, v in draft.state_dict().items()}
                log(f"epoch {math.ceil(step / batches_per_epoch)}: held-out loss {hl:.4f}")
            if checkpoint is not None and (step % settings.checkpoint_every == 0 or end_of_epoch):
                save_ck()
            if stop_after_steps is not None and step >= stop_after_steps:
                stopped = True
                break
            if deadline is not None and time.time() > deadline:
                log("time budget: training stopped")
                stopped = True
                break
    finally:
        bar.close()
    save_ck()
    if state["best"] is not None and not stopped:
        draft.load_state_dict(state["best"])
    return EagleResult(
        state["step"],
        plan.total,
        time.time() - t0,
        stopped,
        bf16,
        [round(a, 4) for a in ema],
        state["best_epoch"],
        state["epoch_losses"],
    )


def use_bf16_eagle(settings: EagleSettings, device: torch.device) -> bool:
    """bf16 autocast: as for heads (on CUDA and on CPUs with native bf16 matmul) unless the settings say."""
    return use_bf16(TrainSettings(bf16=settings.bf16), device)


@torch.no_grad()
def heldout_loss(
    draft: EagleDraft,
    lm_w: torch.Tensor,
    embed: torch.Tensor,
    data: EagleData,
    settings: EagleSettings,
    device: torch.device,
    bf16: bool,
) -> float:
    """Weighted held-out loss (no feature noise)."""
    was = draft.training
    draft.eval()
    tot = cnt = 0.0
    for idx in make_batches(data, settings.batch_tokens, 0):
        batch = data.batch(idx, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = batch_losses(draft, lm_w, embed, batch, settings, 0.0)
        n = float(batch[3].sum())
        tot, cnt = tot + float(loss) * n, cnt + n
    draft.train(was)
    return tot / max(cnt, 1.0)


# ---------------------------------------------------------------------------------------------------------
# evaluation, saving
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_eagle(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    data: EagleData,
    device: torch.device,
    depth: int = 5,
    max_rank: int = MAX_RANK,
    batch_tokens: int = 1024,  # full-vocabulary logits of a batch: 200 MB at 49k tokens
    joint_top: int = 2048,
) -> dict[str, Any]:
    """Held-out accuracy of the draft fed its own outputs, in fp32 (as it runs on a CPU), per decoding step's
    root: the rank of the true token at depths 1 .. `depth` given the true tokens before it. Returns per-depth
    top1/top5/rank_acc, `chain_top1_conditional` (depth d right given depths < d right) and `joint` (rank-tuple
    prefixes' frequencies: a static tree node's greedy acceptance probability, as evaluate.evaluate_heads)."""
    was = draft.training
    draft.eval().to(device).float()
    lm_w = lm_weight.detach().to(device).float()
    embed = embed_weight.detach().to(device).float()
    vocab = draft.vocab_map()
    rank_rows = []
    for idx in make_batches(data, batch_tokens, 0):
        feats, nxt, tgt, use = data.batch(idx, device)
        outs = unrolled_outputs(draft, feats, F.embedding(nxt, embed), depth)
        b, n = use.shape
        ranks = torch.full((b, n, depth), max_rank, dtype=torch.long, device=device)
        for j, out in enumerate(outs):
            # step j at row s is depth j + 1 of the chain rooted at pair s - j: move it back to row s - j
            top = draft_logits(draft, out, lm_w).topk(max_rank, dim=-1).indices  # [B, L, R]
            if vocab is not None:
                top = vocab[top]  # EAGLE-3: draft indices -> token ids
            hit = top == tgt[..., :1]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), max_rank)
            rank = torch.where(tgt[..., 0] >= 0, rank, max_rank)  # past the reply's end: nothing to accept
            if j < n:
                ranks[:, : n - j, j] = rank[:, j:]
        rank_rows.append(ranks[use].cpu())
    draft.train(was)
    if not rank_rows:
        raise ValueError("no held-out samples to evaluate")
    steps = torch.cat(rank_rows)
    top1 = [round(float((steps[:, d] == 0).float().mean()), 4) for d in range(depth)]
    top5 = [round(float((steps[:, d] < 5).float().mean()), 4) for d in range(depth)]
    rank_acc = [
        [round(float((steps[:, d] == r).float().mean()), 5) for r in range(max_rank)] for d in range(depth)
    ]
    chain, alive = [], torch.ones(steps.shape[0], dtype=torch.bool)
    for d in range(depth):
        ok = alive & (steps[:, d] == 0)
        chain.append(round(float(ok.sum()) / max(1, int(alive.sum())), 4))
        alive = ok
    return {
        "positions": int(steps.shape[0]),
        "depths": depth,
        "top1": top1,
        "top5": top5,
        "rank_acc": rank_acc,
        "chain_top1_conditional": chain,
        "joint": joint_path_probs(steps, max_rank, joint_top),
    }


def save_draft(draft: EagleDraft, config: dict[str, Any], out_dir: Path) -> None:
    """`config.json` + `model.safetensors` (fp16, the published key names; the embedding is the backbone's and is
    left out, as the loader drops it anyway)."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in draft.state_dict().items()
    }
    # in memory, then the one atomic writer: a readable file (safetensors' save_file would leave it 0600)
    atomic_write_bytes(out_dir / EAGLE_FILE, save(tensors, metadata={"format": "pt"}))
    atomic_write_json(out_dir / "config.json", config)


def train_and_save_eagle(
    backbone: Any,
    data: EagleData,
    settings: EagleSettings,
    out_dir: Path,
    base_model: str,
    device: torch.device,
    holdout: float = 0.03,
    checkpoint: Path | None = None,
    resume: bool = False,
    deadline: float | None = None,
    tree_budget: int = 64,
    eval_depth: int = 5,
    log: Log = print,
    extra_report: dict[str, Any] | None = None,
    stop_after_steps: int | None = None,
    draft_vocab: int | None = None,
    eagle1_draft_vocab: int = EAGLE1_DRAFT_VOCAB,
    init_from: EagleDraft | None = None,
) -> dict[str, Any]:
    """Train an EAGLE-1 draft (with `draft_vocab`: EAGLE-3 over that many of the most frequent reply tokens, on
    `data` cached with EAGLE-3's taps) for `backbone`, round it to fp16, evaluate it on the held-out prompts,
    write the Hub layout + accuracy.json + tree.json (a static tree fitted to the draft's measured chain ranks);
    an EAGLE-1 draft also its `eagle1_draft_vocab` most frequent reply tokens (draft_vocab.safetensors, where the
    vocabulary is larger), which the C drafter guesses among.
    `init_from`: a trained draft of the same kind and shape to continue from (`warm_start_eagle`); an EAGLE-3
    draft keeps its draft vocabulary, `draft_vocab` is then its size."""
    from medusa_chat.training.fit_tree import fit_tree, size_summary
    from medusa_chat.training.pipeline import round_heads_

    settings.check()
    train, held = data.split(holdout)
    lm_weight = backbone.get_output_embeddings().weight.detach()
    embed_weight = backbone.get_input_embeddings().weight.detach()
    ids = None
    if init_from is not None and init_from.version == 3:  # its own vocabulary: its head's rows stay those tokens
        ids = torch.nonzero(init_from.t2d).flatten()
        draft_vocab = len(ids)
    elif draft_vocab:
        from medusa_chat.training.train_heads import draft_vocabulary

        ids = draft_vocabulary(train, draft_vocab, lm_weight.shape[0])  # type: ignore[arg-type]
    config = draft_config(backbone.config, base_model, draft_vocab)
    draft = new_draft(config, settings.seed, lm_weight, ids)
    if init_from is not None:
        warm_start_eagle(draft, init_from)
    kind = f"EAGLE-3 ({draft_vocab}-token draft vocabulary)" if draft_vocab else "EAGLE-1"
    n_params = sum(p.numel() for p in draft.parameters())
    log(
        f"training an {kind} draft ({n_params / 1e6:.2f} M parameters, {2 * n_params / 1e6:.1f} MB fp16) on "
        f"{len(train)} samples ({train.positions} positions), unroll {settings.unroll}, {settings.epochs} epochs"
        + (" from a trained draft" if init_from is not None else "")
    )
    result = train_eagle(
        draft,
        lm_weight,
        embed_weight,
        train,
        settings,
        device,
        checkpoint=checkpoint,
        resume=resume,
        heldout=held if len(held) else None,
        deadline=deadline,
        log=log,
        stop_after_steps=stop_after_steps,
    )
    draft.cpu().float()
    round_heads_(draft)  # evaluate exactly the fp16 weights that are shipped
    save_draft(draft, config, out_dir)
    if not draft_vocab and eagle1_draft_vocab < lm_weight.shape[0]:
        # EAGLE-1 projects with the backbone's whole lm_head; on a CPU the C drafter reads only these rows of it
        # (native_eagle.py), so they are the reply tokens this draft was trained on, most frequent first
        from safetensors.torch import save

        from medusa_chat.model.heads_files import DRAFT_VOCAB_FILE
        from medusa_chat.training.train_heads import draft_vocabulary

        ids = draft_vocabulary(train, eagle1_draft_vocab, lm_weight.shape[0])  # type: ignore[arg-type]
        atomic_write_bytes(out_dir / DRAFT_VOCAB_FILE, save({"draft_vocab": ids.to(torch.int64).contiguous()}))
    report: dict[str, Any] = {
        "heads": {
            "format": draft.format,
            "layers": 1,
            "parameters": n_params,
            "file_mb": round(2 * n_params / 1e6, 3),
        },
        "data": {
            "train_samples": len(train),
            "train_positions": train.positions,
            "heldout_samples": len(held),
            "heldout_positions": held.positions,
        },
        "training": {**asdict(settings), **asdict(result), "seconds": round(result.seconds, 1)},
        **(extra_report or {}),
    }
    if len(held):
        t = time.time()
        ev = evaluate_eagle(draft, lm_weight, embed_weight, held, device, depth=eval_depth)
        report["heldout"] = ev
        tree = fit_tree(report, budget=tree_budget, name=f"{out_dir.name}-fitted")
        atomic_write_json(out_dir / "tree.json", tree)
        report["estimated_tokens_per_step"] = size_summary(tree)
        report["estimated_tokens_per_step_chain"] = round(
            1 + sum(math.prod(ev["chain_top1_conditional"][: i + 1]) for i in range(eval_depth)), 4
        )
        log(
            f"held-out ({ev['positions']} positions, {time.time() - t:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']}"
        )
        log(f"estimated tokens/step (greedy, fitted static tree): {report['estimated_tokens_per_step']}")
    atomic_write_json(out_dir / "accuracy.json", report)
    report["config"] = config
    return report

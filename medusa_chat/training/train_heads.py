"""Medusa-1 head training on a frozen backbone, from self-distilled data (see distill.py).

Pipeline pieces (the CLI and benchmarks/gpu_train_heads.py both use them):

1. `cache_hidden_states`: one forward pass of the backbone over prompt + reply per sample; keep the last hidden
   state (after the final norm: what the heads see at decode time) at the *reply* positions only, in fp16, one
   cache file per data shard. The backbone never runs again during training: heads see cached states.
2. `train_heads`: head k at position t learns the token at t + 2 + k (cross-entropy), head weights 0.8**k,
   AdamW + warmup/cosine, bf16 autocast where the hardware does bf16 well, checkpoints for resuming. With a
   `teacher_weight`, that share of each head's loss is against the backbone's own distribution of the token
   instead (teacher.py: Hydra++'s teacher loss); the held-out loss that picks the best epoch stays on the
   stored tokens.
3. `evaluate_heads`: held-out per-head top-1/top-5, rank-r accuracy (r < 10, what fit-tree needs), chain
   (conditional) accuracies, and the joint distribution of rank tuples so trees can be fitted to correlated hits.
4. `save_heads`: the published Hub layout (`config.json` + `medusa_lm_head.safetensors`, published key names,
   fp16), which `medusa_chat.model.forward.heads.heads_from_state_dict` reloads bit-exactly.

Hydra heads (`--heads-format hydra`) train the same way with teacher forcing: head k also sees the true tokens
x_{t+1} .. x_{t+1+k} (already in the cached targets), which is exactly what it sees on a tree path whose
earlier tokens were accepted; their loss and accuracies are over the draft vocabulary (a target outside it is a
sure miss). `warm_start_` starts them from trained v2 heads.

Position t of a sample covers t = reply_start - 1 (last prompt token: the hidden state the first decoding step
uses) up to len - 2. Targets past the end of the reply are -1 (ignored).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from medusa_chat.machine import cpu_native_bf16
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads
from medusa_chat.training.loop import (
    Checkpoint,
    DeadlineFit,
    Progress,
    RunningTop1,
    RunOptions,
    RunState,
    TrainResult,
    WarmupCosine,
    set_learning_rate,
)
from medusa_chat.training.positions import MAX_CACHED_HEADS, PositionData
from medusa_chat.training.teacher import teacher_losses, teacher_rows, teacher_targets


# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainSettings:
    num_heads: int = 4
    num_layers: int = 1
    heads_format: str = "v2"  # v2: shared lm_head (small files); v1: one projection per head; hydra (ours)
    draft_vocab_size: int = 8192  # hydra only: heads guess among the most frequent reply tokens
    epochs: float = 2.0
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.03
    head_decay: float = 0.8  # loss weight of head k: head_decay ** k
    teacher_weight: float = 0.0  # the backbone's distribution's share of the loss (teacher.py); 0: stored tokens
    teacher_top: int = 8  # the teacher's likeliest classes kept per position
    seed: int = 0
    checkpoint_every: int = 200
    bf16: bool | None = None  # None: on for CUDA, and on CPUs with native bf16 matmul


def use_bf16(settings: TrainSettings, device: torch.device) -> bool:
    if settings.bf16 is not None:
        return settings.bf16
    return device.type == "cuda" or (device.type == "cpu" and cpu_native_bf16())


def new_heads(
    settings: TrainSettings,
    lm_head: nn.Module,
    hidden_size: int,
    vocab_size: int,
    draft_vocab: torch.Tensor | None = None,
) -> MedusaHeads:
    """Paper init: ResBlocks start as the identity (W = 0, in ResBlock), v1 projections copy lm_head."""
    if settings.num_heads > MAX_CACHED_HEADS:
        raise ValueError(f"at most {MAX_CACHED_HEADS} heads (targets are cached for that many)")
    if settings.heads_format not in ("v1", "v2", "hydra"):
        raise ValueError(f"heads format must be v1, v2 or hydra, not {settings.heads_format!r}")
    if settings.heads_format == "hydra":
        if draft_vocab is None:
            raise ValueError("Hydra heads need a draft vocabulary (see draft_vocabulary)")
        return HydraHeads(hidden_size, vocab_size, settings.num_heads, settings.num_layers, draft_vocab)
    heads = MedusaHeads(
        hidden_size, vocab_size, settings.num_heads, settings.num_layers, settings.heads_format == "v1"
    )
    heads.init_from_lm_head(lm_head)
    return heads


def head_projection(heads: MedusaHeads, lm_weight: torch.Tensor) -> torch.Tensor:
    """The frozen projection shared heads use: the lm_head, or its draft-vocabulary rows for Hydra heads."""
    if isinstance(heads, HydraHeads):
        return lm_weight.index_select(0, heads.draft_vocab.to(lm_weight.device))
    return lm_weight


def head_targets(heads: MedusaHeads, targets: torch.Tensor, vocab_index: torch.Tensor | None) -> torch.Tensor:
    """[B, 1 + M] cached targets -> [B, K] class indices for the heads' logits (-1 none, -2 outside the draft
    vocabulary: a sure miss, left out of the loss)."""
    t = targets[:, 1 : 1 + heads.num_heads].long()
    if vocab_index is None:
        return t
    return torch.where(t >= 0, vocab_index[t.clamp_min(0)], t)


def head_logits(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    proj_weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    embed_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H] -> [K, B, V']. v2 shares the frozen lm_head (`proj_weight`, see head_projection); v1 uses each
    head's projection. Hydra heads are teacher-forced: head k sees the true tokens x_{t+1..t+1+k}, read from
    the cached `targets` (columns 0..K-1) and embedded with the backbone's input embeddings."""
    if isinstance(heads, HydraHeads):
        if targets is None or embed_weight is None:
            raise ValueError("Hydra heads need the cached targets and the backbone's input embeddings")
        inputs = targets[:, : heads.num_heads].long().clamp_min(0)  # past the reply's end: no target anyway
        emb = F.embedding(inputs, embed_weight)
        return F.linear(heads.features_teacher_forced(hidden, emb), proj_weight)
    if heads.own_lm_head:
        return heads(hidden)
    return F.linear(heads.features(hidden), proj_weight)


def draft_vocabulary(train: PositionData, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent reply tokens in the training data (ties by id), most frequent first."""
    t = train.targets[:, 0].long()
    counts = torch.bincount(t[t >= 0], minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # deterministic tie order
    return counts.topk(min(size, vocab_size)).indices


def head_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-head mean cross-entropy over valid targets ([K]); a head with no valid target gets 0."""
    out = []
    for k in range(logits.shape[0]):
        t = targets[:, k].long()
        valid = t >= 0
        if not bool(valid.any()):
            out.append(logits.new_zeros((), dtype=torch.float32))
            continue
        out.append(F.cross_entropy(logits[k][valid].float(), t[valid]))
    return torch.stack(out)


def train_heads(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    train: PositionData,
    settings: TrainSettings,
    run: RunOptions,
    heldout: PositionData | None = None,
    embed_weight: torch.Tensor | None = None,
) -> TrainResult:
    """Train `heads` in place on cached positions. Resumable from `run.checkpoint`; stops by `run.deadline`.

    If the run would miss the deadline, the schedule is shortened once (after a warm-up measurement) so the
    cosine decay still finishes; a hard stop at the deadline saves a checkpoint. With `heldout`, the held-out
    loss is measured at each epoch end and the best epoch's weights are kept (the second epoch on small data
    already memorises). `run.stop_after_steps` simulates an interruption (tests).
    """
    device, checkpoint, log, stop_after_steps = run.device, run.checkpoint, run.log, run.stop_after_steps
    k = settings.num_heads
    bf16 = use_bf16(settings, device)
    heads.to(device).train()
    lm_weight = head_projection(heads, lm_weight.detach().to(device))
    if bf16 and not heads.own_lm_head:
        lm_weight = lm_weight.to(torch.bfloat16)  # cast the frozen projection once, not every step
    vocab_index, embed = hydra_inputs(heads, embed_weight, device, bf16)
    n = len(train)
    if n == 0:
        raise ValueError("no training positions: generate data first")
    teacher = None
    if settings.teacher_weight > 0:
        t = time.time()
        teacher = teacher_targets(train, lm_weight.float(), settings.teacher_top)  # fp32: the ties decide
        log(f"teacher: the backbone's top {settings.teacher_top} at {n} positions in {time.time() - t:.0f}s")
    steps_per_epoch = max(1, math.ceil(n / settings.batch_size))
    plan = WarmupCosine.planned(int(round(settings.epochs * steps_per_epoch)), settings.warmup_frac)

    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    saved = Checkpoint(checkpoint, {**asdict(settings), "positions": n}, heads, opt, plan, "heads", "best_state")
    state = saved.resume(device, log, "training") if run.resume else RunState()

    weights = torch.tensor([settings.head_decay**i for i in range(k)], device=device)
    top1_running = RunningTop1(k, 0.95)
    bar = Progress(plan.total, "train", log)
    t0, stopped = time.time(), False
    fit = DeadlineFit(run.deadline, 10, 40, lambda per: f"{per * 1000:.0f} ms/step")
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    order = _EpochOrder(n, settings.seed, train.hidden.device)
    try:
        while state.step < plan.total:
            idx = order.batch(state.step, steps_per_epoch, settings.batch_size)
            h = train.hidden[idx].to(device, non_blocking=True).float()
            raw = train.targets[idx].to(device, non_blocking=True)
            tg = head_targets(heads, raw, vocab_index)
            with amp:
                logits = head_logits(heads, h, lm_weight, raw, embed)
            a = settings.teacher_weight if teacher is not None else 0.0
            losses = head_losses(logits, tg) * (1 - a) if a < 1 else 0.0  # the stored tokens' share
            if a > 0:
                losses = losses + a * teacher_losses(logits, teacher, *teacher_rows(train, idx, k))
            loss = (losses * weights).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            set_learning_rate(opt, settings.lr * plan(state.step))
            opt.step()
            state.step += 1
            top1_running.update(_batch_top1(logits, tg))
            fit.after_step(state.step, plan, log)
            bar.update(state.step, f"loss {loss.item():.3f} top1 {top1_running}", plan.total)
            end_of_epoch = state.step % steps_per_epoch == 0 or state.step == plan.total
            if end_of_epoch and heldout is not None and len(heldout):
                hl = heldout_loss(heads, lm_weight, heldout, settings, device, bf16, (vocab_index, embed))
                epoch = math.ceil(state.step / steps_per_epoch)
                state.score_epoch(hl, epoch, heads)
                log(f"epoch {epoch}: held-out weighted loss {hl:.4f}")
            if checkpoint is not None and (state.step % settings.checkpoint_every == 0 or end_of_epoch):
                saved.save(state)
            stopped = stop_after_steps is not None and state.step >= stop_after_steps
            if not stopped and fit.passed():
                log("time budget: training stopped")
                stopped = True
            if stopped:
                saved.save(state)
                break
    finally:
        bar.close()
    if state.best is not None and not stopped:
        heads.load_state_dict(state.best)
    saved.save(state)
    ema_top1 = [round(a, 4) for a in top1_running.values]
    return TrainResult(
        state.step, plan.total, time.time() - t0, stopped, bf16, ema_top1, state.best_epoch, state.epoch_losses
    )


class _EpochOrder:
    """The positions' shuffled order: one permutation per epoch, seeded by the epoch (the same after a resume)."""

    def __init__(self, n: int, seed: int, device: torch.device) -> None:
        self.n, self.seed, self.device = n, seed, device
        self.epoch, self.perm = -1, torch.empty(0, dtype=torch.long)

    def batch(self, step: int, steps_per_epoch: int, batch_size: int) -> torch.Tensor:
        """The position indices of step `step`'s batch."""
        epoch, off = divmod(step, steps_per_epoch)
        if epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self.perm, self.epoch = torch.randperm(self.n, generator=g).to(self.device), epoch
        return self.perm[off * batch_size : (off + 1) * batch_size]


@torch.no_grad()
def _batch_top1(logits: torch.Tensor, targets: torch.Tensor) -> list[float | None]:
    """Each head's top-1 accuracy over its valid targets in this batch (None for a head with none)."""
    hit = logits.argmax(-1) == targets.T.long()
    valid = targets.T >= 0
    counts = valid.sum(1).tolist()
    hits = (hit & valid).sum(1).tolist()
    return [h / v if v else None for h, v in zip(hits, counts, strict=True)]


HELDOUT_POSITIONS = 20000  # the held-out loss's sample: enough to rank the epochs, fast at each epoch end


@torch.no_grad()
def heldout_loss(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    data: PositionData,
    settings: TrainSettings,
    device: torch.device,
    bf16: bool,
    hydra: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> float:
    """Weighted held-out loss over at most HELDOUT_POSITIONS positions; `lm_weight` is already the heads'
    projection (head_projection), `hydra` what hydra_inputs gives (the draft-vocab index map, the embeddings)."""
    vocab_index, embed = hydra
    batch_size = 1024
    was = heads.training
    heads.eval()
    n = min(len(data), HELDOUT_POSITIONS)
    tot, cnt = 0.0, 0
    w = torch.tensor([settings.head_decay**i for i in range(settings.num_heads)], device=device)
    for s in range(0, n, batch_size):
        h = data.hidden[s : s + batch_size].to(device).float()
        raw = data.targets[s : s + batch_size].to(device)
        tg = head_targets(heads, raw, vocab_index)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = head_logits(heads, h, lm_weight, raw, embed)
        tot += float((head_losses(logits, tg) * w).sum()) * h.shape[0]
        cnt += h.shape[0]
    heads.train(was)
    return tot / max(cnt, 1)


# ---------------------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------------------


def heads_file_bytes(settings: TrainSettings, hidden: int, vocab: int) -> int:
    per_layer = hidden * hidden + hidden
    proj = hidden * vocab if settings.heads_format == "v1" else 0
    heads = settings.num_heads * (settings.num_layers * per_layer + proj) * 2
    if settings.heads_format == "hydra":  # the shared token cell (fp16) and the draft vocabulary (int32)
        return heads + (2 * hidden * hidden + hidden) * 2 + settings.draft_vocab_size * 4
    return heads


def warm_start_(heads: MedusaHeads, trained: MedusaHeads) -> None:
    """Copy the ResBlocks (and v1 projections; the token cell between Hydra heads) of `trained` into `heads`.

    Shapes must match (K, layers, hidden size). The draft vocabulary is not copied: a Hydra run picks its own
    from its data, and the cell and ResBlocks do not depend on it."""
    mine = heads.state_dict()
    own_keys = [k for k in mine if k[0].isdigit() or k.startswith("draft.linear.")]
    theirs = {k: v for k, v in trained.state_dict().items() if k in own_keys}
    needed = [k for k in own_keys if k[0].isdigit()]  # the cell may stay at zero (Medusa -> Hydra)
    bad = [k for k, v in theirs.items() if v.shape != mine[k].shape]
    if bad or any(k not in theirs for k in needed):
        raise ValueError(
            f"cannot warm-start {heads.num_heads}x{heads.num_layers} {heads.format} heads from "
            f"{trained.num_heads}x{trained.num_layers} {trained.format} heads"
        )
    heads.load_state_dict({**mine, **{k: v.float() for k, v in theirs.items()}})


# ---------------------------------------------------------------------------------------------------------
# one configuration end to end: train -> round -> evaluate -> save -> fit tree
# ---------------------------------------------------------------------------------------------------------


def hydra_inputs(
    heads: MedusaHeads, embed_weight: torch.Tensor | None, device: torch.device, bf16: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(target -> draft-vocab index map, input embeddings on the device) for Hydra heads; (None, None) else."""
    if not isinstance(heads, HydraHeads):
        return None, None
    if embed_weight is None:
        raise ValueError("Hydra heads need the backbone's input embeddings (embed_weight=)")
    embed = embed_weight.detach().to(device, torch.bfloat16 if bf16 else torch.float32)
    return heads.vocab_index(embed.shape[0]).to(device), embed

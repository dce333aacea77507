"""The EAGLE trainer's loop: its settings, batches, losses, and the resumable training run with a held-out loss
per epoch.

Loss (EAGLE): smooth L1 between the draft's output at pair t and the backbone's feature t + 1, plus
`ce_weight` x cross-entropy of the lm_head over the draft's output against the distilled token t + 2; unroll
step j's loss (eagle_model.unrolled_outputs) weighs `step_decay ** j`. EAGLE-3: cross-entropy over its draft
vocabulary only (no feature loss, as EAGLE-3); with `teacher_weight` A, share A of it is against the backbone's
own distribution of the token over the draft vocabulary (teacher.eagle_teacher; EAGLE-3's reference trains on
that distribution alone), the rest against the stored token.

The data is eagle_data.py's, the draft and its unrolled forward eagle_model.py's; evaluating and saving the
trained draft (what `train-heads --heads-format eagle` runs end to end) is eagle_pipeline.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from medusa_chat.model.forward.eagle import EagleDraft
from medusa_chat.training.eagle_data import EagleData
from medusa_chat.training.eagle_model import draft_index, draft_logits, step_rows, unrolled_outputs
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
from medusa_chat.training.train_heads import TrainSettings, use_bf16

MAX_UNROLL = 7  # EAGLE-3 unrolls ~7 steps; the cached targets reach 8 tokens past a feature


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
    teacher_weight: float = 0.0  # EAGLE-3: the backbone's distribution's share of the loss; 0: stored tokens only

    def check(self) -> None:
        if not 1 <= self.unroll <= MAX_UNROLL:
            raise ValueError(f"--unroll must be between 1 and {MAX_UNROLL}, not {self.unroll}")
        if self.epochs <= 0 or self.lr <= 0 or self.batch_tokens < 1:
            raise ValueError("epochs, learning rate and batch size must be positive")
        if not 0 < self.ce_frac <= 1:
            raise ValueError(f"the cross-entropy row share must be in (0, 1], not {self.ce_frac}")
        if self.ce_weight < 0 or self.noise < 0:
            raise ValueError("the loss weight and the feature noise cannot be negative")
        if not 0 <= self.teacher_weight <= 1:
            raise ValueError(f"the teacher's share of the loss must be in [0, 1], not {self.teacher_weight}")


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
) -> tuple[torch.Tensor, list[float | None]]:
    """(weighted loss, per-step top-1 over counted rows: None for a step with none) of one batch. EAGLE-1:
    feature regression + weighted cross-entropy over the full vocabulary; EAGLE-3: cross-entropy over its draft
    vocabulary only (a target outside it is left out of the loss and counted a miss), and with a teacher in the
    batch its share `teacher_weight` against the teacher's distribution where a row has one (`draft_vocab_loss`)."""
    feats, nxt, tgt, use = batch[:4]
    teacher = batch[4:] if len(batch) > 4 and settings.teacher_weight > 0 else None
    emb = F.embedding(nxt, embed).to(feats.dtype)
    v3 = draft.version == 3
    outs = unrolled_outputs(draft, feats, emb, settings.unroll, 0.0 if v3 else noise, generator)
    want = torch.cat([feats[:, 1:], feats[:, :1]], dim=1)  # the backbone's next feature (last row: no target)
    index = draft_index(draft) if v3 else None
    total = feats.new_zeros(())
    top1: list[float | None] = []
    for j, out in enumerate(outs):
        rows = step_rows(use, tgt, j)
        if not bool(rows.any()):
            top1.append(None)
            continue
        o = out[rows]
        t = tgt[..., 0][rows]
        if index is not None:
            t = index[t]
            logits = draft_logits(draft, o, lm_weight).float()
            top1.append(float((logits.argmax(-1) == t).float().mean()))
            taught = None if teacher is None else (teacher[0][rows], teacher[1][rows])
            loss = draft_vocab_loss(logits, t, taught, settings.teacher_weight)
            if loss is not None:
                total = total + settings.step_decay**j * loss
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


def draft_vocab_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    teacher_weight: float,
) -> torch.Tensor | None:
    """An EAGLE-3 step's loss over rows: cross-entropy against the stored token's draft index (`target`, -1
    outside the draft vocabulary), and where a row has a teacher (ids, probs [rows, top]; zero probabilities:
    none), share `teacher_weight` of it against the teacher's distribution instead, -sum_j p_j log q(id_j), the
    KL divergence up to the teacher's entropy. The mean over rows with either; None where no row has one."""
    known = target >= 0
    hard = F.cross_entropy(logits, target.clamp_min(0), reduction="none") * known
    if teacher is None or teacher_weight == 0:
        counted, per_row = known, hard
    else:
        ids, probs = teacher
        has = probs.sum(-1) > 0
        soft = -(probs * torch.log_softmax(logits, dim=-1).gather(-1, ids)).sum(-1)
        share = teacher_weight * has.float()
        counted, per_row = known | has, (1 - share) * hard + share * soft
    if not bool(counted.any()):
        return None
    return per_row[counted].mean()


def train_eagle(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    train: EagleData,
    settings: EagleSettings,
    run: RunOptions,
    heldout: EagleData | None = None,
) -> TrainResult:
    """Train `draft` in place. Resumable from `run.checkpoint` (same settings and data); stops by `run.deadline`
    (the cosine schedule is shortened once to fit, after a warm-up measurement, as train_heads does); with
    `heldout`, the held-out loss is measured at each epoch end and the best epoch's weights are kept.
    `run.stop_after_steps` simulates an interruption (tests)."""
    device, checkpoint, log, stop_after_steps = run.device, run.checkpoint, run.log, run.stop_after_steps
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
    saved = Checkpoint(checkpoint, key, draft, opt, plan, "draft", "best")
    state = saved.resume(device, log, "EAGLE training") if run.resume else RunState()

    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    top1_running = RunningTop1(settings.unroll, 0.9)
    bar = Progress(plan.total, "train eagle", log)
    t0, stopped = time.time(), False
    fit = DeadlineFit(run.deadline, 3, 13, lambda per: f"{per:.2f} s/step")
    order = _EpochBatches(train, settings)
    try:
        while state.step < plan.total:
            batch = train.batch(order.batch(state.step, batches_per_epoch), device)
            with amp:
                noise_gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + state.step)
                loss, top1 = batch_losses(draft, lm_w, embed, batch, settings, settings.noise, noise_gen)
            opt.zero_grad(set_to_none=True)
            # no counted row in the batch (every target outside the draft vocabulary): nothing to learn from it
            if loss.requires_grad:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(draft.parameters(), settings.grad_clip)
                set_learning_rate(opt, settings.lr * plan(state.step))
                opt.step()
            state.step += 1
            top1_running.update(top1)
            fit.after_step(state.step, plan, log)
            bar.update(state.step, f"loss {loss.item():.3f} top1 {top1_running}", plan.total)
            end_of_epoch = state.step % batches_per_epoch == 0 or state.step == plan.total
            if end_of_epoch and heldout is not None and len(heldout):
                hl = heldout_loss(draft, lm_w, embed, heldout, settings, device, bf16)
                epoch = math.ceil(state.step / batches_per_epoch)
                state.score_epoch(hl, epoch, draft, ndigits=5)
                log(f"epoch {epoch}: held-out loss {hl:.4f}")
            if checkpoint is not None and (state.step % settings.checkpoint_every == 0 or end_of_epoch):
                saved.save(state)
            stopped = stop_after_steps is not None and state.step >= stop_after_steps
            if not stopped and fit.passed():
                log("time budget: training stopped")
                stopped = True
            if stopped:
                break
    finally:
        bar.close()
    saved.save(state)
    if state.best is not None and not stopped:
        draft.load_state_dict(state.best)
    ema_top1 = [round(a, 4) for a in top1_running.values]
    return TrainResult(
        state.step, plan.total, time.time() - t0, stopped, bf16, ema_top1, state.best_epoch, state.epoch_losses
    )


class _EpochBatches:
    """The samples' batches in each epoch's seeded order (the same after a resume)."""

    def __init__(self, data: EagleData, settings: EagleSettings) -> None:
        self.data, self.settings = data, settings
        self.epoch, self.batches = -1, []

    def batch(self, step: int, batches_per_epoch: int) -> list[int]:
        """The sample indices of step `step`'s batch."""
        epoch, off = divmod(step, batches_per_epoch)
        if epoch != self.epoch:
            seed = self.settings.seed * 7919 + epoch
            self.batches, self.epoch = make_batches(self.data, self.settings.batch_tokens, seed), epoch
        return self.batches[off]


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

"""Medusa-1 head training on a frozen backbone, from self-distilled data (see distill.py).

Pipeline pieces (the CLI and benchmarks/gpu_train_heads.py both use them):

1. `cache_hidden_states`: one forward pass of the backbone over prompt + reply per sample; keep the last hidden
   state (after the final norm: what the heads see at decode time) at the *reply* positions only, in fp16, one
   cache file per data shard. The backbone never runs again during training: heads see cached states.
2. `train_heads`: head k at position t learns the token at t + 2 + k (cross-entropy), head weights 0.8**k,
   AdamW + warmup/cosine, bf16 autocast where the hardware does bf16 well, checkpoints for resuming.
3. `evaluate_heads`: held-out per-head top-1/top-5, rank-r accuracy (r < 10, what fit-tree needs), chain
   (conditional) accuracies, and the joint distribution of rank tuples so trees can be fitted to correlated hits.
4. `save_heads`: the published Hub layout (`config.json` + `medusa_lm_head.safetensors`, published key names,
   fp16), which `medusa_chat.model.heads.heads_from_state_dict` reloads bit-exactly.

Hydra heads (`--heads-format hydra`) train the same way with teacher forcing: head k also sees the true tokens
x_{t+1} .. x_{t+1+k} (already in the cached targets), which is exactly what it sees on a tree path whose
earlier tokens were accepted; their loss and accuracies are over the draft vocabulary (a target outside it is a
sure miss). `warm_start_` starts them from trained v2 heads.

Position t of a sample covers t = reply_start - 1 (last prompt token: the hidden state the first decoding step
uses) up to len - 2. Targets past the end of the reply are -1 (ignored).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from medusa_chat.atomic import atomic_write_bytes, atomic_write_json
from medusa_chat.machine import cpu_native_bf16
from medusa_chat.model.heads import HydraHeads, MedusaHeads
from medusa_chat.training.distill import DistillStore, Log, atomic_torch_save

MAX_CACHED_HEADS = 8  # targets are cached for up to this many heads, so K can change without a new pass
MAX_RANK = 10  # rank-r accuracies for r < MAX_RANK (published trees use ranks 0-9)
JOINT_TOP = 2048  # rank-tuple prefixes kept in accuracy.json (enough to grow trees of that many nodes)


# ---------------------------------------------------------------------------------------------------------
# cached hidden states
# ---------------------------------------------------------------------------------------------------------
@dataclass
class PositionData:
    """Training positions: hidden state [N, H] (fp16/bf16), targets [N, 1 + M] (col 0 = next token, col 1 + k
    = head k's target, -1 = none), sample [N] (global prompt index, for the held-out split)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    sample: torch.Tensor

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    def subset(self, mask: torch.Tensor) -> PositionData:
        return PositionData(self.hidden[mask], self.targets[mask], self.sample[mask])

    def to(self, device: torch.device | str) -> PositionData:
        return PositionData(self.hidden.to(device), self.targets.to(device), self.sample.to(device))

    @classmethod
    def cat(cls, parts: list[PositionData]) -> PositionData:
        return cls(
            torch.cat([p.hidden for p in parts]),
            torch.cat([p.targets for p in parts]),
            torch.cat([p.sample for p in parts]),
        )


def _targets_for(ids: torch.Tensor, reply_start: int, max_heads: int) -> torch.Tensor:
    n = ids.shape[0]
    pos = torch.arange(reply_start - 1, n - 1)
    cols = []
    for k in range(-1, max_heads):  # k = -1: the backbone's own next token (a check on the cache)
        idx = pos + 2 + k
        cols.append(torch.where(idx < n, ids[idx.clamp(max=n - 1)], torch.full_like(idx, -1)))
    return torch.stack(cols, dim=1).to(torch.int32)


@torch.inference_mode()
def hidden_states_for(
    model: Any,
    samples: list[tuple[int, list[int], int]],
    batch_tokens: int = 8192,
    store_dtype: torch.dtype = torch.float16,
    max_heads: int = MAX_CACHED_HEADS,
) -> PositionData:
    """Backbone last hidden states at the reply positions of `samples` ((prompt index, ids, reply_start))."""
    device = next(model.parameters()).device
    body = model.base_model  # LlamaModel etc.: returns last_hidden_state after the final norm
    keep = [s for s in samples if len(s[1]) - s[2] >= 1 and s[2] >= 1]
    keep.sort(key=lambda s: len(s[1]))
    hid, tgt, smp = [], [], []
    i = 0
    while i < len(keep):
        # Pack samples of similar length while batch x longest <= batch_tokens (right padding, causal mask).
        j = i + 1
        while j < len(keep) and (j + 1 - i) * len(keep[j][1]) <= batch_tokens:
            j += 1
        batch = keep[i:j]
        width = len(batch[-1][1])
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (_, x, _) in enumerate(batch):
            ids[b, : len(x)] = torch.tensor(x)
            mask[b, : len(x)] = 1
        h = body(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        if store_dtype == torch.float16 and float(h.abs().amax()) > 6e4:
            raise OverflowError("hidden states overflow fp16: cache them in bf16 (store_dtype)")
        h = h.to(store_dtype).cpu()  # one device->host copy per batch
        for b, (pidx, x, rs) in enumerate(batch):
            hid.append(h[b, rs - 1 : len(x) - 1].clone())
            tgt.append(_targets_for(torch.tensor(x), rs, max_heads))
            smp.append(torch.full((len(x) - rs,), pidx, dtype=torch.int32))
        i = j
    if not hid:
        width = model.config.hidden_size
        return PositionData(
            torch.zeros((0, width), dtype=store_dtype),
            torch.zeros((0, max_heads + 1), dtype=torch.int32),
            torch.zeros((0,), dtype=torch.int32),
        )
    return PositionData(torch.cat(hid), torch.cat(tgt), torch.cat(smp))


def cache_hidden_states(
    model: Any,
    store: DistillStore,
    cache_dir: Path,
    batch_tokens: int = 8192,
    log: Log = print,
    deadline: float | None = None,
) -> list[Path]:
    """Compute and save the hidden-state cache for every data shard that has none yet (resumable)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for info in store.shards:
        path = cache_dir / info.name
        if path.is_file():
            out.append(path)
            continue
        if out and deadline is not None and time.time() > deadline:  # the first shard always runs
            log("time budget: hidden-state cache left incomplete")
            break
        t = time.time()
        d = store.load_shard(info)
        samples = [
            (info.first + i, ids, rs)
            for i, (ids, rs) in enumerate(zip(d["ids"], d["reply_start"], strict=True))
        ]
        pd = hidden_states_for(model, samples, batch_tokens)
        atomic_torch_save({"hidden": pd.hidden, "targets": pd.targets, "sample": pd.sample}, path)
        dt = time.time() - t
        total = sum(len(ids) for _, ids, _ in samples)
        log(f"hidden {info.name}: {len(pd)} positions, {total / max(dt, 1e-9):.0f} tok/s (prompt+reply)")
        out.append(path)
    return out


def load_cache(paths: list[Path]) -> PositionData:
    if not paths:
        raise ValueError("no hidden-state cache to load: generate data first")
    parts = []
    for p in paths:
        d = torch.load(p, weights_only=True)
        parts.append(PositionData(d["hidden"], d["targets"], d["sample"]))
    return PositionData.cat(parts)


def heldout_mask(sample: torch.Tensor, frac: float) -> torch.Tensor:
    """Deterministic split by prompt (never by position: neighbouring positions share context)."""
    h = (sample.to(torch.int64) * 2654435761 + 97) % (1 << 32)
    return h < int(frac * (1 << 32))


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


class _Progress:
    """A rich progress bar on a terminal; periodic log lines otherwise (logs of long runs stay readable)."""

    def __init__(self, total: int, desc: str, log: Log, every_s: float = 20.0) -> None:
        self.total, self.desc, self.log, self.every_s = total, desc, log, every_s
        self.last = time.time()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"),
                )
                self.bar.start()
                self.task = self.bar.add_task(desc, total=total, info="")
            except ImportError:
                self.bar = None

    def update(self, done: int, info: str, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=self.total, info=info)
        elif time.time() - self.last >= self.every_s or done >= self.total:
            self.last = time.time()
            self.log(f"{self.desc} {done}/{self.total} {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclass
class TrainResult:
    steps: int
    total_steps: int
    seconds: float
    stopped_early: bool
    bf16: bool
    train_top1: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    epoch_heldout_loss: list[float] = field(default_factory=list)


def train_heads(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    train: PositionData,
    settings: TrainSettings,
    device: torch.device,
    checkpoint: Path | None = None,
    resume: bool = False,
    heldout: PositionData | None = None,
    deadline: float | None = None,
    log: Log = print,
    stop_after_steps: int | None = None,
    embed_weight: torch.Tensor | None = None,
) -> TrainResult:
    """Train `heads` in place on cached positions. Resumable from `checkpoint`; stops by `deadline`.

    If the run would miss the deadline, the schedule is shortened once (after a warm-up measurement) so the
    cosine decay still finishes; a hard stop at the deadline saves a checkpoint. With `heldout`, the held-out
    loss is measured at each epoch end and the best epoch's weights are kept (the second epoch on small data
    already memorises). `stop_after_steps` simulates an interruption (tests).
    """
    k = settings.num_heads
    bf16 = use_bf16(settings, device)
    heads.to(device).train()
    lm_weight = head_projection(heads, lm_weight.detach().to(device))
    if bf16 and not heads.own_lm_head:
        lm_weight = lm_weight.to(torch.bfloat16)  # cast the frozen projection once, not every step
    vocab_index, embed = _hydra_inputs(heads, embed_weight, device, bf16)
    n = len(train)
    if n == 0:
        raise ValueError("no training positions: generate data first")
    steps_per_epoch = max(1, math.ceil(n / settings.batch_size))
    plan = {"total": max(1, int(round(settings.epochs * steps_per_epoch)))}
    warmup = max(1, int(settings.warmup_frac * plan["total"]))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, plan["total"] - warmup))
        return 0.5 * (1 + math.cos(math.pi * frac))

    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    key = {**asdict(settings), "positions": n}
    step, best_loss, best_state, best_epoch, epoch_losses = 0, math.inf, None, None, []
    if resume and checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, weights_only=True, map_location=device)
        if ck["key"] == key:
            heads.load_state_dict(ck["heads"])
            opt.load_state_dict(ck["opt"])
            step, plan["total"] = int(ck["step"]), int(ck["total"])
            best_loss, best_epoch, epoch_losses = (
                float(ck["best_loss"]),
                ck["best_epoch"],
                list(ck["epoch_losses"]),
            )
            best_state = ck.get("best_state")
            log(f"resuming training at step {step}/{plan['total']}")
        else:
            log("checkpoint is for other settings or data: training from scratch")

    def save_ck() -> None:
        if checkpoint is None:
            return
        atomic_torch_save(
            {
                "key": key,
                "heads": heads.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "total": plan["total"],
                "best_loss": best_loss,
                "best_epoch": best_epoch,
                "epoch_losses": epoch_losses,
                "best_state": best_state,
            },
            checkpoint,
        )

    weights = torch.tensor([settings.head_decay**i for i in range(k)], device=device)
    hidden, targets = train.hidden, train.targets
    ema = [0.0] * k
    bar = _Progress(plan["total"], "train", log)
    t0, t_meas, stopped = time.time(), None, False
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    perm_epoch, perm = -1, torch.empty(0, dtype=torch.long)
    try:
        while step < plan["total"]:
            epoch, off = divmod(step, steps_per_epoch)
            if epoch != perm_epoch:
                g = torch.Generator().manual_seed(settings.seed * 7919 + epoch)  # same order after a resume
                perm, perm_epoch = torch.randperm(n, generator=g).to(hidden.device), epoch
            idx = perm[off * settings.batch_size : (off + 1) * settings.batch_size]
            h = hidden[idx].to(device, non_blocking=True).float()
            raw = targets[idx].to(device, non_blocking=True)
            tg = head_targets(heads, raw, vocab_index)
            with amp:
                logits = head_logits(heads, h, lm_weight, raw, embed)
            losses = head_losses(logits, tg)
            loss = (losses * weights).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for grp in opt.param_groups:  # schedule set by hand: survives resumes and a shortened plan
                grp["lr"] = settings.lr * lr_at(step)
            opt.step()
            step += 1
            with torch.no_grad():
                hit = logits.argmax(-1) == tg.T.long()
                valid = tg.T >= 0
                for i in range(k):
                    v = int(valid[i].sum())
                    if v:
                        ema[i] = 0.95 * ema[i] + 0.05 * float((hit[i] & valid[i]).sum()) / v
            if step == 10:
                t_meas = time.time()
            elif deadline is not None and t_meas is not None and step == 40:
                per = (time.time() - t_meas) / 30
                fit = int((deadline - time.time()) / per * 0.92)
                if step + fit < plan["total"]:
                    plan["total"] = max(step + 1, step + fit)
                    log(
                        f"time budget: training shortened to {plan['total']} steps ({per * 1000:.0f} ms/step)"
                    )
            info = f"loss {loss.item():.3f} top1 " + " ".join(f"{a:.2f}" for a in ema)
            bar.update(step, info, total=plan["total"])
            end_of_epoch = step % steps_per_epoch == 0 or step == plan["total"]
            if end_of_epoch and heldout is not None and len(heldout):
                hl = heldout_loss(
                    heads, lm_weight, heldout, k, device, bf16, settings.head_decay, vocab_index, embed
                )
                epoch_losses.append(hl)
                if hl < best_loss:
                    best_loss, best_epoch = hl, math.ceil(step / steps_per_epoch)
                    best_state = {n_: t.detach().clone() for n_, t in heads.state_dict().items()}
                log(f"epoch {math.ceil(step / steps_per_epoch)}: held-out weighted loss {hl:.4f}")
            if checkpoint is not None and (step % settings.checkpoint_every == 0 or end_of_epoch):
                save_ck()
            if stop_after_steps is not None and step >= stop_after_steps:
                save_ck()
                stopped = True
                break
            if deadline is not None and time.time() > deadline:
                log("time budget: training stopped")
                save_ck()
                stopped = True
                break
    finally:
        bar.close()
    if best_state is not None and not stopped:
        heads.load_state_dict(best_state)
    save_ck()
    return TrainResult(
        step,
        plan["total"],
        time.time() - t0,
        stopped,
        bf16,
        [round(a, 4) for a in ema],
        best_epoch,
        epoch_losses,
    )


@torch.no_grad()
def heldout_loss(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    data: PositionData,
    k: int,
    device: torch.device,
    bf16: bool,
    decay: float,
    vocab_index: torch.Tensor | None = None,
    embed: torch.Tensor | None = None,
    max_positions: int = 20000,
    batch_size: int = 1024,
) -> float:
    """Weighted held-out loss; `lm_weight` is already the heads' projection (head_projection)."""
    was = heads.training
    heads.eval()
    n = min(len(data), max_positions)
    tot, cnt = 0.0, 0
    w = torch.tensor([decay**i for i in range(k)], device=device)
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
# evaluation
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_heads(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    data: PositionData,
    device: torch.device,
    max_rank: int = MAX_RANK,
    batch_size: int = 512,
    joint_top: int = JOINT_TOP,
    embed_weight: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Held-out accuracies in fp32 (as the heads will run on CPU).

    Returns per-head top1/top5/loss, `rank_acc[k][r]` = P(rank-r guess of head k is right), the chain
    conditionals P(head k top-1 right | heads < k top-1 right), the backbone agreement (argmax of lm_head on the
    cached state = the greedy next token: checks the cache), and `joint`: P(the true tokens have ranks starting
    with path) for the most likely rank-tuple prefixes -- exactly the acceptance probability of that tree node
    under greedy decoding, correlations included.
    """
    heads.eval().to(device)
    w = lm_weight.detach().to(device).float()
    proj = head_projection(heads, w)
    vocab_index, embed = _hydra_inputs(heads, embed_weight, device, False)
    k = heads.num_heads
    ranks_all, valid_all, loss_sum, loss_cnt = [], [], torch.zeros(k), torch.zeros(k)
    agree = agree_n = 0
    for s in range(0, len(data), batch_size):
        h = data.hidden[s : s + batch_size].to(device).float()
        tg = data.targets[s : s + batch_size].to(device).long()
        logits = head_logits(heads, h, proj, tg, embed)  # [K, B, V']
        top = logits.topk(max_rank, dim=-1).indices  # [K, B, R]
        t = head_targets(heads, tg, vocab_index).T  # [K, B]
        hit = top == t.unsqueeze(-1)
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(t, max_rank))
        valid = t != -1  # -2 (outside a Hydra draft vocabulary) is a target the heads always miss
        ranks_all.append(rank.T.to(torch.int16).cpu())
        valid_all.append(valid.T.cpu())
        for i in range(k):
            v = t[i] >= 0
            if bool(v.any()):
                loss_sum[i] += float(F.cross_entropy(logits[i][v], t[i][v], reduction="sum"))
                loss_cnt[i] += int(v.sum())
        base = F.linear(h, w).argmax(-1)
        agree += int((base == tg[:, 0]).sum())
        agree_n += h.shape[0]
    if not ranks_all:
        raise ValueError("no held-out positions to evaluate")
    ranks = torch.cat(ranks_all).long()  # [N, K]
    valid = torch.cat(valid_all)
    rank_acc, top1, top5 = [], [], []
    for i in range(k):
        r = ranks[valid[:, i], i]
        nv = max(1, r.numel())
        rank_acc.append([round(float((r == j).sum()) / nv, 5) for j in range(max_rank)])
        top1.append(round(float((r == 0).sum()) / nv, 4))
        top5.append(round(float((r < 5).sum()) / nv, 4))
    # Joint statistics over decoding steps: positions where head 0 has a target; a target past the end of the
    # reply counts as a miss (decoding stops at EOS, nothing is accepted after it).
    steps = ranks[valid[:, 0]].clone()
    steps[~valid[valid[:, 0]]] = max_rank
    chain = []
    alive = torch.ones(steps.shape[0], dtype=torch.bool)
    for i in range(k):
        n_alive = int(alive.sum())
        ok = alive & (steps[:, i] == 0)
        chain.append(round(float(ok.sum()) / max(1, n_alive), 4))
        alive = ok
    return {
        "positions": len(data),
        "top1": top1,
        "top5": top5,
        "loss": [round(float(a / max(1, c)), 4) for a, c in zip(loss_sum, loss_cnt, strict=True)],
        "rank_acc": rank_acc,
        "chain_top1_conditional": chain,
        "backbone_agreement": round(agree / max(1, agree_n), 5),
        "joint": joint_path_probs(steps, max_rank, joint_top),
    }


def _hydra_inputs(
    heads: MedusaHeads, embed_weight: torch.Tensor | None, device: torch.device, bf16: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(target -> draft-vocab index map, input embeddings on the device) for Hydra heads; (None, None) else."""
    if not isinstance(heads, HydraHeads):
        return None, None
    if embed_weight is None:
        raise ValueError("Hydra heads need the backbone's input embeddings (embed_weight=)")
    embed = embed_weight.detach().to(device, torch.bfloat16 if bf16 else torch.float32)
    return heads.vocab_index(embed.shape[0]).to(device), embed


def joint_path_probs(steps: torch.Tensor, max_rank: int, top: int) -> dict[str, Any]:
    """Frequencies of rank-tuple prefixes ([N, K] ranks, max_rank = miss); keep the `top` most frequent."""
    n = steps.shape[0]
    items: list[tuple[int, tuple[int, ...]]] = []
    for d in range(1, steps.shape[1] + 1):
        pre = steps[:, :d]
        pre = pre[(pre < max_rank).all(1)]
        if pre.shape[0] == 0:
            break
        uniq, counts = torch.unique(pre, dim=0, return_counts=True)
        items += [
            (int(c), tuple(int(x) for x in u)) for u, c in zip(uniq.tolist(), counts.tolist(), strict=True)
        ]
    # Most frequent first; ties by shorter path, then lexicographic (a parent always precedes its children).
    items.sort(key=lambda it: (-it[0], len(it[1]), it[1]))
    items = items[:top]
    return {
        "positions": n,
        "max_rank": max_rank,
        "paths": [list(p) for _, p in items],
        "probs": [round(c / max(1, n), 6) for c, _ in items],
    }


# ---------------------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------------------
HEADS_FILE = "medusa_lm_head.safetensors"


def round_heads_(heads: MedusaHeads, dtype: torch.dtype = torch.float16) -> MedusaHeads:
    """Round the weights to the file dtype in place, so what we evaluate is exactly what we ship."""
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return heads


def save_heads(
    heads: MedusaHeads, out_dir: Path, base_model: str, dtype: torch.dtype = torch.float16
) -> dict[str, Any]:
    """Write `config.json` + `medusa_lm_head.safetensors` (published keys, fp16) into `out_dir`."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else torch.int32).contiguous()
        for k, v in heads.state_dict().items()
    }
    # Serialised in memory and written by the one atomic writer (a file readable like any other: the folder is
    # meant to be shared, where safetensors' own save_file would leave it 0600).
    atomic_write_bytes(out_dir / HEADS_FILE, save(tensors, metadata={"format": "pt"}))
    cfg = heads.config_dict(base_model)
    atomic_write_json(out_dir / "config.json", cfg)
    return cfg


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
def train_and_save(
    lm_head: nn.Module,
    train: PositionData,
    heldout: PositionData,
    settings: TrainSettings,
    out_dir: Path,
    base_model: str,
    device: torch.device,
    checkpoint: Path | None = None,
    resume: bool = False,
    deadline: float | None = None,
    tree_budget: int = 64,
    log: Log = print,
    extra_report: dict[str, Any] | None = None,
    embed_weight: torch.Tensor | None = None,
    init_from: MedusaHeads | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train one head configuration and write the published folder + accuracy.json + tree.json.

    Hydra heads need `embed_weight` (the backbone's input embeddings); `init_from` warm-starts from trained
    heads of the same shape (Medusa v2 heads into Hydra: the ResBlocks are copied, the token cell starts at
    zero, so training starts from exactly the Medusa heads' accuracy). `draft_vocab` keeps a given draft
    vocabulary (e.g. the warm start's, counted on more data than a fine-tuning set) instead of counting one
    from `train`."""
    from medusa_chat.training.fit_tree import fit_tree, size_summary

    weight = lm_head.weight.detach()
    vocab, hidden = weight.shape
    if settings.heads_format != "hydra":
        draft_vocab = None
    elif draft_vocab is None:
        draft_vocab = draft_vocabulary(train, settings.draft_vocab_size, vocab)
    elif len(draft_vocab) != settings.draft_vocab_size:
        raise ValueError(
            f"draft vocabulary of {len(draft_vocab)} tokens, settings say {settings.draft_vocab_size}"
        )
    heads = new_heads(settings, lm_head, hidden, vocab, draft_vocab)
    if init_from is not None:
        warm_start_(heads, init_from)
    size_mb = heads_file_bytes(settings, hidden, vocab) / 1e6
    log(
        f"training {settings.num_heads} heads x {settings.num_layers} layer(s), {settings.heads_format} "
        f"({size_mb:.2f} MB fp16) on {len(train)} positions, {settings.epochs} epochs, batch {settings.batch_size}"
    )
    result = train_heads(
        heads,
        weight,
        train,
        settings,
        device,
        checkpoint=checkpoint,
        resume=resume,
        heldout=heldout if len(heldout) else None,
        deadline=deadline,
        log=log,
        embed_weight=embed_weight,
    )
    heads.cpu().float()
    round_heads_(heads)  # evaluate exactly the fp16 weights that are shipped
    cfg = save_heads(heads, out_dir, base_model)
    report: dict[str, Any] = {
        "heads": {
            "format": settings.heads_format,
            "num_heads": settings.num_heads,
            "num_layers": settings.num_layers,
            "file_mb": round(size_mb, 3),
        },
        "data": {"train_positions": len(train), "heldout_positions": len(heldout)},
        "training": {**asdict(settings), **asdict(result), "seconds": round(result.seconds, 1)},
        **(extra_report or {}),
    }
    if len(heldout):
        t = time.time()
        ev = evaluate_heads(heads.to(device), weight, heldout, device, embed_weight=embed_weight)
        heads.cpu()
        report["heldout"] = ev
        tree = fit_tree(report, budget=tree_budget, name=f"{out_dir.name}-fitted")
        atomic_write_json(out_dir / "tree.json", tree)
        report["estimated_tokens_per_step"] = size_summary(tree)
        report["estimated_tokens_per_step_chain"] = round(
            1 + sum(math.prod(ev["chain_top1_conditional"][: i + 1]) for i in range(settings.num_heads)), 4
        )
        log(
            f"held-out ({len(heldout)} positions, {time.time() - t:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']} backbone agreement {ev['backbone_agreement']}"
        )
        log(f"estimated tokens/step (greedy, fitted tree): {report['estimated_tokens_per_step']}")
    atomic_write_json(out_dir / "accuracy.json", report)
    report["config"] = cfg
    return report

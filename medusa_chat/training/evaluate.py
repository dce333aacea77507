"""How good trained heads are: held-out accuracy per head and rank, and the joint path probabilities that
fit_tree grows trees from."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.training.positions import PositionData
from medusa_chat.training.teacher import teacher_rows
from medusa_chat.training.train_heads import head_logits, head_projection, head_targets, hydra_inputs

MAX_RANK = 10  # rank-r accuracies for r < MAX_RANK (published trees use ranks 0-9)


JOINT_TOP = 2048  # rank-tuple prefixes kept in accuracy.json (enough to grow trees of that many nodes)
EVAL_BATCH = 512  # held-out positions per batch


@torch.no_grad()
def evaluate_heads(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    data: PositionData,
    device: torch.device,
    embed_weight: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Held-out accuracies in fp32 (as the heads will run on CPU).

    Returns per-head top1/top5/loss, `rank_acc[k][r]` = P(rank-r guess of head k is right), the chain
    conditionals P(head k top-1 right | heads < k top-1 right), the backbone agreement (argmax of lm_head on the
    cached state = the greedy next token: checks the cache), and `joint`: P(the true tokens have ranks starting
    with path) for the most likely rank-tuple prefixes -- exactly the acceptance probability of that tree node
    under greedy decoding, correlations included.
    """
    max_rank, batch_size = MAX_RANK, EVAL_BATCH
    heads.eval().to(device)
    w = lm_weight.detach().to(device).float()
    proj = head_projection(heads, w)
    vocab_index, embed = hydra_inputs(heads, embed_weight, device, False)
    k = heads.num_heads
    ranks_all, valid_all, loss_sum, loss_cnt = [], [], torch.zeros(k), torch.zeros(k)
    guess_all, choice_all = [], []
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
        guess_all.append(top[:, :, 0].T.cpu())
        choice_all.append(F.linear(h, w).argmax(-1).cpu())
    if not ranks_all:
        raise ValueError("no held-out positions to evaluate")
    ranks = torch.cat(ranks_all).long()  # [N, K]
    valid = torch.cat(valid_all)
    choice = torch.cat(choice_all)  # the backbone's fp32 argmax at each position: the greedy next token
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
        "backbone_agreement": round(float((choice == data.targets[:, 0].long().cpu()).float().mean()), 5),
        "top1_backbone": _top1_backbone(heads.num_heads, data, torch.cat(guess_all), choice, vocab_index),
        "joint": joint_path_probs(steps, max_rank, JOINT_TOP),
    }


def _top1_backbone(
    num_heads: int, data: PositionData, guess: torch.Tensor, choice: torch.Tensor, vocab_index: torch.Tensor | None
) -> list[float]:
    """Per head, how often its top-1 guess is the backbone's own fp32 argmax for its token (at the cached row
    holding it, teacher.py), not the stored token: what greedy decoding in fp32 accepts. The stored replies may
    come from another numeric path (int4) or a penalised decode; where they do, this is the truer score."""
    rows, valid = teacher_rows(data, torch.arange(len(data), device=data.targets.device), num_heads)
    rows, valid = rows.cpu(), valid.cpu()  # the data may sit on the GPU; the guesses were gathered here
    wanted = choice[rows]  # [N, K] full-vocabulary ids
    if vocab_index is not None:  # Hydra heads guess draft-vocabulary indices; -2 outside it: a miss
        wanted = vocab_index.cpu()[wanted]
    hits = (guess == wanted) & valid
    counts = valid.sum(0).clamp_min(1)
    return [round(float(a), 4) for a in hits.sum(0) / counts]


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

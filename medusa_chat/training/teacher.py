"""The backbone as the heads' teacher: its own next-token distribution as the target, not the stored token.

The stored replies are one decode of the backbone (for ShareGPT: the engine's int4 path with its repetition
penalty), while the heads serve another (e.g. fp32 greedy), and a sampled or penalised token is noise to a
head that has to guess the argmax. The teacher is free: the hidden-state cache holds the backbone's final
hidden state at every reply position, so its distribution there is one product with the lm_head. Head k at
position t guesses x_{t+2+k}; the backbone's own distribution of that token, given the true tokens up to
x_{t+1+k} (the context a Hydra head is teacher-forced on), sits at the cached row t+1+k of the same sample.
This is Hydra++'s teacher loss; Medusa-2's self-distillation trains on the same distribution.

Only the `top` most likely tokens of each distribution are kept (renormalised): the tail carries little mass
and storing it would cost the whole vocabulary per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from medusa_chat.training.positions import PositionData


@dataclass
class TeacherTargets:
    """Row i's next-token distribution under the backbone, cut to its `top` likeliest classes (indices into
    the heads' projection: the draft vocabulary for Hydra heads), renormalised: ids [N, top], probs [N, top]."""

    ids: torch.Tensor
    probs: torch.Tensor


@torch.no_grad()
def teacher_targets(
    data: PositionData, projection: torch.Tensor, top: int, batch: int = 4096
) -> TeacherTargets:
    """The backbone's distribution at every cached position: softmax(hidden @ projection.T), its `top` classes.

    `projection` is the heads' frozen projection (head_projection: the lm_head, or its draft-vocabulary rows for
    Hydra heads, so the distribution is the backbone's renormalised over the draft vocabulary); its dtype sets
    the product's (fp32 gives the backbone's fp32 argmax, the one greedy decoding in fp32 follows)."""
    n = len(data)
    ids = torch.empty((n, top), dtype=torch.int32, device=data.hidden.device)
    probs = torch.empty((n, top), dtype=torch.float16, device=data.hidden.device)
    for s in range(0, n, batch):
        h = data.hidden[s : s + batch].to(projection.device, projection.dtype)
        p = torch.softmax(F.linear(h, projection).float(), dim=-1)
        value, index = p.topk(top, dim=-1)
        ids[s : s + batch] = index.to(ids.device, torch.int32)
        probs[s : s + batch] = (value / value.sum(-1, keepdim=True)).to(probs.device, torch.float16)
    return TeacherTargets(ids, probs)


def teacher_rows(data: PositionData, idx: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, K], valid [B, K]): the cached row holding the teacher of head k at position idx[b], idx + 1 + k,
    and whether it is one: inside the data, the same sample, and its next token the head's stored target (a
    check that the rows lie in order, as the cache writes them; a split by sample keeps them so)."""
    n = len(data)
    k = torch.arange(num_heads, device=idx.device)
    rows = idx[:, None] + 1 + k
    inside = rows < n
    rows = rows.clamp(max=n - 1)
    wanted = data.targets[idx][:, 1 : 1 + num_heads]
    same = (data.sample[rows] == data.sample[idx][:, None]) & (data.targets[rows, 0] == wanted)
    return rows, inside & same & (wanted >= 0)


def teacher_losses(
    logits: torch.Tensor, teacher: TeacherTargets, rows: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Per-head cross-entropy against the teacher's distribution over valid positions ([K]; 0 for a head with
    none): -sum_j p_j log q(id_j), the KL divergence from the teacher up to the teacher's own entropy."""
    log_q = torch.log_softmax(logits.float(), dim=-1)  # [K, B, V']
    ids = teacher.ids[rows].long().permute(1, 0, 2)  # [K, B, top]
    p = teacher.probs[rows].float().permute(1, 0, 2)
    per_position = -(p * log_q.gather(-1, ids)).sum(-1)  # [K, B]
    mask = valid.T.float()
    return (per_position * mask).sum(1) / mask.sum(1).clamp_min(1.0)

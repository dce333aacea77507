"""The backbone as the heads' teacher: its own next-token distribution as the target, not the stored token.

The stored replies are one decode of the backbone (for ShareGPT: the engine's int4 path with its repetition
penalty), while the heads serve another (e.g. fp32 greedy), and a sampled or penalised token is noise to a
head that has to guess the argmax. The teacher is free: the hidden-state cache holds the backbone's final
hidden state at every reply position, so its distribution there is one product with the lm_head. Head k at
position t guesses x_{t+2+k}; the backbone's own distribution of that token, given the true tokens up to
x_{t+1+k} (the context a Hydra head is teacher-forced on), sits at the cached row t+1+k of the same sample.
This is Hydra++'s teacher loss; Medusa-2's self-distillation trains on the same distribution. An EAGLE-3 draft
learns the same way (`eagle_teacher`): its reference trains on the target model's distribution over the draft
vocabulary.

Only the `top` most likely tokens of each distribution are kept (renormalised): the tail carries little mass
and storing it would cost the whole vocabulary per position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from medusa_chat.training.positions import PositionData

if TYPE_CHECKING:
    from medusa_chat.training.eagle_data import EagleData


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


def eagle_teacher(
    data: EagleData, positions: PositionData, projection: torch.Tensor, top: int
) -> tuple[TeacherTargets, torch.Tensor]:
    """(teacher, valid): the backbone's distribution for every row of an EAGLE draft's data, from the
    hidden-state cache of the same distilled samples (positions.cache_hidden_states; `projection`: the lm_head
    rows of the draft vocabulary, in draft-index order, so the ids are draft indices).

    Row t of a sample (feature t; at every unroll step the chain ending there predicts token t + 2, eagle_model
    .unrolled_outputs) has its teacher at position t + 1, which the cache holds from the sample's first pair on:
    cache row t + 1 - first_pair of the sample's block. `valid` [rows] marks rows that have one: at or after the
    first pair, inside the block, and the cached row's next token the EAGLE row's token t + 2 (a cache of other
    replies or in another order leaves rows without a teacher, never with a wrong one). Invalid rows hold zero
    probabilities."""
    taught = teacher_targets(positions, projection, top)
    order, counts = torch.unique_consecutive(positions.sample, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    block = {s: (b, c) for s, b, c in zip(order.tolist(), starts.tolist(), counts.tolist(), strict=True)}
    rows = torch.full((len(data.hidden),), -1, dtype=torch.long)
    spans = zip(data.offsets.tolist(), data.lengths.tolist(), data.first_pair.tolist(), strict=True)
    for offset, length, first in spans:
        if length <= first:
            continue
        begin, count = block.get(int(data.sample[offset]), (0, 0))
        local = torch.arange(first, length)
        cached = local + 1 - first
        inside = cached < count
        rows[offset + local[inside]] = begin + cached[inside]
    has = rows >= 0
    want = data.targets[:, 1].long()
    has[has.clone()] = positions.targets[rows[has], 0].long() == want[has]
    ids = torch.zeros((len(rows), top), dtype=torch.int32)
    probs = torch.zeros((len(rows), top), dtype=torch.float16)
    ids[has] = taught.ids[rows[has]].to(torch.int32).cpu()
    probs[has] = taught.probs[rows[has]].to(torch.float16).cpu()
    return TeacherTargets(ids, probs), has

"""The EAGLE trainer's data: every position's backbone feature of each distilled sample, cached per shard, and
the padded batches training and evaluation read.

One backbone pass over each whole sample (prompt + reply), every position's feature cached in fp16
(`cache_eagle_features`, positions.hidden_states_for with the sample starting at position 0): the draft attends
over the prompt at decode time, so it must see it in training too. Losses only count where a decoding step would
use the prediction (the chain's root at or after the first reply token): `first_pair`. EAGLE-3's features (the
hidden states entering three of the backbone's layers) are cached in bf16.

Apart from the draft (eagle_model.py) and the training loop (train_eagle.py): computing features takes the
backbone and hours on a CPU, so it is cached and resumed on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from medusa_chat.training.positions import cache_shards, heldout_mask, hidden_states_for
from medusa_chat.training.store import DistillStore, Log
from medusa_chat.training.teacher import TeacherTargets


@dataclass
class EagleData:
    """Samples as sequences of pairs. Pair t of a sample: feature t (hidden [N, h], fp16) and the ids of tokens
    t + 1 .. t + 1 + M (targets [N, 1 + M], -1 past the end); `sample` [N] the prompt index; `lengths` the pairs
    per sample (rows are contiguous per sample, in that order); `first_pair` the first pair whose prediction a
    decoding step uses (reply_start - 1: the last prompt token's feature with the first reply token).
    `teacher`: where the draft learns the backbone's distribution (teacher.eagle_teacher), row t's distribution
    of token t + 2 over the draft vocabulary (zero probabilities: none)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    sample: torch.Tensor
    lengths: torch.Tensor
    first_pair: torch.Tensor
    teacher: TeacherTargets | None = None

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
        teacher = self.teacher
        if teacher is not None:
            teacher = TeacherTargets(teacher.ids[rows], teacher.probs[rows])
        return EagleData(
            self.hidden[rows], self.targets[rows], self.sample[rows], ln.clone(), self.first_pair[idx].clone(), teacher
        )

    def with_teacher(self, teacher: TeacherTargets) -> EagleData:
        return replace(self, teacher=teacher)

    def split(self, holdout: float) -> tuple[EagleData, EagleData]:
        """(train, held-out) by prompt, the same deterministic split as the heads' (positions.heldout_mask)."""
        mask = heldout_mask(self.sample[self.offsets] if len(self) else self.sample, holdout)
        return self.select(~mask), self.select(mask)

    def batch(self, idx: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Samples `idx` right-padded to the longest: features [B, L, h] (fp32), next tokens [B, L], targets
        [B, L, M] (token t + 2 + k; -1 none), use [B, L] (a decoding step uses the pair's prediction); with a
        teacher, also its ids and probabilities [B, L, top] (zero probabilities in the padding)."""
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
        tensors = [feats, nxt, tgt, use]
        if self.teacher is not None:
            top = self.teacher.ids.shape[1]
            ids = torch.zeros(b, width, top, dtype=torch.long)
            probs = torch.zeros(b, width, top)
            for r, i in enumerate(idx):
                o, n = int(off[i]), int(ln[i])
                ids[r, :n] = self.teacher.ids[o : o + n].long()
                probs[r, :n] = self.teacher.probs[o : o + n].float()
            tensors += [ids, probs]
        return tuple(t.to(device) for t in tensors)


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

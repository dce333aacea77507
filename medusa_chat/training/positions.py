"""Training data for the heads: the backbone's hidden states at every reply position of the distilled replies,
with the tokens each head should predict there (computed once, cached on disk)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_chat.training.store import DistillStore, Log, atomic_torch_save

MAX_CACHED_HEADS = 8  # targets are cached for up to this many heads, so K can change without a new pass


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
    taps: tuple[int, ...] | None = None,
) -> PositionData:
    """Backbone last hidden states at the reply positions of `samples` ((prompt index, ids, reply_start)); with
    `taps`, the hidden states entering those layers instead, concatenated (EAGLE-3's features)."""
    device = next(model.parameters()).device
    body = model.base_model  # LlamaModel etc.: returns last_hidden_state after the final norm
    keep = [s for s in samples if len(s[1]) - s[2] >= 1 and s[2] >= 1]
    roots, root_of = covering_samples([s[1] for s in keep])
    order = sorted(range(len(roots)), key=lambda r: len(roots[r]))
    covered: list[list[int]] = [[] for _ in roots]
    for i, r in enumerate(root_of):
        covered[r].append(i)
    hid, tgt, smp = [], [], []
    i = 0
    while i < len(order):
        # Pack samples of similar length while batch x longest <= batch_tokens (right padding, causal mask).
        j = i + 1
        while j < len(order) and (j + 1 - i) * len(roots[order[j]]) <= batch_tokens:
            j += 1
        batch = [roots[r] for r in order[i:j]]
        h = _forward(body, batch, device, taps)
        if store_dtype == torch.float16 and float(h.abs().amax()) > 6e4:
            raise OverflowError("hidden states overflow fp16: cache them in bf16 (store_dtype)")
        h = h.to(store_dtype).cpu()  # one device->host copy per batch
        for b, r in enumerate(order[i:j]):
            for k in covered[r]:
                pidx, x, rs = keep[k]
                hid.append(h[b, rs - 1 : len(x) - 1].clone())
                tgt.append(_targets_for(torch.tensor(x), rs, max_heads))
                smp.append(torch.full((len(x) - rs,), pidx, dtype=torch.int32))
        i = j
    if not hid:
        width = model.config.hidden_size * (len(taps) if taps else 1)
        return PositionData(
            torch.zeros((0, width), dtype=store_dtype),
            torch.zeros((0, max_heads + 1), dtype=torch.int32),
            torch.zeros((0,), dtype=torch.int32),
        )
    return PositionData(torch.cat(hid), torch.cat(tgt), torch.cat(smp))


def covering_samples(seqs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the sequences no other one starts with, the index among them of the one each sequence starts with).

    A conversation's later turn holds the earlier turns token for token (the model's own replies), and the
    backbone is causal: its hidden states at an earlier turn's positions are the earlier turn's own, so the
    backbone runs once on the longest turn instead of once per turn (a third less work on ShareGPT's turns)."""
    roots: list[list[int]] = []
    root_of = [0] * len(seqs)
    by_last: dict[tuple[int, int], list[int]] = {}  # (length, token) -> roots holding that token there
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        x = seqs[i]
        found = next((r for r in by_last.get((len(x), x[-1]), []) if roots[r][: len(x)] == x), None)
        if found is None:
            found = len(roots)
            roots.append(x)
            for n, t in enumerate(x, 1):
                by_last.setdefault((n, t), []).append(found)
        root_of[i] = found
    return roots, root_of


def _forward(body: Any, batch: list[list[int]], device: torch.device, taps: tuple[int, ...] | None) -> torch.Tensor:
    """The backbone's last hidden states (or, with `taps`, the inputs of those layers concatenated) for a batch
    of token lists, right-padded to the longest: [B, longest, H]."""
    width = len(batch[-1])
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, x in enumerate(batch):
        ids[b, : len(x)] = torch.tensor(x)
        mask[b, : len(x)] = 1
    if taps is None:
        return body(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    # hidden_states[i] is the input of layer i (0: the embeddings)
    out = body(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in taps], dim=-1)


def cache_shards(
    store: DistillStore,
    cache_dir: Path,
    what: str,
    compute: Callable[[Any], tuple[dict[str, torch.Tensor], int, int]],
    log: Log = print,
    deadline: float | None = None,
) -> list[Path]:
    """A cache file per data shard: for each shard that has none yet, `compute(shard)` gives (tensors to save,
    positions, tokens read), saved atomically (resumable; a killed run leaves no partial file). Past `deadline`
    no new shard is started (the first always runs). `what` names the cache in the log."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for info in store.shards:
        path = cache_dir / info.name
        if not path.is_file():
            if out and deadline is not None and time.time() > deadline:
                log(f"time budget: {what} cache left incomplete")
                break
            t = time.time()
            tensors, positions, tokens = compute(info)
            atomic_torch_save(tensors, path)
            rate = tokens / max(time.time() - t, 1e-9)
            log(f"{what} {info.name}: {positions} positions, {rate:.0f} tok/s (prompt+reply)")
        out.append(path)
    return out


def cache_hidden_states(
    model: Any,
    store: DistillStore,
    cache_dir: Path,
    batch_tokens: int = 8192,
    log: Log = print,
    deadline: float | None = None,
) -> list[Path]:
    """Compute and save the hidden-state cache for every data shard that has none yet (resumable)."""

    def compute(info: Any) -> tuple[dict[str, torch.Tensor], int, int]:
        d = store.load_shard(info)
        samples = [
            (info.first + i, ids, rs)
            for i, (ids, rs) in enumerate(zip(d["ids"], d["reply_start"], strict=True))
        ]
        pd = hidden_states_for(model, samples, batch_tokens)
        tensors = {"hidden": pd.hidden, "targets": pd.targets, "sample": pd.sample}
        return tensors, len(pd), sum(len(ids) for _, ids, _ in samples)

    return cache_shards(store, cache_dir, "hidden-state", compute, log, deadline)


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


def conversation_starts(prompts: list[Any]) -> torch.Tensor:
    """For every prompt index of a store, the index of its conversation's first turn (itself for a single
    turn). The held-out split goes by this, so a conversation's turns never fall on both sides of it: a later
    turn holds the earlier ones, and a held-out turn after trained turns overstates the heads."""
    from medusa_chat.training.conversations import is_follow

    first, current = [], 0
    for i, entry in enumerate(prompts):
        current = current if is_follow(entry) else i
        first.append(current)
    return torch.tensor(first, dtype=torch.int64)

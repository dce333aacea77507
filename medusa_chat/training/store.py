"""The distillation store: prompts and the backbone's replies in resumable shards (see distill.py for the layout),
and their export to / import from one .npz file."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import atomic_write, atomic_write_json
from medusa_chat.training.select import SampleRule, kept_rows

Log = Callable[[str], None]
MANIFEST = "manifest.json"


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save through the package's one atomic writer (a killed run never leaves a truncated shard)."""
    atomic_write(path, lambda fh: torch.save(obj, fh))


def norm_key(text: Any) -> str:
    """The de-duplication key of a prompt entry; a conversation's follow-up turn has none ("": never dropped,
    or the conversation would lose a turn)."""
    if not isinstance(text, str):
        return ""
    return re.sub(r"\s+", " ", text.strip().lower())



@dataclass
class ShardInfo:
    name: str
    first: int
    count: int
    tokens: int  # reply tokens in the shard


@dataclass
class DistillStore:
    """A distillation folder: manifest (prompts, Magpie rounds, shards) + token shards."""

    root: Path
    prompts: list[Any] = field(default_factory=list)  # str, or a conversation's follow-up turn (dict)
    sources: list[str] = field(default_factory=list)
    magpie_rounds: int = 0
    magpie_sampled: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    model: str = ""
    _keys: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, root: str | Path, model: str = "") -> DistillStore:
        root = Path(root)
        (root / "data").mkdir(parents=True, exist_ok=True)
        store = cls(root=root, model=model)
        mpath = root / MANIFEST
        if mpath.is_file():
            m = json.loads(mpath.read_text(encoding="utf-8"))
            if model and m.get("model") and m["model"] != model:
                raise ValueError(
                    f"{root} holds data distilled from {m['model']!r}, not {model!r}: use another --out/--work"
                )
            store.model = m.get("model") or model
            store.prompts = list(m["prompts"])
            store.sources = list(m["sources"])
            store.magpie_rounds = int(m["magpie_rounds"])
            store.magpie_sampled = int(m.get("magpie_sampled", 0))
            store.shards = [ShardInfo(**s) for s in m["shards"]]
        store._keys = {norm_key(p) for p in store.prompts}
        store._reconcile()
        return store

    def _reconcile(self) -> None:
        """A run killed between writing a shard and the manifest leaves a shard the manifest lacks: adopt it."""
        known = {s.name for s in self.shards}
        changed = False
        for f in sorted((self.root / "data").glob("shard-*.pt")):
            if f.name in known:
                continue
            d = torch.load(f, weights_only=True)
            if d["first"] != self.next_prompt_index():
                continue  # not contiguous with what we have: ignore (it is rewritten later)
            self.shards.append(ShardInfo(f.name, d["first"], len(d["ids"]), _reply_tokens(d)))
            changed = True
        if changed:
            self.save()

    def save(self) -> None:
        atomic_write_json(
            self.root / MANIFEST,
            {
                "version": 1,
                "model": self.model,
                "magpie_rounds": self.magpie_rounds,
                "magpie_sampled": self.magpie_sampled,
                "shards": [s.__dict__ for s in self.shards],
                "prompts": self.prompts,
                "sources": self.sources,
            },
        )

    def add_prompts(self, texts: Iterable[Any], source: str) -> int:
        """Append new prompts (deduplicated on case- and whitespace-normalised text). Returns how many.

        An entry may be a list of user turns (a conversation): it is stored as its first turn followed by
        follow-up entries (conversations.py), all of it dropped if the first turn is a duplicate."""
        from medusa_chat.training.conversations import expand

        added = 0
        for t in texts:
            entries = expand(t) if isinstance(t, list) else [t]
            key = norm_key(entries[0]) if entries else ""
            if not key or key in self._keys:
                continue
            self._keys.add(key)
            self.prompts.extend(entries)
            self.sources.extend([source] * len(entries))
            added += len(entries)
        return added

    def next_prompt_index(self) -> int:
        return max((s.first + s.count for s in self.shards), default=0)

    @property
    def reply_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def write_shard(
        self, first: int, ids: list[list[int]], reply_start: list[int], finished: list[bool]
    ) -> ShardInfo:
        name = f"shard-{len(self.shards):05d}.pt"
        d = {"first": first, "ids": ids, "reply_start": reply_start, "finished": finished}
        atomic_torch_save(d, self.root / "data" / name)
        info = ShardInfo(name, first, len(ids), _reply_tokens(d))
        self.shards.append(info)
        self.save()
        return info

    def load_shard(self, info: ShardInfo) -> dict[str, Any]:
        return torch.load(self.root / "data" / info.name, weights_only=True)

    def samples(self) -> Iterator[tuple[int, list[int], int]]:
        """(prompt index, ids, reply_start) over all shards."""
        for info in self.shards:
            d = self.load_shard(info)
            for i, (ids, rs) in enumerate(zip(d["ids"], d["reply_start"], strict=True)):
                yield info.first + i, ids, rs


def _reply_tokens(d: dict[str, Any]) -> int:
    return sum(len(ids) - rs for ids, rs in zip(d["ids"], d["reply_start"], strict=True))


def export_npz(store: DistillStore, path: str | Path) -> dict[str, int]:
    """All samples of `store` in one compressed .npz (uint16 ids when the vocabulary allows) + prompts."""
    import numpy as np

    ids: list[int] = []
    offsets, starts, index, finished = [0], [], [], []
    for info in store.shards:
        d = store.load_shard(info)
        for i, (seq, rs, fin) in enumerate(zip(d["ids"], d["reply_start"], d["finished"], strict=True)):
            ids.extend(seq)
            offsets.append(len(ids))
            starts.append(rs)
            index.append(info.first + i)
            finished.append(fin)
    arr = np.asarray(ids, dtype=np.int64)
    dtype = np.uint16 if (arr.size == 0 or arr.max() < 65536) else np.int32
    answered = max(index, default=-1) + 1  # prompts past the last answered one (a run cut short) stay behind
    meta = {
        "model": store.model,
        "magpie_rounds": store.magpie_rounds,
        "magpie_sampled": store.magpie_sampled,
    }

    def blob(obj: Any) -> Any:
        return np.frombuffer(json.dumps(obj).encode("utf-8"), dtype=np.uint8)

    np.savez_compressed(
        path,
        ids=arr.astype(dtype),
        offsets=np.asarray(offsets, dtype=np.int64),
        reply_start=np.asarray(starts, dtype=np.int32),
        prompt_index=np.asarray(index, dtype=np.int32),
        finished=np.asarray(finished, dtype=bool),
        prompts=blob(store.prompts[:answered]),
        sources=blob(store.sources[:answered]),
        meta=blob(meta),
    )
    return {"samples": len(starts), "tokens": int(arr.size)}


def import_npz(
    store: DistillStore,
    path: str | Path,
    shard_size: int = 1024,
    eos: Iterable[int] = (),
    select: SampleRule | None = None,
) -> DistillStore:
    """Load `export_npz` files into an empty store, so training can resume from them. `path`: a file, or several
    joined by commas, each `FILE` or `FILE:N` (its first N samples); their samples follow one another, each
    file's prompt indices shifted past the previous files' (e.g. ShareGPT replies beside Magpie ones).
    `select` keeps only the prompts it accepts (select.py), before the first N are counted."""
    if store.prompts or store.shards:
        raise ValueError(f"{store.root} already holds data: import into a fresh --work folder")
    parts = str(path).split(",")
    for part in parts:
        file, limit = _file_and_limit(part)
        whole = len(parts) == 1 and limit is None  # keeps its unanswered prompts: the data stage answers them next
        _import_one(store, Path(file), limit, (shard_size, whole), set(eos), select)
    return store


def _file_and_limit(part: str) -> tuple[str, int | None]:
    """`FILE:N` -> (FILE, N); `FILE` -> (FILE, None)."""
    head, sep, tail = part.rpartition(":")
    return (head, int(tail)) if sep and head and tail.isdigit() else (part, None)


def _import_one(
    store: DistillStore,
    path: Path,
    limit: int | None,
    layout: tuple[int, bool],
    stop: set[int],
    select: SampleRule | None,
) -> None:
    import numpy as np

    from medusa_chat.training.conversations import conversation_end, is_follow

    shard_size, whole = layout
    d = np.load(path)
    ids, offsets, starts, index = d["ids"].astype(np.int64), d["offsets"], d["reply_start"], d["prompt_index"]
    finished = d["finished"] if "finished" in d.files else None
    if len(index) and not np.array_equal(index, np.arange(len(index))):
        raise ValueError(f"{path}: samples do not cover prompts 0..n-1 in order")
    prompts, sources = json.loads(d["prompts"].tobytes()), json.loads(d["sources"].tobytes())
    if select is not None:
        ids, offsets, starts, finished, prompts, sources = _selected(
            select, (ids, offsets, starts, finished), prompts, sources
        )
    count = len(starts) if limit is None else min(limit, len(starts))
    while 0 < count < len(starts) and is_follow(prompts[count]):
        count += 1  # a conversation's follow-up turns stay with its first turn
    base = len(store.prompts)
    keep = len(prompts) if whole else count
    store.prompts += prompts[:keep]
    store.sources += sources[:keep]
    store._keys |= {norm_key(p) for p in store.prompts[base:]}
    if "meta" in d.files:
        meta = json.loads(d["meta"].tobytes())
        store.magpie_rounds += int(meta.get("magpie_rounds", 0))
        store.magpie_sampled += int(meta.get("magpie_sampled", 0))
    store.save()
    first = 0
    while first < count:
        end = min(conversation_end(prompts, first + shard_size), count)  # a shard never splits a conversation
        rows = range(first, end)
        seqs = [ids[offsets[i] : offsets[i + 1]].tolist() for i in rows]
        rs = [int(starts[i]) for i in rows]
        if finished is not None:
            fin = [bool(finished[i]) for i in rows]
        else:  # older exports: a reply finished if it ends with an EOS id
            fin = [len(q) > r and q[-1] in stop for q, r in zip(seqs, rs, strict=True)]
        store.write_shard(base + first, seqs, rs, fin)
        first = end


def _selected(
    rule: SampleRule, arrays: tuple[Any, Any, Any, Any], prompts: list[Any], sources: list[Any]
) -> tuple[Any, Any, Any, Any, list[Any], list[Any]]:
    """An imported file's arrays and prompts cut to the entries `rule` keeps (answered ones first, as stored)."""
    import numpy as np

    ids, offsets, starts, finished = arrays
    rows = kept_rows(prompts, rule)
    answered = np.asarray([i for i in rows if i < len(starts)], dtype=np.int64)
    new_offsets = np.concatenate([[0], np.cumsum(np.diff(offsets)[answered])]).astype(np.int64)
    new_ids = np.concatenate([ids[:0], *(ids[offsets[i] : offsets[i + 1]] for i in answered)])
    return (
        new_ids,
        new_offsets,
        starts[answered],
        finished[answered] if finished is not None else None,
        [prompts[i] for i in rows],
        [sources[i] for i in rows],
    )

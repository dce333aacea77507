"""What a repetition penalty costs on text the model should predict: teacher-forced on the shipped fidelity
text (held-out prompts and the embedded model's float greedy replies, medusa_chat/data/fidelity_text.txt), each
scored position's logits penalised with its own context (the chunk so far; the chunk's first half is the
"prompt", the scored half the "reply"), as a reply's would be:

- changed: the share of positions whose greedy token the penalty changes;
- top1: the share where the greedy token is the text's next token (without the penalty: `base`);
- nll: the text's mean negative log-likelihood under softmax of the penalised logits (nats/token).

A penalty that breaks loops should change few tokens of text that does not loop, and cost little likelihood.

    PYTHONPATH=. python benchmarks/penalty_fidelity.py --chunks 18 --config repeat_penalty=1.1 \\
        --config repeat_penalty=1.1,repeat_last_n=-1 --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from medusa_chat.engine.penalties import Penaliser, PenaltyOptions, breaker_tokens
from medusa_chat.model.sources.fidelity import fixed_text, scored_logits, text_chunks
from medusa_chat.model.sources.loading import load_model
from medusa_chat.settings import parse_settings


def options(text: str) -> PenaltyOptions:
    changes = dict(item.split("=", 1) for item in text.split(",") if item)
    return PenaltyOptions(**parse_settings(changes))


def score(
    opts: PenaltyOptions, chunks: list[list[int]], logprobs: list[torch.Tensor], tokenizer: Any
) -> dict[str, float]:
    changed = top1 = base_top1 = 0
    nll = base_nll = 0.0
    count = 0
    for ids, rows in zip(chunks, logprobs, strict=True):
        half = len(ids) // 2
        breakers = breaker_tokens(tokenizer, opts.dry_sequence_breakers) if opts.dry else frozenset()
        pen = Penaliser(opts, ids[:half], breakers)
        for j in range(rows.shape[0]):
            pos = half + j  # the row predicts ids[pos + 1] from ids[: pos + 1]
            if j:
                pen.commit([ids[pos]])
            pen.begin_step([ids[pos]], [-1], rows.device)
            row = pen.rows(rows[j : j + 1], [0])[0]
            target = ids[pos + 1]
            new, old = int(row.argmax()), int(rows[j].argmax())
            changed += new != old
            top1 += new == target
            base_top1 += old == target
            nll -= float(row.log_softmax(-1)[target])
            base_nll -= float(rows[j].log_softmax(-1)[target])
            count += 1
    return {
        "positions": count,
        "changed": round(changed / count, 4),
        "top1": round(top1 / count, 4),
        "base_top1": round(base_top1 / count, 4),
        "nll": round(nll / count, 4),
        "base_nll": round(base_nll / count, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--chunks", type=int, default=None, help="first N chunks of 128 tokens (default: all)")
    ap.add_argument("--config", action="append", default=[], help="NAME=VALUE,... settings (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    loaded = load_model(args.model)
    chunks = text_chunks(loaded.tokenizer, fixed_text(), limit=args.chunks)
    logprobs = list(scored_logits(loaded, chunks))
    out: dict[str, Any] = {"chunks": len(chunks), "configs": {}}
    for text in args.config:
        out["configs"][text] = score(options(text), chunks, logprobs, loaded.tokenizer)
        print(text, out["configs"][text], flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

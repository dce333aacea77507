"""How fast can this machine self-distill? Greedy replies of the embedded model to real prompts, each way timed.

Ways: transformers' batched `generate` (left padding, prompts sorted by length, the data stage's own
`greedy_replies`) in fp32 and bf16 at a few batch sizes. The same prompts for every way; useful tokens/s counts
reply tokens up to and including EOS (what the heads train on), slot tokens/s every generated position (padding
after EOS included). Replies agree with fp32 batch 1 only where noted (bf16 changes the greedy tokens).

    python benchmarks/distill_throughput.py --prompts PROMPTS/heldout.jsonl --threads 1 \
        --ways fp32:8,fp32:16,bf16:8,bf16:16 --json benchmarks/results/distill_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from medusa_chat.training.distill import chat_prompt_ids, greedy_replies, load_for_training, read_prompt_file


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_way(model: torch.nn.Module, tok: object, prompts: list[list[int]], batch: int, new: int) -> dict:
    t = time.perf_counter()
    reps = greedy_replies(model, tok, prompts, batch_size=batch, max_new_tokens=new)
    dt = time.perf_counter() - t
    useful = sum(len(r) for r, _ in reps)
    slots = sum(new * min(batch, len(prompts) - s) for s in range(0, len(prompts), batch))
    return {
        "seconds": round(dt, 2),
        "useful_tok_s": round(useful / dt, 1),
        "slot_tok_s": round(slots / dt, 1),
        "reply_tokens": useful,
        "ended_at_eos": sum(f for _, f in reps),
        "replies": [r for r, _ in reps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="prompt jsonl (first user turns are used)")
    ap.add_argument("--n", type=int, default=32, help="prompts per way")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ways", default="fp32:8,fp32:16,fp32:32,bf16:8,bf16:16,bf16:32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = [p if isinstance(p, str) else p[0] for p in read_prompt_file(args.prompts)]
    results: dict = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "prompts": args.n,
        "max_new_tokens": args.max_new_tokens,
        "date": time.strftime("%Y-%m-%d"),
        "ways": {},
    }
    models: dict[str, tuple] = {}
    ref: list[list[int]] | None = None
    for way in args.ways.split(","):
        dtype_name, batch = way.split(":")
        if dtype_name not in models:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            models[dtype_name] = load_for_training("smollm2-135m", "cpu", dtype)
        model, tok = models[dtype_name]
        prompts = [p for p in (chat_prompt_ids(tok, t) for t in texts) if len(p) <= 512][: args.n]
        greedy_replies(model, tok, prompts[:2], batch_size=2, max_new_tokens=4)  # warm-up
        r = run_way(model, tok, prompts, int(batch), args.max_new_tokens)
        replies = r.pop("replies")
        if dtype_name == "fp32" and ref is None:
            ref = replies
        r["same_as_first_fp32"] = None if ref is None else sum(a == b for a, b in zip(ref, replies, strict=True))
        results["ways"][way] = r
        print(way, json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

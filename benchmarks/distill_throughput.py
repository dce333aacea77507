"""How fast can this machine self-distill? Greedy replies of the embedded model to real prompts, each way timed.

Ways: transformers' batched `generate` (left padding, prompts sorted by length, the data stage's own
`greedy_replies`) in fp32 and bf16 at a few batch sizes (`fp32:16`); `engine`: the app's own engine with no flags,
one reply at a time (`EngineReplies`: its default numeric path and tree, so replies differ from fp32 where that
path's greedy tokens do). The same prompts for every way; useful tokens/s counts
reply tokens up to and including EOS (what the heads train on), slot tokens/s every generated position (padding
after EOS included); per CPU-second too, the steadier figure where other processes share the cores. Replies agree with fp32 batch 1 only where noted (bf16 changes the greedy tokens).

    python benchmarks/distill_throughput.py --prompts PROMPTS/heldout.jsonl --threads 1 \
        --ways fp32:8,fp32:16,bf16:8,bf16:16 --json benchmarks/results/distill_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from medusa_chat.training.distill import chat_prompt_ids, greedy_replies, load_for_training, read_prompt_file
from medusa_chat.training.engine_replies import EngineReplies


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_way(gen: Callable[[list[list[int]]], list], prompts: list[list[int]], batch: int, new: int) -> dict:
    t, c = time.perf_counter(), time.process_time()
    reps = gen(prompts)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    useful = sum(len(r) for r, _ in reps)
    slots = sum(new * min(batch, len(prompts) - s) for s in range(0, len(prompts), batch))
    return {
        "seconds": round(dt, 2),
        "cpu_seconds": round(cpu, 2),
        "useful_tok_s": round(useful / dt, 1),
        "useful_tok_per_cpu_s": round(useful / cpu, 1),  # steadier than wall time on a shared machine
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
        dtype_name, _, batch = way.partition(":")
        if dtype_name not in models:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "engine": torch.float32}[dtype_name]
            models[dtype_name] = load_for_training("smollm2-135m", "cpu", dtype)
        model, tok = models[dtype_name]
        prompts = [p for p in (chat_prompt_ids(tok, t) for t in texts) if len(p) <= 512][: args.n]
        if dtype_name == "engine":  # the app's own engine, no flags, one reply at a time
            gen: Callable[[list[list[int]]], list] = EngineReplies.load("smollm2-135m", args.max_new_tokens)
            print(gen.describe(), flush=True)
            batch = "1"
        else:
            gen = partial(greedy_replies, model, tok, batch_size=int(batch), max_new_tokens=args.max_new_tokens)
        gen(prompts[:1])  # warm-up
        r = run_way(gen, prompts, int(batch), args.max_new_tokens)
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

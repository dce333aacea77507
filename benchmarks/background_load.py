"""Medusa vs the plain loop with other processes keeping cores busy: quiet, then under `--busy N` busy-looping
processes, each with the adaptive thread count (engine/threads.py) and with a fixed count (--fixed, default 2).

Why: the native step is one OpenMP region with a barrier after each worksharing loop; a core held by another
process stalls every barrier, so a fixed 2-thread step collapses on a 2-core machine with one core busy. The
adaptive engines drop to 1 thread there. Every prompt's greedy reply runs on every configuration in rotation (a
slow spell hits them alike), and every reply is checked identical to the plain loop's.

    python benchmarks/background_load.py --busy 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

from medusa_chat.bench.runs import read_prompts
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.sources.loading import load_model
from medusa_chat.tuning.first_start import resolve_tree

PROMPTS = Path(__file__).resolve().parent / "data" / "vicuna_bench_question.jsonl"


def _busy() -> None:  # a Python busy loop: one core held, as another user's job would
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler: terminate() just ends it
    while True:
        pass


def _engines(loaded, fixed: int) -> dict[str, MedusaEngine]:  # noqa: ANN001 - a LoadedModel
    # the tree every entry point uses (calibrated on this machine), not the heads' full 64-node default
    tree, _ = resolve_tree(loaded)
    engines = {}
    for mode in ("adaptive", f"fixed{fixed}"):
        # the governor reads MEDUSA_CHAT_THREADS when an engine is built (and resumes its count per reply)
        if mode == "adaptive":
            os.environ.pop("MEDUSA_CHAT_THREADS", None)
        else:
            os.environ["MEDUSA_CHAT_THREADS"] = str(fixed)
        engines[f"medusa/{mode}"] = MedusaEngine(loaded, tree)
        engines[f"plain/{mode}"] = MedusaEngine(loaded, plain_tree())
    os.environ.pop("MEDUSA_CHAT_THREADS", None)
    return engines


def _phase(engines, loaded, prompts, settings) -> dict[str, float]:  # noqa: ANN001
    """Decode tokens/s per configuration over the prompts (rotating the order per prompt)."""
    totals = {k: [0, 0.0] for k in engines}
    for i, text in enumerate(prompts):
        ids = loaded.build_prompt([{"role": "user", "content": text}])
        names = list(engines)
        names = names[i % len(names) :] + names[: i % len(names)]
        replies = {}
        for name in names:
            engine = engines[name]
            engine.reset()
            summary = list(engine.generate(ids, settings))[-1]
            replies[name] = summary.token_ids
            totals[name][0] += summary.new_tokens - 1
            totals[name][1] += summary.decode_s
            print(f"  prompt {i + 1} {name}: {summary.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        ref = replies[next(n for n in replies if n.startswith("plain/"))]
        if any(r != ref for r in replies.values()):
            raise SystemExit(f"prompt {i + 1}: a reply differs from the plain loop's")
    return {k: tokens / seconds for k, (tokens, seconds) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=1, help="busy-looping processes during the loaded phase")
    parser.add_argument("--fixed", type=int, default=2, help="the fixed thread count compared with adaptive")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model()
    engines = _engines(loaded, args.fixed)
    prompts = read_prompts(args.prompts)[: args.limit]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0)
    _phase({k: v for k, v in engines.items() if "fixed" in k}, loaded, prompts[:1], settings)  # warm-up
    # `timeout` (SIGTERM) ends the run as an exception, so the busy processes are still stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    rates = {"quiet": _phase(engines, loaded, prompts, settings)}
    print(f"quiet: {rates['quiet']}", file=sys.stderr, flush=True)
    busy = [mp.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        rates[f"busy {args.busy}"] = _phase(engines, loaded, prompts, settings)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    phases = list(rates)
    print(
        f"{loaded.name if hasattr(loaded, 'name') else 'embedded model'}, {len(prompts)} prompts x "
        f"{args.max_new_tokens} new tokens, greedy; every reply identical to the plain loop's; {os.cpu_count()} CPUs"
    )
    print(f"{'decode tok/s':>18}" + "".join(f"{p:>14}" for p in phases) + f"{'loaded/quiet':>14}")
    for name in engines:
        row = [rates[p][name] for p in phases]
        print(f"{name:>18}" + "".join(f"{r:14.1f}" for r in row) + f"{row[-1] / row[0]:14.2f}")
    for mode in ("adaptive", f"fixed{args.fixed}"):
        ratios = [rates[p][f"medusa/{mode}"] / rates[p][f"plain/{mode}"] for p in phases]
        print(f"{'medusa/plain ' + mode:>18}" + "".join(f"{r:13.2f}x" for r in ratios))
    for p in phases:
        print(
            f"{p}: adaptive / fixed{args.fixed}: medusa "
            f"{rates[p]['medusa/adaptive'] / rates[p][f'medusa/fixed{args.fixed}']:.2f}x, plain "
            f"{rates[p]['plain/adaptive'] / rates[p][f'plain/fixed{args.fixed}']:.2f}x"
        )


if __name__ == "__main__":
    main()

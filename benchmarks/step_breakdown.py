"""Where a decoding step's time goes, plain loop against Medusa trees, on real replies: the engine's own `generate`
on Vicuna-bench prompts (greedy), each step split into the native C step (decoder_forward: every layer's block
products, attention, norms), the lm_head's fused greedy argmax, the draft (the C drafter's call) and the rest
(Python and the engine's host work between kernels), with tokens per step and the speedup over the plain loop.

    python benchmarks/step_breakdown.py --threads 1,2,auto --sizes 1,2,3,4 --prompts 8 --json out.json

Every (threads, tree size) variant decodes each prompt in turn, in forward then reverse order, so a shared
machine's slow spells hit them alike: read the ratios within one run. `auto` is the thread governor as the app
runs it with no flags (engine/threads.py); a number fixes the count for that variant only. Size 1 is the plain
loop (the root-only tree); size N the first N nodes of the model's default tree, shaped per step by the draft
as the engine does (a 2-node tree is the draft's top-1 chain). `vs_plain` is the variant's decode tokens/s over
the plain loop's at the same thread setting, over all prompts; `per_prompt` its spread over prompts. Replies
must equal the plain loop's (`identical`). The parts are wall times around the calls (ctypes included); the C
step of a step is one call, so attention and the block products inside it are not told apart here
(benchmarks/step_cost.py times the step per row count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PARTS = ("c_step", "lm_head", "draft")


class _Timers:
    """Wall time per part, summed until `take` (one step's worth, or a reply's)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        out, self.acc = self.acc, {}
        return out


class _Lib:
    """The kernel library with decoder_forward timed (the NativeForward's `lib`)."""

    def __init__(self, lib: Any, timers: _Timers) -> None:
        self._lib = lib
        self.decoder_forward = timers.wrap("c_step", lib.decoder_forward)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


def _governor(setting: str) -> Any:
    from medusa_chat.engine.threads import ThreadGovernor

    if setting == "auto":
        return ThreadGovernor()
    n = int(setting)
    gov = ThreadGovernor(full=n)
    gov.adaptive, gov.threads, gov.full, gov.busy = False, n, n, 1
    return gov


def _instrument(engine: Any, timers: _Timers) -> None:
    native = engine.runner.lean
    if native is not None and not isinstance(native.lib, _Lib):
        native.lib = _Lib(native.lib, timers)
    lm = engine.lm_head
    if getattr(lm, "argmax", None) is not None and "argmax" not in vars(lm):
        object.__setattr__(lm, "argmax", timers.wrap("lm_head", type(lm).argmax.__get__(lm)))
    drafter = engine.drafter
    nat = getattr(drafter, "native", None)
    if nat is not None:
        if "draft_shaped" not in vars(nat):
            nat.draft_shaped = timers.wrap("draft", nat.draft_shaped)
        if getattr(drafter, "native_draft", None) is not None:
            drafter.native_draft = timers.wrap("draft", type(nat).draft.__get__(nat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="1,2,3,4", help="tree sizes (1 = the plain loop, always timed)")
    ap.add_argument(
        "--threads", default="1,2,auto", help="thread settings: numbers and/or auto (the governor)"
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--skip", type=int, default=0, help="start at this prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--data", default=str(Path(__file__).parent / "data" / "vicuna_bench_question.jsonl"))
    ap.add_argument("--json", help="result file")
    args = ap.parse_args()
    os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")

    import torch

    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
    from medusa_chat.kernels import isa_choice
    from medusa_chat.machine import cpu_model
    from medusa_chat.model.sources.loading import load_model

    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    settings_t = args.threads.split(",")
    loaded = load_model(model=args.model, quant="auto", device="cpu")
    base = loaded.default_tree
    timers = _Timers()
    engines: dict[tuple[str, int], Any] = {}
    for t in settings_t:
        for n in sizes:
            e = MedusaEngine(loaded, plain_tree() if n == 1 else base.prefix(n))
            e.threads = _governor(t)
            _instrument(e, timers)
            engines[(t, n)] = e
    lines = Path(args.data).read_text().splitlines()[args.skip : args.skip + args.prompts]
    prompts = [json.loads(line)["turns"][0] for line in lines]
    gen = GenerationSettings(temperature=0.0, max_new_tokens=args.max_new_tokens)
    keys = list(engines)
    rec: dict[tuple[str, int], dict[str, Any]] = {
        k: {
            "steps": 0,
            "tokens": 0,
            "step_s": 0.0,
            **dict.fromkeys(PARTS, 0.0),
            "replies": [],
            "per_prompt": [],
        }
        for k in keys
    }
    t_start = time.time()
    with torch.inference_mode():
        for p in prompts:
            ids = loaded.build_prompt([{"role": "user", "content": p}])
            per: dict[tuple[str, int], list[float]] = {k: [0, 0.0] for k in keys}
            for order in (keys, keys[::-1]):
                for k in order:
                    e = engines[k]
                    e.reset()
                    steps, step_s, summary = 0, 0.0, None
                    for ev in e.generate(ids, gen):
                        if isinstance(ev, StepEvent):
                            if ev.step == 0:
                                timers.take()  # the prefill's calls are not a step's
                            else:
                                steps, step_s = steps + 1, step_s + ev.step_time_s
                        elif isinstance(ev, ReplySummary):
                            summary = ev
                    parts = timers.take()
                    r = rec[k]
                    r["steps"] += steps
                    r["tokens"] += summary.new_tokens - 1
                    r["step_s"] += step_s
                    for part in PARTS:
                        r[part] += parts.get(part, 0.0)
                    if order is keys:
                        r["replies"].append(summary.token_ids)
                    per[k][0] += summary.new_tokens - 1
                    per[k][1] += step_s
            for k in keys:
                r, plain = per[k], per[(k[0], 1)]
                rec[k]["per_prompt"].append((r[0] / r[1]) / (plain[0] / plain[1]))
    results: dict[str, Any] = {}
    for t, n in keys:
        r, plain = rec[(t, n)], rec[(t, 1)]
        s = r["steps"]
        ms = {part: 1e3 * r[part] / s for part in PARTS}
        step_ms = 1e3 * r["step_s"] / s
        pp = r["per_prompt"]
        results[f"threads={t} size={n}"] = {
            "tokens_per_step": round(r["tokens"] / s, 3),
            "step_ms": round(step_ms, 3),
            **{f"{part}_ms": round(v, 3) for part, v in ms.items()},
            "other_ms": round(step_ms - sum(ms.values()), 3),
            "tokens_per_s": round(r["tokens"] / r["step_s"], 1),
            "vs_plain": round((r["tokens"] / r["step_s"]) / (plain["tokens"] / plain["step_s"]), 3),
            "per_prompt": {"min": round(min(pp), 3), "median": round(statistics.median(pp), 3),
                           "max": round(max(pp), 3)},
            "identical": sum(a == b for a, b in zip(r["replies"], rec[(t, 1)]["replies"], strict=True)),
            "steps": s,
        }  # fmt: skip
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa": isa_choice.best_isa(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": "python benchmarks/step_breakdown.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "tree": base.name,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "wall_s": round(time.time() - t_start, 1),
        "results": results,
    }
    print(f"{doc['cpu']} ({doc['isa']}), load {doc['load_average']}, {len(prompts)} prompts")
    print(f"{'variant':>20} {'tok/step':>8} {'step ms':>8} {'C step':>7} {'lm_head':>7} {'draft':>6} {'other':>6}"
          f" {'vs plain':>8} {'per prompt':>17} same")  # fmt: skip
    for name, r in results.items():
        pp = r["per_prompt"]
        print(f"{name:>20} {r['tokens_per_step']:>8.3f} {r['step_ms']:>8.3f} {r['c_step_ms']:>7.3f} "
              f"{r['lm_head_ms']:>7.3f} {r['draft_ms']:>6.3f} {r['other_ms']:>6.3f} {r['vs_plain']:>8.3f} "
              f"{pp['min']:>5.2f}-{pp['median']:.2f}-{pp['max']:.2f} {r['identical']}/{len(prompts)}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

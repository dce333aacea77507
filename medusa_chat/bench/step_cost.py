"""`medusa-chat step-cost`: what a tree step costs on this CPU. The engine's own step at 1 / 2 / 4 / 8 rows (nodes)
for the embedded model and for any GGUF you give, side by side in one process, and the weight stream's prefetch hint
as measured for this machine (`auto`, what the app runs) against the former fixed prefetcht0 (`t0`), written to a
result JSON; for a GGUF, llama.cpp's `llama-bench` token generation on the same file beside it where a binary is
found (MEDUSA_CHAT_LLAMA_BENCH or PATH).

    medusa-chat step-cost                                            # the embedded model, 1 and 2 threads
    medusa-chat step-cost --model llama-1b-Q4_K_M.gguf --threads 2 --json out.json
    medusa-chat step-cost --no-embedded --model a.gguf --model b.gguf --sizes 1,2,3,4,8 --prefetch auto

The step timed is `measure_step_latency`'s (the calibration's harness: propose with the model's drafter where it
has one, verify, accept, commit, with a 256-token prefix in the cache); a GGUF without heads is timed on a chain
of 1-8 nodes, as context lookup drafts. Every (threads, prefetch) variant and size is timed in turn in each round,
so a shared machine's slow spells hit them alike: read the ratios, not the absolute times. The figures per size
are the median over rounds of each round's median step; `ratio` is to the 1-node step of the same variant,
`vs_t0` the t0 step over this one (> 1: faster than before). The JSON also holds the CPU, the block kernel's
instruction set and the prefetch measurement (csrc/qblock.h, prefetch.measure_prefetch).
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

from medusa_chat.cliargs import int_list


def _variants(threads: list[int], prefetch: list[str]) -> list[tuple[int, str]]:
    return [(t, p) for t in threads for p in prefetch]


def measure_model(
    model: str, sizes: list[int], threads: list[int], prefetch: list[str], rounds: int, reps: int
) -> dict[str, Any]:
    import torch

    from medusa_chat.bench.runs import repo_path
    from medusa_chat.kernels.prefetch import prefetch_choice, set_prefetch
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency, prefilled_engines, timing_prefix

    t0 = time.perf_counter()
    loaded = load_model(model=model, quant="auto", device="cpu")
    load_s = time.perf_counter() - t0
    heads = loaded.heads is not None
    base = Tree.named("mc_sim_7b_63") if heads else Tree.named(f"chain-{max(sizes)}")
    with torch.inference_mode():
        engines = prefilled_engines(loaded, sizes, base, timing_prefix(loaded, 256, 0), True)
    auto = prefetch_choice().get("hints") or "t0"
    steps: dict[tuple[int, str, int], list[float]] = {}
    try:
        for _ in range(rounds):
            for t, p in _variants(threads, prefetch):
                set_prefetch(auto if p == "auto" else p)
                lat = measure_step_latency(loaded, sizes, engines=engines, reps=reps, threads=t)
                for n in sizes:
                    steps.setdefault((t, p, n), []).append(lat[n]["median_s"])
    finally:
        set_prefetch(auto)
        for engine, _, _ in engines.values():
            engine.reset()
    out: dict[str, Any] = {
        "model": repo_path(model),  # repo-relative, as every result JSON keeps paths
        "load_s": round(load_s, 1),
        "drafter": "heads" if heads else "chain (context lookup)",
        "quant": str(getattr(loaded, "quant", "")),
        "variants": {},
    }
    for t, p in _variants(threads, prefetch):
        one = statistics.median(steps[(t, p, 1)])
        rows = {}
        for n in sizes:
            ms = statistics.median(steps[(t, p, n)])
            cell = {"median_ms": round(ms * 1e3, 3), "ratio": round(ms / one, 3)}
            if p != "t0" and (t, "t0", n) in steps:
                cell["vs_t0"] = round(statistics.median(steps[(t, "t0", n)]) / ms, 3)
            rows[str(n)] = cell
        out["variants"][f"threads={t} prefetch={p}"] = rows
    out["llama_bench"] = llama_bench(loaded, threads, out)
    del engines, loaded
    return out


def llama_bench(loaded: Any, threads: list[int], out: dict[str, Any]) -> dict[str, Any] | str:
    """llama.cpp's `llama-bench -p 0 -n 32` on the same GGUF per thread count, where a binary is found
    (MEDUSA_CHAT_LLAMA_BENCH or PATH): ms per token, and llama.cpp's over our plain (1-node) step with the
    hints in force (> 1: ours faster). Else why not."""
    from medusa_chat.bench.peer import LlamaBench, find_llama_bench, model_gguf

    binary, gguf = find_llama_bench(), model_gguf(loaded)
    if binary is None or gguf is None:
        return "skipped: " + ("no llama-bench binary (MEDUSA_CHAT_LLAMA_BENCH)" if binary is None else "not a GGUF")
    from medusa_chat.bench.runs import repo_path

    res: dict[str, Any] = {"binary": repo_path(str(binary))}
    for t in threads:
        try:
            tg = LlamaBench(binary, gguf, t).token_generation(32, reps=3)
        except (RuntimeError, OSError) as err:
            res[f"threads={t}"] = f"failed: {err}"
            continue
        ms = 1e3 / tg["tokens_per_s"]
        ours = out["variants"].get(f"threads={t} prefetch=auto") or out["variants"].get(f"threads={t} prefetch=t0")
        res[f"threads={t}"] = {
            "ms_per_token": round(ms, 3),
            "build": tg["build"],
            "llamacpp_over_plain_step": round(ms / ours["1"]["median_ms"], 3) if ours else None,
        }
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat step-cost` (and of benchmarks/step_cost.py, which runs this)."""
    ap.add_argument("--model", action="append", default=[], help="a GGUF file (or any model the app loads); repeatable")
    ap.add_argument("--no-embedded", action="store_true", help="leave out the embedded model")
    ap.add_argument("--sizes", type=int_list, default=[1, 2, 4, 8], help="tree sizes (nodes) to time")
    ap.add_argument(
        "--threads",
        dest="thread_counts",  # (not `threads`: the CLI reads that as the one fixed count of the process)
        type=int_list,
        default=[1, 2],
        help="thread counts of the native step, each timed, e.g. 2 or 1,2",
    )
    ap.add_argument("--prefetch", default="t0,auto", help="auto (the measured hints) and/or t0, t1, t2, off")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="steps per size and round (their median is kept)")
    ap.add_argument(
        "--json", help="result file (default: step_cost_<date>_<cpu>.json, in benchmarks/results of a checkout)"
    )


def run(args: argparse.Namespace, command: str) -> int:
    """Time, print the table, write the JSON; the exit status."""
    from medusa_chat.bench.runs import repo_path
    from medusa_chat.kernels import cbind, isa_choice
    from medusa_chat.kernels.prefetch import PREFETCH_HINTS, prefetch_choice
    from medusa_chat.machine import cpu_model, slug

    sizes = sorted({1, *args.sizes})
    prefetch = args.prefetch.split(",")
    bad = [p for p in prefetch if p != "auto" and p not in PREFETCH_HINTS]
    if bad:
        sys.stderr.write(f"error: --prefetch: {bad[0]!r} is not auto or one of {', '.join(PREFETCH_HINTS)}\n")
        return 2
    models = ([] if args.no_embedded else ["smollm2-135m"]) + args.model
    if not models:
        sys.stderr.write("error: nothing to time: give --model or leave out --no-embedded\n")
        return 2
    if not cbind.available():
        sys.stderr.write(f"error: the block kernel cannot run here: {cbind.unavailable_reason()}\n")
        return 1
    doc: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa": isa_choice.best_isa(),
        "kquant_activations": cbind.kquant_scheme(),
        # (the cache file's path is the machine's own: kept out of a result file meant for the repository)
        "prefetch": {k: v for k, v in prefetch_choice().items() if k != "source"},
        "command": command,
        "models": [measure_model(m, sizes, args.thread_counts, prefetch, args.rounds, args.reps) for m in models],
    }
    print(f"{doc['cpu']} ({doc['isa']}); prefetch hints measured here: {doc['prefetch'].get('hints')}")
    for m in doc["models"]:
        print(f"\n{m['model']} ({m['drafter']})")
        print(f"{'variant':>26} " + " ".join(f"{n:>4}-node ms ratio" for n in sizes))
        for name, rows in m["variants"].items():
            cells = " ".join(f"{rows[str(n)]['median_ms']:>11.2f} {rows[str(n)]['ratio']:>5.2f}" for n in sizes)
            print(f"{name:>26} {cells}")
        if isinstance(m.get("llama_bench"), dict):
            for key, v in m["llama_bench"].items():
                if isinstance(v, dict):
                    print(f"llama.cpp llama-bench tg, {key}: {v['ms_per_token']:.2f} ms a token "
                          f"({v['llamacpp_over_plain_step']}x our 1-node step)")  # fmt: skip
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    name = f"step_cost_{day}_{slug(doc['cpu'])}.json"
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    path = Path(args.json) if args.json else (results / name if results.is_dir() else Path(name))
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nwritten: {repo_path(str(path.resolve()))}")
    return 0


def command_line(prefix: str, args: argparse.Namespace) -> str:
    """The command that repeats this run, as the result JSON records it (paths made repository-relative)."""
    from medusa_chat.bench.runs import repo_path

    words = [prefix, *(["--no-embedded"] if args.no_embedded else [])]
    words += [f"--model {repo_path(m)}" for m in args.model]
    words += [f"--sizes {','.join(map(str, args.sizes))}", f"--threads {','.join(map(str, args.thread_counts))}"]
    words += [f"--prefetch {args.prefetch}", f"--rounds {args.rounds}", f"--reps {args.reps}"]
    return " ".join(words)


def step_cost_main(args: argparse.Namespace) -> int:
    """The `medusa-chat step-cost` entry point."""
    return run(args, command_line("medusa-chat step-cost", args))

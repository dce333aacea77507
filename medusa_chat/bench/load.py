"""`medusa-chat bench --background-load N`: the bench run twice, quiet and then with N busy processes, side by
side: Medusa, its baselines (the plain loop; llama.cpp where llama-bench or llama-cpp-python is found) and each
one's speed under load as a fraction of its quiet speed.

Why: a desktop chat app never has the machine to itself. A core held by another process stalls every barrier
of a multi-threaded step (engine/threads.py adapts the thread count to it); this reports what is left of each
method's speed, and of Medusa's lead, under that load (the targets: Medusa >= 0.5x its quiet speed and
>= 1.3x the plain loop under one busy process on 2 cores, still ahead of llama.cpp).

A busy process is a separate Python interpreter spinning `while True: pass` (one core each, as another
program's job would): started after the quiet phase, ended (terminate, then kill) however the loaded phase ends.
The engines are built afresh for each phase, so the loaded phase starts with the load already there.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


BUSY_CODE = "while True:\n    pass\n"
LABELS = {
    "medusa": "medusa",
    "hf": "HF generate",
    "plain": "plain loop",
    "lookup": "HF prompt lookup",
    "heads": "Medusa heads only",
    "llamacpp": "llama.cpp",
}


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` processes that each keep one core busy until the block ends."""
    if n < 0:
        raise ValueError(f"--background-load must be >= 0 (got {n})")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUSY_CODE],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        if procs:
            time.sleep(0.5)  # past their start-up (imports), spinning when the timed runs begin
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _speeds(doc: dict[str, Any]) -> dict[str, float | None]:
    """{method: decode tok/s} from one bench document (Medusa, its baselines, llama.cpp when it ran)."""
    s = doc["summary"]
    out: dict[str, float | None] = {"medusa": s.get("medusa_tokens_per_s")}
    for m in doc["baselines"]:
        out[m] = s.get(f"{m}_tokens_per_s")
    return out


def side_by_side(quiet: dict[str, Any], loaded: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: quiet and loaded tok/s, loaded/quiet, and Medusa's speedup over it in each phase."""
    q, lo = _speeds(quiet), _speeds(loaded)
    rows = []
    for m in [m for m in q if m in lo] + [m for m in lo if m not in q]:
        qs, ls = q.get(m), lo.get(m)
        rows.append(
            {
                "method": m,
                "quiet_tokens_per_s": qs,
                "loaded_tokens_per_s": ls,
                "loaded_over_quiet": round(ls / qs, 4) if qs and ls else None,
                "medusa_speedup_quiet": round(q["medusa"] / qs, 4) if q.get("medusa") and qs else None,
                "medusa_speedup_loaded": round(lo["medusa"] / ls, 4) if lo.get("medusa") and ls else None,
            }
        )
    return rows


def run_with_background_load(bench: Callable[[], dict[str, Any]], n: int, err: Console | None = None) -> dict[str, Any]:
    """`bench` (a whole run: harness.run_bench with its arguments) quiet, then under `n` busy processes:
    {"background_load", "quiet", "loaded", "side_by_side"}."""
    if n < 1:
        raise ValueError(f"--background-load must be >= 1 (got {n})")
    if err is not None:
        err.print("[dim]quiet phase[/dim]")
    quiet = bench()
    if err is not None:
        err.print(f"[dim]loaded phase: {n} busy process{'es' if n > 1 else ''}[/dim]")
    with busy_processes(n):
        under = bench()
    return {"background_load": n, "quiet": quiet, "loaded": under, "side_by_side": side_by_side(quiet, under)}


def print_load_summary(console: Console, doc: dict[str, Any]) -> None:
    from rich.table import Table

    from medusa_chat.bench.report import fmt_value

    q = doc["quiet"]
    n = doc["background_load"]
    title = (
        f"{q['model']} ({q['device']}, quant {q['quant']}), tree {q['tree_size']} nodes, "
        f"{q['summary']['prompts']} prompts x <= {q['max_new_tokens']} tokens, {q['accept_mode']}, "
        f"{q['cpu_count']} CPUs: quiet vs {n} busy process{'es' if n > 1 else ''}"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "method",
        "quiet tok/s",
        "loaded tok/s",
        "loaded/quiet",
        "Medusa/it quiet",
        "Medusa/it loaded",
    ):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for row in doc["side_by_side"]:
        table.add_row(
            LABELS.get(row["method"], row["method"]),
            fmt_value(row["quiet_tokens_per_s"], ".1f"),
            fmt_value(row["loaded_tokens_per_s"], ".1f"),
            fmt_value(row["loaded_over_quiet"], ".2f", "x"),
            "" if row["method"] == "medusa" else fmt_value(row["medusa_speedup_quiet"], ".2f", "x"),
            "" if row["method"] == "medusa" else fmt_value(row["medusa_speedup_loaded"], ".2f", "x"),
        )
    console.print(table)
    for phase in ("quiet", "loaded"):
        s = doc[phase]["summary"]
        if s.get("identical_to_plain_loop_fraction") is not None:
            console.print(
                f"{phase}: greedy output identical to the plain loop in "
                f"{s['identical_to_plain_loop_fraction'] * 100:.0f}% of prompts"
            )
        if s.get("llamacpp_note"):
            console.print(f"[yellow]{phase}: {s['llamacpp_note']}[/yellow]")
    loads = [doc[p].get("load_average") for p in ("quiet", "loaded")]
    console.print(f"[dim]1-minute load average (before, after) quiet {loads[0]}, loaded {loads[1]}[/dim]")

"""The loop metric: the share of replies that run to the token cap while repeating an n-gram cycle.

A reply "loops" when it stopped at max_new_tokens and its end is one token sequence of some length p (1-64)
over and over: the last 2p tokens (at least 24) each equal the token p before, i.e. at least three copies
of the cycle end the reply. A reply that varies its loop slightly (a changed word each round) is not counted,
so the figure is a lower bound. The bench reports it beside tokens per step: a loop is what context lookup
accepts best, so a speed figure must never hide one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

MAX_PERIOD = 64  # the longest cycle looked for, in tokens (a long sentence)
MIN_SPAN = 24  # the fewest repeating tokens that count (24 copies of one token, 8 of a 3-token cycle, ...)


def loop_period(tokens: Sequence[int]) -> int | None:
    """The shortest cycle length p the reply's end repeats (at least 3 copies, >= MIN_SPAN tokens), or None."""
    n = len(tokens)
    for p in range(1, min(MAX_PERIOD, n // 3) + 1):
        need = max(2 * p, MIN_SPAN)
        if need + p > n:
            continue
        if all(tokens[n - 1 - i] == tokens[n - 1 - i - p] for i in range(need)):
            return p
    return None


def loops(row: dict[str, Any]) -> bool:
    """Did this bench row's reply hit the token cap inside a cycle?"""
    return row.get("stop_reason") == "max_new_tokens" and loop_period(row.get("token_ids") or []) is not None


def loop_fraction(rows: Iterable[dict[str, Any]]) -> float | None:
    flags = [loops(r) for r in rows]
    return round(sum(flags) / len(flags), 4) if flags else None


__all__ = ["MAX_PERIOD", "MIN_SPAN", "loop_fraction", "loop_period", "loops"]

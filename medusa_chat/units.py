"""Sizes and counts for people to read: the package's one formatter of each."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """A byte count in binary units: "512 B", "518.1 MiB" ("?" when unknown)."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    """A count such as a parameter count: "950", "1.3M", "134.5M", "6.7B"."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"

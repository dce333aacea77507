"""Sizes and counts for people to read: the package's one formatter of each."""

from __future__ import annotations


def human_bytes(n: float | None, binary: bool = False) -> str:
    """A byte count: decimal units ("512 B", "98.4 MB"), or with `binary` powers of 1024 ("518.1 MiB");
    "?" when unknown."""
    if n is None:
        return "?"
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    return f"{n:.1f} {units[-1]}"


def human_count(n: float) -> str:
    """A count such as a parameter count: "950", "1.3M", "134.5M", "6.7B"."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"

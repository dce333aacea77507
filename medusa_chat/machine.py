"""What this machine's CPU is: its feature flags and model name (one probe of /proc/cpuinfo for the package)."""

from __future__ import annotations

import platform
import re
from pathlib import Path


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is absent or unreadable)."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    """The CPU's model name, e.g. "AMD EPYC 7B13" (platform's guess where /proc/cpuinfo is absent)."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_native_bf16() -> bool:
    """Does this CPU compute bf16 natively (AMX or AVX512-BF16)? Then bf16 is ~2x faster here."""
    if _cpuinfo_lines():
        return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    import torch

    try:  # not Linux: ask PyTorch whether AMX can be used
        return bool(torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


def slug(text: str) -> str:
    """`text` as a file-name part: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (/proc/meminfo MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

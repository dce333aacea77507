"""Every `MEDUSA_CHAT_*` environment variable, declared once and read through this module.

Two kinds: `CONFIG`, the user's configuration (where files go, threads, first-start measurements, ...), and
`COMPARISON`, a switch that turns a measured-better path off to compare it with the one it replaced (each names
the benchmark or test that compares). docs/configuration.md lists them all (tests/test_envvars.py checks the
page against `VARIABLES`). The values are read at each call, not cached: tests and benchmarks set them per run.

No torch, no UI: any module may import this one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CONFIG = "configuration"
COMPARISON = "comparison"


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # CONFIG or COMPARISON
    reader: str  # the module that acts on it


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("MEDUSA_CHAT_CACHE", CONFIG, "paths"),
        EnvVar("MEDUSA_CHAT_DATA", CONFIG, "chat/conversations"),
        EnvVar("MEDUSA_CHAT_API_KEY", CONFIG, "openai/server"),
        EnvVar("MEDUSA_CHAT_AUTO_CALIBRATE", CONFIG, "chat/session, tuning/calibrate, model/sources/fidelity, cli"),
        EnvVar("MEDUSA_CHAT_LLAMA_BENCH", CONFIG, "bench/peer"),
        EnvVar("MEDUSA_CHAT_LLAMA_SERVER", CONFIG, "bench/server_peers"),
        EnvVar("MEDUSA_CHAT_THREADS", CONFIG, "engine/threads"),
        EnvVar("MEDUSA_CHAT_DEBUG", CONFIG, "cli"),
        EnvVar("MEDUSA_CHAT_UI_HZ", CONFIG, "chat/updates"),
        EnvVar("MEDUSA_CHAT_UI_PANEL_HZ", CONFIG, "chat/updates"),
        EnvVar("MEDUSA_CHAT_EAGLE_DRAFT_VOCAB", CONFIG, "model/forward/native_eagle"),
        EnvVar("MEDUSA_CHAT_THINKING", CONFIG, "model/sources/chat_template"),
        EnvVar("MEDUSA_CHAT_QGEMM_ISA", CONFIG, "kernels/isa_choice"),
        EnvVar("MEDUSA_CHAT_PREFETCH", CONFIG, "kernels/prefetch"),
        EnvVar("MEDUSA_CHAT_KQUANT_ACTIVATIONS", CONFIG, "kernels/cbind"),
        EnvVar("MEDUSA_CHAT_NATIVE", COMPARISON, "model/forward/block_forward, model/forward/block_heads, model/forward/native_eagle"),
        EnvVar("MEDUSA_CHAT_LEAN", COMPARISON, "model/forward/lean_forward"),
        EnvVar("MEDUSA_CHAT_QUANT_CACHE", COMPARISON, "model/sources/quantized_cache"),
        EnvVar("MEDUSA_CHAT_QGEMM", COMPARISON, "kernels/cbind"),
        EnvVar("MEDUSA_CHAT_BLOCK_HEADS", COMPARISON, "model/forward/block_heads"),
        EnvVar("MEDUSA_CHAT_DUET", COMPARISON, "engine/threads"),
        EnvVar("MEDUSA_CHAT_COMPILE", COMPARISON, "model/forward/graph_step"),
        EnvVar("MEDUSA_CHAT_UI_DECODE_AHEAD", COMPARISON, "chat/updates"),
        EnvVar("MEDUSA_CHAT_UI_LIVE_REPLY", COMPARISON, "ui/web"),
    )
}


def _known(name: str) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared environment variable (medusa_chat/envvars.py)")
    return name


def value(name: str) -> str | None:
    """The variable's value, stripped; None where it is unset or empty."""
    text = os.environ.get(_known(name), "").strip()
    return text or None


def enabled(name: str) -> bool:
    """A switch that is on unless set to 0 (every COMPARISON switch, MEDUSA_CHAT_AUTO_CALIBRATE)."""
    return value(name) != "0"


def positive_rate(name: str, default: float) -> float:
    """A rate per second from the variable (a number > 0; anything else is a ValueError), else `default`."""
    text = value(name)
    if text is None:
        return default
    try:
        rate = float(text)
    except ValueError as err:
        raise ValueError(f"{name} must be a number of updates per second (got {text!r})") from err
    if not rate > 0:
        raise ValueError(f"{name} must be > 0 (got {text!r})")
    return rate


def auto_calibrate() -> bool:
    """First-start measurements (tree calibration, the numeric path's fidelity probe): on unless
    MEDUSA_CHAT_AUTO_CALIBRATE=0 (the test suite turns them off)."""
    return enabled("MEDUSA_CHAT_AUTO_CALIBRATE")

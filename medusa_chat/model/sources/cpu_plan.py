"""A big model on a CPU: what its 4-bit weights need in memory and on disk, and how fast it will answer, said in one
line before anything large is read; refused only where this machine cannot hold it, with how much is missing.

The need is estimated from the quantized size, not the parameter count's fp32 bytes:
- a GGUF file: its own size (the loader keeps its blocks as stored, ~1.0x the file; docs/gguf_models.md);
- a Hugging Face checkpoint on the int4 path: the cached GGUF it is quantized into once (quantized_cache.py): Q4_1
  projections (20 bytes per 32 weights), a Q8_0 lm_head (34 per 32), the token embedding as stored (16-bit);
plus the engine's first KV cache (1024 fp32 slots of every layer's keys and values) and the runtime itself. Disk:
the cached GGUF where it is not made yet, and the checkpoint's download (~2 bytes a weight) where it is not here.

Speed: this machine's own measurement of this model where the calibration cache holds one (its plain step),
else the project's measured figures for a 6.9B Q4_K_M on 2-vCPU machines (benchmarks/RESULTS.md), scaled by
the weights' bytes (a CPU decoding step reads every weight once) and named as such.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medusa_chat.errors import DeviceError
from medusa_chat.units import human_bytes

RUNTIME_BYTES = 600 * 2**20  # Python, torch, the tokenizer and the C kernels beside the weights (RSS of a start)
KV_SLOTS = 1024  # the engine's first KV cache (engine.fresh_cache), fp32
DOWNLOAD_BYTES_PER_WEIGHT = 2  # a Hub checkpoint is fp16 or bf16
# The project's measured plain decoding of a 6.9B Q4_K_M GGUF (4.18 GB) on 2-vCPU machines, tokens/s:
# Zen 1 3.6, Zen 5 5.2, Xeon (AVX512-VNNI) 5.6 (benchmarks/RESULTS.md, 2026-12-03 and 2026-12-04)
REFERENCE_BYTES = 4.18e9
REFERENCE_TOKENS_PER_S = (3.6, 5.6)


@dataclass(frozen=True)
class CpuNeed:
    """What loading the model 4-bit on this CPU takes, and what this machine has."""

    weights: int  # bytes of the 4-bit weights in memory
    ram: int  # weights + KV cache + runtime
    ram_free: int | None  # MemAvailable (None: unknown)
    disk: int  # bytes still to be written (cached GGUF, download)
    disk_free: int | None
    disk_where: str
    speed: str  # e.g. "~4.1 tokens/s (measured on this CPU)"

    def line(self, name: str, quant: str) -> str:
        disk = f", {human_bytes(self.disk)} of disk once" if self.disk else ""
        return (
            f"{name} on this CPU, 4-bit ({quant}): ~{human_bytes(self.ram)} of RAM "
            f"({human_bytes(self.ram_free)} available){disk}; expect {self.speed}"
        )

    def missing(self) -> str:
        """What this machine lacks ("" where it holds the model)."""
        lacks = []
        if self.ram_free is not None and self.ram > self.ram_free:
            lacks.append(f"{human_bytes(self.ram - self.ram_free)} of RAM ({human_bytes(self.ram_free)} available)")
        if self.disk_free is not None and self.disk > self.disk_free:
            lacks.append(
                f"{human_bytes(self.disk - self.disk_free)} of disk ({human_bytes(self.disk_free)} free in "
                f"{self.disk_where})"
            )
        return " and ".join(lacks)


def _cfg(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def kv_bytes(config: dict[str, Any], slots: int = KV_SLOTS) -> int:
    cfg = _cfg(config)
    h = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (h // heads if heads else 0))
    return int(cfg.get("num_hidden_layers") or 0) * 2 * kv * head_dim * slots * 4


def int4_checkpoint_bytes(config: dict[str, Any], params: int) -> int:
    """The cached int4 GGUF of a checkpoint (quantized_cache.plan): Q4_1 projections, Q8_0 lm_head, a 16-bit
    token embedding."""
    cfg = _cfg(config)
    embed = int(cfg.get("vocab_size") or 0) * int(cfg.get("hidden_size") or 0)
    projections = max(params - embed * (1 if cfg.get("tie_word_embeddings") else 2), 0)
    return int(projections * 20 / 32 + embed * 34 / 32 + embed * 2)


def _disk_free(folder: Path) -> tuple[int | None, str]:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free, str(probe)
    except OSError:
        return None, str(probe)


def measured_speed(model_name: str) -> str:
    """This CPU's calibrated plain step for this model ("" where there is none)."""
    from medusa_chat.machine import cpu_model, slug
    from medusa_chat.paths import cache_root

    folder = cache_root() / "calibration"
    for path in sorted(folder.glob(f"{slug(model_name)}__*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            if cpu_model() not in str(record.get("device_name", "")):  # a cache copied from another machine
                continue
            one = next(s for s in record["sizes"] if s["size"] == 1)
            per_s = 1.0 / float(one["latency_s"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration, ZeroDivisionError):
            continue
        best = float(record.get("tokens_per_s_est") or per_s)
        return f"~{per_s:.1f} tokens/s plain, ~{max(best, per_s):.1f} with its tree (measured on this CPU)"
    return ""


def reference_speed(weights: int) -> str:
    low, high = (t * REFERENCE_BYTES / max(weights, 1) for t in REFERENCE_TOKENS_PER_S)
    return (
        f"~{low:.1f}-{high:.1f} tokens/s on 2 cores (the project's measurements of a 6.9B Q4_K_M on 2-vCPU "
        f"machines, scaled to this size; not measured on this CPU yet)"
    )


def estimate(
    model_name: str, config: dict[str, Any], weights: int, disk: int, disk_folder: Path, free_ram: int | None
) -> CpuNeed:
    disk_free, where = _disk_free(disk_folder)
    speed = measured_speed(model_name) or reference_speed(weights)
    ram = weights + kv_bytes(config) + RUNTIME_BYTES
    return CpuNeed(weights, ram, free_ram, disk, disk_free if disk else None, where, speed)


def gguf_need(model_name: str, gguf: Path, config: dict[str, Any], free_ram: int | None) -> CpuNeed:
    return estimate(model_name, config, gguf.stat().st_size, 0, gguf.parent, free_ram)


def checkpoint_need(
    model_name: str, location: str, config: dict[str, Any], params: int, free_ram: int | None
) -> CpuNeed:
    """The int4 path of a checkpoint: its cached GGUF (unless made already) and its download (unless here)."""
    from medusa_chat.model.sources import hub
    from medusa_chat.model.sources.registry import is_repo_id
    from medusa_chat.paths import cache_root

    weights = int4_checkpoint_bytes(config, params)
    models = cache_root() / "models"
    disk = 0 if _cached_gguf(models, location) else weights
    if is_repo_id(location) and not _weights_here(location):
        # the download and the cached file on one disk: both count here (on another, hub.py checks its own)
        if _device_of(hub.hub_cache_dir()) == _device_of(models):
            disk += params * DOWNLOAD_BYTES_PER_WEIGHT
    return estimate(model_name, config, weights, disk, models, free_ram)


def _device_of(folder: Path) -> int | None:
    try:
        return Path(_disk_free(folder)[1]).stat().st_dev
    except OSError:
        return None


def _cached_gguf(models: Path, location: str) -> bool:
    """Is this checkpoint's int4 file made already (quantized_cache.cache_path's name; any revision)?"""
    from medusa_chat.model.sources.registry import is_repo_id

    label = f"models--{location.replace('/', '--')}" if is_repo_id(location) else Path(location).resolve().name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label)[:48]
    return models.is_dir() and any(models.glob(f"hfq-{slug}-int4-*.gguf"))


def _weights_here(repo: str) -> bool:
    from medusa_chat.model.sources import hub

    try:
        cached = hub.cached_repos().get(repo)
    except Exception:  # noqa: BLE001 - a cache scan that fails only means "download size unknown"
        return False
    return cached is not None and bool(hub.weight_files(cached.files))


class WontFit(DeviceError):
    """The model's 4-bit weights cannot be held here (memory or disk): what is missing is in the message."""


def check(need: CpuNeed, name: str, quant: str, say: Callable[[str], None]) -> None:
    """Say the line; WontFit where this machine cannot hold the model (`info` tells it rather than failing)."""
    say(need.line(name, quant))
    missing = need.missing()
    if missing:
        raise WontFit(
            f"{name} does not fit on this machine 4-bit: {missing} missing; free memory or disk, or use a smaller "
            "model (the embedded smollm2-135m runs anywhere)"
        )


def free_ram() -> int | None:
    """Memory a new process may use: MemAvailable, capped by a cgroup v2 limit where there is one."""
    from medusa_chat.machine import available_memory

    avail = available_memory()
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail if avail is None else max(avail, 0)



"""Which tree a reply uses, and why: the calibration cache and the one rule every entry point follows.

The runtime half of calibration (calibrate.py is the measurement harness): the session, `ask`, `bench`, `serve`
and `info` call `resolve_tree`, which takes --tree / --tree-size, else this machine's cached calibration, else
(on a CPU) calibrates once now and caches it. Records are keyed by model + device + quantization + dtype and
stamped with the heads file, so retrained heads or another numeric path are calibrated anew.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from medusa_chat.tree import Tree

CALIBRATION_VERSION = 15  # bumped whenever the timed step or acceptance changes (v15: weight prefetch)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device | str) -> str:
    """A name for the hardware that determines step latency: the GPU model, or the CPU model + thread count +
    the instruction set the block kernel uses (the same model name can come with or without AVX-512 on
    virtual machines, and MEDUSA_CHAT_QGEMM_ISA can force a narrower one): each gets its own measurements."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from medusa_chat.kernels.qgemm import best_isa

    return f"{cpu} ({torch.get_num_threads()} threads, {best_isa()})"


def calibration_path(
    model_name: str, device: torch.device | str, quant: str, dtype: torch.dtype | str
) -> Path:
    from medusa_chat.model.embedded import cache_root

    name = "__".join(_slug(x) for x in (model_name, device_name(device), quant or "none", dtype_name(dtype)))
    return cache_root() / "calibration" / f"{name}.json"


def save_calibration(
    result: dict[str, Any], model_name: str, device: torch.device | str, quant: str, dtype: torch.dtype | str
) -> Path:
    """Write atomically (a half-written file must never be read back as a calibration)."""
    path = calibration_path(model_name, device, quant, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    from medusa_chat.atomic import atomic_write_text  # the package's one atomic writer (unique temp, fsync)

    atomic_write_text(path, json.dumps(result, indent=1))
    return path


def load_calibration(
    model_name: str, device: torch.device | str, quant: str, dtype: torch.dtype | str
) -> dict[str, Any] | None:
    """The cached calibration for this model on this device / quantization / dtype, or None."""
    path = calibration_path(model_name, device, quant, dtype)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("version") != CALIBRATION_VERSION
        or not isinstance(data.get("tree_size"), int)
    ):
        return None
    return data


def calibrated_source(cal: dict[str, Any]) -> str:
    """Why this tree, for the UIs' tree line: "calibrated (1.8x est.)" or the plain-decoding verdict."""
    if cal["tree_size"] == 1:
        return "calibrated: plain decoding is fastest on this device"
    return f"calibrated ({cal.get('speedup_est', 1.0):.1f}x est.)"


def describe_calibration(cal: dict[str, Any] | None, tree: Tree | None = None) -> str:
    """One line for the UIs, e.g. "tree: 16 nodes (calibrated: 1.8x est.)"."""
    if cal is None:
        return f"tree: {tree.size} nodes (default)" if tree is not None else "tree: default"
    if cal["tree_size"] == 1:
        return "tree: root only (calibrated: plain decoding is fastest on this device)"
    return f"tree: {cal['tree_size']} nodes (calibrated: {cal.get('speedup_est', 1.0):.1f}x est.)"


def model_identity(loaded: Any) -> tuple[str, torch.device, str, str]:
    """(model name, device, quant, dtype) of a LoadedModel, the calibration key."""
    spec = getattr(loaded, "spec", None)
    name = getattr(spec, "name", None) or getattr(loaded, "name", None) or "model"
    dtype = getattr(loaded, "dtype", None) or loaded.backbone.get_input_embeddings().weight.dtype
    return str(name), torch.device(loaded.device), str(getattr(loaded, "quant", "none")), dtype_name(dtype)


def heads_stamp(loaded: Any) -> str | None:
    """Identifies the heads file a calibration was made with (path, size, mtime): retrained or other heads
    accept differently, so their calibration does not apply."""
    path = getattr(loaded, "heads_file", "") or ""
    try:
        st = Path(path).stat() if path else None
    except OSError:
        return None
    return f"{path}:{st.st_size}:{st.st_mtime_ns}" if st else None


def choose_tree(loaded: Any, tree_name: str | None = None, tree_size: int | None = None) -> tuple[Tree, str]:
    """The tree chat, `info`, `ask`, `bench` and the API use, and why: (tree, source). The one place this is
    decided, so every command reports and runs the same tree.

    `--tree NAME|FILE` (default: the model's default tree) cut to `--tree-size N` wins, checked against the
    heads; otherwise a cached calibration for this model + device, if it was made for the model's default
    tree and these heads; otherwise the model's default tree. source is "--tree", "--tree-size",
    "calibrated (1.8x est.)" or "default".
    """
    if tree_name or tree_size is not None:
        chosen = Tree.named(tree_name) if tree_name else loaded.default_tree
        if tree_size is not None:
            chosen = chosen.prefix(tree_size)
        chosen.check_fits(loaded.heads.num_heads)
        return chosen, "--tree-size" if tree_size is not None else "--tree"
    base = loaded.default_tree
    cal = load_calibration(*model_identity(loaded))
    stamp = heads_stamp(loaded)
    if (
        cal
        and cal.get("tree") == base.name
        and 1 <= cal["tree_size"] <= base.size
        and (cal.get("heads_stamp") is None or stamp is None or cal["heads_stamp"] == stamp)
    ):
        if "graph_step" in cal:  # a GPU calibration that timed CUDA-graph steps against eager ones
            loaded.graph_step = bool(cal["graph_step"])
        return base.prefix(cal["tree_size"]), calibrated_source(cal)
    return base, "default"


# On a CPU a tree step's cost grows with every node (the exact per-node attention, the projections' extra
# rows): measured on a 2-core AVX2 EPYC, 8 nodes cost ~3x a plain step and 16 ~9x, so the first-start
# calibration looks at prefixes up to 8 nodes (and stays short: ~10 s).
CPU_MAX_TREE = 8
CPU_SIZES = (1, 2, 3, 4, 6, 8)


def resolve_tree(
    loaded: Any,
    tree_name: str | None = None,
    tree_size: int | None = None,
    progress: Callable[[str], None] | None = None,
    auto_calibrate: bool | None = None,
) -> tuple[Tree, str]:
    """The tree every entry point uses (chat, web, ask, bench, info, serve), and why.

    --tree / --tree-size win; else this machine's cached calibration; else, on a CPU, calibrate once now
    (about 10 s; cached for every later start and command); else the model's default tree.
    """
    if auto_calibrate is None:  # MEDUSA_CHAT_AUTO_CALIBRATE=0 turns it off (the test suite does)
        auto_calibrate = os.environ.get("MEDUSA_CHAT_AUTO_CALIBRATE", "1") != "0"
    tree, source = choose_tree(loaded, tree_name, tree_size)
    if source != "default" or not auto_calibrate or loaded.device.type != "cpu" or tree.size <= 1:
        return tree, source
    base = tree.prefix(min(tree.size, CPU_MAX_TREE))
    if progress is not None:
        progress(f"calibrating the tree size for this CPU once ({loaded.quant}; cached for next time)")
    from medusa_chat.tuning.calibrate import (  # the harness (imports the engine)
        CALIBRATION_PROMPTS,
        calibrate,
    )

    record = calibrate(
        loaded,
        base=base,
        sizes=CPU_SIZES,
        reps=30,  # round-robin over the sizes, ~1 s in all: medians that a noisy VM does not flip
        measure_accuracy=True,
        measure_replies=len(CALIBRATION_PROMPTS),  # ~600 tokens: a reply costs well under a second here
        measure_tokens=48,
        progress=progress,
    )
    record["tree"] = tree.name  # the default tree: its prefixes are what the record chooses among
    model_name, device, quant, dtype = model_identity(loaded)
    save_calibration(record, model_name, device, quant, dtype)
    return tree.prefix(record["tree_size"]), calibrated_source(record)

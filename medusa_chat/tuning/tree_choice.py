"""Which tree a reply uses: the calibration cache (keyed by model + device + quantization + dtype, stamped with
the heads file, so retrained heads or another numeric path are calibrated anew) and `choose_tree`, which takes
--tree / --tree-size, else this machine's cached calibration, else the model's default tree. Every entry point
goes through `first_start.resolve_tree`, which adds: on a CPU without a cached calibration, calibrate once now.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from medusa_chat.machine import slug
from medusa_chat.model.sources.lookup_only import LOOKUP_ONLY
from medusa_chat.model.sources.numeric_path import device_name
from medusa_chat.tree import SizeChoices, Tree

# A size whose calibrated rate is this share of the pick's or more stays in reach of the replies' own choice: on
# the 2-core Zen 4 the 4-node tree estimated at 0.89x the 2-node pick was the faster one minutes later
# (engine/tree_sizer.py).
ADAPTIVE_FLOOR = 0.85
CALIBRATION_VERSION = 18  # bumped whenever the timed step or acceptance changes (v18: small CPU models time replies)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def calibration_path(
    model_name: str, device: torch.device | str, quant: str, dtype: torch.dtype | str
) -> Path:
    from medusa_chat.paths import cache_root

    name = "__".join(slug(x) for x in (model_name, device_name(device), quant or "none", dtype_name(dtype)))
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
    sizes = _sizes_note(cal)
    if cal["tree_size"] == 1:
        return f"calibrated: plain decoding is fastest on this device{sizes}"
    return f"calibrated ({cal.get('speedup_est', 1.0):.1f}x est.{sizes})"


def _sizes_note(cal: dict[str, Any]) -> str:
    """"; 1-4 nodes as measured while replying" where the calibration leaves the steps a range of sizes, else ""."""
    choices = adaptive_choices(cal, 1 << 30)
    return f"; {choices.sizes[0]}-{choices.sizes[-1]} nodes as measured while replying" if choices else ""


def describe_calibration(cal: dict[str, Any] | None, tree: Tree | None = None) -> str:
    """One line for the UIs, e.g. "tree: 16 nodes (calibrated: 1.8x est.)"."""
    if cal is None:
        return f"tree: {tree.size} nodes (default)" if tree is not None else "tree: default"
    sizes = _sizes_note(cal)
    if cal["tree_size"] == 1:
        return f"tree: root only (calibrated: plain decoding is fastest on this device{sizes})"
    return f"tree: {cal['tree_size']} nodes (calibrated: {cal.get('speedup_est', 1.0):.1f}x est.{sizes})"


def model_identity(loaded: Any) -> tuple[str, torch.device, str, str]:
    """(model name, device, quant, dtype) of a LoadedModel, the calibration key."""
    spec = getattr(loaded, "spec", None)
    name = getattr(spec, "name", None) or getattr(loaded, "name", None) or "model"
    dtype = getattr(loaded, "dtype", None) or loaded.backbone.get_input_embeddings().weight.dtype
    return str(name), torch.device(loaded.device), str(getattr(loaded, "quant", "none")), dtype_name(dtype)


def heads_stamp(loaded: Any) -> str | None:
    """Identifies the heads file a calibration was made with (path, size, mtime): retrained or other heads
    accept differently, so their calibration does not apply."""
    if getattr(loaded, "heads", True) is None:  # no heads: a lookup-only calibration, never one made with heads
        return LOOKUP_ONLY
    path = getattr(loaded, "heads_file", "") or ""
    try:
        st = Path(path).stat() if path else None
    except OSError:
        return None
    return f"{path}:{st.st_size}:{st.st_mtime_ns}" if st else None


# The embedded model's shipped drafts a calibration chooses among (tuning/first_start.py, calibrate_first_start);
# Medusa-1 heads are not among them: they guess strictly less than the Hydra heads (docs/medusa1_heads.md).
DRAFT_CHOICES = ("hydra", "eagle3")


def shipped_draft(loaded: Any) -> str | None:
    """The shipped name of the embedded model's draft when it is the model's default (no --heads given) and
    one of DRAFT_CHOICES; else None (another model, or heads the user asked for)."""
    from medusa_chat.model.sources.registry import SHIPPED_HEADS

    spec = getattr(loaded, "spec", None)
    if getattr(spec, "kind", "") != "embedded" or getattr(loaded, "heads_asked", "") or not loaded.heads_file:
        return None
    folder = Path(loaded.heads_file).resolve().parent
    return next((n for n in DRAFT_CHOICES if SHIPPED_HEADS[n].resolve() == folder), None)


def adaptive_choices(cal: dict[str, Any], base_size: int) -> SizeChoices | None:
    """The prefix sizes a CPU calibration lets replies choose among as they run (engine/tree_sizer.py): its pick and
    every size it timed up to the largest whose estimated rate came within ADAPTIVE_FLOOR of the pick's, each with
    its tokens per step (only their ratios matter to the sizer: a trial-step calibration's, from replies without
    lookup runs, do as well). None where the record does not say (a GPU's, an older one's, a model without heads: its
    lookup chain verifies only what the lookup guessed, a cost the sizer would not see), where the steps ran in
    transformers (no exact per-node step, so no sizer) or where it leaves one size only."""
    if cal.get("device") != "cpu" or cal.get("timing") not in ("replies", "steps") or cal.get("lookup_only"):
        return None
    if cal.get("forward", "transformers") == "transformers":  # no exact per-node step: no sizer (trees.py)
        return None
    rows = [r for r in cal.get("sizes", []) if isinstance(r, dict) and 1 <= r.get("size", 0) <= base_size]
    rates = {int(r["size"]): float(r.get("tokens_per_s_est", 0.0)) for r in rows}
    pick = int(cal["tree_size"])
    if pick not in rates or rates[pick] <= 0:
        return None
    top = max(n for n, v in rates.items() if v >= ADAPTIVE_FLOOR * rates[pick] or n <= pick)
    sizes = sorted(n for n in rates if n <= top)
    if len(sizes) < 2:
        return None
    tps = {int(r["size"]): float(r["tokens_per_step"]) for r in rows if int(r["size"]) in sizes}
    return SizeChoices(sizes, pick, tps)


def calibrated_tree(loaded: Any, cal: dict[str, Any], base: Tree) -> Tree:
    """The prefix of `base` a calibration gives the engine, with the sizes replies may choose among (the tree's
    `sizes`; the tree is then the largest of them, the steps start at the pick), and what it tells `loaded` for the
    engine's steps: the one-thread size (single_thread_trees)."""
    size = cal["tree_size"]
    choices = adaptive_choices(cal, base.size)
    if choices is not None:
        size = choices.sizes[-1]
    if cal.get("tree_size_1_thread"):  # a CPU calibration that timed one-thread steps too
        loaded.single_thread_trees[size] = min(int(cal["tree_size_1_thread"]), cal["tree_size"])
    return replace(base.prefix(size), sizes=choices)


def choose_tree(loaded: Any, tree_name: str | None = None, tree_size: int | None = None) -> tuple[Tree, str]:
    """The tree chat, `info`, `ask`, `bench` and the API use, and why: (tree, source). The one place this is
    decided, so every command reports and runs the same tree.

    `--tree NAME|FILE` (default: the model's default tree) cut to `--tree-size N` wins, checked against the
    heads; otherwise a cached calibration for this model + device, if it was made for the model's default
    tree and these heads; otherwise the model's default tree. source is "--tree", "--tree-size",
    "calibrated (1.8x est.)" or "default". The embedded model without --heads also takes the draft its
    calibration chose (`switch_heads`: `loaded` drafts with it from then on).
    """
    if tree_name or tree_size is not None:
        # a tree the user names is verified whole, every step (a prefix carries no calibrated sizes)
        chosen = Tree.named(tree_name) if tree_name else loaded.default_tree
        if tree_size is not None:
            chosen = chosen.prefix(tree_size)
        chosen.check_fits(loaded.heads.num_heads if loaded.heads is not None else None)
        return chosen, "--tree-size" if tree_size is not None else "--tree"
    cal = load_calibration(*model_identity(loaded))
    current = shipped_draft(loaded)
    if cal and current and cal.get("draft") in DRAFT_CHOICES and cal["draft"] != current:
        # this machine's calibration found another shipped draft faster: it drafts from now on
        from medusa_chat.model.sources.loading import switch_heads

        switch_heads(loaded, cal["draft"])
    base = loaded.default_tree
    stamp = heads_stamp(loaded)
    if (
        cal
        and cal.get("tree") == base.name
        and 1 <= cal["tree_size"] <= base.size
        and (cal.get("heads_stamp") is None or stamp is None or cal["heads_stamp"] == stamp)
    ):
        if "graph_step" in cal:  # a GPU calibration that timed CUDA-graph steps against eager ones
            loaded.graph_step = bool(cal["graph_step"])
        return calibrated_tree(loaded, cal, base), calibrated_source(cal)
    return base, "default"



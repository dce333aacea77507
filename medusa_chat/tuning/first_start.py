"""The first start's tree: `resolve_tree`, the one rule every entry point uses (chat, web, ask, bench, info,
serve), and `calibrate_first_start`, the calibration it runs once per machine, with a budget scaled to the model
and, for the embedded model, a choice among its shipped drafts. The measuring itself is calibrate.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from medusa_chat import envvars
from medusa_chat.tree import Tree
from medusa_chat.tuning.calibrate import CPU_SIZES, StepTiming, calibrate, calibrate_on_replies
from medusa_chat.tuning.measure import CALIBRATION_PROMPTS, DEFAULT_PREFIX_TOKENS
from medusa_chat.tuning.tree_choice import (
    calibrated_source,
    calibrated_tree,
    choose_tree,
    model_identity,
    save_calibration,
)


@dataclass(frozen=True)
class FirstStartBudget:
    """How much the first-start calibration measures: greedy replies for tokens/step, timed steps per size and
    the cached prefix they are timed with."""

    replies: int
    reps: int
    prefix_tokens: int


def first_start_budget(loaded: Any) -> FirstStartBudget:
    """The first-start calibration's measurements, scaled to the model so that it stays a few seconds.

    For a model of the embedded one's size (~135M, or smaller) the full measurement: all twelve built-in replies
    (~600 tokens), 30 timed steps per size, a 256-token prefix. A bigger model decodes proportionally slower on a
    CPU (a 1B model ~8x), so the work shrinks with its size (scale = 2e8 / parameters), down to floors that still
    decide: two replies, eight timed steps per size (the sizes are timed round-robin, so a slow spell of the
    machine hits every size alike, and near-ties go to the smaller tree anyway), a 64-token prefix (at 1B the
    attention over the prefix is ~1% of a step's work: the projections dominate, whatever the context).
    A 1.17B Q4_K_M GGUF without heads, one thread on a busy 2-core VM: the former fixed budget (3 replies, 30
    steps per size, a 256-token prefix prefilled per size) calibrated in 97.9 s, this one in 25.9 s
    (docs/gguf_models.md, "First start")."""
    from medusa_chat.model.sources.loading import estimate_params

    if getattr(getattr(loaded, "device", None), "type", "cpu") == "cuda":
        # a GPU decodes even a 7B model at 100+ steps a second: the full measurement takes seconds there
        return FirstStartBudget(replies=len(CALIBRATION_PROMPTS), reps=20, prefix_tokens=DEFAULT_PREFIX_TOKENS)
    config = getattr(loaded.backbone, "config", None)
    params = estimate_params(config.to_dict()) if config is not None else 0
    scale = 1.0 if params <= 0 else min(1.0, 2e8 / params)
    return FirstStartBudget(
        replies=max(2, min(len(CALIBRATION_PROMPTS), round(len(CALIBRATION_PROMPTS) * scale))),
        reps=max(8, round(30 * scale)),
        prefix_tokens=max(64, round(DEFAULT_PREFIX_TOKENS * scale / 16) * 16),
    )


# On a CPU a tree step's cost grows with every node (the exact per-node attention, the projections' extra
# rows): measured on a 2-core AVX2 EPYC, 8 nodes cost ~3x a plain step and 16 ~9x, so the first-start
# calibration looks at prefixes up to 8 nodes (and stays short: ~10 s).
CPU_MAX_TREE = 8


# On a GPU a tree row costs little until the step stops being memory-bound (H200, 7B fp16 with CUDA graphs: 64
# nodes 1.32x a plain step), but with NF4 weights bitsandbytes dequantizes every weight for more than one row
# (4 nodes 2.15x, 64 nodes 2.57x a plain step): the first start times the default tree's prefixes up to its
# whole size and keeps the fastest, plain decoding included (benchmarks/RESULTS.md, "GPU").
GPU_SIZES = (1, 2, 4, 8, 16, 32, 64)


# Why a reply uses plain decoding before this CPU is calibrated (the UIs' tree line shows it).
PROVISIONAL_SOURCE = "plain decoding until this CPU is calibrated (once, after the first reply)"


# Calibrate the embedded model's other shipped drafts only where the default draft's best tree has this many nodes
# (big trees pay: the deep-accepting EAGLE-3 draft can win), and switch only for an estimate this much faster.
DRAFT_CHOICE_MIN_NODES = 6
DRAFT_CHOICE_MARGIN = 1.03


def calibration_is_long(loaded: Any) -> bool:
    """Is the first-start calibration too long to run before the first reply? It is for a model bigger than the
    embedded one (its budget shrinks below the full measurement): a 1.17B GGUF calibrated for 19.5 s on a
    2-core EPYC, and 36 s on a slower one, before its first token (docs/gguf_models.md, "First start")."""
    return first_start_budget(loaded).replies < len(CALIBRATION_PROMPTS)


def resolve_tree(
    loaded: Any,
    tree_name: str | None = None,
    tree_size: int | None = None,
    progress: Callable[[str], None] | None = None,
    auto_calibrate: bool | None = None,
    defer: bool = False,
) -> tuple[Tree, str]:
    """The tree every entry point uses (chat, web, ask, bench, info, serve), and why.

    --tree / --tree-size win; else this machine's cached calibration; else, on a CPU or a CUDA GPU, calibrate
    once now (about 10 s; cached for every later start and command); else the model's default tree. With `defer`, a
    model whose calibration is long (`calibration_is_long`) is not calibrated now: the root alone (plain
    decoding, never slower than the plain loop) with PROVISIONAL_SOURCE, and the caller runs
    `calibrate_first_start` when the user is reading the first reply.
    """
    if auto_calibrate is None:  # MEDUSA_CHAT_AUTO_CALIBRATE=0 turns it off (the test suite does)
        auto_calibrate = envvars.auto_calibrate()
    tree, source = choose_tree(loaded, tree_name, tree_size)
    if source != "default" or not auto_calibrate or loaded.device.type not in ("cpu", "cuda") or tree.size <= 1:
        return tree, source
    if defer and calibration_is_long(loaded):
        return tree.prefix(1), PROVISIONAL_SOURCE
    return calibrate_first_start(loaded, tree, progress)


def calibrate_first_start(
    loaded: Any,
    tree: Tree,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Tree, str]:
    """Calibrate prefixes of `tree` (the model's default) with the first-start budget, save the choice for
    every later start, and return the chosen prefix and why. `cancel`: see `calibrate` (nothing is saved)."""
    cpu = loaded.device.type == "cpu"
    if progress is not None:
        what = "CPU" if cpu else "GPU"
        progress(f"calibrating the tree size for this {what} once ({loaded.quant}; cached for next time)")
    budget = first_start_budget(loaded)

    def measure(model: Any, tree: Tree) -> dict[str, Any]:
        if cpu and budget.replies == len(CALIBRATION_PROMPTS) and model.heads is not None:
            # a small model with a draft: time its real replies (without one, the lookup's chain is kept unless
            # plain steps were clearly faster, as a few short replies undersell it: `_best_size`)
            record = calibrate_on_replies(
                model,
                tree.prefix(min(tree.size, CPU_MAX_TREE)),
                sizes=CPU_SIZES,
                timing=StepTiming(budget.prefix_tokens, budget.reps, progress, cancel),
            )
            record["tree"] = tree.name
            return record
        record = calibrate(
            model,
            base=tree.prefix(min(tree.size, CPU_MAX_TREE)) if cpu else tree,
            sizes=CPU_SIZES if cpu else GPU_SIZES,
            prefix_tokens=budget.prefix_tokens,
            reps=budget.reps,  # round-robin over the sizes: medians that a noisy VM does not flip
            measure_accuracy=True,
            measure_replies=budget.replies,
            measure_tokens=48,
            progress=progress,
            cancel=cancel,
        )
        record["tree"] = tree.name  # the default tree: its prefixes are what the record chooses among
        return record

    record, tree = _choose_draft(loaded, measure(loaded, tree), tree, measure, progress)
    model_name, device, quant, dtype = model_identity(loaded)
    save_calibration(record, model_name, device, quant, dtype)
    return calibrated_tree(loaded, record, tree), calibrated_source(record)


def _choose_draft(
    loaded: Any,
    record: dict[str, Any],
    tree: Tree,
    measure: Callable[[Any, Tree], dict[str, Any]],
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, Any], Tree]:
    """The embedded model ships more than one draft (tree_choice.DRAFT_CHOICES). Where big trees pay here (the
    default draft's calibration chose DRAFT_CHOICE_MIN_NODES nodes or more), the others are calibrated too, and
    the fastest by the same estimate (measured step times x measured tokens per step) drafts from now on:
    `loaded` switches to it and the record says so (`draft`; each candidate's estimate in `drafts`), so later
    starts load it (tree_choice.choose_tree). Where trees stay small (a 2-core CPU: 3-4 nodes) the drafts
    accept about alike at depth 1 and the stronger deep draft only costs more (docs/EAGLE.md): nothing more is
    measured, and the first start stays as short."""
    from medusa_chat.model.sources.loading import switch_heads, with_heads
    from medusa_chat.tuning.tree_choice import DRAFT_CHOICES, shipped_draft

    current = shipped_draft(loaded)
    if current is None:
        return record, tree
    record["draft"] = current
    if record["tree_size"] < DRAFT_CHOICE_MIN_NODES:
        return record, tree
    drafts = {current: record["tokens_per_s_est"]}
    best, best_tree = record, tree
    for name in DRAFT_CHOICES:
        if name == current:
            continue
        if progress is not None:
            progress(f"big trees pay here: calibrating the shipped {name} draft too")
        other = with_heads(loaded, name)
        rec = measure(other, other.default_tree)
        rec["draft"] = name
        drafts[name] = rec["tokens_per_s_est"]
        if rec["tokens_per_s_est"] > DRAFT_CHOICE_MARGIN * best["tokens_per_s_est"]:
            best, best_tree = rec, other.default_tree
    best["drafts"] = drafts
    if best["draft"] != current:
        switch_heads(loaded, best["draft"])
    return best, best_tree

"""The 4-bit backbone on a CUDA GPU: `--quant int4` there, and what `--quant auto` picks when Triton is present.

Load: the checkpoint is read in 16 bits on the CPU (transformers, any format it reads: safetensors or
`weights_only` pickles), then each decoder projection is moved to the GPU alone, quantized there to group-wise
int4 (kernels/int4_quant.py: round-to-nearest plus a least-squares refit, group 64) and its 16-bit copy dropped.
Peak GPU memory is the 4-bit model plus one 16-bit weight and its quantization temporaries, never the 16-bit
model. Embeddings, norms and the lm_head stay 16-bit; the lm_head becomes a row-invariant Triton linear.

Then the kernel: the Triton int4 kernel or torch's tinygemm over the very same codes, chosen by timing both on
this model's projection shapes at one row and at a tree's rows, among those whose rows are bitwise the same at
every row count (`rows_invariant`): a tree step must give each node the plain step's bits. The choice and each
shape's Triton configuration are cached per GPU (measured once: a few seconds).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from medusa_chat.atomic import atomic_write_json
from medusa_chat.kernels.int4_quant import group_for
from medusa_chat.kernels.triton_linears import Int4Linear, RowInvariantLinear, rows_invariant, time_call, tune
from medusa_chat.kernels.triton_matmul import CANDIDATES, Config
from medusa_chat.paths import cache_root

Progress = Callable[[str], None]

PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
GROUP = 64
TREE_ROWS = 64  # the tree step the kernel choice weighs beside the plain step
CHOICE_VERSION = 1


def quantize_backbone(
    model: Any, device: torch.device, dtype: torch.dtype, group: int = GROUP, progress: Progress | None = None
) -> dict[str, Any]:
    """Quantize `model`'s decoder projections onto `device` one at a time, move the rest there, and make its
    lm_head row-invariant. `model` is a transformers Llama-family causal LM loaded on the CPU in `dtype`.
    Returns {"int4": count, "kept_16bit": [names], "bytes": int4 bytes}."""
    layers = model.model.layers
    count, kept, nbytes = 0, [], 0
    for i, layer in enumerate(layers):
        for part, name in PROJECTIONS:
            parent = getattr(layer, part)
            linear = getattr(parent, name)
            g = group_for(linear.in_features, group)
            if g is None:  # K/2 not a multiple of 32: this one stays 16-bit (moved with the rest below)
                kept.append(f"layers.{i}.{part}.{name}")
                continue
            quantized = Int4Linear.from_linear(linear, g, device, dtype)
            setattr(parent, name, quantized)
            linear.weight = None  # the CPU copy goes now, not at the end
            count += 1
            nbytes += quantized.nbytes()
        if progress and (i + 1) % 8 == 0:
            progress(f"  quantized {i + 1}/{len(layers)} layers to int4 on {device}")
    model.to(device)  # embeddings, norms, rotary buffers, the lm_head (int4 buffers are there already)
    head = model.get_output_embeddings()
    model.lm_head = RowInvariantLinear(head.weight, head.bias)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"int4": count, "kept_16bit": kept, "bytes": nbytes}


def quantize_head_projections(
    heads: Any, device: torch.device, dtype: torch.dtype, group: int = GROUP
) -> int:
    """Medusa-1 heads' own vocab projections to int4 (Vicuna-7B's five 32000 x 4096 projections: 1.3 GB read at
    every step in 16 bits, 0.37 GB in int4). They only draft, so their precision moves acceptance, never the
    reply; the ResBlocks stay 16-bit. Returns how many were quantized."""
    count = 0
    if not getattr(heads, "own_lm_head", False):
        return 0
    for head in heads:
        proj = head[heads.num_layers]
        g = group_for(proj.in_features, group)
        if isinstance(proj, torch.nn.Linear) and g is not None:
            head[heads.num_layers] = Int4Linear.from_linear(proj, g, device, dtype)
            count += 1
    return count


def int4_modules(model: Any) -> list[Int4Linear]:
    return [m for m in model.modules() if isinstance(m, Int4Linear)]


def _choice_file(device: torch.device) -> Any:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    safe = "".join(c if c.isalnum() else "-" for c in name)
    return cache_root() / "cuda_int4" / f"{safe}.json"


def choose_kernel(
    model: Any,
    device: torch.device,
    progress: Progress | None = None,
    candidates: tuple[Config, ...] = CANDIDATES,
) -> dict[str, Any]:
    """Pick the int4 kernel and each shape's Triton configuration for this GPU (cached); apply them to every
    Int4Linear of `model` and return the record: {"kernel", "configs": {shape: name}, "measured": {...}}."""
    modules = int4_modules(model)
    by_shape: dict[str, list[Int4Linear]] = {}
    for m in modules:
        by_shape.setdefault(f"{m.out_features}x{m.in_features}g{m.group}", []).append(m)
    path = _choice_file(device)
    try:
        record = json.loads(path.read_text())
        if record.get("version") != CHOICE_VERSION or not set(by_shape) <= set(record.get("configs", {})):
            record = None
    except (OSError, ValueError, AttributeError):
        record = None
    if record is None:
        if progress:
            progress(f"Measuring the int4 kernels on {len(by_shape)} projection shapes once")
        record = _measure(by_shape, candidates)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            old = json.loads(path.read_text()) if path.is_file() else {}
            merged = (
                {**old.get("configs", {}), **record["configs"]}
                if isinstance(old, dict)
                else record["configs"]
            )
            atomic_write_json(path, {**record, "configs": merged})
        except (OSError, ValueError):
            pass  # a read-only cache: measured again next time
    for shape, group in by_shape.items():
        cfg = Config.parse(record["configs"].get(shape, ""))
        for m in group:
            m.use(record["kernel"] or "triton", cfg)
    return record


def _measure(by_shape: dict[str, list[Int4Linear]], candidates: tuple[Config, ...]) -> dict[str, Any]:
    """Time the Triton kernel (tuned per shape) and tinygemm on one module per shape; weigh by module count."""
    configs: dict[str, str] = {}
    cost = {"triton": 0.0, "tinygemm": 0.0}
    invariant = {"triton": True, "tinygemm": True}
    measured: dict[str, Any] = {}
    for shape, group in by_shape.items():
        m = group[0]
        cfg, _ = tune(m, rows=(1, TREE_ROWS), candidates=candidates, reps=10)
        configs[shape] = cfg.name()
        x = torch.randn(TREE_ROWS, m.in_features, device=m.codes.device, dtype=m.act_dtype)
        entry: dict[str, Any] = {}
        for kernel in ("triton", "tinygemm"):
            try:
                m.use(kernel, cfg)
                times = [time_call(lambda r=r, m=m, x=x: m(x[:r]), 10) for r in (1, TREE_ROWS)]
                ok = rows_invariant(m, x)
            except Exception as err:  # noqa: BLE001 - tinygemm absent on this build/GPU: not a candidate
                entry[kernel] = {"error": str(err).splitlines()[0][:200] if str(err) else type(err).__name__}
                cost[kernel] = float("inf")
                continue
            entry[kernel] = {"rows_1_s": times[0], f"rows_{TREE_ROWS}_s": times[1], "rows_invariant": ok}
            cost[kernel] += len(group) * (times[0] + times[1])
            invariant[kernel] = invariant[kernel] and ok
        m.use("triton", cfg)
        measured[shape] = entry
    usable = [k for k in ("triton", "tinygemm") if invariant[k] and cost[k] < float("inf")]
    # none usable: no kernel here (the load check then falls back to 16-bit or NF4, cuda_check.py)
    kernel = min(usable, key=lambda k: cost[k]) if usable else None
    return {"version": CHOICE_VERSION, "kernel": kernel, "configs": configs, "measured": measured,
            "cost_s": cost, "rows_invariant": invariant}  # fmt: skip

"""The CUDA int4 load checked on this GPU before it answers, and what loads instead when the check fails.

After the kernel choice (cuda_int4.choose_kernel), the chosen int4 kernel, the row-invariant lm_head and the
tree attention run known answers on the model's own shapes (kernels/load_check.py: values against torch in
fp32, and each row's bits alone vs among a tree's rows). On a failure: the other int4 kernel over the same
codes; if neither passes (or the lm_head or the attention fails, which both kernels share), no int4 at all:
16-bit weights where the GPU's free memory holds them, else bitsandbytes NF4 (whose tree a calibration sizes:
`medusa-chat calibrate`). One line says so; `medusa-chat info` lists it with the notes.

The verdicts are cached per GPU, keyed by the shapes, the head layout and the torch/Triton versions (a driver or
Triton upgrade checks again): the check runs at the first load only, like the kernel choice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import atomic_write_json
from medusa_chat.errors import DeviceError
from medusa_chat.kernels.load_check import Verdict, check_attention, check_int4, check_linear
from medusa_chat.paths import cache_root
from medusa_chat.units import human_bytes

CHECK_VERSION = 1
KERNEL_ORDER = ("triton", "tinygemm")
HEAD_ROWS = 4096  # lm_head rows the check computes
HEADROOM = 1 << 30  # what a 16-bit fallback leaves free beside its weights: KV cache, activations, heads


@dataclass(frozen=True)
class Checked:
    kernel: str | None  # the int4 kernel that passed on this GPU; None: none did (the load falls back)
    line: str  # what runs and why, one line for the notes


def _software() -> str:
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "none"
    return f"torch {torch.__version__}, triton {version}"


def _cache_file(device: torch.device) -> Path:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return cache_root() / "cuda_int4" / f"{''.join(c if c.isalnum() else '-' for c in name)}.checks.json"


def _load_cache(path: Path, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
        entry = doc.get(key, {}) if doc.get("version") == CHECK_VERSION else {}
        return {k: Verdict(bool(v["ok"]), str(v.get("why", ""))) for k, v in entry.items()}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}


def _save_cache(path: Path, key: str, verdicts: dict[str, Verdict]) -> None:
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(doc, dict) or doc.get("version") != CHECK_VERSION:
            doc = {"version": CHECK_VERSION}
        # an exception may be transient (memory, a busy GPU): only values and rows are remembered as failures
        doc[key] = {k: v.as_dict() for k, v in verdicts.items() if v.ok or not v.raised}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, doc)
    except (OSError, ValueError):
        pass  # a read-only cache: checked again next time


def _layout(model: Any) -> tuple[int, int, int]:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return kv, heads // kv, head_dim


def verify_int4_load(model: Any, device: torch.device, record: dict[str, Any], rows: int,
                     progress: Any = None) -> Checked:  # fmt: skip
    """Check the loaded int4 model's kernels (module docstring) at 1 and `rows` rows; leave every Int4Linear on
    the kernel that passed. `record` is choose_kernel's (its kernel first; one it measured as not row-invariant
    fails without running again)."""
    from medusa_chat.model.forward.cuda_int4 import int4_modules

    modules = int4_modules(model)
    one_per_shape = list({(m.out_features, m.in_features, m.group): m for m in modules}.values())
    head = model.get_output_embeddings()
    kv, groups, head_dim = _layout(model)
    dtype = one_per_shape[0].act_dtype if one_per_shape else head.weight.dtype
    shapes = sorted(f"{n}x{k}g{g}" for n, k, g in {(m.out_features, m.in_features, m.group) for m in modules})
    key = f"{_software()} | {','.join(shapes)} | head {tuple(head.weight.shape)} | attention {kv}x{groups}x" \
          f"{head_dim} | {dtype} | rows {rows}"  # fmt: skip
    path = _cache_file(device)
    verdicts = _load_cache(path, key)
    fresh = not verdicts
    if fresh and progress:
        progress(f"Checking the int4 kernels and the tree attention on {device} once")
    if "attention" not in verdicts:
        verdicts["attention"] = check_attention(kv, groups, head_dim, rows, dtype, device)
    if "lm_head" not in verdicts:
        verdicts["lm_head"] = _check_head(head, rows, dtype)
    chosen = record.get("kernel")
    order = [k for k in (chosen, *KERNEL_ORDER) if k in KERNEL_ORDER]
    order = list(dict.fromkeys(order))
    passed = None
    if verdicts["attention"].ok and verdicts["lm_head"].ok:
        for kernel in order:
            if kernel not in verdicts:
                verdicts[kernel] = _check_kernel(kernel, modules, one_per_shape, record, rows)
            if verdicts[kernel].ok:
                passed = kernel
                break
    if passed is not None:
        for m in modules:
            m.use(passed)
    _save_cache(path, key, verdicts)
    failed = [k for k in ("attention", "lm_head", *order) if k in verdicts and not verdicts[k].ok]
    why = "; ".join(verdicts[k].why for k in failed)
    if passed is None:
        return Checked(None, f"int4 failed its check on this GPU ({why})")
    line = f"int4 on the {passed} kernel, checked on this GPU (values and rows at 1 and {rows} rows, tree attention)"
    if failed:
        line += f" after the {' and the '.join(failed)} kernel failed ({why})"
    return Checked(passed, line)


def _check_head(head: Any, rows: int, dtype: torch.dtype) -> Verdict:
    """The lm_head's kernel on its first HEAD_ROWS vocabulary rows (the same kernel and configuration; an fp32
    copy of a whole 128k vocabulary would cost gigabytes)."""
    from medusa_chat.kernels.triton_linears import RowInvariantLinear

    weight = head.weight.detach()[:HEAD_ROWS]
    part = RowInvariantLinear(torch.nn.Parameter(weight, requires_grad=False))
    part.config = head.config
    return check_linear(part, rows, weight.to(dtype).float(), dtype, "16-bit lm_head")


def _check_kernel(kernel: str, modules: list[Any], one_per_shape: list[Any], record: dict[str, Any],
                  rows: int) -> Verdict:  # fmt: skip
    if record.get("rows_invariant", {}).get(kernel) is False:
        return Verdict(
            False, f"int4 {kernel}: rows differ with the row count (measured at the kernel choice)"
        )
    try:
        for m in one_per_shape:
            m.use(kernel)
    except Exception as err:  # noqa: BLE001 - e.g. tinygemm's packing op missing on this build or GPU
        text = str(err).strip().splitlines()
        return Verdict(
            False, f"int4 {kernel}: {type(err).__name__}: {text[0][:160] if text else ''}", raised=True
        )
    return check_int4(one_per_shape, rows)


def sixteen_bit_bytes(model: Any) -> int:
    """What the model's weights take in 16 bits (its int4 projections counted at their 16-bit size)."""
    from medusa_chat.model.forward.cuda_int4 import int4_modules

    int4 = int4_modules(model)
    inside = {id(p) for m in int4 for p in m.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return 2 * (rest + sum(m.in_features * m.out_features for m in int4))


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def fallback_quant(need_16bit: int, free: int, nf4_available: bool) -> tuple[str, str]:
    """(quant, why) after the int4 check failed: 16-bit where `free` bytes hold its weights and headroom, else
    NF4; DeviceError where neither can run (a message, not a crash)."""
    if need_16bit + HEADROOM <= free:
        return "none", f"16-bit weights instead ({human_bytes(need_16bit)}, {human_bytes(free)} free)"
    if nf4_available:
        return "nf4", (
            f"NF4 instead (16-bit needs {human_bytes(need_16bit)}, {human_bytes(free)} free; "
            "`medusa-chat calibrate` sizes its tree)"
        )
    raise DeviceError(
        f"the int4 kernels failed their check on this GPU, 16-bit weights need {human_bytes(need_16bit)} "
        f"({human_bytes(free)} free) and NF4 needs bitsandbytes: `pip install bitsandbytes`, or use --device cpu"
    )


def nf4_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True

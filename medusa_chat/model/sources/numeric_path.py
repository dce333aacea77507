"""Which numeric path a CPU decodes in by default (`--quant auto`): measured on this machine, then cached.

The candidates are the CPU paths whose tree steps reproduce their own plain loop bit for bit
(kernels/cpu_linears.py): packed dense in the model's dtype ("none"), weight-only int8 and int4. Which is fastest depends on the CPU:
on AVX512-BF16 machines int4 reads the fewest bytes and wins; on AVX2-only CPUs the int4 kernel spends more
time unpacking than it saves and int8 wins; a CPU whose kernels are not row-invariant loses the candidate.
So each candidate's decoding-step projections (one layer's shapes x layers, plus the lm_head) are timed on
random weights of the model's shapes, one row (the plain step) and a few rows (a small tree step), and the
fastest is kept among those faithful enough to the float model.

Speed alone is not the choice: a path counts only if its replies are the model's. Where the float model fits in
memory, each candidate is also scored teacher-forced against it on a fixed text (model/sources/fidelity.py: top-1 agreement and
KL per token, llama-perplexity's method), and a candidate whose KL exceeds the most faithful quantized
candidate's by more than FIDELITY_SLACK is out (e.g. the embedded GGUF's Q4_1 blocks re-quantized as Q8_0:
two roundings, 1.4x the KL of the file's own blocks). The measurements take a few seconds at the first start;
the result is cached per model, CPU, thread count and torch version, so later starts reuse it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa_chat.atomic import atomic_write_text
from medusa_chat.errors import MedusaChatError
from medusa_chat.kernels.cpu_linears import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    can_pack,
    check_row_invariant,
)
from medusa_chat.kernels.quantizers import quantize_int8, quantize_q4_1
from medusa_chat.machine import cpu_model, slug

CANDIDATES = ("none", "int8", "int4")
VERSION = 7  # v7: the choice weighs fidelity to the float model (re-measure)
# a candidate may have at most this multiple of the most faithful quantized candidate's KL (plus a hair, for
# models whose paths all agree to within float noise)
FIDELITY_SLACK = 1.2
FIDELITY_EPS = 1e-4


def device_name(device: torch.device | str) -> str:
    """A name for the hardware that determines step latency: the GPU model, or the CPU model + thread count +
    the instruction set the block kernel uses (the same model name can come with or without AVX-512 on
    virtual machines, and MEDUSA_CHAT_QGEMM_ISA can force a narrower one), and a K-quant activation scheme other
    than the default (MEDUSA_CHAT_KQUANT_ACTIVATIONS: its steps cost differently): each gets its own
    measurements."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from medusa_chat.kernels.cbind import kquant_scheme
    from medusa_chat.kernels.isa_choice import best_isa

    scheme = kquant_scheme()
    kquant = "" if scheme == "32" else f", K-quant activations {scheme}"
    return f"{cpu_model()} ({torch.get_num_threads()} threads, {best_isa()}{kquant})"


def _cache_file(model_name: str) -> Path:
    from medusa_chat.paths import cache_root

    key = "__".join(slug(x) for x in (model_name, device_name("cpu"), torch.__version__))
    return cache_root() / "numeric_path" / f"{key}.json"


def _module(
    mode: str, out_f: int, in_f: int, gen: torch.Generator, lm_head: bool = False
) -> nn.Module | None:
    """The module prepare_cpu_linears would build for this mode and shape (random weights)."""
    from medusa_chat.kernels.cbind import available
    from medusa_chat.model.forward.cpu_blocks import block_module

    weight = torch.randn(out_f, in_f, generator=gen) * 0.02
    if mode == "none":
        lin = nn.Linear(in_f, out_f, bias=False)
        lin.weight.data = weight
        return PackedLinear(lin) if can_pack(lin) else None
    if in_f % 32:
        return None
    if available():
        return block_module(mode, weight, None, lm_head)
    if mode == "int8" or lm_head:
        return Int8Linear(*quantize_int8(weight))
    return Int4Linear(*quantize_q4_1(weight))


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_paths(config: dict[str, Any], reps: int = 5, rows: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Per candidate: projection time of one decoding step (seconds) for each row count, or why it is out."""
    cfg = config.get("text_config") or config
    h = int(cfg["hidden_size"])
    inter = int(cfg.get("intermediate_size") or 4 * h)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    shapes = [
        (heads * hd, h),
        (kv * hd, h),
        (kv * hd, h),
        (h, heads * hd),
        (inter, h),
        (inter, h),
        (h, inter),
    ]
    gen = torch.Generator().manual_seed(0)
    # A few distinct layers, cycled: the weights then come from memory as in a real step, not from a cache
    # that one repeated layer would fit in (which favours the kernels that compute the most per byte).
    distinct = min(layers, 4)
    out: dict[str, Any] = {}
    for mode in CANDIDATES:
        stack = [[_module(mode, o, i, gen) for o, i in shapes] for _ in range(distinct)]
        head = _module(mode, vocab, h, gen, lm_head=True)
        if any(m is None for mods in stack for m in mods) or head is None:
            out[mode] = {"excluded": "no row-invariant kernel for these shapes"}
            continue
        try:
            for m in [*stack[0], head]:
                check_row_invariant(m, torch.float32)
        except MedusaChatError as err:
            out[mode] = {"excluded": str(err)}
            continue
        result = {}
        for n in rows:
            xs = [torch.randn(n, i, generator=gen) for _, i in shapes]
            xh = torch.randn(n, h, generator=gen)

            def layer_pass(xs: list[torch.Tensor] = xs, stack: list = stack) -> None:
                for mods in stack:
                    for m, x in zip(mods, xs, strict=True):
                        m(x)

            lm = _time(lambda xh=xh, head=head: head(xh), reps)
            result[str(n)] = _time(layer_pass, reps) * layers / distinct + lm
        out[mode] = {"step_s": result}
    return out


def faithful(fidelity: dict[str, Any]) -> set[str]:
    """The candidates that meet the fidelity floor: "none" (the float model itself) always; a quantized one when
    its KL is within FIDELITY_SLACK of the most faithful quantized candidate's. Without measurements: all."""
    kl = {m: float(v["mean_kl"]) for m, v in fidelity.items() if m != "none" and "mean_kl" in v}
    if not kl:
        return set(CANDIDATES)
    best = min(kl.values())
    return {"none"} | {m for m, v in kl.items() if v <= FIDELITY_SLACK * best + FIDELITY_EPS}


def pick(measured: dict[str, Any], fidelity: dict[str, Any] | None = None) -> str:
    """The candidate with the cheapest one-row step (the plain loop's cost; tree calibration comes after) among
    those that meet the fidelity floor."""
    ok = faithful(fidelity or {})
    timed = {m: v["step_s"]["1"] for m, v in measured.items() if "step_s" in v and m in ok}
    if not timed:
        return "none"
    return min(timed, key=timed.__getitem__)


def choose_cpu_quant(
    model_name: str,
    config: dict[str, Any],
    progress: Callable[[str], None] | None = None,
    fidelity_probe: Callable[[list[str]], dict[str, Any]] | None = None,
) -> str:
    """The CPU numeric path for `--quant auto`: cached, else measured now (and cached). `fidelity_probe(modes)`
    scores the runnable candidates against the float model (see model/sources/fidelity.py); None: speed alone."""
    path = _cache_file(model_name)
    try:
        cached = json.loads(path.read_text())
        if cached.get("version") == VERSION and cached.get("threads") == torch.get_num_threads():
            return str(cached["quant"])
    except (OSError, json.JSONDecodeError, AttributeError, KeyError):
        pass
    if progress:
        progress("Measuring this CPU's numeric paths once (packed fp32, int8, int4)")
    measured = measure_paths(config)
    runnable = [m for m in CANDIDATES if "step_s" in measured[m] and m != "none"]
    fidelity = fidelity_probe(runnable) if fidelity_probe and len(runnable) > 1 else {}
    quant = pick(measured, fidelity)
    if progress:
        costs = ", ".join(
            f"{m} {v['step_s']['1'] * 1000:.1f} ms" if "step_s" in v else f"{m} excluded"
            for m, v in measured.items()
        )
        progress(f"  projections per token: {costs}")
        for m, v in fidelity.items():
            if "mean_kl" in v:
                progress(f"  fidelity of {m}: top-1 {v['top1'] * 100:.1f}%, KL {v['mean_kl']:.4f} nats/token")
        progress(f"  -> {quant}")
    record = {
        "version": VERSION,
        "quant": quant,
        "threads": torch.get_num_threads(),
        "measured": measured,
        "fidelity": fidelity,
    }
    atomic_write_text(path, json.dumps(record, indent=1))
    return quant


def cached_fidelity(model_name: str, quant: str) -> dict[str, Any] | None:
    """The measured fidelity of `quant` for this model on this machine, where the choice measured it."""
    try:
        record = json.loads(_cache_file(model_name).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = (record.get("fidelity") or {}).get(quant) if isinstance(record, dict) else None
    return value if isinstance(value, dict) else None

#!/usr/bin/env python3
"""The parts of gpu_step_latency.py that are not the run itself: the acceptance model a tree's expected tokens per
step come from, the 7B-shaped Llama (fp16 or NF4) with random Medusa heads, and the device's ceilings (copy
bandwidth, matmul rate). gpu_4bit.py builds its models with them too."""

from __future__ import annotations

import heapq
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.tree import Tree

MAX_RANK = 10  # top-10 per head, as in the published trees


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------------------
# Acceptance model
# ------------------------------------------------------------------------------------------------------------
def rank_accuracy(
    top1: tuple[float, ...], top5: tuple[float, ...], ranks: int = MAX_RANK
) -> list[list[float]]:
    """Per head, P(true token at rank r) = a1 * q**r with q solving a1 * (1 - q**5) / (1 - q) = a5."""
    table = []
    for a1, a5 in zip(top1, top5, strict=True):
        target = a5 / a1  # = 1 + q + q^2 + q^3 + q^4, in (1, 5)
        lo, hi = 0.0, 0.999999
        for _ in range(100):
            q = (lo + hi) / 2
            if sum(q**i for i in range(5)) < target:
                lo = q
            else:
                hi = q
        table.append([a1 * q**r for r in range(ranks)])
    return table


def grow_tree(acc: list[list[float]], size: int, name: str) -> tuple[Tree, list[float]]:
    """Greedy tree growth: repeatedly add the node with the largest path probability (product of the heads'
    rank accuracies along the path). Returns the tree (growth order) and E[tokens/step] for every prefix size
    (index i = first i+1 nodes)."""
    heads = len(acc)
    frontier: list[tuple[float, tuple[int, ...]]] = [(-acc[0][0], (0,))]
    paths: list[tuple[int, ...]] = []
    expected = [1.0]
    while frontier and len(paths) + 1 < size:
        neg, path = heapq.heappop(frontier)
        paths.append(path)
        expected.append(expected[-1] - neg)
        value = -neg
        depth, rank = len(path), path[-1]
        if depth < heads:  # first child: the next head's top-1
            heapq.heappush(frontier, (-value * acc[depth][0], (*path, 0)))
        if rank + 1 < len(acc[depth - 1]):  # next sibling: same head, next rank
            heapq.heappush(
                frontier, (-value / acc[depth - 1][rank] * acc[depth - 1][rank + 1], (*path[:-1], rank + 1))
            )
    return Tree(tuple(paths), name=name), expected


def expected_for_tree(tree: Tree, acc: list[list[float]]) -> float:
    total = 1.0
    for p in tree.paths:
        prob = 1.0
        for d, r in enumerate(p):
            prob *= acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0
        total += prob
    return total


def smollm2_expected(path: Path, sizes: list[int]) -> dict[int, float] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        log(f"note: cannot read {path}: {err}")
        return None
    values = data.get("expected_tokens_per_step") if isinstance(data, dict) else None
    if isinstance(values, list):
        by_size = {i + 1: float(v) for i, v in enumerate(values) if v is not None}
    elif isinstance(values, dict):
        by_size = {int(k): float(v) for k, v in values.items()}
    else:
        log(f"note: {path} has no expected_tokens_per_step: SmolLM2 projection skipped")
        return None
    last = max(by_size)
    # Beyond the fitted tree a bigger one cannot accept less: hold the last value (conservative).
    return {n: by_size.get(n, by_size[min(last, max(k for k in by_size if k <= n))]) for n in sizes}


# ------------------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------------------
def build_llama(
    shape: dict[str, int], dtype: torch.dtype, device: torch.device, std: float | None = None
) -> nn.Module:
    """A random Llama built directly on `device` in `dtype` (no CPU init, no fp32 copy of a 7B model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if std is not None:  # larger weights than the default init: less flat logits, fewer exact ties
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, std)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def bnb_available() -> tuple[bool, str]:
    try:
        import bitsandbytes as bnb  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means "no NF4 here", said in the output
        return False, f"bitsandbytes not importable ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    return True, f"bitsandbytes {bnb.__version__}"


def to_nf4(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Replace every nn.Linear inside the decoder layers by an NF4 bnb Linear4bit, in place, quantizing on the
    model's device. lm_head and embeddings stay 16-bit (transformers' load_in_4bit does the same)."""
    import bitsandbytes as bnb

    targets = [
        (parent, name, child)
        for parent in model.model.layers.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        device = child.weight.device
        q = bnb.nn.Linear4bit(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=False,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(
            child.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=False, module=q
        ).to(device)
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name, q)
        del child
    # The lean forward built for the 16-bit model holds its projections' bound methods: drop it, so the next
    # engine builds one over the NF4 modules (else the "nf4" rows would time the fp16 weights again).
    model.__dict__.pop("_medusa_lean_forward", None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_heads(
    hidden: int,
    vocab: int,
    num_heads: int,
    own_lm_head: bool,
    dtype: torch.dtype,
    device: torch.device,
    std: float = 0.02,
) -> MedusaHeads:
    torch.manual_seed(1)
    with torch.device(device):
        heads = MedusaHeads(hidden, vocab, num_heads, 1, own_lm_head=own_lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return heads.to(dtype).eval().requires_grad_(False)


def bytes_read_per_step(model: nn.Module) -> int:
    """Weight bytes a decoding step reads: every parameter except the embedding table (one row per token),
    plus NF4 quantization statistics (absmax), which are not parameters."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None and getattr(qs, "absmax", None) is not None:
            total += qs.absmax.numel() * qs.absmax.element_size()
    return total


# ------------------------------------------------------------------------------------------------------------
# Device ceilings
# ------------------------------------------------------------------------------------------------------------
def _timed(fn: Any, device: torch.device, reps: int) -> float:
    cuda = device.type == "cuda"
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize(device)
            times.append(e0.elapsed_time(e1) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device memory bandwidth in bytes/s from a large copy (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = _timed(lambda: a @ b, device, 5)
    return 2 * n**3 / s



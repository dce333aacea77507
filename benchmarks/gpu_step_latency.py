#!/usr/bin/env python3
"""GPU step latency of Medusa tree verification on a 7B-shaped Llama, and what it means for speed.

Needs no downloads: the backbone is a randomly initialised Llama with Vicuna-7B's shape (hidden 4096, 32
layers, 32 heads, intermediate 11008, vocab 32000), built directly on the GPU in fp16, then converted in place
to NF4 (bitsandbytes `Linear4bit`, lm_head and embeddings left in fp16, as transformers does) when
bitsandbytes is importable. Random weights cost exactly what real ones do: latency depends on shapes only.

For tree sizes 1, 4, 8, 16, 32, 64, 128 it times one decoding step exactly as `MedusaEngine` runs it (the
engine's TreeKVCache holding a 512-token prefix, the same additive float 4D mask and explicit positions, lm_head
on every node, greedy acceptance + in-place KV commit, v1 heads (a vocab projection each, like the published
Vicuna-7B Medusa-1 heads) on the last accepted node, one host sync), median of 20 reps, timed with
torch.cuda.synchronize + wall clock (what a reply pays) and CUDA events (device time).

Projected speedup over plain one-token steps = E[tokens/step](n) * latency(1) / latency(n), with E from:
  * a rank-accuracy model of the Vicuna-7B Medusa-1 heads (MEDUSA_FACTS section 2: top-1 .56/.32/.20/.15/.12,
    top-5 .78/.56/.42/.34/.30). Head k's probability that the true token sits at rank r is modelled as
    a1_k * q_k**r, q_k chosen so ranks 0-4 sum to the top-5 figure; heads are taken as independent, so a
    node's chance to be accepted is the product along its path, and E(n) = 1 + sum over the first n-1 nodes.
    The tree is grown greedily by that value (how the published trees were made). This is a model: the
    paper measured ~2.3-2.6 tokens/step with real heads (section 8), printed beside ours for comparison.
  * optionally the SmolLM2 heads measured here (`--tree-json assets/smollm2-135m/tree.json`, field
    expected_tokens_per_step; beyond its last size the value is held flat).
The memory-bandwidth roofline (bytes read per step / measured device-to-device copy bandwidth, and the
matmul peak for large trees) is printed beside the measurements.

`--check-lossless`: a small random Llama (4 layers, hidden 512, vocab 32000) in fp16 and NF4 with random
non-zero v2 heads, briefly self-distilled on the backbone's own greedy output (seconds; so that steps accept
several tokens and multi-token commits are checked); MedusaEngine greedy vs HF generate greedy on 10 random
prompts, identical fraction and, where they differ, the reference's top-2 logit gap (16-bit arithmetic flips
near-ties).

    python benchmarks/gpu_step_latency.py --out gpu_step_latency.json [--check-lossless]   # GPU, < 4 min
    python benchmarks/gpu_step_latency.py --tiny --out tiny.json --check-lossless     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gpu_step_parts import (  # noqa: E402  (beside this script)
    bnb_available,
    build_llama,
    bytes_read_per_step,
    copy_bandwidth,
    expected_for_tree,
    grow_tree,
    log,
    matmul_flops,
    random_heads,
    rank_accuracy,
    smollm2_expected,
    to_nf4,
)

from medusa_chat.engine.engine import MedusaEngine, plain_tree  # noqa: E402
from medusa_chat.events import GenerationSettings  # noqa: E402
from medusa_chat.model.forward.heads import MedusaHeads  # noqa: E402
from medusa_chat.tree import Tree  # noqa: E402
from medusa_chat.tuning.measure import measure_step_latency  # noqa: E402

VICUNA7B_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)
VICUNA7B_TOP5 = (0.78, 0.56, 0.42, 0.34, 0.30)
PAPER_TOKENS_PER_STEP = "2.3-2.6 (Medusa-1, Vicuna-7B, MEDUSA_FACTS section 8)"

VICUNA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)
TINY = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=32000,
)
LOSSLESS = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
)


# ------------------------------------------------------------------------------------------------------------
# Losslessness check
# ------------------------------------------------------------------------------------------------------------
class _IdsTokenizer:
    """The engine only decodes for display; numbers are enough here (no tokenizer download)."""

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


@dataclass
class _Loaded:
    """The LoadedModel fields MedusaEngine reads (docs/ARCHITECTURE.md)."""

    backbone: nn.Module
    heads: MedusaHeads
    device: torch.device
    dtype: torch.dtype
    quant: str
    tokenizer: Any = field(default_factory=_IdsTokenizer)
    context_limit: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)  # none: both sides run to max_new_tokens
    stop_strings: tuple[str, ...] = ()
    default_tree: Tree = field(default_factory=lambda: Tree.named("mc_sim_7b_63"))


@torch.inference_mode()
def check_lossless(loaded: _Loaded, prompts: int, tokens: int, tie_tol: float) -> dict[str, Any]:
    engine = MedusaEngine(loaded, loaded.default_tree)
    # The engine's own plain loop (a root-only tree through the same step code): the same numeric path as far
    # as the step's code goes, though a 1-row step may take other GPU kernels than a 64-row one.
    plain = MedusaEngine(loaded, plain_tree())
    g = torch.Generator().manual_seed(123)
    rows = []
    for _ in range(prompts):
        length = int(torch.randint(8, 64, (1,), generator=g))
        prompt = torch.randint(3, loaded.backbone.config.vocab_size, (length,), generator=g).tolist()
        items = list(engine.generate(prompt, GenerationSettings(max_new_tokens=tokens)))
        summary = items[-1]
        ids = torch.tensor([prompt], device=loaded.device)
        t0 = time.perf_counter()
        out = loaded.backbone.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        hf_s = time.perf_counter() - t0
        ref = out.sequences[0, length:].tolist()
        got = summary.token_ids
        plain_ids = list(plain.generate(prompt, GenerationSettings(max_new_tokens=tokens)))[-1].token_ids
        div = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
        row: dict[str, Any] = {
            "prompt_len": length,
            "identical": div is None,
            "identical_to_engine_plain_loop": plain_ids == got,
            "engine_plain_loop_identical_to_hf": plain_ids == ref,
            "tokens_per_step": round(summary.tokens_per_step, 3),
            "medusa_tokens_per_s": round(summary.decode_tokens_per_s, 1),
            "hf_generate_tokens_per_s": round(len(ref) / hf_s, 1),
        }
        if div is not None:
            top = out.logits[div][0].float().topk(2).values
            gap = float(top[0] - top[1])
            row.update(first_divergence=div, top2_gap=round(gap, 5), near_tie=gap < tie_tol)
        rows.append(row)
    same = sum(r["identical"] for r in rows)
    return {
        "prompts": prompts,
        "new_tokens": tokens,
        "tree": loaded.default_tree.name,
        "identical_fraction": same / prompts,
        "identical_to_engine_plain_loop_fraction": sum(r["identical_to_engine_plain_loop"] for r in rows) / prompts,
        "engine_plain_loop_identical_to_hf_fraction": sum(r["engine_plain_loop_identical_to_hf"] for r in rows)
        / prompts,
        "differences_at_near_ties": sum(1 for r in rows if r.get("near_tie")),
        "differences_not_near_ties": sum(1 for r in rows if not r["identical"] and not r.get("near_tie")),
        "near_tie_threshold": tie_tol,
        "mean_tokens_per_step": round(statistics.fmean(r["tokens_per_step"] for r in rows), 3),
        # indicative only (small model, total generate time incl. prefill for HF): the latency table is the measure
        "medusa_tokens_per_s": round(statistics.fmean(r["medusa_tokens_per_s"] for r in rows), 1),
        "hf_generate_tokens_per_s": round(statistics.fmean(r["hf_generate_tokens_per_s"] for r in rows), 1),
        "rows": rows,
    }


def distill_heads(
    model: nn.Module, heads: MedusaHeads, steps: int = 150, prompts: int = 32, length: int = 80
) -> None:
    """A few seconds of Medusa-1 self-distillation (heads trained on the backbone's own greedy continuations),
    so that tree steps really accept several tokens and the multi-token commit path is exercised."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(3, vocab, (prompts, 4), generator=g).to(device)
    with torch.no_grad():
        seqs = model.generate(
            starts, attention_mask=torch.ones_like(starts), max_new_tokens=length, do_sample=False
        )
        hidden = model.model(seqs).last_hidden_state.float()
    lm = nn.Linear(hidden.shape[-1], vocab, bias=False, device=device)
    with torch.no_grad():
        lm.weight.copy_(model.get_output_embeddings().weight.float())
    lm.requires_grad_(False)
    heads.float().requires_grad_(True).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    k = heads.num_heads
    start = starts.shape[1] - 1
    for _ in range(steps):
        with torch.enable_grad():
            logits = heads(hidden[:, start : -k - 1], lm)  # [K, B, T, V]
            loss = sum(
                (0.8**h)
                * nn.functional.cross_entropy(
                    logits[h].reshape(-1, vocab),
                    seqs[:, start + 2 + h : seqs.shape[1] - k + 1 + h].reshape(-1),
                )
                for h in range(k)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    heads.eval().requires_grad_(False)


def run_lossless(
    device: torch.device, dtype: torch.dtype, args: argparse.Namespace, nf4_ok: bool
) -> dict[str, Any]:
    shape = dict(TINY if args.tiny else LOSSLESS)
    # The default init (std 0.02) makes a random Llama's greedy output fall into short cycles, which heads can
    # learn: acceptance > 1 token/step, so multi-token commits are really checked (larger weights: no repeats).
    model = build_llama(shape, dtype, device)
    heads = random_heads(shape["hidden_size"], shape["vocab_size"], 5, False, torch.float32, device, std=0.02)
    t0 = time.perf_counter()
    if args.tiny:  # the CPU smoke run only needs to exercise the code
        distill_heads(model, heads, steps=5, prompts=4, length=32)
    else:
        distill_heads(model, heads)
    heads.to(dtype)
    log(f"heads self-distilled in {time.perf_counter() - t0:.1f} s")
    # 16-bit logits carry ~3 significant digits: a top-2 gap this small can flip with summation order.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    out: dict[str, Any] = {"config": shape}
    label = "fp16" if dtype == torch.float16 else str(dtype).removeprefix("torch.")
    t0 = time.perf_counter()
    out[label] = check_lossless(
        _Loaded(model, heads, device, dtype, "none"), args.lossless_prompts, args.lossless_tokens, tol
    )
    log(
        f"lossless {label}: identical to HF generate {out[label]['identical_fraction']:.0%}, to the engine's plain "
        f"loop {out[label]['identical_to_engine_plain_loop_fraction']:.0%}, tokens/step "
        f"{out[label]['mean_tokens_per_step']} ({out[label]['medusa_tokens_per_s']} tok/s vs HF generate "
        f"{out[label]['hf_generate_tokens_per_s']}), near-tie differences {out[label]['differences_at_near_ties']}, "
        f"others {out[label]['differences_not_near_ties']} ({time.perf_counter() - t0:.1f} s)"
    )
    if nf4_ok and not args.no_nf4:
        to_nf4(model, dtype)
        t0 = time.perf_counter()
        out["nf4"] = check_lossless(
            _Loaded(model, heads, device, dtype, "nf4"), args.lossless_prompts, args.lossless_tokens, tol
        )
        log(
            f"lossless nf4: identical to HF generate {out['nf4']['identical_fraction']:.0%}, to the engine's plain "
            f"loop {out['nf4']['identical_to_engine_plain_loop_fraction']:.0%}, tokens/step "
            f"{out['nf4']['mean_tokens_per_step']} ({out['nf4']['medusa_tokens_per_s']} tok/s vs HF generate "
            f"{out['nf4']['hf_generate_tokens_per_s']}), near-tie differences {out['nf4']['differences_at_near_ties']}, "
            f"others {out['nf4']['differences_not_near_ties']} ({time.perf_counter() - t0:.1f} s)"
        )
    del model, heads
    return out


# ------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------
def latency_table(
    model: nn.Module, heads: MedusaHeads, tree: Tree, sizes: list[int], args: argparse.Namespace
) -> dict[int, dict[str, float]]:
    device = next(model.parameters()).device
    dtype = model.get_input_embeddings().weight.dtype
    return measure_step_latency(
        _Loaded(model, heads, device, dtype, "none", default_tree=tree),  # the engine's own step is timed
        sizes,
        tree=tree,
        prefix_tokens=args.prefix,
        reps=args.reps,
        warmup=args.warmup,
        progress=log,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_step_latency.json"), help="JSON results path")
    p.add_argument("--tiny", action="store_true", help="small model (CPU smoke test of the whole script)")
    p.add_argument("--sizes", default="1,4,8,16,32,64,128")
    p.add_argument("--prefix", type=int, default=512, help="tokens in the KV cache (default 512)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-nf4", action="store_true")
    p.add_argument(
        "--tree-json", type=Path, default=None, help="SmolLM2 heads' tree.json (expected_tokens_per_step)"
    )
    p.add_argument("--check-lossless", action="store_true")
    p.add_argument("--lossless-only", action="store_true", help="skip the 7B latency part")
    p.add_argument("--lossless-prompts", type=int, default=10)
    p.add_argument("--lossless-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.tiny:
        args.prefix = min(args.prefix, 64)
        args.reps = min(args.reps, 3)
        args.warmup = min(args.warmup, 1)
        args.lossless_prompts = min(args.lossless_prompts, 3)
        args.lossless_tokens = min(args.lossless_tokens, 24)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32  # 16-bit matmuls on CPU are slow and not the point
    sizes = [int(x) for x in args.sizes.split(",")]
    nf4_ok, nf4_note = bnb_available()
    import transformers

    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if cuda
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bitsandbytes": nf4_note,
        "python": platform.python_version(),
        "tiny": args.tiny,
        "prefix_tokens": args.prefix,
        "reps": args.reps,
        "timing": "median over reps of one engine-style step (wall clock incl. host sync; CUDA-event time too)",
    }
    log(
        f"{result['device_name']}, torch {torch.__version__}, transformers {transformers.__version__}, {nf4_note}"
    )
    if not args.lossless_only:
        latency_part(result, args, device, dtype, sizes, nf4_ok, nf4_note)
    if args.check_lossless:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # Keep the latency part on disk in case the rest fails or runs out of time.
        args.out.write_text(json.dumps(result, indent=1, default=str))
        log("losslessness check (small random Llama, random v2 heads, tree mc_sim_7b_63):")
        result["lossless"] = run_lossless(device, dtype, args, nf4_ok)

    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out} ({result['wall_s']} s total)")
    return 0


def latency_part(
    result: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    sizes: list[int],
    nf4_ok: bool,
    nf4_note: str,
) -> None:
    """The ceilings, the acceptance model and its tree, the step latencies (16-bit, NF4) and the projections,
    into `result`."""
    bw, peak = ceilings(result, device, dtype)
    tree, sizes, e_vicuna, e_smol = acceptance_model(result, args, sizes)
    shape = TINY if args.tiny else VICUNA_7B
    result["config"] = shape
    runs, weights, costs = step_latencies(result, args, shape, device, dtype, tree, sizes, nf4_ok, nf4_note)
    result["results"] = projections(runs, weights, costs, sizes, bw, peak, e_vicuna, e_smol)
    result["heads_GB_per_step"] = round(costs["heads_bytes"] / 1e9, 3)
    print_table(result, sizes, e_vicuna, e_smol)


def ceilings(result: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, matmul FLOP/s) of the device."""
    cuda = device.type == "cuda"
    bw = copy_bandwidth(device, (2 << 30) if cuda else (64 << 20))
    peak = matmul_flops(device, 8192 if cuda else 512, dtype)
    result["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    result["matmul_tflops"] = round(peak / 1e12, 1)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s, {str(dtype).removeprefix('torch.')} matmul {peak / 1e12:.1f} TFLOP/s")
    return bw, peak


def acceptance_model(
    result: dict[str, Any], args: argparse.Namespace, sizes: list[int]
) -> tuple[Tree, list[int], dict[int, float], dict[int, float] | None]:
    """The tree grown under Vicuna-7B's rank model, the sizes it allows, and the expected tokens per step by
    size: (tree, sizes, under the model, SmolLM2's measured heads or None)."""
    acc = rank_accuracy(VICUNA7B_TOP1, VICUNA7B_TOP5)
    tree, expected = grow_tree(acc, max(sizes), "vicuna7b-rank-model")
    sizes = [n for n in sizes if n <= tree.size]
    e_vicuna = {n: expected[n - 1] for n in sizes}
    e_smol = smollm2_expected(args.tree_json, sizes) if args.tree_json else None
    result["acceptance_model"] = {
        "heads": "Vicuna-7B Medusa-1 (5 heads)",
        "top1": VICUNA7B_TOP1,
        "top5": VICUNA7B_TOP5,
        "rank_accuracy": [[round(x, 4) for x in row] for row in acc],
        "model": "P(rank r) = a1*q^r per head, q from the top-5 figure; heads independent; greedy tree growth",
        "expected_tokens_per_step_published_mc_sim_7b_63": round(expected_for_tree(Tree.named("mc_sim_7b_63"), acc), 3),
        "paper_tokens_per_step": PAPER_TOKENS_PER_STEP,
    }
    result["expected_tokens_per_step"] = {"vicuna7b_medusa1_model": e_vicuna}
    if e_smol:
        result["expected_tokens_per_step"]["smollm2_measured"] = e_smol
    log(
        "E[tokens/step] (rank model): "
        + ", ".join(f"{n}:{e_vicuna[n]:.2f}" for n in sizes)
        + f"; published 64-node tree under the model: {result['acceptance_model']['expected_tokens_per_step_published_mc_sim_7b_63']}"
    )
    return tree, sizes, e_vicuna, e_smol


def step_latencies(
    result: dict[str, Any],
    args: argparse.Namespace,
    shape: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    tree: Tree,
    sizes: list[int],
    nf4_ok: bool,
    nf4_note: str,
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[str, int], dict[str, int]]:
    """The step latency table of the 16-bit model, then NF4's where it runs: (tables by numeric path, weight
    bytes read per step by path, the KV, heads and FLOPs-per-token costs)."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    model = build_llama(shape, dtype, device)
    heads = random_heads(shape["hidden_size"], shape["vocab_size"], 5, True, dtype, device, std=0.002)
    log(f"built {'tiny' if args.tiny else '7B-shaped'} Llama + 5 v1 heads in {time.perf_counter() - t0:.1f} s")
    costs = {
        "kv_bytes": 2 * shape["num_hidden_layers"] * args.prefix * shape["hidden_size"] * torch.finfo(dtype).bits // 8,
        "heads_bytes": sum(q.numel() * q.element_size() for q in heads.parameters()),
        "flops_per_token": 2 * sum(q.numel() for n_, q in model.named_parameters() if "embed_tokens" not in n_),
    }
    runs: dict[str, dict[int, dict[str, float]]] = {}
    weights: dict[str, int] = {}
    label = "fp16" if dtype == torch.float16 else "fp32"
    log(f"{label} step latency ({args.prefix}-token cache):")
    runs[label] = latency_table(model, heads, tree, sizes, args)
    weights[label] = bytes_read_per_step(model)
    if args.no_nf4:
        result["nf4_note"] = "skipped (--no-nf4)"
    elif not nf4_ok:
        result["nf4_note"] = f"skipped: {nf4_note}"
        log(f"NF4 skipped: {nf4_note}")
    else:
        t0 = time.perf_counter()
        to_nf4(model, dtype)
        log(f"NF4 conversion {time.perf_counter() - t0:.1f} s; nf4 step latency:")
        runs["nf4"] = latency_table(model, heads, tree, sizes, args)
        weights["nf4"] = bytes_read_per_step(model)
    if cuda:
        result["max_memory_allocated_GB"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    del model, heads
    if cuda:
        torch.cuda.empty_cache()
    return runs, weights, costs


def projections(
    runs: dict[str, dict[int, dict[str, float]]],
    weights: dict[str, int],
    costs: dict[str, int],
    sizes: list[int],
    bw: float,
    peak: float,
    e_vicuna: dict[int, float],
    e_smol: dict[int, float] | None,
) -> dict[str, Any]:
    """Per numeric path and tree size: the measured latency, the projected speedup under the acceptance model,
    and the roofline's."""
    kv_bytes, heads_bytes, flops_per_token = costs["kv_bytes"], costs["heads_bytes"], costs["flops_per_token"]
    table = {}
    for q, lat in runs.items():
        l1 = lat[1]["median_s"]
        rows = {}
        for n in sizes:
            read = weights[q] + kv_bytes + (heads_bytes if n > 1 else 0)
            roof = max(read / bw, n * flops_per_token / peak)
            roof1 = (weights[q] + kv_bytes) / bw
            row = {
                "latency_ms": round(lat[n]["median_s"] * 1000, 3),
                "latency_min_ms": round(lat[n]["min_s"] * 1000, 3),
                "event_latency_ms": round(lat[n]["event_median_s"] * 1000, 3)
                if "event_median_s" in lat[n]
                else None,
                "relative_to_1": round(lat[n]["median_s"] / l1, 3),
                "projected_speedup_vicuna7b": round(e_vicuna[n] * l1 / lat[n]["median_s"], 3),
                "roofline_ms": round(roof * 1000, 3),
                "roofline_projected_speedup_vicuna7b": round(e_vicuna[n] * roof1 / roof, 3),
            }
            if e_smol:
                row["projected_speedup_smollm2_heads"] = round(e_smol[n] * l1 / lat[n]["median_s"], 3)
            rows[n] = row
        best = max(sizes, key=lambda n: rows[n]["projected_speedup_vicuna7b"])
        table[q] = {
            "weights_GB_read_per_step": round(weights[q] / 1e9, 3),
            "roofline_tokens_per_s_plain": round(bw / (weights[q] + kv_bytes), 1),
            "measured_tokens_per_s_plain": round(1 / l1, 1),
            "best_size_vicuna7b": best,
            "best_projected_speedup_vicuna7b": rows[best]["projected_speedup_vicuna7b"],
            "sizes": rows,
        }
    return table


def print_table(
    result: dict[str, Any], sizes: list[int], e_vic: dict[int, float], e_smol: dict[int, float] | None
) -> None:
    quants = list(result["results"])
    head = f"{'nodes':>5} {'E[tok/step]':>11}"
    for q in quants:
        head += f" | {q + ' ms':>9} {'x lat(1)':>8} {'proj.':>6} {'roof ms':>8}"
        if e_smol:
            head += f" {'smol':>5}"
    log("\n" + head)
    log("-" * len(head))
    for n in sizes:
        line = f"{n:>5} {e_vic[n]:>11.2f}"
        for q in quants:
            r = result["results"][q]["sizes"][n]
            line += f" | {r['latency_ms']:>9.2f} {r['relative_to_1']:>8.2f} {r['projected_speedup_vicuna7b']:>5.2f}x {r['roofline_ms']:>8.2f}"
            if e_smol:
                line += f" {r['projected_speedup_smollm2_heads']:>4.2f}x"
        log(line)
    for q in quants:
        r = result["results"][q]
        log(
            f"{q}: {r['weights_GB_read_per_step']} GB weights/step; plain decoding measured {r['measured_tokens_per_s_plain']} "
            f"tok/s vs roofline {r['roofline_tokens_per_s_plain']} tok/s; best projected {r['best_projected_speedup_vicuna7b']}x "
            f"at {r['best_size_vicuna7b']} nodes"
        )
    log(
        "proj. = E[tokens/step](n) x latency(1) / latency(n) with the Vicuna-7B rank-accuracy model; "
        "roof ms = max(bytes read / copy bandwidth, FLOPs / matmul peak)\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())

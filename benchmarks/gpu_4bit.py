#!/usr/bin/env python3
"""The 4-bit CUDA path, measured: kernels side by side, the 7B-shaped step, fidelity, and the one summary file.

    python benchmarks/gpu_4bit.py kernels  --out DIR/kernels.json            # ~1-2 min on an H200
    python benchmarks/gpu_4bit.py step7b   --out DIR/step7b.json             # ~1-2 min
    python benchmarks/gpu_4bit.py fidelity --model FOLDER --out DIR/fidelity.json
    python benchmarks/gpu_4bit.py summary  DIR                               # -> DIR/gpu_4bit_<card>_<date>.json
Each stage also runs on a CPU with `--tiny` (small shapes, Triton's interpreter: TRITON_INTERPRET=1), which is
how this script is dry-run before it runs on a GPU machine (tests/test_gpu_4bit_script.py runs that dry run).

kernels: y = x @ W.T on Llama-2-7B's projection shapes (4096x4096, 11008x4096, 4096x11008, 32000x4096; N x K)
at 1/2/4/8/16/32/64 rows for: 16-bit `F.linear` (cuBLAS); the Triton int4 kernel (kernels/triton_matmul.py,
its configuration tuned per shape); torch's tinygemm int4 (`_weight_int4pack_mm`) and gemlite's A16W4 (when
importable) over the same codes; bitsandbytes NF4; FP8 weights through `torch._scaled_mm` (activations cast per
call, row-wise scales); the Triton 16-bit kernel (the lm_head's). Per kernel and row count: the median time
(CUDA events) and whether every row's result is bitwise the row computed alone.

step7b: a random-weight Llama with Llama-2-7B's shape and 5 random Medusa-1 heads (weights do not change the
cost), three ways: the CUDA int4 load (model/forward/cuda_int4.py: quantized on the GPU one weight at a time, kernel
chosen by measuring), bitsandbytes NF4 and 16-bit. For each: the engine's plain-loop tokens/s (128 tokens, CUDA
graphs, the app's path), the step time at 1 and 64 tree nodes (tuning.measure.measure_step_latency) and their
ratio, and whether Medusa's greedy replies equal the plain loop's on a few prompts (random heads: few accepted,
but every accepted token counts). Peak GPU memory of the int4 load is recorded beside the 4-bit bytes.

fidelity: teacher-forced KL of each 4-bit path against the 16-bit model on the shipped text (model/sources/fidelity.py),
on a real checkpoint folder (the embedded SmolLM2 converted from its GGUF, gpu_checks.sh stages it): int4 (the
Triton kernel), NF4, and int4 with group 128.

summary: the keys the issue asks for, read from the stages' files (and the embedded model's `bench` JSONs
written by gpu_checks.sh), nothing derived by hand: card, plain_tok_s_7b, nf4_plain_tok_s_7b,
tree64_step_ratio_7b, kl_4bit, kl_nf4, embedded_medusa_speedup, embedded_identical_fraction.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from medusa_chat.kernels.int4_quant import pack_int4, unpack_codes  # noqa: E402
from medusa_chat.kernels.triton_linears import Int4Linear, RowInvariantLinear, time_call, tune  # noqa: E402
from medusa_chat.kernels.triton_matmul import CANDIDATES, Config  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64)
TINY_CONFIGS = (Config(64, 32, 1, 4, 3),)  # --tiny: one program per column block of a tiny weight
SHAPES_7B = ((4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096))
SHAPES_TINY = ((96, 128), (160, 64))
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["card"] = torch.cuda.get_device_name(device)
    else:
        info["card"] = f"cpu ({platform.machine()}, Triton interpreter)"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    log(f"wrote {path}")


# ---- kernels --------------------------------------------------------------------------------------------------
def _nf4(w: torch.Tensor) -> Any:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=w.dtype, quant_type="nf4",
                              compress_statistics=True, device="meta")  # fmt: skip
    layer.weight = bnb.nn.Params4bit(w.data, requires_grad=False, quant_type="nf4", module=layer).to(w.device)
    return layer


def _fp8(w: torch.Tensor) -> Any:
    fp8 = torch.float8_e4m3fn
    scale_w = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)  # [N, 1]
    wq = (w.float() / scale_w).to(fp8)

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = (-m) % 16
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        scale_x = (xp.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)  # [M, 1]
        xq = (xp.float() / scale_x).to(fp8)
        y = torch._scaled_mm(xq, wq.T, scale_a=scale_x, scale_b=scale_w.T, out_dtype=x.dtype)
        return y[:m]

    return run


def _gemlite(packed_module: Int4Linear) -> Any:
    import gemlite
    from gemlite import DType, GemLiteLinear

    del gemlite
    codes = unpack_codes(packed_module.codes)  # [N, K]
    s = packed_module.scales.T.float()
    z = packed_module.zeros.T.float()
    # ours: w = (q - 8) * s + z; gemlite (hqq): w = (q - zero) * s  ->  zero = 8 - z / s
    layer = GemLiteLinear(4, group_size=packed_module.group, in_features=packed_module.in_features,
                          out_features=packed_module.out_features, input_dtype=DType.BF16,
                          output_dtype=DType.BF16)  # fmt: skip
    layer.pack(codes, s.to(torch.bfloat16), (8 - z / s).to(torch.bfloat16), None)
    return layer


def _invariant(fn: Any, x: torch.Tensor) -> bool:
    full = fn(x)
    return all(torch.equal(fn(x[i : i + 1])[0], full[i]) for i in (0, x.shape[0] // 2, x.shape[0] - 1))


def kernels_stage(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SHAPES_TINY if args.tiny else SHAPES_7B
    rows = (1, 4, 16) if args.tiny else ROWS
    doc: dict[str, Any] = {
        **device_info(device),
        "rows": rows,
        "shapes": {},
        "timing": "median of CUDA events",
    }
    g = torch.Generator(device=device).manual_seed(0)
    for n, k in shapes:
        log(f"shape {n}x{k}")
        w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
        x = torch.randn(max(rows), k, generator=g, device=device).to(dtype)
        doc["shapes"][f"{n}x{k}"] = _kernel_shape(w, x, rows, args.tiny)
        write(args.out, doc)  # as it goes: a timeout loses the shape in flight only
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["attention"] = _attention_costs(device, dtype, args.tiny)
    return doc


def _attention_costs(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict[str, Any]:
    """One layer's exact path attention (kernels/triton_attention.py) at 1 and 64 nodes and several context
    lengths, beside SDPA over the same keys (one query; the tree with an ancestor mask): what the tree's attention
    adds to a step as the context grows, and whether each node keeps the plain call's bits at this size."""
    from medusa_chat.kernels.triton_attention import tree_paths
    from medusa_chat.tree import Tree

    layouts = {"mha_32x128": (32, 1, 128), "gqa_8x4x128": (8, 4, 128)} if not tiny else {"gqa_2x2x16": (2, 2, 16)}
    contexts = (64, 300) if tiny else (256, 1024, 4096)
    parents = list(Tree.named("mc_sim_7b_63").prefix(8 if tiny else 64).parents)
    path, depth = (t.to(device) for t in tree_paths(parents))
    n = len(parents)
    reps = 3 if tiny else 20
    g = torch.Generator(device=device).manual_seed(1)
    out: dict[str, Any] = {"tree_nodes": n, "timing": "median of CUDA events, one layer", "layouts": {}}
    for name, (kvh, groups, hd) in layouts.items():
        rows = {}
        for ctx in contexts:
            try:
                rows[str(ctx)] = _attention_at(kvh, groups, hd, ctx, path, depth, dtype, g, reps)
            except Exception as err:  # noqa: BLE001 - a failure at one size is a result; the others still run
                rows[str(ctx)] = {"error": _why(err)}
            log(f"  attention {name} ctx {ctx}: {rows[str(ctx)]}")
        out["layouts"][name] = rows
    return out


def _attention_at(kvh: int, groups: int, hd: int, ctx: int, path: torch.Tensor, depth: torch.Tensor,
                  dtype: torch.dtype, g: torch.Generator, reps: int) -> dict[str, Any]:  # fmt: skip
    from medusa_chat.kernels.triton_attention import path_attention

    device = path.device
    n = path.shape[0]
    width = ctx + n
    keys = torch.randn(kvh, width, hd, generator=g, device=device).to(dtype)
    values = torch.randn(kvh, width, hd, generator=g, device=device).to(dtype)
    q = torch.randn(n, kvh * groups, hd, generator=g, device=device).to(dtype)
    start = torch.tensor(ctx, device=device)
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    scale = hd**-0.5
    mask = torch.full((n, width), float("-inf"), device=device)
    mask[:, :ctx] = 0
    for node in range(n):
        mask[node, ctx + path[node, : int(depth[node]) + 1]] = 0
    mask = mask.to(dtype)
    k_rep, v_rep = keys.repeat_interleave(groups, 0)[None], values.repeat_interleave(groups, 0)[None]
    q_heads = q.transpose(0, 1)[None]
    calls = {
        "path_1": lambda: path_attention(q[:1], keys, values, start, one, zero, width, scale),
        f"path_{n}": lambda: path_attention(q, keys, values, start, path, depth, width, scale),
        "sdpa_1": lambda: F.scaled_dot_product_attention(
            q_heads[:, :, :1], k_rep[:, :, : ctx + 1], v_rep[:, :, : ctx + 1], scale=scale
        ),
        f"sdpa_{n}": lambda: F.scaled_dot_product_attention(q_heads, k_rep, v_rep, attn_mask=mask, scale=scale),
    }
    with torch.inference_mode():
        us = {k: round(time_call(fn, reps) * 1e6, 2) for k, fn in calls.items()}
        tree = path_attention(q, keys, values, start, path, depth, width, scale)
        same = _node_alone_equal(q, keys, values, ctx, path, depth, tree, scale)
    return {"us": us, f"ratio_path_{n}_vs_1": round(us[f"path_{n}"] / us["path_1"], 2), "nodes_bitwise_as_alone": same}


def _node_alone_equal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int, path: torch.Tensor,
                      depth: torch.Tensor, tree: torch.Tensor, scale: float) -> bool:  # fmt: skip
    """Whether a few nodes of the tree call get the bits of the plain call for their token (the path committed)."""
    from medusa_chat.kernels.triton_attention import path_attention

    zero = torch.zeros(1, dtype=torch.long, device=q.device)
    for node in {0, 1, len(q) // 2, len(q) - 1}:
        chain = path[node, : int(depth[node]) + 1].tolist()
        k2, v2 = keys.clone(), values.clone()
        for t, a in enumerate(chain):
            k2[:, ctx + t], v2[:, ctx + t] = keys[:, ctx + a], values[:, ctx + a]
        at = torch.tensor(ctx + len(chain) - 1, device=q.device)
        alone = path_attention(q[node : node + 1], k2, v2, at, zero[None], zero, keys.shape[1], scale)
        if not torch.equal(alone[0], tree[node]):
            return False
    return True


def _kernel_shape(w: torch.Tensor, x: torch.Tensor, rows: tuple[int, ...], tiny: bool) -> dict[str, Any]:
    """Every kernel on one weight: times per row count, row invariance, bandwidth at one row."""
    n, k = w.shape
    reps = 3 if tiny else 20
    int4 = Int4Linear(pack_int4(w, 64 if (k // 2) % 64 == 0 else 32), None, act_dtype=w.dtype)
    cfg, tuned = tune(int4, rows=(1, max(rows)), candidates=CANDIDATES[:2] if tiny else CANDIDATES, reps=reps)
    kernels: dict[str, Any] = {
        "bf16_cublas" if w.is_cuda else "float_linear": lambda t: F.linear(t, w),
        "triton_int4": int4,
        "triton_dense16": RowInvariantLinear(torch.nn.Parameter(w, requires_grad=False)),
    }
    entry: dict[str, Any] = {"triton_int4_config": cfg.name(), "triton_int4_tuning": tuned, "kernels": {}}
    makers = {
        "tinygemm_int4": lambda: _tinygemm(int4),
        "nf4_bnb": lambda: _nf4(w),
        "fp8_scaled_mm": lambda: _fp8(w),
        "gemlite_int4": lambda: _gemlite(int4),
    }
    for name, make in makers.items():
        try:
            kernels[name] = make()
        except Exception as err:  # noqa: BLE001 - each kernel is optional: its absence is a result
            entry["kernels"][name] = {"error": _why(err)}
    top = max(rows)
    for name, fn in kernels.items():
        try:
            with torch.inference_mode():
                times = {r: time_call(lambda r=r, fn=fn: fn(x[:r]), reps) for r in rows}
                ok = _invariant(fn, x)
        except Exception as err:  # noqa: BLE001
            entry["kernels"][name] = {"error": _why(err)}
            continue
        entry["kernels"][name] = {
            "us": {str(r): round(t * 1e6, 2) for r, t in times.items()},
            f"ratio_{top}_vs_1": round(times[top] / times[1], 3),
            "rows_bitwise_invariant": ok,
            "GBps_1_row": round(_bytes(name, n, k, int4) / times[1] / 1e9, 1),
        }
        log(
            f"  {name:16s} " + " ".join(f"{r}:{t * 1e6:.1f}us" for r, t in times.items()) + f" invariant={ok}"
        )
    return entry


def _tinygemm(int4: Int4Linear) -> Int4Linear:
    twin = Int4Linear(int4.packed, None, act_dtype=int4.act_dtype)
    twin.use("tinygemm")
    return twin


def _bytes(name: str, n: int, k: int, int4: Int4Linear) -> int:
    if "int4" in name:
        return int4.nbytes()
    if "nf4" in name:
        return n * k // 2 + n * k // 64 * 4
    if "fp8" in name:
        return n * k
    return n * k * 2


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


# ---- step7b ---------------------------------------------------------------------------------------------------
def step_stage(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_step_latency import _Loaded, build_llama, random_heads, to_nf4

    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.events import GenerationSettings
    from medusa_chat.model.forward import cuda_int4
    from medusa_chat.model.forward.cuda_check import verify_int4_load
    from medusa_chat.model.forward.cuda_int4 import choose_kernel, quantize_backbone
    from medusa_chat.tree import Tree
    from medusa_chat.tuning.measure import measure_step_latency

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.tiny else LLAMA2_7B
    tokens = 6 if args.tiny else 128
    if args.tiny:  # the interpreter's cost is per launch and per program: fewer of both
        cuda_int4.TREE_ROWS = 16
    sizes = [1, 8] if args.tiny else [1, 64]
    prompts = 1 if args.tiny else 2
    doc: dict[str, Any] = {**device_info(device), "config": shape, "tree_sizes": sizes, "paths": {}}
    heads = random_heads(shape["hidden_size"], shape["vocab_size"], 5, True, dtype, device, std=0.002)
    tree = Tree.named("mc_sim_7b_63").prefix(max(sizes))
    for path in args.paths.split(","):
        log(f"7B shape, {path}")
        try:
            if path == "int4":
                # as a checkpoint load: the 16-bit model on the CPU (built on the GPU, where random init is fast,
                # and moved), then quantized onto the GPU one weight at a time: the peak counts from here
                model = build_llama(shape, dtype, device).to("cpu")
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                done = quantize_backbone(model, device, dtype)
                choice = choose_kernel(
                    model, device, progress=log, candidates=TINY_CONFIGS if args.tiny else CANDIDATES
                )
                t_check = time.perf_counter()  # the load-time check a user's first load runs (uncached here)
                checked = verify_int4_load(model, device, choice, cuda_int4.TREE_ROWS)
                extra = {"int4_bytes": done["bytes"], "kernel": checked.kernel, "kernel_costs": choice.get("cost_s"),
                         "rows_invariant": choice.get("rows_invariant"), "configs": choice["configs"],
                         "load_check": {"line": checked.line, "s": round(time.perf_counter() - t_check, 3)}}  # fmt: skip
            else:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                model = build_llama(shape, dtype, device)
                if path == "nf4":
                    to_nf4(model, dtype)
                extra = {}
            if cuda:
                extra["peak_gpu_bytes_after_load"] = torch.cuda.max_memory_allocated(device)
                extra["gpu_bytes_after_load"] = torch.cuda.memory_allocated(device)
            loaded = _Loaded(
                backbone=model, heads=heads, device=device, dtype=dtype, quant=path, default_tree=tree
            )
            with torch.inference_mode():
                plain = MedusaEngine(loaded, plain_tree())
                medusa = MedusaEngine(loaded, tree)
                g = torch.Generator().manual_seed(0)
                same, rates, medusa_rates = 0, [], []
                for _ in range(prompts):
                    prompt = torch.randint(3, shape["vocab_size"], (32,), generator=g).tolist()
                    *_, a = plain.generate(prompt, GenerationSettings(max_new_tokens=tokens))
                    *_, b = medusa.generate(prompt, GenerationSettings(max_new_tokens=tokens))
                    same += a.token_ids == b.token_ids
                    rates.append(a.decode_tokens_per_s)
                    medusa_rates.append(b.decode_tokens_per_s)
                graph_notes = [plain.graph_note, medusa.graph_note]
                del plain, medusa
                latency = measure_step_latency(loaded, sizes, tree=tree, reps=3 if args.tiny else 20)
            one, big = latency[sizes[0]]["median_s"], latency[sizes[-1]]["median_s"]
            doc["paths"][path] = {
                **extra,
                "plain_tok_s": round(sorted(rates)[len(rates) // 2], 2),
                "medusa_random_heads_tok_s": round(sorted(medusa_rates)[len(medusa_rates) // 2], 2),
                "greedy_identical_fraction": same / prompts,
                "step_s": {str(s): v for s, v in latency.items()},
                f"tree{sizes[-1]}_step_ratio": round(big / one, 3),
                "graph_notes": [n for n in graph_notes if n],
            }
            log(f"  {path}: plain {doc['paths'][path]['plain_tok_s']} tok/s, {sizes[-1]}-node step {big / one:.2f}x, "
                f"identical {same}/{prompts}")  # fmt: skip
        except Exception as err:  # noqa: BLE001 - one path's failure is a result; the others still run
            doc["paths"][path] = {"error": _why(err)}
            log(f"  {path} failed: {_why(err)}")
        write(args.out, doc)  # as it goes: a timeout loses the path in flight only
        model = loaded = None  # noqa: F841
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return doc


# ---- fidelity -------------------------------------------------------------------------------------------------
class _Scored:
    """What model.fidelity.scored_logprobs reads of a loaded model."""

    def __init__(self, backbone: Any, tokenizer: Any, device: torch.device) -> None:
        self.backbone, self.tokenizer, self.device = backbone, tokenizer, device


def _dequantized(backbone: Any, group: int) -> Any:
    """The int4 scheme's values in place of each decoder projection's weight (a CPU's view of the CUDA path:
    the quantization error itself; the kernel's 16-bit arithmetic aside)."""
    from medusa_chat.kernels.int4_quant import group_for
    from medusa_chat.model.forward.cuda_int4 import PROJECTIONS

    for layer in backbone.model.layers:
        for part, name in PROJECTIONS:
            linear = getattr(getattr(layer, part), name)
            g = group_for(linear.in_features, group)
            if g is not None:
                linear.weight.data = pack_int4(linear.weight.data, g).dequantize(linear.weight.dtype)
    return backbone


def fidelity_stage(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from medusa_chat.bench.runs import repo_path
    from medusa_chat.model.forward.cuda_int4 import choose_kernel, quantize_backbone
    from medusa_chat.model.sources.backbones import load_backbone
    from medusa_chat.model.sources.devices import pick_dtype
    from medusa_chat.model.sources.fidelity import compare, fixed_text, scored_logprobs, text_chunks

    folder = Path(args.model)
    cuda = device.type == "cuda"
    dtype = pick_dtype(args.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cpu = torch.device("cpu")

    def plain(quant: str) -> Any:
        return lambda: _Scored(load_backbone(folder, device, dtype, quant), tokenizer, device)

    def int4(group: int) -> Any:
        def load() -> Any:
            if not cuda:
                return _Scored(
                    _dequantized(load_backbone(folder, cpu, dtype, "none"), group), tokenizer, device
                )
            backbone = load_backbone(folder, cpu, dtype, "none")
            quantize_backbone(backbone, device, dtype, group=group)
            choose_kernel(backbone, device)
            return _Scored(backbone, tokenizer, device)

        return load

    paths = {"int4": int4(64), "nf4": plain("nf4"), "int4_g128": int4(128)}  # the summary's two first
    doc = {**device_info(device), "model": repo_path(str(folder)), "reference": f"16-bit load ({dtype})",
           "int4": "the CUDA kernel" if cuda else "the scheme's dequantized values in fp32 (no GPU)",
           "paths": {}}  # fmt: skip
    ref_model = plain("none")()
    chunks = text_chunks(ref_model.tokenizer, fixed_text(), limit=args.chunks)
    ref = list(scored_logprobs(ref_model, chunks))
    del ref_model
    for name, load in paths.items():
        try:
            doc["paths"][name] = compare(ref, list(scored_logprobs(load(), chunks))).as_dict()
        except Exception as err:  # noqa: BLE001 - one path's failure (NF4 without bitsandbytes) is a result
            doc["paths"][name] = {"error": _why(err)}
        write(args.out, doc)  # as it goes: a timeout loses the path in flight only
        gc.collect()
    return doc


# ---- summary --------------------------------------------------------------------------------------------------
def summary_stage(folder: Path) -> dict[str, Any]:
    def read(name: str) -> dict[str, Any]:
        try:
            return json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}

    kernels, step, fidelity = read("kernels.json"), read("step7b.json"), read("fidelity.json")
    paths = step.get("paths", {})
    int4, nf4 = paths.get("int4", {}), paths.get("nf4", {})
    embedded = {name: read(name) for name in sorted(p.name for p in folder.glob("embedded_*.json"))}
    speedups = {k: v["summary"].get("speedup_vs_plain_loop") for k, v in embedded.items() if v.get("summary")}
    identical = {
        k: v["summary"].get("identical_to_plain_loop_fraction")
        for k, v in embedded.items()
        if v.get("summary")
    }
    fid = fidelity.get("paths", {})
    return {
        "card": step.get("card") or kernels.get("card"),
        "date": datetime.date.today().isoformat(),
        "plain_tok_s_7b": int4.get("plain_tok_s"),
        "nf4_plain_tok_s_7b": nf4.get("plain_tok_s"),
        "bf16_plain_tok_s_7b": paths.get("bf16", {}).get("plain_tok_s"),
        "tree64_step_ratio_7b": int4.get("tree64_step_ratio"),
        "nf4_tree64_step_ratio_7b": nf4.get("tree64_step_ratio"),
        "int4_kernel_7b": int4.get("kernel"),
        "greedy_identical_fraction_7b": int4.get("greedy_identical_fraction"),
        "kl_4bit": (fid.get("int4") or {}).get("mean_kl"),
        "kl_4bit_g128": (fid.get("int4_g128") or {}).get("mean_kl"),
        "kl_nf4": (fid.get("nf4") or {}).get("mean_kl"),
        "embedded_medusa_speedup": speedups.get("embedded_hydra_int4.json"),
        "embedded_identical_fraction": identical.get("embedded_hydra_int4.json"),
        "embedded_runs": {
            k: {"speedup_vs_plain_loop": speedups[k], "identical_to_plain_loop_fraction": identical[k]}
            for k in speedups
        },  # fmt: skip
        "sources": ["kernels.json", "step7b.json", "fidelity.json", *embedded],
    }


def print_plan(args: argparse.Namespace) -> int:
    """The GPU run's commands as JSON (benchmarks/gpu_plan.py), checked against the limits (GPU_PLAN_* set
    them); exit status 1 where the plan breaks one."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_plan

    if args.stages:
        print(gpu_plan.stage_lines(args.part))
        return 0
    limits = gpu_plan.limits_from_env()
    plan = gpu_plan.make_plan(limits, gguf=args.gguf_bytes, whl=args.whl_bytes)
    plan["problems"] = gpu_plan.problems(plan, limits)
    print(json.dumps(plan, indent=1))
    return 1 if plan["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("kernels", "step7b", "fidelity", "summary", "plan"))
    p.add_argument("folder", nargs="?", type=Path, help="summary: the folder of the stages' JSON files")
    p.add_argument("--out", type=Path, help="the stage's JSON file")
    p.add_argument(
        "--tiny", action="store_true", help="small shapes: a CPU dry run under Triton's interpreter"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--paths", default="int4,nf4,bf16", help="step7b: which loads to measure")
    p.add_argument("--model", help="fidelity: a checkpoint folder")
    p.add_argument("--dtype", default="auto", help="fidelity: the compute dtype")
    p.add_argument("--chunks", type=int, default=8, help="fidelity: text chunks scored")
    p.add_argument("--part", help="plan: one command's stages (with --stages: `name limit_s` lines)")
    p.add_argument("--stages", action="store_true", help="plan: print --part's stage limits for gpu_checks.sh")
    p.add_argument("--gguf-bytes", type=int, help="plan: the GGUF's size (default: the file's, where present)")
    p.add_argument("--whl-bytes", type=int, help="plan: the carried wheels' size (default: .whl/site's)")
    args = p.parse_args(argv)
    if args.stage == "plan":
        return print_plan(args)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    if args.stage == "summary":
        if args.folder is None:
            p.error("summary needs the folder of the stages' files")
        doc = summary_stage(args.folder)
        card = "".join(c if c.isalnum() else "_" for c in str(doc["card"] or "unknown").lower()).strip("_")
        out = args.out or args.folder / f"gpu_4bit_{card}_{doc['date']}.json"
        write(out, doc)
        print(json.dumps(doc, indent=1))
        return 0
    if args.out is None:
        p.error("--out is required")
    if args.stage == "fidelity" and not args.model:
        p.error("fidelity needs --model FOLDER")
    stage = {"kernels": kernels_stage, "step7b": step_stage, "fidelity": fidelity_stage}[args.stage]
    doc = stage(args, device)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

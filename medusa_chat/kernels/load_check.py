"""Known answers for the CUDA kernels, checked on the user's own GPU before a reply depends on them.

A kernel can compile and still compute the wrong numbers on one GPU, driver or Triton release (a tile offset,
a mask or a group's scale read wrongly), or give a row other bits beside other rows than alone, which would
make a tree step's tokens differ from the plain loop's. So at the first load on a GPU the int4 kernel runs on
the model's own projections (their own codes, one module per shape) and the tree attention on the model's own
head layout, each at one row and at a tree's row count, against torch computing the same thing in fp32:
- values: every row within the kernel's 16-bit rounding of the reference (a misread tile, mask or scale is off
  by tens of percent, far above it);
- rows: each row's bits alone equal its bits among the others (the property that makes a tree step exact).
Any exception (a compile error included) is a failed check, never a crash. The caller (model/forward/cuda_check.py)
caches the verdict per GPU and falls back on a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Largest per-row relative error accepted against the fp32 reference: the kernels round their inputs and output
# to the activation dtype (bf16: 2^-8 relative per value), so a correct kernel stays far below these.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
PREFIX = 300  # committed keys before the tree in the attention check: more than one split-KV chunk (256), unaligned


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""  # what failed, one line ("" when ok)
    # failed by an exception (a compile error, or a transient one such as memory): checked again at the next load
    raised: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "why": self.why}


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def _row_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest over rows of ||y_i - ref_i|| / ||ref_i|| (fp32)."""
    y, ref = y.float().reshape(ref.shape[0], -1), ref.reshape(ref.shape[0], -1)
    scale = ref.norm(dim=1).clamp(min=1e-12)
    return float(((y - ref).norm(dim=1) / scale).max())


def _inputs(rows: int, width: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)


def check_linear(module: Any, rows: int, reference: torch.Tensor, dtype: torch.dtype, name: str) -> Verdict:
    """`module` (x [M, K] -> [M, N]) against `reference` (its weight [N, K] in fp32, as the kernel's dtype rounds
    it) at 1 row and at `rows` rows: values and row invariance."""
    try:
        x = _inputs(rows, reference.shape[1], dtype, reference.device, seed=rows)
        want = x.float() @ reference.T
        bias = getattr(module, "bias", None)
        if bias is not None:
            want = want + bias.float()
        with torch.inference_mode():
            full, alone = module(x), [module(x[i : i + 1]) for i in range(rows)]
        limit = TOLERANCE.get(dtype, 2e-2)
        for label, y, ref in (("1 row", alone[0], want[:1]), (f"{rows} rows", full, want)):
            err = _row_error(y, ref)
            if not err <= limit:  # NaN fails too
                return Verdict(
                    False, f"{name}: wrong values at {label} (relative error {err:.2g} > {limit:g})"
                )
        bad = [i for i in range(rows) if not torch.equal(alone[i][0], full[i])]
        if bad:
            return Verdict(
                False, f"{name}: row {bad[0]} differs alone and among {rows} rows ({len(bad)} rows)"
            )
    except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is a failed check, not a crash
        return Verdict(False, f"{name}: {_why(err)}", raised=True)
    return Verdict(True)


def check_int4(modules: list[Any], rows: int) -> Verdict:
    """Each Int4Linear (one per projection shape, with its kernel and configuration as set) at 1 and `rows`
    rows against torch's matmul over its own dequantized weight."""
    for m in modules:
        name = f"int4 {m.kernel} {m.out_features}x{m.in_features}"
        try:
            reference = m.packed.dequantize(torch.float32).to(m.act_dtype).float()
        except Exception as err:  # noqa: BLE001
            return Verdict(False, f"{name}: {_why(err)}", raised=True)
        verdict = check_linear(m, rows, reference, m.act_dtype, name)
        if not verdict.ok:
            return verdict
    return Verdict(True)


def binary_tree(nodes: int) -> list[int]:
    """Parents of a `nodes`-node tree with every depth up to log2(nodes) and several nodes per depth."""
    return [-1] + [(i - 1) // 2 for i in range(1, nodes)]


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                        path: torch.Tensor, depth: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """What each node's query sees, in fp32: softmax over the prefix 0..start-1 and its path's slots."""
    n, hq, _ = q.shape
    kvh = keys.shape[0]
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float32, device=q.device)
    prefix = torch.arange(start, device=q.device)
    for node in range(n):
        slots = torch.cat([prefix, start + path[node, : int(depth[node]) + 1]])
        k = keys[:, slots].float().repeat_interleave(hq // kvh, 0)  # [Hq, L, D]
        v = values[:, slots].float().repeat_interleave(hq // kvh, 0)
        w = torch.softmax(torch.einsum("hd,hld->hl", q[node].float(), k) * scale, dim=-1)
        out[node] = torch.einsum("hl,hld->hd", w, v)
    return out


def check_attention(kv_heads: int, groups: int, head_dim: int, nodes: int, dtype: torch.dtype,
                    device: torch.device, prefix: int = PREFIX) -> Verdict:  # fmt: skip
    """The path attention for this head layout on a `nodes`-node tree after `prefix` committed keys: every node
    against the fp32 reference, and a few nodes alone (the plain step for that token: its path committed, one
    query) with the bits they get in the tree."""
    name = f"tree attention {kv_heads}x{groups}x{head_dim}"
    try:
        from medusa_chat.kernels.path_tables import tree_paths
        from medusa_chat.kernels.triton_attention import path_attention

        path, depth = (t.to(device) for t in tree_paths(binary_tree(nodes)))
        width = prefix + nodes
        g = torch.Generator(device="cpu").manual_seed(nodes)
        keys, values = (
            torch.randn(kv_heads, width, head_dim, generator=g).to(device, dtype) for _ in range(2)
        )
        q = torch.randn(nodes, kv_heads * groups, head_dim, generator=g).to(device, dtype)
        scale = head_dim**-0.5
        with torch.inference_mode():
            tree = path_attention(
                q, keys, values, torch.tensor(prefix, device=device), path, depth, width, scale
            )
            err = _row_error(tree, attention_reference(q, keys, values, prefix, path, depth, scale))
            limit = TOLERANCE.get(dtype, 2e-2)
            if not err <= limit:
                return Verdict(
                    False, f"{name}: wrong values at {nodes} nodes (relative error {err:.2g} > {limit:g})"
                )
            zero = torch.zeros(1, dtype=torch.long, device=device)
            for node in sorted({0, 1, nodes // 2, nodes - 1} & set(range(nodes))):
                chain = path[node, : int(depth[node]) + 1]
                k2, v2 = keys.clone(), values.clone()
                k2[:, prefix : prefix + len(chain)] = keys[:, prefix + chain]
                v2[:, prefix : prefix + len(chain)] = values[:, prefix + chain]
                at = torch.tensor(prefix + len(chain) - 1, device=device)
                alone = path_attention(q[node : node + 1], k2, v2, at, zero[None], zero, width, scale)
                if not torch.equal(alone[0], tree[node]):
                    return Verdict(False, f"{name}: node {node} differs alone and in a {nodes}-node tree")
    except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is a failed check, not a crash
        return Verdict(False, f"{name}: {_why(err)}", raised=True)
    return Verdict(True)

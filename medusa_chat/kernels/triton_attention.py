"""Tree attention for CUDA whose every node gets the bits the plain loop gives that token, in Triton.

The plain loop decodes the token at position p against keys 0..p, all in the cache. A tree step verifies
that token as a node at depth d of a tree whose root sits at `start` = p - d: its keys are the prefix
0..start-1 (cache slots 0..start-1) and then its path root..itself (tree slots start + ancestor index).
SDPA over the tree block with an ancestor mask computes the same softmax with other blocking and a masked
width, so its bits differ and greedy replies can part at near-ties.

Here every query attends over its *logical* keys 0..p: key j comes from slot j when j < start and from slot
start + path[j - start] otherwise. Keys go in blocks of BLOCK logical positions, chunks of CHUNK positions run
as separate programs (split-KV, so a long context fills the GPU) and a second kernel merges the chunks in
chunk order. Every quantity depends on logical positions only, so a node computes exactly what the plain step
computes for that token, whatever the tree around it, the start or the width:
- A program holds ROWS query rows: NODES nodes times the query heads of one KV head. A block wholly inside the
  committed prefix has the same keys for every node, so one tensor-core product serves all rows and the prefix
  is read once per NODES nodes, not once per node (a 64-node tree would otherwise read it 64 times).
- A block that reaches the tree has other keys per node: one product per node, each row taking its own node's.
  Both are the same [ROWS, D] x [D, BLOCK] product, and a row of a matrix product does not depend on the other
  rows or on where it sits in the tile (the same premise as triton_matmul's row-invariant kernels; the GPU
  checks test it), so a row gets the same bits on either branch, in the plain step or in any tree.
- Blocks past a row's length (other rows in its program are longer) add exact zeros.

Inputs are device tensors (start, path, depth), so a CUDA graph records one call and replays it at any start.
Runs under Triton's interpreter on a CPU (TRITON_INTERPRET=1) for tests; timed on a GPU.
"""

from __future__ import annotations

import torch

from medusa_chat.kernels import triton_interpreter
from medusa_chat.kernels.path_tables import tree_paths  # noqa: F401 - its home before; callers import it here

try:
    import triton
    import triton.language as tl

    if triton_interpreter.interpreting():
        triton_interpreter.make_dots_row_invariant()
except ImportError:  # pragma: no cover
    triton = None
    tl = None

ROWS = 16  # query rows per program: one tensor-core tile (nodes x query heads per KV head)
BLOCK = 64  # logical keys per block
CHUNK = 256  # logical keys per program (split-KV); a multiple of BLOCK


def nodes_per_program(groups: int) -> int:
    """Nodes per program for `groups` query heads per KV head: a function of the model's head layout alone, so
    the plain step and every tree step tile a token's rows alike."""
    pad = 1 << max(0, (groups - 1).bit_length())
    return max(1, ROWS // pad)


if triton is not None:

    @triton.jit
    def _path_attention_chunks(
        q_ptr, k_ptr, v_ptr, start_ptr, path_ptr, depth_ptr, acc_ptr, ml_ptr, n_nodes,
        stride_qn, stride_qh, stride_kh, stride_ks, stride_pn, stride_an, stride_ah, stride_ac, scale,
        GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, NODES: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        chunk = tl.program_id(2)
        start = tl.load(start_ptr)
        r = tl.arange(0, NODES * GROUPS_PAD)  # rows: node-major, then query head
        which = r // GROUPS_PAD  # the row's node within this program
        node = tile * NODES + which
        g = r % GROUPS_PAD
        has_node = node < n_nodes
        live = has_node & (g < GROUPS)
        depth = tl.load(depth_ptr + node, mask=has_node, other=0)
        lo = chunk * CHUNK
        row_hi = tl.where(has_node, tl.minimum(lo + CHUNK, start + depth + 1), lo)  # [ROWS]: keys lo..hi-1
        hi = tl.max(row_hi, axis=0)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUPS + g
        q = tl.load(q_ptr + node[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        m_i = tl.full((NODES * GROUPS_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((NODES * GROUPS_PAD,), tl.float32)
        acc = tl.zeros((NODES * GROUPS_PAD, HEAD_DIM), tl.float32)
        kv_head = kvh * stride_kh
        for b in range(lo, hi, BLOCK):
            j = b + tl.arange(0, BLOCK)
            valid = j[None, :] < row_hi[:, None]
            shared = b + BLOCK <= start  # the whole block is committed prefix: the same keys for every row
            if shared:
                k = tl.load(k_ptr + kv_head + j[:, None] * stride_ks + d[None, :])
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            else:
                s = tl.zeros((NODES * GROUPS_PAD, BLOCK), tl.float32)
                for i in range(NODES):
                    k = _node_keys(k_ptr + kv_head, path_ptr, depth_ptr, n_nodes, stride_pn, stride_ks,
                                   tile * NODES + i, j, d, start, lo + CHUNK)  # fmt: skip
                    s_i = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                    s = tl.where((which == i)[:, None], s_i, s)
            s = tl.where(valid, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))  # a row with no keys yet stays 0
            p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = p.to(v_ptr.dtype.element_ty)
            if shared:
                v = tl.load(v_ptr + kv_head + j[:, None] * stride_ks + d[None, :])
                pv = tl.dot(p, v, input_precision=DOT_PRECISION)
            else:
                pv = tl.zeros((NODES * GROUPS_PAD, HEAD_DIM), tl.float32)
                for i in range(NODES):
                    v = _node_keys(v_ptr + kv_head, path_ptr, depth_ptr, n_nodes, stride_pn, stride_ks,
                                   tile * NODES + i, j, d, start, lo + CHUNK)  # fmt: skip
                    pv_i = tl.dot(p, v, input_precision=DOT_PRECISION)
                    pv = tl.where((which == i)[:, None], pv_i, pv)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = node * stride_an + heads * stride_ah + chunk * stride_ac
        tl.store(acc_ptr + out[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None])
        tl.store(ml_ptr + out * 2, m_i, mask=live)
        tl.store(ml_ptr + out * 2 + 1, l_i, mask=live)

    @triton.jit
    def _node_keys(ptr, path_ptr, depth_ptr, n_nodes, stride_pn, stride_ks, node, j, d, start, chunk_end):
        """`node`'s keys (or values) at logical positions `j` [BLOCK, D] from one KV head's cache at `ptr`: slot j
        before `start`, its path's tree slots from there; zeros past its length."""
        depth = tl.load(depth_ptr + tl.minimum(node, n_nodes - 1))  # a node past the last: no keys (end 0)
        end = tl.where(node < n_nodes, tl.minimum(chunk_end, start + depth + 1), 0)
        ok = j < end
        in_path = ok & (j >= start)
        step = tl.load(path_ptr + node * stride_pn + (j - start), mask=in_path, other=0)
        slot = tl.where(in_path, start + step, j)
        return tl.load(ptr + slot[:, None] * stride_ks + d[None, :], mask=ok[:, None], other=0.0)

    @triton.jit
    def _merge_chunks(acc_ptr, ml_ptr, out_ptr, chunks, stride_on, stride_oh,
                      HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
        node = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        row = (node * HEADS + head) * chunks
        m = tl.load(ml_ptr + row * 2)
        for c in range(1, chunks):
            m = tl.maximum(m, tl.load(ml_ptr + (row + c) * 2))
        total = tl.zeros((HEAD_DIM,), tl.float32)
        norm = 0.0
        for c in range(0, chunks):
            m_c = tl.load(ml_ptr + (row + c) * 2)
            l_c = tl.load(ml_ptr + (row + c) * 2 + 1)
            w = tl.where(l_c > 0, tl.exp(m_c - m), 0.0)  # an empty chunk adds exact zeros
            total += tl.load(acc_ptr + (row + c) * HEAD_DIM + d) * w
            norm += l_c * w
        tl.store(
            out_ptr + node * stride_on + head * stride_oh + d, (total / norm).to(out_ptr.dtype.element_ty)
        )


def path_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    path: torch.Tensor,
    depth: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """Exact tree attention (module docstring).

    q [N, Hq, D] (node-major); keys/values [KVH, S, D] (one layer's cache, the tree's entries written at
    slots start + node; q, keys and values of one dtype); start: a 0-d long tensor; path [N, max depth + 1]
    long: path[n, t] = the node index of n's ancestor at depth t (path[n, depth[n]] = n); depth [N] long;
    width: an upper bound on start + N (the graph's bucket), which fixes the grid. Returns [N, Hq, D] in q's
    dtype."""
    if triton is None:
        raise RuntimeError("exact GPU tree attention needs triton (pip install triton)")
    n, hq, hd = q.shape
    kvh = keys.shape[0]
    groups = hq // kvh
    nodes = nodes_per_program(groups)
    chunks = max(1, -(-width // CHUNK))
    q = q.contiguous()
    acc = torch.empty((n, hq, chunks, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, hq, chunks, 2), dtype=torch.float32, device=q.device)
    _path_attention_chunks[(-(-n // nodes), kvh, chunks)](
        q, keys, values, start, path, depth, acc, ml, n,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), path.stride(0),
        hq * chunks, chunks, 1, scale,
        GROUPS=groups, GROUPS_PAD=triton.next_power_of_2(groups), NODES=nodes, HEAD_DIM=hd, BLOCK=BLOCK,
        CHUNK=CHUNK, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_chunks[(n, hq)](acc, ml, out, chunks, out.stride(0), out.stride(1), HEADS=hq, HEAD_DIM=hd)
    return out

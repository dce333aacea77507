"""Tree attention for CUDA whose every node gets the bits the plain loop gives that token, in Triton.

The plain loop decodes the token at position p against keys 0..p, all in the cache. A tree step verifies
that token as a node at depth d of a tree whose root sits at `start` = p - d: its keys are the prefix
0..start-1 (cache slots 0..start-1) and then its path root..itself (tree slots start + ancestor index).
SDPA over the tree block with an ancestor mask computes the same softmax with other blocking and a masked
width, so its bits differ and greedy replies can part at near-ties.

Here every query attends over its *logical* keys 0..p: key j comes from slot j when j < start and from slot
start + path[j - start] otherwise. Keys go in blocks of BLOCK logical positions, chunks of CHUNK positions run
as separate programs (split-KV, so a long context fills the GPU) and a second kernel merges the chunks in
chunk order. Every quantity depends on logical positions only, and one program handles one node (its query
heads of one KV head as rows), so a node computes exactly what the plain step computes for that token,
whatever the tree around it, the start or the width. Chunks past a node's length add exact zeros.

Inputs are device tensors (start, path, depth), so a CUDA graph records one call and replays it at any start.
Runs under Triton's interpreter on a CPU (TRITON_INTERPRET=1) for tests; timed on a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

KEYS_X_GROUPS = 32  # logical keys per block times query heads per KV head: a [groups, keys, head_dim] fp32 tile
CHUNK = 256  # logical keys per program (split-KV)


def block_for(groups: int) -> int:
    """Logical keys per block: a function of the model's head layout alone, so the plain step and every tree step
    block a token's keys alike."""
    pad = 1 << max(0, (groups - 1).bit_length())
    return max(8, KEYS_X_GROUPS // pad)


if triton is not None:

    @triton.jit
    def _path_attention_chunks(
        q_ptr, k_ptr, v_ptr, start_ptr, path_ptr, depth_ptr, acc_ptr, ml_ptr,
        stride_qn, stride_qh, stride_kh, stride_ks, stride_pn, stride_an, stride_ah, stride_ac,
        scale, chunks,
        GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        node = tl.program_id(0)
        kvh = tl.program_id(1)
        chunk = tl.program_id(2)
        start = tl.load(start_ptr)
        depth = tl.load(depth_ptr + node)
        length = start + depth + 1
        g = tl.arange(0, GROUPS_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUPS + g
        q = tl.load(q_ptr + node * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUPS)[:, None], other=0.0).to(tl.float32)  # fmt: skip
        m_i = tl.full((GROUPS_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUPS_PAD,), tl.float32)
        acc = tl.zeros((GROUPS_PAD, HEAD_DIM), tl.float32)
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, length)
        for b in range(lo, hi, BLOCK):
            j = b + tl.arange(0, BLOCK)
            valid = j < hi
            in_path = valid & (j >= start)
            step = tl.load(path_ptr + node * stride_pn + (j - start), mask=in_path, other=0)
            slot = tl.where(in_path, start + step, j)
            kv = kvh * stride_kh + slot[:, None] * stride_ks + d[None, :]
            k = tl.load(k_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = node * stride_an + heads * stride_ah + chunk * stride_ac
        ok = g < GROUPS
        tl.store(acc_ptr + out[:, None] * HEAD_DIM + d[None, :], acc, mask=ok[:, None])
        tl.store(ml_ptr + out * 2, m_i, mask=ok)
        tl.store(ml_ptr + out * 2 + 1, l_i, mask=ok)

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
    slots start + node); start: a 0-d long tensor; path [N, max depth + 1] long: path[n, t] = the node index of
    n's ancestor at depth t (path[n, depth[n]] = n); depth [N] long; width: an upper bound on start + N (the
    graph's bucket), which fixes the grid. Returns [N, Hq, D] in q's dtype."""
    if triton is None:
        raise RuntimeError("exact GPU tree attention needs triton (pip install triton)")
    n, hq, hd = q.shape
    kvh = keys.shape[0]
    groups = hq // kvh
    chunks = max(1, -(-width // CHUNK))
    q = q.contiguous()
    acc = torch.empty((n, hq, chunks, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, hq, chunks, 2), dtype=torch.float32, device=q.device)
    _path_attention_chunks[(n, kvh, chunks)](
        q, keys, values, start, path, depth, acc, ml,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), path.stride(0),
        hq * chunks, chunks, 1, scale, chunks,
        GROUPS=groups, GROUPS_PAD=triton.next_power_of_2(groups), HEAD_DIM=hd, BLOCK=block_for(groups), CHUNK=CHUNK,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_chunks[(n, hq)](acc, ml, out, chunks, out.stride(0), out.stride(1), HEADS=hq, HEAD_DIM=hd)
    return out


def tree_paths(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(path [N, max depth + 1], depth [N]) for a tree given each node's parent (-1 for the root; parents come
    before children): the `path` and `depth` inputs of `path_attention`. Built once per tree."""
    depth: list[int] = []
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        chain = [node] if parent < 0 else [*paths[parent], node]
        paths.append(chain)
        depth.append(len(chain) - 1)
    width = max(depth) + 1
    table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths], dtype=torch.long)
    return table, torch.tensor(depth, dtype=torch.long)

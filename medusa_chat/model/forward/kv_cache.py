"""The engine's KV cache: one preallocated buffer for all layers, compacted in place after each step."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _BufferLayer(DynamicLayer):
    """A cache layer that is a view into TreeKVCache's shared buffer (no torch.cat per step)."""

    def __init__(self, owner: TreeKVCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0


class TreeKVCache(Cache):
    """Keys and values of every layer in one tensor `[layers, 2, 1, kv_heads, capacity, head_dim]`.

    Each forward writes its new entries after `length` (all layers see the same `length`; the last layer's
    write advances it). Accepting a tree path is one `index_select` + copy over all layers at once. Capacity
    grows by doubling, so the amortised cost per token is constant.

    Exact tree attention (lean_forward.TreePlan) also keeps per-node key rows `[layers, 2, N - 1, kv_heads,
    capacity, head_dim]`: a copy of the prefix for each non-root node, then the node's path. The prefix part is
    synced incrementally (`rows_synced`): a step copies only what was committed since the previous one.
    """

    def __init__(self, num_layers: int, capacity: int = 1024) -> None:
        super().__init__(layers=[_BufferLayer(self, i) for i in range(num_layers)])
        self.num_layers = num_layers
        self.capacity = capacity
        self.length = 0  # committed entries (visible to the next forward)
        self.buffer: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.rows_synced = 0  # prefix entries already copied into every row

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[-2]
        start, end = self.length, self.length + n
        if self.buffer is None or self.buffer.dtype != k.dtype or self.buffer.device != k.device:
            shape = (self.num_layers, 2, *k.shape[:2], max(self.capacity, end), k.shape[-1])
            self.buffer = k.new_zeros(shape)
            self.rows = None
        elif end > self.buffer.shape[-2]:
            self._grow(end)
        self.buffer[layer, 0, :, :, start:end] = k
        self.buffer[layer, 1, :, :, start:end] = v
        if layer == self.num_layers - 1:
            self.length = end
        return self.buffer[layer, 0, :, :, :end], self.buffer[layer, 1, :, :, :end]

    def reserve(
        self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The whole buffer, allocated or grown so that slots [0, end) exist: the native step
        (block_forward.py) writes its entries into it itself and then advances `length`."""
        buf = self.buffer
        if buf is None or buf.dtype != dtype or buf.device != device or buf.shape[3] != kv_heads:
            shape = (self.num_layers, 2, 1, kv_heads, max(self.capacity, end), head_dim)
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
            self.rows = None
        elif end > buf.shape[-2]:
            self._grow(end)
        return self.buffer

    def _grow(self, needed: int) -> None:
        old = self.buffer
        new_cap = max(needed, 2 * old.shape[-2])
        self.buffer = old.new_zeros((*old.shape[:-2], new_cap, old.shape[-1]))
        self.buffer[..., : old.shape[-2], :] = old

    def tree_rows(self, layer: int, start: int, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value rows [N - 1, kv_heads, >= start + depth + 1, head_dim] of the tree written at `start`:
        row r = prefix [0, start) then the tree entries of `plan.paths[r]` (root .. node)."""
        buf = self.buffer
        rows_n, cap = plan.size - 1, buf.shape[-2]
        # Rows are interchangeable (each holds the same prefix; a step writes its node's path after it), so a
        # smaller plan (a prefix of the tree near the end of the context window, or a smaller tree) uses the
        # first rows of the buffer it finds: only more rows or more capacity reallocate.
        if self.rows is None or self.rows.shape[2] < rows_n or self.rows.shape[-2] != cap:
            old, keep = self.rows, self.rows_synced
            count = max(rows_n, old.shape[2] if old is not None else 0)
            self.rows = buf.new_empty((self.num_layers, 2, count, buf.shape[3], cap, buf.shape[-1]))
            if old is not None and old.shape[2] == count and keep:
                self.rows[..., :keep, :] = old[..., :keep, :]
            else:
                self.rows_synced = 0
        every = self.rows[layer]
        if self.rows_synced < start:  # committed since the last step: append it to every row's prefix
            every[:, :, :, self.rows_synced : start] = buf[layer, :, :, :, self.rows_synced : start]
        rows = every[:, :rows_n]
        # the node's path: [2, kv_heads, N - 1, depth + 1, head_dim] -> rows[..., start : start + depth + 1]
        path = buf[layer, :, 0].index_select(-2, (start + plan.paths).flatten())
        path = path.view(2, buf.shape[3], rows_n, plan.depth + 1, buf.shape[-1]).transpose(1, 2)
        rows[:, :, :, start : start + plan.depth + 1] = path
        if layer == self.num_layers - 1:
            self.rows_synced = start
        return rows[0], rows[1]

    def keep(self, start: int, nodes: list[int], on_device: torch.Tensor | None = None) -> None:
        """After a tree forward written at `start`: keep the entries of tree nodes `nodes` (host list; the same
        indices on the device in `on_device`, if at hand) as positions start..start+len(nodes)-1 and drop the
        rest of the tree. Nodes 0, 1, .. (a chain, the plain loop) are in place already: nothing to copy."""
        count = len(nodes)
        if self.buffer is not None and nodes != list(range(count)):
            index = (
                on_device[:count] if on_device is not None else torch.tensor(nodes, device=self.buffer.device)
            )
            picked = self.buffer.index_select(-2, index + start)
            self.buffer[..., start : start + count, :] = picked
        self.length = start + count

    def crop(self, length: int) -> None:  # type: ignore[override]
        self.length = min(self.length, length)
        self.rows_synced = min(self.rows_synced, self.length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

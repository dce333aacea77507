"""The tree as the path attention reads it (kernels/triton_attention.py), built without Triton: the CUDA graph
step builds these tables on any device, and importing Triton on a CPU only costs start-up time and leaves
"nanobind: leaked ..." lines at exit."""

from __future__ import annotations

import torch


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

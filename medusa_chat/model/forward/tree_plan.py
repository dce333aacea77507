"""TreePlan: how the nodes of one tree attend in a verification step (the lean and the native forward read it).

Exact tree attention: each node attends to the committed context and to its own path root .. node only, in an
order that gives it the bits the plain loop gives that token (see lean_forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreePlan:
    """How the nodes of one tree attend in a verification step, built once per tree (see the module doc).

    Nodes are taken in depth order (`order`, root first); `rows` lists the non-root nodes in that order, each
    with its path's tree slots `paths[r]` (root .. node, padded by repeating the node: never read, a node's
    key row ends at its own depth). `groups` are the (first row, end row, depth) runs of equal depth.
    """

    size: int
    depth: int
    order: torch.Tensor  # [N] node indices, by depth
    inverse: torch.Tensor  # [N] position of each node in `order`
    paths: torch.Tensor  # [N - 1, depth + 1] tree slots of each row's path
    groups: list[tuple[int, int, int]]
    # for the native step (block_forward.py): node i's path root .. i in tree order, int32 [N, depth + 1]
    # (padded), and its length depth + 1
    blocks: torch.Tensor | None = None
    block_len: torch.Tensor | None = None

    @classmethod
    def build(cls, parents: list[int], depths: list[int], device: torch.device) -> TreePlan:
        n = len(parents)
        order = sorted(range(n), key=lambda i: (depths[i], i))
        width = max(depths) + 1
        paths = []
        for node in order[1:]:
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = path[::-1]
            paths.append(path + [node] * (width - len(path)))
        groups: list[tuple[int, int, int]] = []
        for r, node in enumerate(order[1:]):
            if groups and groups[-1][2] == depths[node]:
                groups[-1] = (groups[-1][0], r + 1, depths[node])
            else:
                groups.append((r, r + 1, depths[node]))
        t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        inverse = [0] * n
        for pos, node in enumerate(order):
            inverse[node] = pos
        blocks = []
        for node in range(n):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            blocks.append(path[::-1] + [0] * (width - len(path)))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731 - host-side, read by the C step
        return cls(
            n,
            width - 1,
            t(order),
            t(inverse),
            t(paths).view(n - 1, width),
            groups,
            i32(blocks),
            i32([d + 1 for d in depths]),
        )

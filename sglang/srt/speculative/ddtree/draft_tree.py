# SPDX-License-Identifier: Apache-2.0
"""The selected draft tree, as ``tree_build`` and its plain-Python reference
produce it and ``tree_compile`` consumes it.

A module of its own so that the build kernel and the reference, which each
use the other's output format, depend on it rather than on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The tensor fields of ``DraftTree``, in constructor order.
FIELDS = ("node_token", "node_parent", "node_depth", "node_rank", "node_score", "num_nodes")


@dataclass
class DraftTree:
    """Selected nodes per request, in pop order (node n is column n - 1).

    Requests whose draft offers fewer than B distinct prefixes (only possible
    when the vocabulary is smaller than B) are padded: a padded node has
    ``parent == -1``, ``depth == 0``, ``token == 0`` and ``score == -inf``;
    ``num_nodes`` counts the real ones. Real nodes always come first.
    """

    node_token: torch.Tensor  # [bs, B] int64 token ids
    node_parent: torch.Tensor  # [bs, B] int32, index into 0..B (0 = root), -1 = padding
    node_depth: torch.Tensor  # [bs, B] int32 in 1..L, 0 = padding
    node_rank: torch.Tensor  # [bs, B] int32 rank of the token among its depth's top-K
    node_score: torch.Tensor  # [bs, B] float32 accumulated path log-prob
    num_nodes: torch.Tensor  # [bs] int32

    @property
    def budget(self) -> int:
        return self.node_token.shape[1]

    @property
    def batch_size(self) -> int:
        return self.node_token.shape[0]


def empty_tree(bs: int, budget: int, device) -> DraftTree:
    """Uninitialised buffers of the right shapes and dtypes."""
    return DraftTree(
        node_token=torch.empty((bs, budget), dtype=torch.int64, device=device),
        node_parent=torch.empty((bs, budget), dtype=torch.int32, device=device),
        node_depth=torch.empty((bs, budget), dtype=torch.int32, device=device),
        node_rank=torch.empty((bs, budget), dtype=torch.int32, device=device),
        node_score=torch.empty((bs, budget), dtype=torch.float32, device=device),
        num_nodes=torch.empty((bs,), dtype=torch.int32, device=device),
    )

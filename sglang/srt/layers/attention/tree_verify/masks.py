# SPDX-License-Identifier: Apache-2.0
"""Packed ancestor bitmasks for tree verify.

A tree of ``N`` nodes (root first, parents before children) is described per
request by ``mask[i, j // 32] >> (j % 32) & 1``: node ``i`` sees node ``j``.
That is ``ceil(N / 32)`` int32 words per node instead of a dense
``N x (prefix + N)`` byte mask, and the committed prefix needs no mask at all
because every node sees all of it.
"""

from __future__ import annotations

import torch

#: The largest DDTREE budget (draft nodes besides the root) anything in the project accepts.
MAX_BUDGET = 256
#: Nodes of the largest tree: the budget and the root.
MAX_TREE_SIZE = MAX_BUDGET + 1


def mask_words(num_nodes: int) -> int:
    """int32 words per node row."""
    return (num_nodes + 31) // 32


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """``bool [..., N]`` -> ``int32 [..., ceil(N/32)]``: bit ``j % 32`` of word
    ``j // 32`` is flag j (the mask layout, one row)."""
    n = flags.shape[-1]
    words = mask_words(n)
    pad = words * 32 - n
    if pad:
        flags = torch.nn.functional.pad(flags, (0, pad))
    weights = torch.ones(32, dtype=torch.int64, device=flags.device) << torch.arange(
        32, dtype=torch.int64, device=flags.device
    )
    packed = (flags.view(*flags.shape[:-1], words, 32).to(torch.int64) * weights).sum(-1)
    # Reinterpret the low 32 bits as a signed int32 (bit 31 set => negative).
    return torch.where(packed >= (1 << 31), packed - (1 << 32), packed).to(torch.int32)


def pack_tree_mask(dense: torch.Tensor) -> torch.Tensor:
    """Pack a boolean ``[bs, N, N]`` visibility matrix into ``[bs, N, W]`` int32."""
    if dense.dim() != 3 or dense.shape[1] != dense.shape[2]:
        raise ValueError(f"expected a [bs, N, N] mask, got {tuple(dense.shape)}")
    return pack_bits(dense)


def unpack_tree_mask(bits: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., W]`` int32 -> bool ``[..., N]``
    (a ``[bs, N, W]`` mask -> its ``[bs, N, N]`` visibility matrix)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :num_nodes]


def causal_tree_mask(bs: int, num_nodes: int, device="cpu") -> torch.Tensor:
    """The chain as a tree: node ``i`` sees nodes ``0..i`` (DFlash chain verify)."""
    _check_size(num_nodes)
    dense = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device).tril()
    return pack_tree_mask(dense.expand(bs, num_nodes, num_nodes))


def full_tree_mask(bs: int, num_nodes: int, device="cpu") -> torch.Tensor:
    """Every node sees every node: the DFlash drafter's non-causal block."""
    _check_size(num_nodes)
    dense = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device)
    return pack_tree_mask(dense.expand(bs, num_nodes, num_nodes))


def tree_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor bitmask from parent indices ``[bs, N]`` (root's parent is -1).

    Parents must precede their children (``parents[:, i] < i``), which is the
    order DDTree's best-first selection produces.
    """
    if parents.dim() != 2:
        raise ValueError(f"expected parents of shape [bs, N], got {tuple(parents.shape)}")
    bs, n = parents.shape
    _check_size(n)
    idx = torch.arange(n, device=parents.device)
    if bool((parents[:, 1:] >= idx[1:]).any()) or bool((parents[:, 1:] < 0).any()):
        raise ValueError("every non-root node needs a parent with a smaller index")
    dense = torch.zeros(bs, n, n, dtype=torch.bool, device=parents.device)
    dense[:, idx, idx] = True
    for i in range(1, n):
        p = parents[:, i].long()
        dense[:, i] |= dense[torch.arange(bs, device=parents.device), p]
    return pack_tree_mask(dense)


def _check_size(num_nodes: int) -> None:
    if not 1 <= num_nodes <= MAX_TREE_SIZE:
        raise ValueError(
            f"tree size must be in [1, {MAX_TREE_SIZE}] (root + budget), got {num_nodes}"
        )

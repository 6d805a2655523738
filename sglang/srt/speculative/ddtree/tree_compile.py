# SPDX-License-Identifier: Apache-2.0
"""Compile a DDTree into what the verify forward and acceptance consume.

Node i of a request's tree (N = B + 1 nodes, node 0 = root = bonus token):

- ``tokens[i]``     the token fed to the target
- ``positions[i]``  ``committed_len + depth[i]``: siblings share a position, so
  RoPE sees every root-to-leaf path as an ordinary sequence
- ``tree_mask[i]``  ancestor bitmask, ``int32 [N, ceil(N/32)]``: bit ``j % 32``
  of word ``j // 32`` is set iff node j is node i or one of its ancestors (the
  committed prefix is visible to every node and is not in the mask)
- ``retrive_*``     the linked-list layout of sglang-kernel's tree verify ops:
  ``retrive_index = b * N + i`` (row into flattened target outputs),
  ``retrive_next_token`` = first child, ``retrive_next_sibling`` = next child
  of the same parent in index order, -1 for none (int64, as the ops require)

On the GPU this is one Triton launch (a program per request and block of 32
nodes); a batched-torch version with the same contract serves CPUs and tests.
Static shapes, no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.masks import mask_words, pack_bits
from sglang.srt.speculative.ddtree.draft_tree import DraftTree
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted as _interpreted


@dataclass
class CompiledTree:
    tokens: torch.Tensor  # [bs, N] int64
    positions: torch.Tensor  # [bs, N] int64
    depth: torch.Tensor  # [bs, N] int32, root 0 (padding 0)
    parent: torch.Tensor  # [bs, N] int64, root -1 (padding -1)
    tree_mask: torch.Tensor  # [bs, N, ceil(N/32)] int32 ancestor bitmask
    retrive_index: torch.Tensor  # [bs, N] int64
    retrive_next_token: torch.Tensor  # [bs, N] int64
    retrive_next_sibling: torch.Tensor  # [bs, N] int64
    max_depth: int  # static bound on any node's depth; acceptance width = max_depth + 1
    #: ``[bs, N]`` int64 KV slots of the tree's window ``req_to_token[req, P : P + N]``
    #: (``step_io.tree_cache_locs``); only when ``compile_tree`` got ``req_to_token``.
    cache_loc: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


def max_tree_depth(budget: int, num_depths: int) -> int:
    """Deepest node a tree of ``budget`` nodes over ``num_depths`` depths can have."""
    return min(budget, num_depths)


def compile_tree(
    tree: DraftTree,
    bonus: torch.Tensor,
    committed_len: torch.Tensor,
    max_depth: int,
    *,
    req_to_token: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
    use_triton: Optional[bool] = None,
) -> CompiledTree:
    """Tokens, positions, ancestor bitmask and ``retrive_*`` links for a batch.

    ``bonus`` ``[bs]`` is the root token, ``committed_len`` ``[bs]`` the number
    of tokens whose KV is already committed (the root's position).
    ``max_depth`` (use ``max_tree_depth``) bounds the ancestor walk. With
    ``req_to_token`` and ``req_pool_indices`` ``[bs]`` the tree window's KV
    slots are read too (``CompiledTree.cache_loc``), so the step needs no
    separate gather.
    One Triton launch on CUDA (or under ``TRITON_INTERPRET=1``), batched torch
    ops otherwise; ``use_triton`` forces a choice.
    """
    bs, budget = tree.node_token.shape
    device = tree.node_token.device
    if bonus.shape != (bs,) or committed_len.shape != (bs,):
        raise ValueError(
            f"bonus and committed_len must be [bs={bs}], got "
            f"{tuple(bonus.shape)} and {tuple(committed_len.shape)}"
        )
    if not 1 <= max_depth <= budget:
        raise ValueError(f"max_depth must be in 1..{budget}, got {max_depth}")
    if (req_to_token is None) != (req_pool_indices is None) or (
        req_pool_indices is not None and req_pool_indices.shape != (bs,)
    ):
        raise ValueError(
            f"req_to_token and req_pool_indices [bs={bs}] go together, got "
            f"{None if req_to_token is None else tuple(req_to_token.shape)} and "
            f"{None if req_pool_indices is None else tuple(req_pool_indices.shape)}"
        )
    window = None if req_to_token is None else (req_to_token, req_pool_indices)
    runnable = device.type == "cuda" or _interpreted()
    if use_triton and not runnable:
        raise RuntimeError(
            "the DDTree compile kernel needs CUDA tensors or TRITON_INTERPRET=1 "
            f"set before import; got tensors on {device}"
        )
    if bs > 0 and (runnable if use_triton is None else use_triton):
        return _compile_triton(tree, bonus, committed_len, max_depth, window)
    return _compile_torch(tree, bonus, committed_len, max_depth, window)


def _compile_torch(tree, bonus, committed_len, max_depth, window=None) -> CompiledTree:
    bs, budget = tree.node_token.shape
    n = budget + 1
    device = tree.node_token.device
    tokens = torch.cat([bonus.view(bs, 1).to(torch.int64), tree.node_token.to(torch.int64)], dim=1)
    parent = torch.cat(
        [torch.full((bs, 1), -1, dtype=torch.int64, device=device), tree.node_parent.to(torch.int64)],
        dim=1,
    )
    depth = torch.cat(
        [torch.zeros((bs, 1), dtype=torch.int32, device=device), tree.node_depth.to(torch.int32)],
        dim=1,
    )
    positions = committed_len.view(bs, 1).to(torch.int64) + depth.to(torch.int64)

    tree_mask = ancestor_bitmask(parent, max_depth)
    next_token, next_sibling = child_links(parent)
    retrive_index = row_offsets(bs, n, device) + torch.arange(n, device=device)
    cache_loc = None
    if window is not None:
        req_to_token, req_pool_indices = window
        cols = committed_len.view(bs, 1).to(torch.int64) + torch.arange(n, device=device)
        cache_loc = req_to_token[req_pool_indices.to(torch.int64).unsqueeze(1), cols].to(torch.int64)
    return CompiledTree(
        tokens=tokens,
        positions=positions,
        depth=depth,
        parent=parent,
        tree_mask=tree_mask,
        retrive_index=retrive_index,
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        max_depth=max_depth,
        cache_loc=cache_loc,
    )


def _compile_triton(tree, bonus, committed_len, max_depth, window=None) -> CompiledTree:
    bs, budget = tree.node_token.shape
    n = budget + 1
    words = mask_words(n)
    device = tree.node_token.device

    def new(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)

    out = CompiledTree(
        tokens=new(bs, n),
        positions=new(bs, n),
        depth=new(bs, n, dtype=torch.int32),
        parent=new(bs, n),
        tree_mask=new(bs, n, words, dtype=torch.int32),
        retrive_index=new(bs, n),
        retrive_next_token=new(bs, n),
        retrive_next_sibling=new(bs, n),
        max_depth=max_depth,
        cache_loc=None if window is None else new(bs, n),
    )
    node_token = tree.node_token.contiguous()
    node_parent = tree.node_parent.contiguous()
    node_depth = tree.node_depth.contiguous()
    block_i = 32
    grid = (bs, triton.cdiv(n, block_i))
    _ddtree_compile_kernel[grid](
        node_token,
        node_parent,
        node_depth,
        bonus.contiguous(),
        committed_len.contiguous(),
        out.tokens,
        out.positions,
        out.depth,
        out.parent,
        out.tree_mask,
        out.retrive_index,
        out.retrive_next_token,
        out.retrive_next_sibling,
        # Without a window: same-typed stand-ins that the kernel never touches.
        out.depth if window is None else window[0],
        committed_len if window is None else window[1],
        out.positions if window is None else out.cache_loc,
        0 if window is None else window[0].stride(0),
        int(window is not None),
        budget,
        max_depth,
        BLOCK_I=block_i,
        BLOCK_J=64,
        WORDS=words,
        WORDS_PAD=triton.next_power_of_2(words),
        num_warps=4,
    )
    return out


def ancestor_bitmask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``int32 [bs, N, W]`` self-or-ancestor bits from parent pointers.

    Pointer doubling on the packed rows: after step k a row holds every
    ancestor within 2^k hops, so ``ceil(log2(max_depth + 1))`` steps cover the
    deepest node. The root points at itself; padding (parent -1) at the root.
    """
    bs, n = parent.shape
    words = mask_words(n)
    jump = parent.clamp(min=0)
    rows = _self_bits(n, parent.device).expand(bs, n, words)
    steps = max(1, (max_depth).bit_length())  # 2**steps > max_depth
    for _ in range(steps):
        rows = rows | torch.gather(rows, 1, jump.unsqueeze(-1).expand(bs, n, words))
        jump = torch.gather(jump, 1, jump)
    return rows.contiguous()


def child_links(parent: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """First child and next sibling (index order) from parent pointers.

    A stable sort by parent groups each node's children in index order; the
    first of a group is the parent's first child, each next entry of the same
    group is the next sibling. Root and padding (parent -1) get no links.
    """
    bs, n = parent.shape
    device = parent.device
    idx = torch.arange(n, device=device).expand(bs, n)
    order = torch.sort(parent, dim=1, stable=True).indices
    sorted_parent = torch.gather(parent, 1, order)
    nxt_parent = torch.cat([sorted_parent[:, 1:], torch.full((bs, 1), -2, device=device, dtype=parent.dtype)], 1)
    nxt_idx = torch.cat([order[:, 1:], torch.full((bs, 1), -1, device=device, dtype=order.dtype)], 1)
    sib_sorted = torch.where((nxt_parent == sorted_parent) & (sorted_parent >= 0), nxt_idx, -1)
    next_sibling = torch.empty_like(sib_sorted).scatter_(1, order, sib_sorted)

    # First child: the smallest child index, scattered into the parent's row.
    # Nodes without a parent write into a spare column that is dropped.
    target = torch.where(parent >= 0, parent, n)
    first = torch.full((bs, n + 1), n, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, target, idx.to(torch.int64), reduce="amin", include_self=True)
    first = first[:, :n]
    next_token = torch.where(first < n, first, -1)
    return next_token, next_sibling


_SELF_BITS: Dict[Tuple[int, str], torch.Tensor] = {}


def _self_bits(n: int, device: torch.device) -> torch.Tensor:
    """``int32 [1, N, W]`` with only bit i of row i set (cached per device)."""
    key = (n, str(device))
    cached = _SELF_BITS.get(key)
    if cached is None:
        eye = torch.eye(n, dtype=torch.bool, device=device)
        cached = pack_bits(eye).unsqueeze(0)
        _SELF_BITS[key] = cached
    return cached


def row_offsets(bs: int, n: int, device) -> torch.Tensor:
    """``int64 [bs, 1]``: the first row of each request in a flattened ``[bs * N]``."""
    return (torch.arange(bs, device=device, dtype=torch.int64) * n).unsqueeze(1)


@triton.jit
def _ddtree_compile_kernel(
    node_token_ptr,  # [bs, B]
    node_parent_ptr,  # [bs, B] int32, -1 = padding
    node_depth_ptr,  # [bs, B] int32
    bonus_ptr,  # [bs]
    committed_ptr,  # [bs]
    tokens_ptr,  # [bs, N] int64
    positions_ptr,  # [bs, N] int64
    depth_ptr,  # [bs, N] int32
    parent_ptr,  # [bs, N] int64
    mask_ptr,  # [bs, N, WORDS] int32
    retrive_index_ptr,  # [bs, N] int64
    next_token_ptr,  # [bs, N] int64
    next_sibling_ptr,  # [bs, N] int64
    req_to_token_ptr,  # with_cache_loc: [pool, context]
    req_pool_indices_ptr,  # with_cache_loc: [bs]
    cache_loc_ptr,  # with_cache_loc: out [bs, N] int64
    stride_r2t,
    with_cache_loc,
    budget,
    max_depth,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    WORDS: tl.constexpr,
    WORDS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = budget + 1
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_tree = i < n
    is_node = in_tree & (i > 0)
    nodes = b * budget  # row offset into the [bs, B] inputs (node i is column i - 1)

    parent = tl.load(node_parent_ptr + nodes + i - 1, mask=is_node, other=-1).to(tl.int64)
    depth = tl.load(node_depth_ptr + nodes + i - 1, mask=is_node, other=0).to(tl.int32)
    token = tl.load(node_token_ptr + nodes + i - 1, mask=is_node, other=0).to(tl.int64)
    bonus = tl.load(bonus_ptr + b).to(tl.int64)
    token = tl.where(i == 0, bonus, token)
    committed = tl.load(committed_ptr + b).to(tl.int64)

    row = b * n + i
    tl.store(tokens_ptr + row, token, mask=in_tree)
    tl.store(positions_ptr + row, committed + depth.to(tl.int64), mask=in_tree)
    tl.store(depth_ptr + row, depth, mask=in_tree)
    tl.store(parent_ptr + row, parent, mask=in_tree)
    tl.store(retrive_index_ptr + row, row, mask=in_tree)
    if with_cache_loc != 0:
        # The tree's KV window req_to_token[req, P : P + N], node order.
        pool_row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
        slot = tl.load(req_to_token_ptr + pool_row * stride_r2t + committed + i, mask=in_tree, other=0)
        tl.store(cache_loc_ptr + row, slot.to(tl.int64), mask=in_tree)

    # Ancestor bits: walk each node's parent chain (padding hops to the root).
    w = tl.arange(0, WORDS_PAD)
    bits = tl.zeros([BLOCK_I, WORDS_PAD], dtype=tl.int32)
    j = i
    active = in_tree
    for _ in range(max_depth + 1):
        hit = active[:, None] & (w[None, :] == (j // 32)[:, None])
        bit = (tl.full([BLOCK_I], 1, tl.int32) << (j % 32).to(tl.int32))[:, None]
        bits = tl.where(hit, bits | bit, bits)
        up = tl.load(node_parent_ptr + nodes + j - 1, mask=active & (j > 0), other=0)
        active = active & (j > 0)
        j = tl.where(up < 0, 0, up).to(j.dtype)
    mask_off = row[:, None] * WORDS + w[None, :]
    tl.store(mask_ptr + mask_off, bits, mask=in_tree[:, None] & (w[None, :] < WORDS))

    # First child: smallest j with parent[j] == i. Next sibling: smallest
    # j > i with parent[j] == parent[i]. Scanned in blocks of candidates j.
    none = 2147483647
    first = tl.full([BLOCK_I], none, tl.int32)
    sibling = tl.full([BLOCK_I], none, tl.int32)
    has_parent = parent >= 0
    for start in range(1, n, BLOCK_J):
        jj = start + tl.arange(0, BLOCK_J)
        pj = tl.load(node_parent_ptr + nodes + jj - 1, mask=jj < n, other=-1).to(tl.int64)
        jj32 = jj.to(tl.int32)
        child = pj[None, :] == i[:, None].to(tl.int64)
        first = tl.minimum(first, tl.min(tl.where(child, jj32[None, :], none), axis=1))
        sib = (pj[None, :] == parent[:, None]) & (jj[None, :] > i[:, None]) & has_parent[:, None]
        sibling = tl.minimum(sibling, tl.min(tl.where(sib, jj32[None, :], none), axis=1))
    tl.store(next_token_ptr + row, tl.where(first == none, -1, first).to(tl.int64), mask=in_tree)
    tl.store(next_sibling_ptr + row, tl.where(sibling == none, -1, sibling).to(tl.int64), mask=in_tree)

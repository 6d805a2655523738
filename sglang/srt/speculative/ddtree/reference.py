# SPDX-License-Identifier: Apache-2.0
"""Plain-Python references for the DDTree algorithm core.

Slow and obvious on purpose: loops, a ``heapq`` and explicit parent walks.
The vectorised/Triton implementations are tested against these. Scores are
accumulated in float32 (``numpy.float32``) with the same left-to-right order
as the kernel, so comparisons can be exact.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.speculative.ddtree.draft_tree import DraftTree


@dataclass
class RefNode:
    token: int
    parent: int  # 0 = root
    depth: int  # 1..L
    rank: int
    score: float  # float32 value


def _f32(x) -> np.float32:
    v = np.float32(x)
    return np.float32(-np.inf) if np.isnan(v) else v


def build_tree_ref(
    logprobs: Sequence[Sequence[float]],
    token_ids: Sequence[Sequence[int]],
    budget: int,
) -> List[RefNode]:
    """Best-first top-``budget`` prefixes of one request, with a heap.

    ``logprobs[d][r]`` is the log-prob of the rank-r token at depth d + 1.
    Ties: smaller depth, then smaller parent, then smaller rank pops first.
    """
    num_depths = len(logprobs)
    k = min(len(logprobs[0]), budget) if num_depths else 0
    lp = [[_f32(logprobs[d][r]) for r in range(k)] for d in range(num_depths)]
    nodes: List[RefNode] = []
    if num_depths == 0 or k == 0:
        return nodes
    # heap entries: (-score, depth, parent, rank, base = parent's score)
    heap = [(-lp[0][0], 1, 0, 0, np.float32(0.0))]
    while heap and len(nodes) < budget:
        neg, depth, parent, rank, base = heapq.heappop(heap)
        score = np.float32(-neg)
        nodes.append(RefNode(int(token_ids[depth - 1][rank]), parent, depth, rank, score))
        n = len(nodes)
        if rank + 1 < k:
            sib = np.float32(base + lp[depth - 1][rank + 1])
            heapq.heappush(heap, (-sib, depth, parent, rank + 1, base))
        if depth < num_depths:
            child = np.float32(score + lp[depth][0])
            heapq.heappush(heap, (-child, depth + 1, n, 0, score))
    return nodes


def build_tree_ref_batched(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int):
    """``build_tree_ref`` over a batch, packed as a ``DraftTree``."""
    lp_all = logprobs.detach().float().cpu().numpy()
    ids_all = token_ids.detach().cpu().tolist()
    trees = [build_tree_ref(lp_all[b], ids_all[b], budget) for b in range(logprobs.shape[0])]
    return pack_ref_trees(trees, budget, logprobs.device)


def pack_ref_trees(trees: Sequence[Sequence[RefNode]], budget: int, device) -> DraftTree:
    """One reference tree per request, packed as a padded ``DraftTree`` on ``device``."""
    bs = len(trees)
    token = torch.zeros((bs, budget), dtype=torch.int64)
    parent = torch.full((bs, budget), -1, dtype=torch.int32)
    depth = torch.zeros((bs, budget), dtype=torch.int32)
    rank = torch.zeros((bs, budget), dtype=torch.int32)
    score = torch.full((bs, budget), -math.inf, dtype=torch.float32)
    num = torch.zeros((bs,), dtype=torch.int32)
    for b, nodes in enumerate(trees):
        num[b] = len(nodes)
        for i, nd in enumerate(nodes):
            token[b, i], parent[b, i], depth[b, i] = nd.token, nd.parent, nd.depth
            rank[b, i], score[b, i] = nd.rank, float(nd.score)
    return DraftTree(
        node_token=token.to(device),
        node_parent=parent.to(device),
        node_depth=depth.to(device),
        node_rank=rank.to(device),
        node_score=score.to(device),
        num_nodes=num.to(device),
    )


def ancestors_ref(parent_full: Sequence[int], i: int) -> List[int]:
    """Node ``i`` and its ancestors up to the root (``parent_full[0] == -1``).

    A padded node (parent -1, i > 0) sees itself and the root.
    """
    out = [i]
    j = i
    while j != 0:
        j = parent_full[j]
        if j < 0:
            j = 0
        out.append(j)
    return out


def compile_tree_ref(
    node_token: Sequence[int],
    node_parent: Sequence[int],
    node_depth: Sequence[int],
    bonus: int,
    committed_len: int,
) -> dict:
    """One request's compiled tree with naive loops (N = B + 1 entries)."""
    n = len(node_token) + 1
    parent_full = [-1] + list(node_parent)
    depth_full = [0] + list(node_depth)
    words = (n + 31) // 32
    mask = [[0] * words for _ in range(n)]
    for i in range(n):
        for j in ancestors_ref(parent_full, i):
            mask[i][j // 32] |= 1 << (j % 32)
    mask = [[w - (1 << 32) if w >= (1 << 31) else w for w in row] for row in mask]
    first_child = [-1] * n
    next_sibling = [-1] * n
    for i in range(1, n):
        p = parent_full[i]
        if p < 0:
            continue
        if first_child[p] == -1:
            first_child[p] = i
        for j in range(i + 1, n):
            if parent_full[j] == p:
                next_sibling[i] = j
                break
    return dict(
        tokens=[bonus] + list(node_token),
        positions=[committed_len + d for d in depth_full],
        tree_mask=mask,
        first_child=first_child,
        next_sibling=next_sibling,
    )


def greedy_accept_ref(
    tokens: Sequence[int],
    parent_full: Sequence[int],
    target_predict: Sequence[int],
) -> Tuple[List[int], int]:
    """Walk from the root while the target's argmax is a child's token.

    Returns ``(accepted node indices from the root, next bonus token)``.
    """
    path = [0]
    cur = 0
    while True:
        want = target_predict[cur]
        nxt = next(
            (j for j in range(1, len(tokens)) if parent_full[j] == cur and tokens[j] == want),
            None,
        )
        if nxt is None:
            return path, int(want)
        path.append(nxt)
        cur = nxt


def kv_commit_ref(
    out_cache_loc: Sequence[int], path: Sequence[int]
) -> Tuple[List[int], List[int]]:
    """``(kept slots in path order, freed slots)`` for one request."""
    kept = [out_cache_loc[i] for i in path]
    freed = [s for i, s in enumerate(out_cache_loc) if i not in set(path)]
    return kept, freed

# SPDX-License-Identifier: Apache-2.0
"""DDTree from a DFlash 2 drafter's candidate selector: best-first over paths scored
by their transitions.

``tree_build`` scores a prefix by the sum of its tokens' per-depth marginal
log-probs, so a node's children are the same K candidates in the same order
whatever the node is. A DFlash 2 drafter's selector (``speculative/dflash2``)
gives, per block slot s, K candidates and K x K transition scores
``scores[s, p, c]`` (candidate c at slot s after candidate p at slot s - 1; after
the anchor at slot 0, where all K rows are equal). Read as a Markov chain over
the candidates, with transition distribution ``log_softmax(scores[s, p, :])``, a
path's score is its first candidate's log-prob plus the log-probs of the
transitions along it, the log-probability the selector's walk would take it;
the children of a node holding candidate p at slot s - 1 are slot s's K
candidates ordered by ``scores[s, p, :]``. The B best paths are found
best-first exactly as in ``tree_build``::

    frontier = {(depth 1, rank 0 of slot 0's row, parent root)}
    repeat B times:
        pop the best -> node n, holding candidate c of its slot
        push its next sibling (same parent, next rank in the parent's row)
        push its first child  (depth + 1, rank 0 of row c of the next slot)

Ranks are positions in a row sorted by descending log-prob, ties by candidate
index (a stable sort). Ties between frontier entries: smaller depth, then smaller
parent, then smaller rank (as ``tree_build``). NaN scores count as ``-inf``.

The output is ``tree_build``'s ``DraftTree`` (``tree_compile`` and everything
after it are unchanged); ``node_rank`` holds the node's candidate index in its
slot's top-K (candidates come sorted by the LM-head logit, so it is the token's
rank among its depth's top-K, as there) and ``node_score`` the path's log-prob.

``build_selector_tree`` runs one Triton program per request on CUDA tensors (or
under ``TRITON_INTERPRET=1``), with the frontier in registers, no host sync,
CUDA-graph capturable; ``build_selector_tree_ref`` is the plain-Python reference
(a heap that takes every child of a popped node at once) it is tested against.
"""

from __future__ import annotations

import heapq
import math
from typing import List, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.masks import MAX_BUDGET
from sglang.srt.speculative.ddtree.draft_tree import DraftTree
from sglang.srt.speculative.ddtree.reference import RefNode, pack_ref_trees
from sglang.srt.speculative.ddtree.tree_build import (
    _launch_config,
    copy_tree,
    output_tree,
    pop_best,
    store_tree,
    use_kernel,
)


def transition_logprobs(scores: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of every row of the selector's ``scores [bs, S, K, K]`` (float32)."""
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be [bs, S, K, K], got {tuple(scores.shape)}")
    return torch.log_softmax(scores.float(), dim=-1)


def sorted_rows(logprobs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row descending, ties by candidate index: ``(values float32, candidate
    index int32)``, both ``[bs, S, K, K]``. NaN sorts as ``-inf``."""
    lp = torch.nan_to_num(logprobs.float(), nan=-math.inf)
    values, order = torch.sort(lp, dim=-1, descending=True, stable=True)
    return values.contiguous(), order.to(torch.int32).contiguous()


def _check(candidate_ids: torch.Tensor, scores: torch.Tensor, budget: int) -> None:
    if not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"DDTree budget must be an int in 1..{MAX_BUDGET}, got {budget!r}")
    if candidate_ids.dim() != 3 or scores.dim() != 4:
        raise ValueError(
            f"candidate_ids must be [bs, S, K] and scores [bs, S, K, K]; got "
            f"{tuple(candidate_ids.shape)} and {tuple(scores.shape)}"
        )
    bs, slots, k = candidate_ids.shape
    if tuple(scores.shape) != (bs, slots, k, k) or slots < 1 or k < 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} do not match candidate_ids {tuple(candidate_ids.shape)}"
        )
    if candidate_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"candidate_ids must be int32 or int64, got {candidate_ids.dtype}")
    if candidate_ids.device != scores.device:
        raise ValueError(f"candidate_ids on {candidate_ids.device} but scores on {scores.device}")


def build_selector_tree(
    candidate_ids: torch.Tensor,
    scores: torch.Tensor,
    budget: int,
    *,
    out: Optional[DraftTree] = None,
    use_triton: Optional[bool] = None,
) -> DraftTree:
    """The ``budget`` best paths through the selector's lattice, for every request.

    ``candidate_ids [bs, S, K]`` and ``scores [bs, S, K, K]`` are what the DFlash 2
    drafter's ``selector_lattice`` returns for a drafted block (S = block - 1).
    ``out`` lets a caller reuse buffers (inside a captured CUDA graph).
    """
    _check(candidate_ids, scores, budget)
    bs, slots, k = candidate_ids.shape
    device = scores.device
    tree = output_tree(out, bs, budget, device)
    if bs == 0:
        return tree
    if not use_kernel(device, use_triton, "the selector tree kernel"):
        return copy_tree(tree, build_selector_tree_ref_batched(candidate_ids, scores, budget))

    values, order = sorted_rows(transition_logprobs(scores))
    ids = candidate_ids.contiguous()
    frontier, num_warps = _launch_config(budget)
    _selector_tree_kernel[(bs,)](
        values,
        order,
        ids,
        tree.node_token,
        tree.node_parent,
        tree.node_depth,
        tree.node_rank,
        tree.node_score,
        tree.num_nodes,
        tree.node_token.stride(0),
        slots,
        k,
        min(k, budget),
        budget,
        FRONTIER=frontier,
        num_warps=num_warps,
    )
    return tree


# ---------------------------------------------------------------- reference


def build_selector_tree_ref(
    candidate_ids: List[List[int]],
    logprobs: np.ndarray,
    budget: int,
) -> List[RefNode]:
    """One request's tree, plainly: its nodes in pop order, ``rank`` holding each
    node's candidate index. ``logprobs [S, K, K]`` are the transition log-probs.

    A heap of candidates keyed ``(-score, depth, parent, rank)``; popping a node
    pushes all its children (ranked within their row as ``sorted_rows`` does).
    Scores add in float32 in the kernel's order (parent's score + log-prob).
    """
    lp = np.asarray(logprobs, dtype=np.float32)
    lp = np.where(np.isnan(lp), np.float32(-np.inf), lp)
    slots, k, _ = lp.shape
    width = min(k, budget)

    def ranked(slot: int, row: int):
        # Stable: descending value, then ascending candidate index.
        order = sorted(range(k), key=lambda c: (-float(lp[slot, row, c]), c))
        return order[:width]

    nodes = []
    heap = []
    for rank, c in enumerate(ranked(0, 0)):
        heapq.heappush(heap, (-float(lp[0, 0, c]), 1, 0, rank, c, np.float32(lp[0, 0, c])))
    while heap and len(nodes) < budget:
        _, depth, parent, rank, c, score = heapq.heappop(heap)
        nodes.append(RefNode(int(candidate_ids[depth - 1][c]), parent, depth, c, score))
        n = len(nodes)
        if depth < slots and n < budget:
            for r, child in enumerate(ranked(depth, c)):
                s = np.float32(score + lp[depth, c, child])
                heapq.heappush(heap, (-float(s), depth + 1, n, r, child, s))
    return nodes


def build_selector_tree_ref_batched(candidate_ids: torch.Tensor, scores: torch.Tensor, budget: int) -> DraftTree:
    """``build_selector_tree_ref`` over a batch, packed as a ``DraftTree``."""
    lp_all = transition_logprobs(scores.detach().cpu()).numpy()
    ids_all = candidate_ids.detach().cpu().tolist()
    trees = [build_selector_tree_ref(ids, lp, budget) for ids, lp in zip(ids_all, lp_all)]
    return pack_ref_trees(trees, budget, candidate_ids.device)


# ------------------------------------------------------------------- kernel


@triton.jit
def _row_load(ptr, offset, mask, other):
    return tl.load(ptr + offset, mask=mask, other=other)


@triton.jit
def _selector_tree_kernel(
    lp_ptr,  # [bs, S, K, K] float32, each row descending
    order_ptr,  # [bs, S, K, K] int32, candidate index at each rank of the row
    ids_ptr,  # [bs, S, K] int32/int64 candidate tokens
    out_token_ptr,  # [bs, B] int64
    out_parent_ptr,  # [bs, B] int32
    out_depth_ptr,  # [bs, B] int32
    out_rank_ptr,  # [bs, B] int32 (candidate index)
    out_score_ptr,  # [bs, B] float32
    out_num_ptr,  # [bs] int32
    stride_out_b,
    slots,
    k,
    width,  # ranks that can be selected: min(K, B)
    budget,
    FRONTIER: tl.constexpr,
):
    # The frontier and the pop are tree_build's (``pop_best``, key = (depth,
    # parent, rank)). What differs is where a slot's row lives: a candidate's
    # children are row (its slot + 1, its candidate index), so each frontier slot
    # also carries its row's predecessor index and its own candidate index, and
    # prefetches its next sibling's and first child's log-probs.
    pid = tl.program_id(0)
    kk = k * k
    lp_req = lp_ptr + pid.to(tl.int64) * slots * kk
    order_req = order_ptr + pid.to(tl.int64) * slots * kk
    neg_inf = float("-inf")

    slot = tl.arange(0, FRONTIER)
    # The first candidate: rank 0 of slot 0's row 0.
    c0 = _row_load(order_req, 0, True, 0)
    first = _row_load(lp_req, 0, True, neg_inf)
    s_valid = slot == 0
    s_score = tl.where(slot == 0, first, neg_inf)
    s_base = tl.zeros([FRONTIER], dtype=tl.float32)
    s_depth = tl.full([FRONTIER], 1, tl.int32)
    s_parent = tl.zeros([FRONTIER], dtype=tl.int32)
    s_rank = tl.zeros([FRONTIER], dtype=tl.int32)
    s_row = tl.zeros([FRONTIER], dtype=tl.int32)  # predecessor candidate: the row in its slot
    s_cand = tl.where(slot == 0, c0, 0)
    s_sib_lp = tl.where(slot == 0, _row_load(lp_req, 1, width > 1, neg_inf), neg_inf)
    s_child_lp = tl.where(slot == 0, _row_load(lp_req, kk + c0 * k, slots > 1, neg_inf), neg_inf)

    n_depth = tl.zeros([FRONTIER], dtype=tl.int32)
    n_parent = tl.full([FRONTIER], -1, tl.int32)
    n_cand = tl.zeros([FRONTIER], dtype=tl.int32)
    n_score = tl.full([FRONTIER], float("-inf"), tl.float32)
    count = tl.full([], 0, tl.int32)

    key_depth = (budget + 1) * width
    for n in range(1, budget + 1):
        # Scores are sums of sorted_rows' log-probs, which are never NaN.
        key = (s_depth * (budget + 1) + s_parent) * width + s_rank
        found, kmin, best = pop_best(s_valid, s_score, key)
        d = kmin // key_depth
        p = (kmin % key_depth) // width
        r = kmin % width
        sel = s_valid & (key == kmin)
        base = tl.sum(tl.where(sel, s_base, 0.0), axis=0)
        row = tl.sum(tl.where(sel, s_row, 0), axis=0)
        cand = tl.sum(tl.where(sel, s_cand, 0), axis=0)
        sib_lp = tl.sum(tl.where(sel, s_sib_lp, 0.0), axis=0)
        child_lp = tl.sum(tl.where(sel, s_child_lp, 0.0), axis=0)

        rec = (slot == (n - 1)) & found
        n_depth = tl.where(rec, d, n_depth)
        n_parent = tl.where(rec, p, n_parent)
        n_cand = tl.where(rec, cand, n_cand)
        n_score = tl.where(rec, best, n_score)
        count += found.to(tl.int32)

        # The popped slot now holds the next sibling: rank r + 1 of the same row.
        row_off = ((d - 1) * k + row) * k
        has_sib = found & (r + 1 < width)
        sib_cand = _row_load(order_req, row_off + r + 1, has_sib, 0)
        s_valid = tl.where(sel, has_sib, s_valid)
        s_score = tl.where(sel, base + sib_lp, s_score)
        s_rank = tl.where(sel, r + 1, s_rank)
        s_cand = tl.where(sel, sib_cand, s_cand)
        s_sib_lp = tl.where(sel, _row_load(lp_req, row_off + r + 2, found & (r + 2 < width), neg_inf), s_sib_lp)
        s_child_lp = tl.where(
            sel, _row_load(lp_req, (d * k + sib_cand) * k, has_sib & (d < slots), neg_inf), s_child_lp
        )

        # Slot n receives the first child: rank 0 of row `cand` of the next slot.
        cs = slot == n
        has_child = found & (d < slots) & (n < budget)
        child_off = (d * k + cand) * k
        child_cand = _row_load(order_req, child_off, has_child, 0)
        s_valid = tl.where(cs, has_child, s_valid)
        s_score = tl.where(cs, best + child_lp, s_score)
        s_base = tl.where(cs, best, s_base)
        s_depth = tl.where(cs, d + 1, s_depth)
        s_parent = tl.where(cs, n, s_parent)
        s_rank = tl.where(cs, 0, s_rank)
        s_row = tl.where(cs, cand, s_row)
        s_cand = tl.where(cs, child_cand, s_cand)
        s_sib_lp = tl.where(cs, _row_load(lp_req, child_off + 1, has_child & (width > 1), neg_inf), s_sib_lp)
        s_child_lp = tl.where(
            cs, _row_load(lp_req, ((d + 1) * k + child_cand) * k, has_child & (d + 1 < slots), neg_inf), s_child_lp
        )

    real = n_parent >= 0
    in_budget = slot < budget
    ids_off = pid.to(tl.int64) * slots * k + (n_depth - 1) * k + n_cand
    tok = tl.load(ids_ptr + ids_off, mask=real & in_budget, other=0).to(tl.int64)
    store_tree(out_token_ptr, out_parent_ptr, out_depth_ptr, out_rank_ptr, out_score_ptr, out_num_ptr,
               pid, stride_out_b, slot, budget, tok, n_parent, n_depth, n_cand, n_score, count)  # fmt: skip

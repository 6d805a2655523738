# SPDX-License-Identifier: Apache-2.0
"""DDTree construction: best-first selection of the top-B draft prefixes.

The DFlash drafter gives, per request, L independent distributions (one per
depth). A prefix's score is the sum of its tokens' draft log-probs; the B
highest-scoring prefixes form a prefix-closed tree that maximises the expected
accepted length under the draft. They are found best-first:

    frontier = {(depth 1, rank 0, parent root)}
    repeat B times:
        pop the best candidate -> it becomes node n (n = 1, 2, ...)
        push its next sibling (same parent, rank + 1)
        push its first child  (depth + 1, rank 0, parent n)

Pop order numbers the nodes, so ``parent < child`` always holds; node 0 is the
root (the bonus token) and is not part of the output.

Tie-break (deterministic, shared with ``reference.build_tree_ref``): among equal
scores the candidate with the smaller depth wins, then the smaller parent
index, then the smaller rank. ``(depth, parent, rank)`` identifies a candidate
uniquely, so the order is total. NaN log-probs are treated as ``-inf``.

The Triton kernel runs one program per request, keeps the frontier in
registers and never leaves the device, so it is CUDA-graph capturable. Frontier
slots are assigned statically: slot 0 holds the first candidate, a popped slot
is reused by that node's next sibling and slot n receives node n's first child,
so B slots suffice and no compaction is needed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.masks import MAX_BUDGET
from sglang.srt.speculative.ddtree.draft_tree import FIELDS, DraftTree, empty_tree
from sglang.srt.speculative.ddtree.reference import build_tree_ref_batched



def draft_topk(
    draft_logits: torch.Tensor, budget: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-K (K = min(budget, vocab)) of the full-vocab log-softmax.

    ``draft_logits`` is ``[bs, L, V]``; returns ``(logprobs [bs, L, K] float32
    sorted descending, token_ids [bs, L, K] int64)``.
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits must be [bs, L, V], got shape {tuple(draft_logits.shape)}"
        )
    _check_budget(budget)
    k = min(budget, draft_logits.shape[-1])
    logprobs = torch.log_softmax(draft_logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return values, ids


def build_tree(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    *,
    out: Optional[DraftTree] = None,
    use_triton: Optional[bool] = None,
) -> DraftTree:
    """Select the top-``budget`` prefixes for every request of the batch.

    ``logprobs``/``token_ids`` are ``[bs, L, K]`` per-depth top-K candidates,
    log-probs sorted descending along K (``draft_topk`` produces them). Only the
    first ``min(K, budget)`` ranks can ever be selected. Runs the Triton kernel
    on CUDA tensors (or anywhere under ``TRITON_INTERPRET=1``) and the
    plain-Python reference otherwise (``use_triton`` forces a choice). ``out``
    lets a caller reuse buffers (e.g. inside a captured CUDA graph).
    """
    _check_inputs(logprobs, token_ids, budget)
    bs, num_depths, k = logprobs.shape
    k = min(k, budget)
    device = logprobs.device
    tree = output_tree(out, bs, budget, device)
    if bs == 0:
        return tree
    if not use_kernel(device, use_triton, "the DDTree build kernel"):
        return copy_tree(tree, build_tree_ref_batched(logprobs[..., :k], token_ids[..., :k], budget))

    lp = logprobs if logprobs.dtype == torch.float32 else logprobs.float()
    lp = lp.contiguous()
    ids = token_ids.contiguous()
    frontier, num_warps = _launch_config(budget)
    _ddtree_build_kernel[(bs,)](
        lp,
        ids,
        tree.node_token,
        tree.node_parent,
        tree.node_depth,
        tree.node_rank,
        tree.node_score,
        tree.num_nodes,
        lp.stride(0),
        lp.stride(1),
        ids.stride(0),
        ids.stride(1),
        tree.node_token.stride(0),
        num_depths,
        k,
        budget,
        FRONTIER=frontier,
        num_warps=num_warps,
    )
    return tree


def build_tree_from_logits(
    draft_logits: torch.Tensor, budget: int, *, out: Optional[DraftTree] = None
) -> DraftTree:
    """``draft_topk`` followed by ``build_tree``."""
    logprobs, token_ids = draft_topk(draft_logits, budget)
    return build_tree(logprobs, token_ids, budget, out=out)


def output_tree(out: Optional[DraftTree], bs: int, budget: int, device) -> DraftTree:
    """``out`` checked against the batch, or new buffers."""
    if out is not None:
        _check_out(out, bs, budget, device)
        return out
    return empty_tree(bs, budget, device)


def use_kernel(device, use_triton: Optional[bool], what: str) -> bool:
    """Whether a tree kernel runs (CUDA tensors, or anywhere under the interpreter) or
    the plain-Python reference does; ``use_triton`` forces the choice."""
    runnable = device.type == "cuda" or triton_interpreted()
    if use_triton and not runnable:
        raise RuntimeError(f"{what} needs CUDA tensors or TRITON_INTERPRET=1 set before import; got tensors on {device}")
    return runnable if use_triton is None else bool(use_triton)


def copy_tree(dst: DraftTree, src: DraftTree) -> DraftTree:
    for name in FIELDS:
        getattr(dst, name).copy_(getattr(src, name))
    return dst


def _check_out(out: DraftTree, bs: int, budget: int, device) -> None:
    reference = empty_tree(0, budget, device)
    for name in FIELDS:
        t, want = getattr(out, name), getattr(reference, name)
        shape = (bs, budget) if want.dim() == 2 else (bs,)
        if tuple(t.shape) != shape or t.dtype != want.dtype or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"out.{name} must be a contiguous {want.dtype} tensor of shape {shape} on {device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def _launch_config(budget: int) -> Tuple[int, int]:
    """Frontier width and warps. The loop is a chain of B dependent
    reductions, so one warp (shuffles only, no shared-memory round trips)
    is fastest while each thread holds a few slots."""
    frontier = max(16, triton.next_power_of_2(budget))
    return frontier, 1 if frontier <= 128 else 4


def triton_interpreted() -> bool:
    """Whether the build kernel was decorated under ``TRITON_INTERPRET=1``."""
    return type(_ddtree_build_kernel).__name__ == "InterpretedFunction"


def _check_budget(budget: int) -> None:
    if not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"DDTree budget must be an int in 1..{MAX_BUDGET}, got {budget!r}"
        )


def _check_inputs(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    _check_budget(budget)
    if logprobs.dim() != 3 or token_ids.shape != logprobs.shape:
        raise ValueError(
            "logprobs and token_ids must both be [bs, L, K]; got "
            f"{tuple(logprobs.shape)} and {tuple(token_ids.shape)}"
        )
    if logprobs.shape[1] < 1 or logprobs.shape[2] < 1:
        raise ValueError(
            f"need at least one depth and one candidate, got {tuple(logprobs.shape)}"
        )
    if not logprobs.is_floating_point():
        raise TypeError(f"logprobs must be floating point, got {logprobs.dtype}")
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_ids must be int32 or int64, got {token_ids.dtype}")
    if token_ids.device != logprobs.device:
        raise ValueError(
            f"logprobs on {logprobs.device} but token_ids on {token_ids.device}"
        )


@triton.jit
def _load_lp(row_ptr, offset, mask):
    """One draft log-prob, ``-inf`` when masked off or NaN."""
    x = tl.load(row_ptr + offset, mask=mask, other=float("-inf"))
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def pop_best(valid, score, key):
    """The frontier's best entry: the highest score, equal scores by the smallest
    ``key``. One 64-bit max: the high word is the score mapped to an
    order-preserving int32, the low word ``INT32_MAX - key``. Returns
    ``(found, key, score)``."""
    no_key = 2147483647
    empty = -9223372036854775808
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 == +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    packed = (ordered.to(tl.int64) << 32) | (no_key - key).to(tl.int64)
    packed = tl.where(valid, packed, empty)
    top = tl.max(packed, axis=0)
    hi = (top >> 32).to(tl.int32)
    best = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    return top != empty, no_key - (top & 0xFFFFFFFF).to(tl.int32), best


@triton.jit
def store_tree(
    out_token_ptr, out_parent_ptr, out_depth_ptr, out_rank_ptr, out_score_ptr, out_num_ptr,
    pid, stride_out_b, slot, budget, token, parent, depth, rank, score, count,
):  # fmt: skip
    """One request's selected nodes (column n - 1 holds node n) and their count."""
    in_budget = slot < budget
    out = pid.to(tl.int64) * stride_out_b + slot
    tl.store(out_token_ptr + out, token, mask=in_budget)
    tl.store(out_parent_ptr + out, parent, mask=in_budget)
    tl.store(out_depth_ptr + out, depth, mask=in_budget)
    tl.store(out_rank_ptr + out, rank, mask=in_budget)
    tl.store(out_score_ptr + out, score, mask=in_budget)
    tl.store(out_num_ptr + pid, count)


@triton.jit
def _ddtree_build_kernel(
    lp_ptr,  # [bs, L, K] float32, descending along K
    ids_ptr,  # [bs, L, K] int32/int64
    out_token_ptr,  # [bs, B] int64
    out_parent_ptr,  # [bs, B] int32
    out_depth_ptr,  # [bs, B] int32
    out_rank_ptr,  # [bs, B] int32
    out_score_ptr,  # [bs, B] float32
    out_num_ptr,  # [bs] int32
    stride_lp_b,
    stride_lp_d,
    stride_ids_b,
    stride_ids_d,
    stride_out_b,
    num_depths,
    k,
    budget,
    FRONTIER: tl.constexpr,
):
    # One pop = one 64-bit max over the frontier (``pop_best``) with key =
    # (depth, parent, rank) flattened, so equal scores pick the smallest key.
    # Each slot also carries the log-probs its next sibling and first child will
    # need, loaded when the slot is filled, so the loads are off the pop-to-pop
    # critical path.
    pid = tl.program_id(0)
    lp_row = lp_ptr + pid.to(tl.int64) * stride_lp_b
    neg_inf = float("-inf")

    slot = tl.arange(0, FRONTIER)
    first = _load_lp(lp_row, 0, True)
    s_valid = slot == 0
    s_score = tl.where(slot == 0, first, neg_inf)
    s_base = tl.zeros([FRONTIER], dtype=tl.float32)  # the parent's score
    s_depth = tl.full([FRONTIER], 1, tl.int32)
    s_parent = tl.zeros([FRONTIER], dtype=tl.int32)
    s_rank = tl.zeros([FRONTIER], dtype=tl.int32)
    s_sib_lp = tl.where(slot == 0, _load_lp(lp_row, 1, k > 1), neg_inf)
    s_child_lp = tl.where(slot == 0, _load_lp(lp_row, stride_lp_d, num_depths > 1), neg_inf)

    # Selected nodes (column n - 1 holds node n).
    n_depth = tl.zeros([FRONTIER], dtype=tl.int32)
    n_parent = tl.full([FRONTIER], -1, tl.int32)
    n_rank = tl.zeros([FRONTIER], dtype=tl.int32)
    n_score = tl.full([FRONTIER], float("-inf"), tl.float32)
    count = tl.full([], 0, tl.int32)

    key_depth = (budget + 1) * k
    for n in range(1, budget + 1):
        key = (s_depth * (budget + 1) + s_parent) * k + s_rank
        found, kmin, best = pop_best(s_valid, s_score, key)
        d = kmin // key_depth
        p = (kmin % key_depth) // k
        r = kmin % k
        sel = s_valid & (key == kmin)
        base = tl.sum(tl.where(sel, s_base, 0.0), axis=0)
        sib_lp = tl.sum(tl.where(sel, s_sib_lp, 0.0), axis=0)
        child_lp = tl.sum(tl.where(sel, s_child_lp, 0.0), axis=0)

        rec = (slot == (n - 1)) & found
        n_depth = tl.where(rec, d, n_depth)
        n_parent = tl.where(rec, p, n_parent)
        n_rank = tl.where(rec, r, n_rank)
        n_score = tl.where(rec, best, n_score)
        count += found.to(tl.int32)

        # The popped slot now holds the next sibling (same parent, rank + 1).
        row = lp_row + (d - 1) * stride_lp_d
        s_valid = tl.where(sel, found & (r + 1 < k), s_valid)
        s_score = tl.where(sel, base + sib_lp, s_score)
        s_rank = tl.where(sel, r + 1, s_rank)
        s_sib_lp = tl.where(sel, _load_lp(row, r + 2, found & (r + 2 < k)), s_sib_lp)

        # Slot n receives the first child (depth + 1, rank 0, parent n).
        cs = slot == n
        s_valid = tl.where(cs, found & (d < num_depths) & (n < budget), s_valid)
        s_score = tl.where(cs, best + child_lp, s_score)
        s_base = tl.where(cs, best, s_base)
        s_depth = tl.where(cs, d + 1, s_depth)
        s_parent = tl.where(cs, n, s_parent)
        s_rank = tl.where(cs, 0, s_rank)
        s_sib_lp = tl.where(cs, _load_lp(row, stride_lp_d + 1, found & (d < num_depths) & (k > 1)), s_sib_lp)
        s_child_lp = tl.where(cs, _load_lp(row, 2 * stride_lp_d, found & (d + 1 < num_depths)), s_child_lp)

    real = n_parent >= 0
    in_budget = slot < budget
    ids_off = pid.to(tl.int64) * stride_ids_b + (n_depth - 1) * stride_ids_d + n_rank
    tok = tl.load(ids_ptr + ids_off, mask=real & in_budget, other=0).to(tl.int64)
    store_tree(out_token_ptr, out_parent_ptr, out_depth_ptr, out_rank_ptr, out_score_ptr, out_num_ptr,
               pid, stride_out_b, slot, budget, tok, n_parent, n_depth, n_rank, n_score, count)  # fmt: skip

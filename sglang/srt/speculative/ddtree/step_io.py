# SPDX-License-Identifier: Apache-2.0
"""A DDTree step's reads and writes of request state: the tree's window in
``req_to_token``, the tokens the scheduler emits, the drafter's context rows.

The tree's N tokens occupy ``req_to_token[req, P : P + N]`` (P = committed
length; the slots were reserved ahead of time by spec-v2 over-allocation).
After acceptance the kept path moves to the front of that window by permuting
the window's slots (``kv_slot_plan.plan_kv_remap``): the set of slots a request
owns never changes, so nothing leaks and nothing is double-freed, and the
dropped slots stay reserved as the next step's spare slots. page_size 1 only.

Everything here is batched torch with host-known shapes: no host sync.
``commit_accepted`` does a step's whole commit (the window permutation and write,
the emitted tokens, the drafter's context rows, the committed lengths) in one
Triton launch on a GPU; its plain torch reference is the composition of the
functions above it, which it must match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from sglang.srt.speculative.ddtree.accept import AcceptResult, KernelAccept
from sglang.srt.speculative.ddtree.kv_slot_plan import plan_kv_remap
from sglang.srt.speculative.ddtree.metrics import add_step_counts
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted
from sglang.srt.speculative.ddtree.tree_compile import row_offsets


_OFFSETS: Dict[Tuple[int, str], torch.Tensor] = {}


def _offsets(n: int, device: torch.device) -> torch.Tensor:
    """``int64 [n]`` 0..n-1, made once per width and device (read-only)."""
    key = (n, str(device))
    cached = _OFFSETS.get(key)
    if cached is None:
        cached = _OFFSETS[key] = torch.arange(n, device=device, dtype=torch.int64)
    return cached


def _window(prefix_lens: torch.Tensor, n: int) -> torch.Tensor:
    return prefix_lens.to(torch.int64).unsqueeze(1) + _offsets(n, prefix_lens.device)


def tree_cache_locs(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """``int64 [bs, N]`` KV slots the verify writes the tree tokens into."""
    rows = req_pool_indices.to(torch.int64).unsqueeze(1)
    return req_to_token[rows, _window(prefix_lens, num_tokens)].to(torch.int64)


def write_tree_window(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_cache_loc: torch.Tensor,
) -> None:
    """Store the permuted window (``KVCommit.new_cache_loc``) back in place."""
    rows = req_pool_indices.to(torch.int64).unsqueeze(1)
    cols = _window(prefix_lens, new_cache_loc.shape[1])
    req_to_token[rows, cols] = new_cache_loc.to(req_to_token.dtype)


def output_tokens(res: AcceptResult, num_tokens: int) -> torch.Tensor:
    """``int64 [bs, N]`` row-strided emitted tokens for the scheduler.

    Row b holds the accepted drafts then the new bonus in its first
    ``num_accepted + 1`` columns; the scheduler reads exactly that many
    (``accept_lens``) at stride N. The rest is 0 and never read.
    """
    bs, width = res.accept_tokens.shape
    out = torch.zeros((bs, num_tokens), dtype=torch.int64, device=res.accept_tokens.device)
    out[:, :width] = res.accept_tokens.clamp(min=0)
    return out


def draft_context_rows(
    res: AcceptResult,
    new_cache_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the drafter's context KV append needs for the kept path.

    Returns ``(rows [bs * (D + 1)], positions [bs * (D + 1)], cache_loc_2d
    [bs, D + 1], commit_lens [bs] int32)``: row (b, t) is the kept node at depth
    t, whose hidden state is ``verify_hidden[rows[b * (D + 1) + t]]`` (the
    target's captured ``[bs * N, H]``), placed at position ``P_b + t`` in slot
    ``new_cache_loc[b, t]``; only the first ``commit_lens[b]`` rows of a request
    are written (``set_kv_buffer_prefix_valid``).
    """
    bs, width = res.accept_index.shape
    n = new_cache_loc.shape[1]
    rows = res.accept_index.clamp(min=0).to(torch.int64) + row_offsets(bs, n, new_cache_loc.device)
    commit_lens = (res.num_accepted.to(torch.int32) + 1).contiguous()
    return (
        rows.reshape(-1),
        _window(prefix_lens, width).reshape(-1),
        new_cache_loc[:, :width].contiguous(),
        commit_lens,
    )


@dataclass
class StepCommit:
    """Everything a DDTree step commits after acceptance (``commit_accepted``)."""

    new_cache_loc: torch.Tensor  # int64 [bs, N], the permuted window (kept path first)
    output_tokens: torch.Tensor  # int64 [bs, N], see ``output_tokens``
    commit_lens: torch.Tensor  # int32 [bs] = num_accepted + 1
    new_seq_lens: torch.Tensor  # [bs] prefix_lens + commit_lens, prefix_lens' dtype
    ctx_rows: torch.Tensor  # int64 [bs * (D + 1)] rows of the flattened verify hidden states
    ctx_positions: torch.Tensor  # int64 [bs * (D + 1)]
    ctx_cache_loc: torch.Tensor  # int64 [bs, D + 1]
    accept: AcceptResult  # the acceptance committed (read back here from a ``KernelAccept``)


def commit_accepted(
    res: Union[AcceptResult, KernelAccept],
    cache_loc_2d: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    *,
    stats_counts: Optional[torch.Tensor] = None,
    tree_depth: Optional[torch.Tensor] = None,
    use_triton: Optional[bool] = None,
) -> StepCommit:
    """Commit an accepted path: permute the tree's KV window so the kept path
    comes first (``plan_kv_remap``), write it into ``req_to_token``
    (``write_tree_window``), and return the emitted tokens (``output_tokens``),
    the committed lengths and the drafter's context rows
    (``draft_context_rows``: its hidden states are ``verify_hidden[ctx_rows]``).

    ``res`` may be sglang-kernel's raw greedy outputs (``KernelAccept``): they
    are read back here, into ``StepCommit.accept``. With ``stats_counts`` (the
    step statistics' ``[3, budget + 1]`` counters) the step's accepted depths,
    tree depths (the max of ``tree_depth`` ``[bs, N]``) and path maxima are
    added to them (``metrics.add_step_counts``).

    One Triton launch on CUDA tensors (or under ``TRITON_INTERPRET=1``), the
    torch reference otherwise; ``use_triton`` forces a choice. No host sync.
    """
    bs, n = cache_loc_2d.shape
    raw = isinstance(res, KernelAccept)
    num_accepted = res.accept_num if raw else res.num_accepted
    width = res.accept_index.shape[1]
    if res.accept_index.shape[0] != bs or width > n or (not raw and res.accept_tokens.shape != (bs, width)):
        raise ValueError(
            f"accept_index / accept_tokens must be [bs={bs}, D+1 <= {n}], got "
            f"{tuple(res.accept_index.shape)}"
            + ("" if raw else f" / {tuple(res.accept_tokens.shape)}")
        )
    if prefix_lens.shape != (bs,) or req_pool_indices.shape != (bs,) or num_accepted.shape != (bs,):
        raise ValueError(
            f"prefix_lens, req_pool_indices and num_accepted must be [bs={bs}], got "
            f"{tuple(prefix_lens.shape)}, {tuple(req_pool_indices.shape)}, {tuple(num_accepted.shape)}"
        )
    if raw and res.predicts.shape != (bs * n,):
        raise ValueError(f"predicts must be [bs * N = {bs * n}], got {tuple(res.predicts.shape)}")
    if stats_counts is not None and (tree_depth is None or tree_depth.shape != (bs, n)):
        raise ValueError(
            f"stats_counts needs tree_depth [bs={bs}, N={n}], got "
            f"{None if tree_depth is None else tuple(tree_depth.shape)}"
        )
    runnable = cache_loc_2d.is_cuda or triton_interpreted()
    if use_triton and not runnable:
        raise RuntimeError(
            "the DDTree commit kernel needs CUDA tensors or TRITON_INTERPRET=1 set before import"
        )
    if bs == 0 or not (runnable if use_triton is None else use_triton):
        return commit_accepted_torch(
            res, cache_loc_2d, prefix_lens, req_to_token, req_pool_indices,
            stats_counts=stats_counts, tree_depth=tree_depth,
        )  # fmt: skip

    device = cache_loc_2d.device
    if raw:
        accept = AcceptResult(
            accept_index=torch.empty((bs, width), dtype=torch.int64, device=device),
            num_accepted=num_accepted,
            accept_tokens=torch.empty((bs, width), dtype=torch.int64, device=device),
            next_bonus=torch.empty((bs,), dtype=torch.int64, device=device),
        )
        tokens_in, predicts = res.accept_index, res.predicts  # tokens are read through the rows
    else:
        accept = res
        tokens_in, predicts = res.accept_tokens, res.accept_tokens  # predicts unused
    out = StepCommit(
        new_cache_loc=torch.empty((bs, n), dtype=torch.int64, device=device),
        output_tokens=torch.empty((bs, n), dtype=torch.int64, device=device),
        commit_lens=torch.empty((bs,), dtype=torch.int32, device=device),
        new_seq_lens=torch.empty((bs,), dtype=prefix_lens.dtype, device=device),
        ctx_rows=torch.empty((bs * width,), dtype=torch.int64, device=device),
        ctx_positions=torch.empty((bs * width,), dtype=torch.int64, device=device),
        ctx_cache_loc=torch.empty((bs, width), dtype=torch.int64, device=device),
        accept=accept,
    )
    record = stats_counts is not None
    _ddtree_commit_kernel[(bs,)](
        res.accept_index,
        num_accepted,
        tokens_in,
        predicts,
        cache_loc_2d,
        prefix_lens,
        req_pool_indices,
        req_to_token,
        # Not recording: same-typed stand-ins that the kernel never touches.
        tree_depth if record else out.commit_lens,
        stats_counts if record else out.new_cache_loc,
        out.new_cache_loc,
        out.output_tokens,
        out.commit_lens,
        out.new_seq_lens,
        out.ctx_rows,
        out.ctx_positions,
        out.ctx_cache_loc,
        accept.accept_index,
        accept.accept_tokens,
        accept.next_bonus,
        res.accept_index.stride(0),
        tokens_in.stride(0),
        cache_loc_2d.stride(0),
        req_to_token.stride(0),
        tree_depth.stride(0) if record else 0,
        stats_counts.stride(0) if record else 0,
        n,
        width,
        int(record),
        FROM_KERNEL=raw,
        BLOCK_N=triton.next_power_of_2(n),
        BLOCK_W=triton.next_power_of_2(width),
        num_warps=1 if n <= 64 else 4,
    )
    return out


def commit_accepted_torch(
    res: Union[AcceptResult, KernelAccept],
    cache_loc_2d: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    *,
    stats_counts: Optional[torch.Tensor] = None,
    tree_depth: Optional[torch.Tensor] = None,
) -> StepCommit:
    """Reference of ``commit_accepted``: the step's commit as separate torch ops."""
    bs, n = cache_loc_2d.shape
    if isinstance(res, KernelAccept):
        res = res.to_result(n)
    kv = plan_kv_remap(cache_loc_2d, res.accept_index, res.num_accepted)
    write_tree_window(req_to_token, req_pool_indices, prefix_lens, kv.new_cache_loc)
    rows, positions, ctx_cache_loc, commit_lens = draft_context_rows(res, kv.new_cache_loc, prefix_lens)
    if stats_counts is not None and bs > 0:
        add_step_counts(stats_counts, res.num_accepted, tree_depth, res.accept_index)
    return StepCommit(
        new_cache_loc=kv.new_cache_loc,
        output_tokens=output_tokens(res, n),
        commit_lens=commit_lens,
        new_seq_lens=prefix_lens + commit_lens.to(prefix_lens.dtype),
        ctx_rows=rows,
        ctx_positions=positions,
        ctx_cache_loc=ctx_cache_loc,
        accept=res,
    )


@triton.jit
def _ddtree_commit_kernel(
    accept_index_ptr,  # [bs, W] node of each depth on the path, -1 after it (FROM_KERNEL: flat row b * N + node, unread after it)
    num_accepted_ptr,  # [bs]
    accept_tokens_ptr,  # [bs, W] emitted tokens, -1 after the bonus (FROM_KERNEL: unused)
    predicts_ptr,  # FROM_KERNEL: [bs * N] emitted token at each accepted row
    cache_loc_ptr,  # [bs, N] the tree's KV slots, node order
    prefix_lens_ptr,  # [bs]
    req_pool_indices_ptr,  # [bs]
    req_to_token_ptr,  # [pool, context]
    depth_ptr,  # record_stats: [bs, N] node depths
    counts_ptr,  # record_stats: [3, budget + 1] int64 counters, added to (``metrics``)
    new_cache_loc_ptr,  # out [bs, N] int64
    output_tokens_ptr,  # out [bs, N] int64
    commit_lens_ptr,  # out [bs] int32
    new_seq_lens_ptr,  # out [bs]
    ctx_rows_ptr,  # out [bs, W] int64
    ctx_positions_ptr,  # out [bs, W] int64
    ctx_cache_loc_ptr,  # out [bs, W] int64
    out_accept_index_ptr,  # FROM_KERNEL out [bs, W] int64 nodes, -1 after the path
    out_accept_tokens_ptr,  # FROM_KERNEL out [bs, W] int64, -1 after the bonus
    out_next_bonus_ptr,  # FROM_KERNEL out [bs] int64
    stride_accept,
    stride_tokens,
    stride_loc,
    stride_r2t,
    stride_depth,
    stride_counts,
    n,
    width,
    record_stats,
    FROM_KERNEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # One program per request. A node's rank in the permuted window is its
    # depth if it is on the path, else num_kept + (dropped nodes before it).
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    in_tree = i < n
    w = tl.arange(0, BLOCK_W)
    in_path_width = w < width

    prefix = tl.load(prefix_lens_ptr + b)
    num_acc = tl.load(num_accepted_ptr + b)
    num_kept = num_acc.to(tl.int64) + 1
    pool_row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    if FROM_KERNEL:
        # sglang-kernel's rows are b * N + node in columns 0..num_accepted (the
        # columns after it are not written); the emitted tokens sit at those rows of predicts.
        on_path_w = in_path_width & (w <= num_acc)
        path = tl.load(accept_index_ptr + b * stride_accept + w, mask=on_path_w, other=-1).to(tl.int64)
        on_path_i = (i < width) & (i <= num_acc)
        row_i = tl.load(accept_index_ptr + b * stride_accept + i, mask=on_path_i, other=-1).to(tl.int64)
        tokens = tl.load(predicts_ptr + tl.maximum(row_i, 0), mask=row_i >= 0, other=-1).to(tl.int64)
        path_tokens = tl.load(predicts_ptr + tl.maximum(path, 0), mask=path >= 0, other=-1).to(tl.int64)
        path = tl.where(path >= 0, path - b * n, -1)
        out_w = b * width + w
        tl.store(out_accept_index_ptr + out_w, path, mask=in_path_width)
        tl.store(out_accept_tokens_ptr + out_w, path_tokens, mask=in_path_width)
        bonus = tl.sum(tl.where(w.to(tl.int64) == num_kept - 1, path_tokens, 0), axis=0)
        tl.store(out_next_bonus_ptr + b, bonus)
    else:
        path = tl.load(accept_index_ptr + b * stride_accept + w, mask=in_path_width, other=-1).to(tl.int64)
        tokens = tl.load(accept_tokens_ptr + b * stride_tokens + i, mask=i < width, other=0).to(tl.int64)

    on_depth = (path[None, :] == i[:, None].to(tl.int64)) & (path[None, :] >= 0)  # [BLOCK_N, BLOCK_W]
    on_path = tl.max(on_depth.to(tl.int32), axis=1) > 0
    depth = tl.sum(tl.where(on_depth, w[None, :], 0), axis=1).to(tl.int64)
    dropped = (in_tree & (on_path == 0)).to(tl.int32)
    rank = tl.where(on_path, depth, num_kept + tl.cumsum(dropped, axis=0).to(tl.int64) - 1)

    loc = tl.load(cache_loc_ptr + b * stride_loc + i, mask=in_tree, other=0).to(tl.int64)
    tl.store(new_cache_loc_ptr + b * n + rank, loc, mask=in_tree)
    window = req_to_token_ptr + pool_row * stride_r2t + prefix.to(tl.int64) + rank
    tl.store(window, loc.to(req_to_token_ptr.dtype.element_ty), mask=in_tree)

    tl.store(output_tokens_ptr + b * n + i, tl.maximum(tokens, 0), mask=in_tree)

    # The drafter's context: the first D + 1 entries of the permuted window.
    at_rank = (rank[:, None] == w[None, :].to(tl.int64)) & in_tree[:, None]
    ctx_loc = tl.sum(tl.where(at_rank, loc[:, None], 0), axis=0)
    out = b * width + w
    tl.store(ctx_cache_loc_ptr + out, ctx_loc, mask=in_path_width)
    tl.store(ctx_rows_ptr + out, b * n + tl.maximum(path, 0), mask=in_path_width)
    tl.store(ctx_positions_ptr + out, prefix.to(tl.int64) + w, mask=in_path_width)

    tl.store(commit_lens_ptr + b, num_kept.to(tl.int32))
    tl.store(new_seq_lens_ptr + b, (prefix + num_kept).to(new_seq_lens_ptr.dtype.element_ty))

    if record_stats != 0:
        # The step statistics' histograms: one count per request at its
        # accepted depth (row 0) and at its tree's depth (row 1).
        node_depth = tl.load(depth_ptr + b * stride_depth + i, mask=in_tree, other=0)
        tree_depth = tl.max(node_depth, axis=0).to(tl.int64)
        tl.atomic_add(counts_ptr + num_acc.to(tl.int64), 1)
        tl.atomic_add(counts_ptr + stride_counts + tree_depth, 1)
        # Row 2: one count per accepted depth at the largest node index on the
        # path down to it (nodes are numbered best-first, so a budget of b keeps
        # exactly nodes 1..b: that depth is accepted under every b >= it).
        w64 = w.to(tl.int64)
        accepted_w = (w64 >= 1) & (w64 <= num_acc.to(tl.int64)) & in_path_width
        upto = (w64[None, :] <= w64[:, None]) & (w64[None, :] >= 1) & in_path_width[None, :]
        path_max = tl.max(tl.where(upto, path[None, :], 0), axis=1)
        tl.atomic_add(counts_ptr + 2 * stride_counts + path_max, tl.full([BLOCK_W], 1, tl.int64), mask=accepted_w)

# SPDX-License-Identifier: Apache-2.0
"""Each verified node's logits as SGLang's sampler would adjust them for that node.

A verify forward scores every node of a draft tree (a DFLASH chain is a tree whose
node ``i`` has parent ``i - 1``) in one pass; the target token at a node is what the
server would have sampled had the node's root path been its output. The sampler
adjusts the logits first, in this order (``SamplingBatchInfo.apply_logits_bias``):

1. additive penalties: ``-frequency_penalty * count(t) - presence_penalty * [count(t) > 0]``
   and ``-inf`` on the stop tokens while fewer than ``min_new_tokens`` tokens are out;
2. the repetition penalty on every token seen: ``x * r`` for ``x < 0``, ``x / r`` otherwise;
3. (the grammar mask, applied by the caller);
4. the request's logit bias.

``count(t)`` and "tokens out" are over the output so far *at that node*: the committed
output before the root (the request's row of the penalty table), the root (the last
committed token) and the node's ancestors down to the node itself. Upstream's DFlash
verify used the step's committed state for every node alike; here each node's path
counts, so a token accepted at depth 1 penalises depth 2.

One Triton launch over ``[bs * N, V]`` (a program per row and vocabulary block, the
path walked by parent links, at most ``max_depth + 1`` steps); the torch reference
beside it is the plain per-node loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass
class NodePaths:
    """The tree every verified row belongs to: row ``b * N + i`` is node ``i`` of request ``b``."""

    tokens: torch.Tensor  # [bs, N] int64, node 0 = root (the last committed token)
    parent: torch.Tensor  # [bs, N] int64, -1 for the root (and padding nodes)
    depth: torch.Tensor  # [bs, N] int32, 0 for the root
    max_depth: int  # static bound on depth

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


_CHAIN_LINKS: dict = {}


def chain_paths(tokens: torch.Tensor) -> NodePaths:
    """A DFLASH block ``[bonus, d1 .. dL]`` as a tree: node ``i``'s parent is ``i - 1``."""
    bs, n = tokens.shape
    key = (n, tokens.device)
    links = _CHAIN_LINKS.get(key)
    if links is None:
        idx = torch.arange(n, device=tokens.device)
        links = (idx - 1, idx.to(torch.int32))
        _CHAIN_LINKS[key] = links
    parent, depth = links
    return NodePaths(tokens, parent.expand(bs, n), depth.expand(bs, n), n - 1)


@dataclass
class PenaltyRows:
    """The penalty table's tensors a step reads (``penalty_table.PenaltyTable``)."""

    rows: torch.Tensor  # [bs] int32: the request's table row, -1 = no penalties
    counts: torch.Tensor  # [R, V] int32 occurrences in the output before the root
    out_len: torch.Tensor  # [R] int32 output tokens before the root
    frequency: torch.Tensor  # [R] float32
    presence: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    min_new_tokens: torch.Tensor  # [R] int32
    stop_ids: torch.Tensor  # [R, S] int32 stop tokens, -1 padded


def apply_node_logit_adjustments(
    logits: torch.Tensor,
    paths: NodePaths,
    penalties: Optional[PenaltyRows],
    logit_bias: Optional[torch.Tensor],
    *,
    use_triton: Optional[bool] = None,
) -> None:
    """Apply penalties (per node) and the logit bias (per request) to ``logits`` in place.

    ``logits`` is ``[bs * N, V]`` float32; ``logit_bias`` ``[bs, V]`` or None.
    """
    if penalties is None and logit_bias is None:
        return
    bs, n = paths.tokens.shape
    if logits.dim() != 2 or logits.shape[0] != bs * n:
        raise ValueError(f"logits must be [bs*N={bs * n}, V], got {tuple(logits.shape)}")
    if use_triton is None:
        use_triton = logits.is_cuda or _interpreted()
    if use_triton:
        _adjust_triton(logits, paths, penalties, logit_bias)
    else:
        node_logit_adjustments_reference(logits, paths, penalties, logit_bias)


def node_logit_adjustments_reference(
    logits: torch.Tensor,
    paths: NodePaths,
    penalties: Optional[PenaltyRows],
    logit_bias: Optional[torch.Tensor],
) -> None:
    """The per-node loop: build each node's output counts, apply the sampler's formulas."""
    bs, n = paths.tokens.shape
    v = logits.shape[1]
    for b in range(bs):
        row = -1 if penalties is None else int(penalties.rows[b])
        for i in range(n):
            x = logits[b * n + i]
            if row >= 0:
                p = penalties
                counts = p.counts[row].to(torch.float32).clone()
                j = i
                while j >= 0:
                    counts[int(paths.tokens[b, j])] += 1
                    j = int(paths.parent[b, j])
                additive = -float(p.frequency[row]) * counts - float(p.presence[row]) * (counts > 0).float()
                out = int(p.out_len[row]) + 1 + int(paths.depth[b, i])
                if out < int(p.min_new_tokens[row]):
                    stops = [int(t) for t in p.stop_ids[row] if 0 <= int(t) < v]
                    additive[stops] = float("-inf")
                y = x + additive
                r = float(p.repetition[row])
                scaled = torch.where(y < 0, y * r, y / r)
                x.copy_(torch.where(counts > 0, scaled, y))
            if logit_bias is not None:
                x.add_(logit_bias[b].to(x.dtype))


def _interpreted() -> bool:
    return type(_node_logits_kernel).__name__ == "InterpretedFunction"


_BLOCK_V = 1024


def _adjust_triton(logits, paths, penalties, logit_bias) -> None:
    bs, n = paths.tokens.shape
    v = logits.shape[1]
    device = logits.device
    has_pen = penalties is not None
    has_bias = logit_bias is not None
    dummy_i = torch.empty((1,), dtype=torch.int32, device=device)
    dummy_f = torch.empty((1,), dtype=torch.float32, device=device)
    p = penalties
    block = min(_BLOCK_V, triton.next_power_of_2(v))
    grid = (bs * n, triton.cdiv(v, block))
    _node_logits_kernel[grid](
        logits,
        logits.stride(0),
        paths.tokens,
        paths.tokens.stride(0),
        paths.parent,
        paths.parent.stride(0),
        paths.depth,
        paths.depth.stride(0),
        p.rows if has_pen else dummy_i,
        p.counts if has_pen else dummy_i,
        p.counts.stride(0) if has_pen else 0,
        p.out_len if has_pen else dummy_i,
        p.frequency if has_pen else dummy_f,
        p.presence if has_pen else dummy_f,
        p.repetition if has_pen else dummy_f,
        p.min_new_tokens if has_pen else dummy_i,
        p.stop_ids if has_pen else dummy_i,
        p.stop_ids.stride(0) if has_pen else 0,
        p.stop_ids.shape[1] if has_pen else 0,
        logit_bias if has_bias else dummy_f,
        logit_bias.stride(0) if has_bias else 0,
        n,
        v,
        paths.max_depth,
        HAS_PENALTY=has_pen,
        HAS_BIAS=has_bias,
        BLOCK=block,
    )


@triton.jit
def _node_logits_kernel(
    logits_ptr,
    stride_logits,
    tokens_ptr,
    stride_tokens,
    parent_ptr,
    stride_parent,
    depth_ptr,
    stride_depth,
    rows_ptr,
    counts_ptr,
    stride_counts,
    out_len_ptr,
    freq_ptr,
    pres_ptr,
    rep_ptr,
    min_new_ptr,
    stop_ptr,
    stride_stop,
    num_stop,
    bias_ptr,
    stride_bias,
    n,
    v,
    max_depth,
    HAS_PENALTY: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    b = r // n
    i = r % n
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < v
    prow = -1
    if HAS_PENALTY:
        prow = tl.load(rows_ptr + b)
    if HAS_BIAS or prow >= 0:
        ptrs = logits_ptr + r.to(tl.int64) * stride_logits + offs
        x = tl.load(ptrs, mask=m, other=0.0)
        if HAS_PENALTY:
            if prow >= 0:
                crow = prow.to(tl.int64)
                cnt = tl.load(counts_ptr + crow * stride_counts + offs, mask=m, other=0)
                # The node's root path: itself, its ancestors, the root.
                j = i.to(tl.int64)
                for _ in range(max_depth + 1):
                    live = j >= 0
                    jj = tl.where(live, j, 0)
                    t = tl.load(tokens_ptr + b * stride_tokens + jj)
                    cnt += ((offs == t) & live).to(tl.int32)
                    j = tl.where(live, tl.load(parent_ptr + b * stride_parent + jj), -1)
                seen = cnt > 0
                freq = tl.load(freq_ptr + prow)
                pres = tl.load(pres_ptr + prow)
                additive = -freq * cnt.to(tl.float32) - tl.where(seen, pres, 0.0)
                out = tl.load(out_len_ptr + prow) + 1 + tl.load(depth_ptr + b * stride_depth + i)
                if out < tl.load(min_new_ptr + prow):
                    for s in range(num_stop):
                        stop = tl.load(stop_ptr + crow * stride_stop + s)
                        additive = tl.where(offs == stop, float("-inf"), additive)
                x = x + additive
                rep = tl.load(rep_ptr + prow)
                x = tl.where(seen, tl.where(x < 0, x * rep, x / rep), x)
        if HAS_BIAS:
            x += tl.load(bias_ptr + b.to(tl.int64) * stride_bias + offs, mask=m, other=0.0)
        tl.store(ptrs, x, mask=m)

# SPDX-License-Identifier: Apache-2.0
"""FlashMLA prefix pass + our masked tree tail, merged in the tail's epilogue (sm_90 / sm_100).

FlashMLA runs the prefix of a wide tree at several times our Triton tile's rate on
Hopper (measurements in docs/tree-verify.md), but it reads the KV cache in 64-token pages through a block table, and tree verify gets
page_size-1 slot indices. So the pass first copies each request's prefix rows into
page-contiguous staging: one read and one write of the prefix, a small cost next to
the attention once the tree is wide. The requests' pages follow each other in the
staging (a device-side prefix sum), so it needs one page per 64 prefix tokens plus one
per request, at most one KV layer's worth. Everything runs on the GPU from device
tensors; with a host bound on the prefix length and a preallocated staging buffer the
whole call replays in a CUDA graph with no host work per step.

Two things take FlashMLA's split-KV combine and our tail's latency off a lone request's
critical path (``benchmarks/flashmla_split_parts.py`` times each part):

- **KV chunks as requests.** FlashMLA cuts the keys of a lone wide request into
  splits over its SM parts and merges them in a second kernel. Handing it the
  prefix as equal requests of whole pages, one per SM part (``kv_chunks``), gives
  its scheduler nothing to split: its combine launch returns at once, and our
  merge weighs the chunks by their LSEs instead.
- **The tail beside FlashMLA.** The tree tail does not depend on the prefix pass,
  and FlashMLA leaves SMs idle at batch 1 (one CTA per 64 query rows and SM
  part), so the tail runs on a side stream while FlashMLA runs; one small merge
  kernel then combines the chunks and the tail. Captured graphs keep the fork and
  the join. A batch keeps whole requests and the merge in the tail's epilogue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.prefix_split import (
    merge_external_prefix,
    tail_partials,
)
from sglang.srt.layers.attention.tree_verify.registry import MLA_DIMS, StrategyUnavailable

#: FlashMLA's page size (``page_block_size``); the staging is laid out in such pages.
PAGE = 64
#: Compute capability majors FlashMLA ships kernels for (sm_90a, sm_100a).
FLASHMLA_MAJORS = (9, 10)
_LOG2E = math.log2(math.e)


@triton.jit
def _tree_verify_page_gather_kernel(
    kv, indptr, indices, page_start, staging,
    stride_kv_row, stride_staging_row,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_ROWS: tl.constexpr,
):  # fmt: skip
    """Program (b, j) writes request b's page j, staging page ``page_start[b] + j``:
    prefix rows ``j*PAGE .. j*PAGE+PAGE-1`` and zeros past the prefix's end
    (FlashMLA masks their scores, but a stale NaN there would still reach P·V)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(indptr + b)
    length = tl.load(indptr + b + 1) - start
    if j * PAGE_ROWS < length:
        pos = j * PAGE_ROWS + tl.arange(0, PAGE_ROWS)
        ok = pos < length
        src = tl.load(indices + start + pos, mask=ok, other=0).to(tl.int64)
        page = tl.load(page_start + b).to(tl.int64) + j
        dst = page * PAGE_ROWS + tl.arange(0, PAGE_ROWS)
        for d0 in tl.static_range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            rows = tl.load(kv + src[:, None] * stride_kv_row + cols[None, :], mask=ok[:, None], other=0.0)
            tl.store(staging + dst[:, None] * stride_staging_row + cols[None, :], rows)


def pages_for(max_prefix_len: int) -> int:
    """Block-table width for prefixes of up to ``max_prefix_len`` tokens."""
    return max(1, triton.cdiv(max_prefix_len, PAGE))


def staging_pages(bs: int, total_prefix_tokens: int) -> int:
    """Pages that always hold ``bs`` prefixes of ``total_prefix_tokens`` in all."""
    return total_prefix_tokens // PAGE + bs


def new_staging(pages: int, like: torch.Tensor) -> torch.Tensor:
    """``[pages, PAGE, 1, 576]`` in the KV cache's dtype (``staging_pages``)."""
    return torch.empty(pages, PAGE, 1, MLA_DIMS[0], dtype=like.dtype, device=like.device)


def page_starts(prefix_kv_indptr: torch.Tensor) -> torch.Tensor:
    """Device-side: each request's first staging page (its pages follow the
    previous request's); FlashMLA's block table over them is ``chunk_layout``'s."""
    lengths = prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]
    pages = (lengths + PAGE - 1) // PAGE
    return (torch.cumsum(pages, 0) - pages).to(torch.int32)


def gather_prefix_pages(
    k_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    page_start: torch.Tensor,
    max_pages: int,
    staging: torch.Tensor,
) -> torch.Tensor:
    """Copy request b's prefix into staging pages ``page_start[b] ..`` in order,
    zeros after its end. ``max_pages`` bounds every request's pages (a host
    value, so the grid is static); the staging must hold them all
    (``staging_pages``): both are the caller's contract, unchecked on the host."""
    bs = prefix_kv_indptr.numel() - 1
    d = k_buffer.shape[-1]
    if staging.shape[1:] != (PAGE, 1, d) or staging.dtype != k_buffer.dtype:
        raise ValueError(
            f"staging must be [pages, {PAGE}, 1, {d}] of {k_buffer.dtype}; got "
            f"{tuple(staging.shape)} of {staging.dtype}"
        )
    if bs == 0:
        return staging
    rows = staging.view(-1, d)
    _tree_verify_page_gather_kernel[(bs, max_pages)](
        k_buffer, prefix_kv_indptr, prefix_kv_indices, page_start, rows,
        k_buffer.stride(0), rows.stride(0),
        D=d, BLOCK_D=64, PAGE_ROWS=PAGE,
    )  # fmt: skip
    return staging


def gather_prefix_pages_ref(
    k_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    pages: int,
) -> torch.Tensor:
    """Plain torch: the staging ``gather_prefix_pages`` writes, requests' pages one
    after another, NaN where it writes nothing."""
    bs = prefix_kv_indptr.numel() - 1
    d = k_buffer.shape[-1]
    staging = torch.full((pages * PAGE, d), float("nan"), dtype=k_buffer.dtype, device=k_buffer.device)
    bounds = prefix_kv_indptr.tolist()
    base = 0
    for b in range(bs):
        rows = prefix_kv_indices[bounds[b] : bounds[b + 1]].long()
        used = triton.cdiv(rows.numel(), PAGE) * PAGE
        staging[base : base + used] = 0
        staging[base : base + rows.numel()] = k_buffer.reshape(k_buffer.shape[0], d)[rows]
        base += used
    return staging.view(pages, PAGE, 1, d)


def _flash_mla():
    try:
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # ImportError, or the extension failing to load
        raise StrategyUnavailable(f"flashmla_split needs sgl_kernel's FlashMLA: {e}") from e
    return flash_mla_with_kvcache, get_mla_metadata


def check_supported(q, k_buffer, v_buffer, logit_cap: float) -> None:
    """Raise StrategyUnavailable unless FlashMLA's dense bf16/fp16 kernel serves this call."""
    if logit_cap > 0:
        raise StrategyUnavailable("flashmla_split does not apply a logit cap")
    dims = (q.shape[-1], v_buffer.shape[-1], k_buffer.shape[1])
    if dims != MLA_DIMS:
        raise StrategyUnavailable(
            f"flashmla_split serves absorbed MLA (Dqk 576, Dv 512, 1 KV head); got "
            f"Dqk={dims[0]}, Dv={dims[1]}, Hkv={dims[2]}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16) or k_buffer.dtype != q.dtype:
        raise StrategyUnavailable(
            f"flashmla_split needs a bf16/fp16 KV cache in q's dtype; got q {q.dtype}, "
            f"KV {k_buffer.dtype} (fp8 KV: use the fused strategy)"
        )


def sm_parts(num_sms: int, n: int, num_heads: int) -> int:
    """FlashMLA's SM parts for ``n`` query tokens of ``num_heads`` heads on one KV
    head: its decode kernel runs one CTA per 64 query rows and part."""
    return max(num_sms // triton.cdiv(n * num_heads, 64), 1)


def kv_chunks(bs: int, parts: int) -> int:
    """Requests FlashMLA sees per real one: a lone request in ``parts`` equal chunks,
    so its scheduler gives each part one whole chunk and splits nothing. A batch
    stays whole: its chunks would need a query copy each and still be split, which
    measured slower from two requests on (docs/tree-verify.md)."""
    return max(1, parts) if bs == 1 else 1


def chunk_layout(
    page_start: torch.Tensor, lengths: torch.Tensor, chunks: int, max_pages: int, total_pages: int
):
    """Device-side: chunk c of request b is its pages ``c * cp .. (c + 1) * cp - 1``,
    ``cp = ceil(pages_b / chunks)``, as one FlashMLA request. Returns the
    ``[bs * chunks, ceil(max_pages / chunks)]`` block table and the chunk lengths
    (``[bs * chunks]`` int32, 0 for a chunk past the prefix's end)."""
    chunk_pages = (lengths + PAGE - 1) // PAGE
    chunk_pages = (chunk_pages + chunks - 1) // chunks  # [bs]
    c = torch.arange(chunks, dtype=torch.int32, device=lengths.device)
    first = page_start[:, None] + c[None, :] * chunk_pages[:, None]
    span = chunk_pages[:, None] * PAGE
    chunk_len = (lengths[:, None] - c[None, :] * span).clamp(min=0)
    chunk_len = torch.minimum(chunk_len, span).to(torch.int32)
    width = triton.cdiv(max_pages, chunks)
    cols = torch.arange(width, dtype=torch.int32, device=lengths.device)
    table = (first[:, :, None] + cols).clamp_(max=total_pages - 1).to(torch.int32)
    return table.reshape(-1, width), chunk_len.reshape(-1)


@dataclass
class FlashMLAPlan:
    """What every layer's prefix pass of one forward shares: the page layout, the
    KV chunks FlashMLA sees as requests, its schedule. Device tensors only."""

    max_pages: int
    chunks: int
    page_start: torch.Tensor  # int32 [bs]: each request's first staging page
    page_table: torch.Tensor  # int32 [bs * chunks, ceil(max_pages / chunks)]
    lengths: torch.Tensor  # int32 [bs * chunks]: each chunk's keys
    schedule: torch.Tensor
    splits: torch.Tensor


def plan_flashmla(
    prefix_kv_indptr: torch.Tensor,
    n: int,
    num_heads: int,
    max_prefix_len: int,
    staging_pages: int,
    chunks: Optional[int] = None,
) -> FlashMLAPlan:
    """Once per forward (the hook makes it in the forward's first layer): the
    layers differ only in their KV, not in the layout or the schedule.
    ``chunks`` defaults to ``kv_chunks`` for this GPU (1 reproduces FlashMLA's
    own split of whole requests)."""
    _, get_mla_metadata = _flash_mla()
    bs = prefix_kv_indptr.numel() - 1
    if chunks is None:
        # Measured on sm_90 only (FlashMLA's sm_100 kernel may schedule otherwise).
        device = prefix_kv_indptr.device
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if hopper else 1
        chunks = kv_chunks(bs, sm_parts(sms, n, num_heads))
    max_pages = pages_for(max_prefix_len)
    page_start = page_starts(prefix_kv_indptr)
    lengths = (prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).to(torch.int32)
    table, chunk_len = chunk_layout(page_start, lengths, chunks, max_pages, staging_pages)
    schedule, splits = get_mla_metadata(chunk_len, n * num_heads, 1)
    return FlashMLAPlan(max_pages, chunks, page_start, table, chunk_len, schedule, splits)


def flashmla_prefix_pass(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    sm_scale: float,
    plan: FlashMLAPlan,
    staging: torch.Tensor,
):
    """Every tree query over each KV chunk of its prefix: FlashMLA's ``(o
    [bs * chunks, N, H, 512], lse [bs * chunks, N, H])`` as it returns them (the LSE
    natural-log, a head-major view, undefined for an empty chunk). A lone request's
    chunks read its queries through a zero batch stride (bit-identical to a copy per
    chunk, and faster: docs/tree-verify.md); a batch's chunks need copies."""
    flash_mla_with_kvcache, _ = _flash_mla()
    h, d = q.shape[1], q.shape[2]
    bs = prefix_kv_indptr.numel() - 1
    n = q.shape[0] // bs
    gather_prefix_pages(
        k_buffer, prefix_kv_indptr, prefix_kv_indices, plan.page_start, plan.max_pages, staging
    )
    q4 = q.reshape(bs, 1, n, h, d).expand(bs, plan.chunks, n, h, d)
    q4 = q4.reshape(bs * plan.chunks, n, h, d)
    if bs > 1 and plan.chunks > 1:
        q4 = q4.contiguous()
    o, lse = flash_mla_with_kvcache(
        q4, staging, plan.page_table, plan.lengths, MLA_DIMS[1],
        plan.schedule, plan.splits, softmax_scale=sm_scale, causal=False,
    )  # fmt: skip
    return o, lse.transpose(1, 2)


@triton.jit
def _tree_verify_merge_chunks_kernel(
    Ext_o, Ext_lse, Tail_o, Tail_lse, prefix_indptr, Out,
    total_rows, num_nodes, num_heads, chunks,
    stride_eob, stride_eoq, stride_eoh, stride_elb, stride_elq, stride_elh,
    stride_tr, stride_ot, stride_oh,
    D_V: tl.constexpr, PAGE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Rows ``BLOCK_R`` x value columns ``BLOCK_DV`` of the output: the prefix's
    chunks (natural-log LSEs; a chunk past the prefix's end has nothing to merge,
    whatever FlashMLA left there) and the tail's partial (base-2 LSE), weighed by
    their LSEs."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < total_rows
    tok = rows // num_heads
    head = rows % num_heads
    b = tok // num_nodes
    node = tok % num_nodes
    start = tl.load(prefix_indptr + b, mask=ok, other=0)
    length = tl.load(prefix_indptr + b + 1, mask=ok, other=0) - start
    span = tl.cdiv(tl.cdiv(length, PAGE_ROWS), chunks) * PAGE_ROWS  # keys per chunk (chunk_layout)
    c = tl.arange(0, BLOCK_C)
    has = ok[:, None] & (c[None, :] < chunks) & (c[None, :] * span[:, None] < length[:, None])
    pb = (b[:, None] * chunks + c[None, :]).to(tl.int64)
    lse = tl.load(
        Ext_lse + pb * stride_elb + node[:, None] * stride_elq + head[:, None] * stride_elh,
        mask=has, other=float("-inf"),
    )  # fmt: skip
    lse = tl.where(has, lse * 1.4426950408889634, float("-inf"))
    t_lse = tl.load(Tail_lse + rows, mask=ok, other=float("-inf"))
    m = tl.maximum(tl.max(lse, 1), t_lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m[:, None])
    w_t = tl.math.exp2(t_lse - m)
    den = tl.sum(w, 1) + w_t

    d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = d < D_V
    acc = tl.load(
        Tail_o + rows[:, None].to(tl.int64) * stride_tr + d[None, :],
        mask=ok[:, None] & d_ok[None, :], other=0.0,
    ) * w_t[:, None]  # fmt: skip
    o_row = Ext_o + node[:, None] * stride_eoq + head[:, None] * stride_eoh + d[None, :]
    for ci in range(0, chunks):
        in_chunk = ok & (ci * span < length)
        w_c = tl.sum(tl.where(c[None, :] == ci, w, 0.0), 1)
        o = tl.load(
            o_row + (b[:, None] * chunks + ci).to(tl.int64) * stride_eob,
            mask=in_chunk[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += o.to(tl.float32) * w_c[:, None]
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(
        Out + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=ok[:, None] & d_ok[None, :],
    )


def merge_chunks(o_ext, lse_ext, tail_o, tail_lse, prefix_kv_indptr, chunks, out):
    """``out [bs * N, H, Dv]`` from FlashMLA's chunks (``flashmla_prefix_pass``) and
    the tail's fp32 partial ``tail_o [bs * N * H, Dv]`` with its base-2 ``tail_lse``."""
    total_rows, dv = tail_o.shape
    bs_chunks, n, h, _ = o_ext.shape
    if total_rows == 0:
        return out
    if out.stride(-1) != 1:
        return out.copy_(merge_chunks(o_ext, lse_ext, tail_o, tail_lse, prefix_kv_indptr,
                                      chunks, torch.empty_like(out, memory_format=torch.contiguous_format)))  # fmt: skip
    block_r, block_dv = 16, min(128, triton.next_power_of_2(dv))
    grid = (triton.cdiv(total_rows, block_r), triton.cdiv(dv, block_dv))
    _tree_verify_merge_chunks_kernel[grid](
        o_ext, lse_ext, tail_o, tail_lse, prefix_kv_indptr, out,
        total_rows, n, h, chunks,
        *o_ext.stride()[:3], *lse_ext.stride(), tail_o.stride(0), out.stride(0), out.stride(1),
        D_V=dv, PAGE_ROWS=PAGE, BLOCK_R=block_r, BLOCK_C=triton.next_power_of_2(chunks),
        BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip
    return out


def merge_chunks_ref(o_ext, lse_ext, tail_o, tail_lse, prefix_kv_indptr, chunks, out):
    """Plain torch: what ``merge_chunks`` writes."""
    bs_chunks, n, h, dv = o_ext.shape
    bs = bs_chunks // chunks
    lengths = (prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).long()
    span = (lengths + PAGE - 1) // PAGE
    span = (span + chunks - 1) // chunks * PAGE
    has = torch.arange(chunks)[None, :] * span[:, None] < lengths[:, None]  # [bs, chunks]
    lse = lse_ext.float().reshape(bs, chunks, n, h) / math.log(2.0)
    lse = torch.where(has[:, :, None, None], lse, float("-inf"))
    o = torch.where(has[:, :, None, None, None], o_ext.float().reshape(bs, chunks, n, h, dv), 0.0)
    t_lse = tail_lse.float().reshape(bs, 1, n, h)
    t_o = tail_o.float().reshape(bs, 1, n, h, dv)
    all_lse = torch.cat([lse, t_lse], 1)
    all_o = torch.cat([o, t_o], 1)
    m = all_lse.amax(1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    w = torch.exp2(all_lse - m)
    merged = (w[..., None] * all_o).sum(1) / w.sum(1).clamp(min=1e-30)[..., None]
    out.copy_(merged.reshape(bs * n, h, dv))
    return out


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for the tail, made once; callers that capture graphs
    make it before their first capture."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _SIDE_STREAMS[key]


def tree_verify_flashmla_split(
    q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
    tree_mask, sm_scale, out, logit_cap, config: TreeVerifyConfig,
    max_prefix_len: Optional[int] = None, staging: Optional[torch.Tensor] = None,
    plan: Optional[FlashMLAPlan] = None, overlap: bool = True,
):  # fmt: skip
    """Without ``max_prefix_len`` the call reads the longest prefix on the host (a
    sync); with it and a ``staging`` that holds every prefix (``new_staging`` of
    ``staging_pages``) it is graph-capturable. ``plan`` (``plan_flashmla``) lets
    the layers of one forward share the layout and schedule.

    With KV chunks (a lone request, ``plan.chunks > 1``) the tail runs on a side
    stream during FlashMLA (``overlap``, CUDA only) and ``merge_chunks`` merges. A
    whole request is merged in the tail kernel's epilogue instead: there FlashMLA
    fills the GPU and the side stream only delays it (docs/tree-verify.md)."""
    check_supported(q, k_buffer, v_buffer, logit_cap)
    bs, n = tree_kv_indices.shape
    h, dv = q.shape[1], v_buffer.shape[2]
    if bs == 0:
        return out if out is not None else q.new_empty(0, h, dv)
    if staging is None:
        staging = new_staging(staging_pages(bs, prefix_kv_indices.numel()), k_buffer)
    if plan is None:
        if max_prefix_len is None:
            max_prefix_len = int((prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).max())
        plan = plan_flashmla(prefix_kv_indptr, n, h, max_prefix_len, staging.shape[0])
    if plan.chunks == 1:
        o_pre, lse_pre = flashmla_prefix_pass(
            q, k_buffer, prefix_kv_indptr, prefix_kv_indices, sm_scale, plan, staging
        )
        return merge_external_prefix(
            q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
            tree_mask, sm_scale, config, o_pre, lse_pre, out, lse_scale=_LOG2E,
        )  # fmt: skip
    if out is None:
        out = q.new_empty(bs * n, h, dv)
    tail_o = torch.empty(bs * n * h, dv, dtype=torch.float32, device=q.device)
    tail_lse = torch.empty(bs * n * h, dtype=torch.float32, device=q.device)
    tail = lambda: tail_partials(  # noqa: E731
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, config, tail_o, tail_lse,
    )  # fmt: skip
    side = side_stream(q.device) if overlap and q.is_cuda else None
    if side is None:
        tail()
    else:
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            tail()
    o_pre, lse_pre = flashmla_prefix_pass(
        q, k_buffer, prefix_kv_indptr, prefix_kv_indices, sm_scale, plan, staging
    )
    if side is not None:
        main.wait_stream(side)
    return merge_chunks(o_pre, lse_pre, tail_o, tail_lse, prefix_kv_indptr, plan.chunks, out)

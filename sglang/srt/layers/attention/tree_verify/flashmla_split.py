"""FlashMLA prefix pass + our masked tree tail, merged in the tail's epilogue (sm_90 / sm_100).

FlashMLA runs the prefix of a wide tree at several times our Triton tile's rate on
Hopper (0.077 against 0.210 ms at H=16, N=65, P=16K on the H200:
``../shared/reference/flashmla_prefix_only_h200.jsonl``, ``docs/tree-verify.md``), but it
reads the KV cache in 64-token pages through a block table, and tree verify gets
page_size-1 slot indices. So the pass first copies each request's prefix rows into
page-contiguous staging: one read and one write of the prefix, a small cost next to
the attention once the tree is wide. The requests' pages follow each other in the
staging (a device-side prefix sum), so it needs one page per 64 prefix tokens plus one
per request, at most one KV layer's worth. Everything runs on the GPU from device
tensors; with a host bound on the prefix length and a preallocated staging buffer the
whole call replays in a CUDA graph with no host work per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.prefix_split import merge_external_prefix
from sglang.srt.layers.attention.tree_verify.upstream_extend import (
    StrategyUnavailable,
)

#: FlashMLA's page size (``page_block_size``); the staging is laid out in such pages.
PAGE = 64
_MLA_DIMS = (576, 512, 1)  # latent + rope per key, value width, KV heads
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
    return torch.empty(pages, PAGE, 1, _MLA_DIMS[0], dtype=like.dtype, device=like.device)


def page_layout(prefix_kv_indptr: torch.Tensor, max_pages: int, total_pages: int):
    """Device-side: each request's first staging page (its pages follow the
    previous request's) and FlashMLA's ``[bs, max_pages]`` block table."""
    lengths = prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]
    pages = (lengths + PAGE - 1) // PAGE
    page_start = (torch.cumsum(pages, 0) - pages).to(torch.int32)
    table = page_start[:, None] + torch.arange(max_pages, dtype=torch.int32, device=page_start.device)
    # Entries past a request's last page are never read; keep them inside the staging.
    return page_start, table.clamp_(max=total_pages - 1)


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


def flash_mla_reason() -> Optional[str]:
    """Why sgl_kernel's FlashMLA cannot be loaded here (None: it can)."""
    try:
        _flash_mla()
    except StrategyUnavailable as e:
        return str(e)
    return None


def check_supported(q, k_buffer, v_buffer, logit_cap: float) -> None:
    """Raise StrategyUnavailable unless FlashMLA's dense bf16/fp16 kernel serves this call."""
    if logit_cap > 0:
        raise StrategyUnavailable("flashmla_split does not apply a logit cap")
    dims = (q.shape[-1], v_buffer.shape[-1], k_buffer.shape[1])
    if dims != _MLA_DIMS:
        raise StrategyUnavailable(
            f"flashmla_split serves absorbed MLA (Dqk 576, Dv 512, 1 KV head); got "
            f"Dqk={dims[0]}, Dv={dims[1]}, Hkv={dims[2]}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16) or k_buffer.dtype != q.dtype:
        raise StrategyUnavailable(
            f"flashmla_split needs a bf16/fp16 KV cache in q's dtype; got q {q.dtype}, "
            f"KV {k_buffer.dtype} (fp8 KV: use the fused strategy)"
        )


@dataclass
class FlashMLAPlan:
    """What every layer's prefix pass of one forward shares: the page layout,
    FlashMLA's schedule. Device tensors only."""

    max_pages: int
    page_start: torch.Tensor  # int32 [bs]: each request's first staging page
    page_table: torch.Tensor  # int32 [bs, max_pages]
    lengths: torch.Tensor  # int32 [bs]
    schedule: torch.Tensor
    splits: torch.Tensor


def plan_flashmla(
    prefix_kv_indptr: torch.Tensor, n: int, num_heads: int, max_prefix_len: int, staging_pages: int
) -> FlashMLAPlan:
    """Once per forward (the hook makes it in the forward's first layer): the
    layers differ only in their KV, not in the layout or the schedule."""
    _, get_mla_metadata = _flash_mla()
    max_pages = pages_for(max_prefix_len)
    page_start, page_table = page_layout(prefix_kv_indptr, max_pages, staging_pages)
    lengths = (prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).to(torch.int32)
    schedule, splits = get_mla_metadata(lengths, n * num_heads, 1)
    return FlashMLAPlan(max_pages, page_start, page_table, lengths, schedule, splits)


def flashmla_prefix_pass(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    sm_scale: float,
    plan: FlashMLAPlan,
    staging: torch.Tensor,
):
    """Every tree query over its prefix only: FlashMLA's ``(o [bs, N, H, 512],
    lse [bs, N, H])`` as it returns them (the LSE natural-log, a head-major view,
    undefined for a request with no prefix)."""
    flash_mla_with_kvcache, _ = _flash_mla()
    bs, h = plan.lengths.shape[0], q.shape[1]
    n = q.shape[0] // bs
    gather_prefix_pages(
        k_buffer, prefix_kv_indptr, prefix_kv_indices, plan.page_start, plan.max_pages, staging
    )
    o, lse = flash_mla_with_kvcache(
        q.reshape(bs, n, h, q.shape[-1]), staging, plan.page_table, plan.lengths, _MLA_DIMS[1],
        plan.schedule, plan.splits, softmax_scale=sm_scale, causal=False,
    )  # fmt: skip
    return o, lse.transpose(1, 2)


def tree_verify_flashmla_split(
    q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
    tree_mask, sm_scale, out, logit_cap, config: TreeVerifyConfig,
    max_prefix_len: Optional[int] = None, staging: Optional[torch.Tensor] = None,
    plan: Optional[FlashMLAPlan] = None,
):  # fmt: skip
    """Without ``max_prefix_len`` the call reads the longest prefix on the host (a
    sync); with it and a ``staging`` that holds every prefix (``new_staging`` of
    ``staging_pages``) it is graph-capturable. ``plan`` (``plan_flashmla``) lets
    the layers of one forward share the layout and schedule."""
    check_supported(q, k_buffer, v_buffer, logit_cap)
    bs, n = tree_kv_indices.shape
    if bs == 0:
        return out if out is not None else q.new_empty(0, q.shape[1], v_buffer.shape[2])
    if staging is None:
        staging = new_staging(staging_pages(bs, prefix_kv_indices.numel()), k_buffer)
    if plan is None:
        if max_prefix_len is None:
            max_prefix_len = int((prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).max())
        plan = plan_flashmla(prefix_kv_indptr, n, q.shape[1], max_prefix_len, staging.shape[0])
    o_pre, lse_pre = flashmla_prefix_pass(
        q, k_buffer, prefix_kv_indptr, prefix_kv_indices, sm_scale, plan, staging
    )
    return merge_external_prefix(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, config, o_pre, lse_pre, out, lse_scale=_LOG2E,
    )  # fmt: skip

# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's XQA kernel as a tree verify, measured as a candidate strategy for MHA/GQA.

XQA (TensorRT-LLM's decode kernel, which FlashInfer ships with sm_90, sm_100 and
sm_120/121 builds) has a speculative-decoding mode: ``q_seq_len`` query tokens per
request attend to the request's whole KV, of which the last ``q_seq_len`` tokens are
masked by a bit-packed mask ``[bs, q_seq_len, 2 * ceil(q_seq_len / 32)]`` uint16 and
every earlier token is visible. A DDTREE tree is that case when its nodes' KV sits at
the request's next ``N`` logical positions (``step_io.tree_cache_locs``), and its rows
are this project's ancestor bitmask (``tree_verify/masks.py``: bit ``j % 32`` of 32-bit
word ``j // 32``) read as pairs of uint16.

It is not a serving strategy: it reads a paged cache of 16 to 128 tokens a page, and a
DDTREE server runs at page size 1 (it reorders token slots on commit). This module
measures whether it would be worth serving: ``paged_copy`` lays the benchmark's
slot-indexed KV out in pages (not timed; a server at page size 16 would hold it so),
and :class:`XqaTreeVerify` runs the kernel over it, graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PAGE_SIZES = (16, 32, 64, 128)
#: FlashInfer's trtllm decode reserves this much of its workspace for XQA's semaphores.
_SEMAPHORE_BYTES = 8 << 20
_SCRATCH_BYTES = 256 << 20


def xqa_reason(num_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_v: int, dtype, kv_dtype,
               page_size: int) -> Optional[str]:  # fmt: skip
    """Why XQA cannot compute this verify (None: it can)."""
    if head_dim_qk != head_dim_v:
        return f"XQA needs Dqk == Dv, got {head_dim_qk} and {head_dim_v}"
    if head_dim_qk % 16 or not 16 <= head_dim_qk <= 256:
        return f"XQA needs a head size that is a multiple of 16 in [16, 256], got {head_dim_qk}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if dtype not in (torch.float16, torch.bfloat16) or kv_dtype != dtype:
        return f"XQA here takes q and KV in one 16-bit dtype, got {dtype} and {kv_dtype}"
    if page_size not in PAGE_SIZES:
        return f"XQA needs pages of {PAGE_SIZES} tokens, got {page_size}"
    if not torch.cuda.is_available():
        return "XQA needs a CUDA GPU"
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10, 12):
        return f"XQA has kernels for sm_90, sm_100 and sm_12x, not sm_{major}x"
    try:
        import flashinfer.xqa  # noqa: F401
    except ImportError as e:
        return f"flashinfer.xqa does not import: {e}"
    return None


@dataclass
class PagedTree:
    """The verify's KV as XQA reads it: each request's prefix then its N tree tokens,
    in pages."""

    k_pages: torch.Tensor  # [pages, page_size, Hkv, D]
    v_pages: torch.Tensor
    page_table: torch.Tensor  # [bs, pages_per_request] int32
    seq_lens: torch.Tensor  # [bs, 1] int32: prefix + N
    page_size: int


def paged_copy(k, v, prefix_indptr, prefix_indices, tree_indices, page_size: int) -> PagedTree:
    """Copy slot-indexed KV (``k``/``v`` ``[slots, Hkv, D]``, the tree-verify call's
    layout) into pages: request b's tokens are its prefix slots then its tree slots."""
    bs, n = tree_indices.shape
    lens = (prefix_indptr[1:] - prefix_indptr[:-1]).long() + n
    per_req = int((lens.max() + page_size - 1) // page_size)
    pages = bs * per_req
    hkv, d = k.shape[1], k.shape[2]
    k_pages = torch.zeros(pages, page_size, hkv, d, dtype=k.dtype, device=k.device)
    v_pages = torch.zeros(pages, page_size, hkv, v.shape[2], dtype=v.dtype, device=v.device)
    for b in range(bs):
        slots = torch.cat([prefix_indices[prefix_indptr[b] : prefix_indptr[b + 1]].long(), tree_indices[b].long()])
        flat = slice(b * per_req * page_size, b * per_req * page_size + slots.numel())
        k_pages.view(-1, hkv, d)[flat] = k[slots]
        v_pages.view(-1, hkv, v.shape[2])[flat] = v[slots]
    page_table = torch.arange(pages, dtype=torch.int32, device=k.device).view(bs, per_req)
    return PagedTree(k_pages, v_pages, page_table, lens.to(torch.int32).view(bs, 1), page_size)


class XqaTreeVerify:
    """XQA over a :class:`PagedTree`: ``q [bs * N, H, D]`` -> ``out [bs * N, H, D]``.
    The first call compiles the module for this shape (FlashInfer's JIT, nvcc)."""

    def __init__(self, device, num_kv_heads: int, sm_scale: float, head_dim: int):
        self.num_kv_heads = num_kv_heads
        # XQA scales Q.K^T by q_scale / sqrt(head_dim) itself.
        self.q_scale = float(sm_scale) * head_dim**0.5
        # The semaphores must start at zero; the kernels leave them so.
        self.semaphores = torch.zeros(_SEMAPHORE_BYTES, dtype=torch.uint8, device=device)
        self.scratch = torch.zeros(_SCRATCH_BYTES, dtype=torch.uint8, device=device)

    def __call__(self, q, paged: PagedTree, tree_mask, out=None):
        from flashinfer.xqa import xqa

        bs, n = paged.seq_lens.shape[0], tree_mask.shape[1]
        h, d = q.shape[1], q.shape[2]
        if out is None:
            out = torch.empty_like(q)
        xqa(
            q.view(bs, 1, n, h, d),
            paged.k_pages,
            paged.v_pages,
            paged.page_table,
            paged.seq_lens,
            out.view(bs, 1, n, h, d),
            self.scratch,
            self.semaphores,
            self.num_kv_heads,
            paged.page_size,
            q_scale=self.q_scale,
            q_seq_len=n,
            mask=tree_mask.contiguous().view(torch.uint16),
        )
        return out

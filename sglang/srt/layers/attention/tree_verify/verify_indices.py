# SPDX-License-Identifier: Apache-2.0
"""A verify's KV indices: the committed prefix as an ``int32`` CSR and the tree's slots.

Before every TARGET_VERIFY forward (eager, and before each CUDA graph replay) the hook turns the
batch (pool rows, committed lengths, the tree's KV slots) into what the verify kernels read. As
torch ops that is a cub scan for the row pointers (two launches, a workspace, then a cast copy),
the gather kernel, a copy and a zero-fill for the tree's slots: tens of microseconds of host time
per forward, and a DDTREE step runs two such forwards (the drafter's block and the verify). On a
small target the step is host-bound, so :func:`verify_indices` does it in one launch, one program
per request: its own row pointer (the sum of the lengths before it), its prefix's slots and its
tree's slots. :func:`verify_indices_reference` is the same in plain torch (the CPU path).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

#: Prefix slots one program copies per iteration.
_COPY_BLOCK = 512
#: The fewest lengths a program sums for its row pointer: one compiled variant serves every
#: batch up to this size (a new variant compiles at the first batch past each power of two).
_MIN_BS_BLOCK = 64


@triton.jit(do_not_specialize=["bs", "rows", "width"])
def _verify_indices_kernel(
    req_to_token,
    req_pool_indices,
    seq_lens,
    indptr,
    prefix_out,
    tree_src,
    tree_out,
    bs,
    rows,
    width,
    r2t_stride,
    BS_BLOCK: tl.constexpr,
    COPY_BLOCK: tl.constexpr,
    TREE_BLOCK: tl.constexpr,
    FILL_INDPTR: tl.constexpr,
    FILL_TREE: tl.constexpr,
):
    b = tl.program_id(0)
    if FILL_INDPTR:
        offs = tl.arange(0, BS_BLOCK)
        before = tl.load(seq_lens + offs, mask=offs < b, other=0).to(tl.int32)
        start = tl.sum(before, axis=0)
        length = tl.load(seq_lens + b).to(tl.int32)
        tl.store(indptr + b + 1, start + length)
        if b == 0:
            tl.store(indptr, start)  # the sum of no lengths: 0
    else:
        start = tl.load(indptr + b)
        length = tl.load(indptr + b + 1) - start
    row = tl.load(req_pool_indices + b).to(tl.int64)
    src = req_to_token + row * r2t_stride
    dst = prefix_out + start
    for j in range(0, tl.cdiv(length, COPY_BLOCK)):
        col = j * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
        keep = col < length
        tl.store(dst + col, tl.load(src + col, mask=keep, other=0), mask=keep)
    if FILL_TREE:
        t = tl.arange(0, TREE_BLOCK)
        idx = b * width + t
        mine = t < width
        slot = tl.load(tree_src + idx, mask=mine & (idx < rows), other=0)
        tl.store(tree_out + idx, slot.to(tl.int32), mask=mine)


def verify_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    prefix_out: torch.Tensor,
    *,
    fill_indptr: bool,
    tree_src: Optional[torch.Tensor] = None,
    tree_out: Optional[torch.Tensor] = None,
    width: int = 0,
) -> None:
    """For ``bs = len(req_pool_indices)`` requests, in place and without a host sync:

    * with ``fill_indptr``, ``indptr[: bs + 1] = [0, cumsum(seq_lens)]`` (``int32``); else
      ``indptr`` already holds them;
    * ``prefix_out[indptr[b] : indptr[b + 1]] = req_to_token[req_pool_indices[b], : seq_lens[b]]``;
    * with ``tree_out``, ``tree_out[: bs * width] = tree_src`` as ``int32``, zero past
      ``tree_src``'s end (a CUDA graph's padding rows).
    """
    bs = int(req_pool_indices.shape[0])
    if bs == 0:
        return
    if not (prefix_out.is_cuda or _interpreted()):
        verify_indices_reference(
            req_to_token, req_pool_indices, seq_lens, indptr, prefix_out,
            fill_indptr=fill_indptr, tree_src=tree_src, tree_out=tree_out, width=width,
        )  # fmt: skip
        return
    fill_tree = tree_out is not None
    if fill_tree and tree_src.shape[0] > bs * width:
        raise ValueError(f"{tree_src.shape[0]} tree slots for {bs} requests of width {width}")
    _verify_indices_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        indptr,
        prefix_out,
        tree_src if fill_tree else indptr,
        tree_out if fill_tree else indptr,
        bs,
        int(tree_src.shape[0]) if fill_tree else 0,
        int(width),
        req_to_token.stride(0),
        BS_BLOCK=max(_MIN_BS_BLOCK, triton.next_power_of_2(bs)),
        COPY_BLOCK=_COPY_BLOCK,
        TREE_BLOCK=triton.next_power_of_2(max(1, int(width))),
        FILL_INDPTR=bool(fill_indptr),
        FILL_TREE=fill_tree,
    )


def _interpreted() -> bool:
    """Whether the kernel was decorated under ``TRITON_INTERPRET=1`` (the CPU tests)."""
    return type(_verify_indices_kernel).__name__ == "InterpretedFunction"


def verify_indices_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    prefix_out: torch.Tensor,
    *,
    fill_indptr: bool,
    tree_src: Optional[torch.Tensor] = None,
    tree_out: Optional[torch.Tensor] = None,
    width: int = 0,
) -> None:
    """:func:`verify_indices` in torch ops."""
    bs = int(req_pool_indices.shape[0])
    if fill_indptr:
        indptr[0] = 0
        indptr[1 : bs + 1] = torch.cumsum(seq_lens[:bs], 0)
    fill_prefix_indices(req_to_token, req_pool_indices, seq_lens, indptr[: bs + 1], prefix_out)
    if tree_out is not None:
        rows = int(tree_src.shape[0])
        if rows > bs * width:
            raise ValueError(f"{rows} tree slots for {bs} requests of width {width}")
        tree = tree_out[: bs * width]
        tree[:rows].copy_(tree_src)
        tree[rows:].zero_()


def fill_prefix_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
    start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[indptr[b] : indptr[b+1]] = req_to_token[req_pool_indices[b], s : s + seq_lens[b]]``
    (``s = start[b]``, 0 without ``start``) as int32, without reading a device
    value on the host."""
    bs = req_pool_indices.shape[0]
    if bs == 0 or out.numel() == 0:
        return out
    if out.is_cuda:
        create_flashinfer_kv_indices_triton[(bs,)](
            req_to_token, req_pool_indices, seq_lens, indptr, start, out,
            req_to_token.stride(0),
        )  # fmt: skip
        return out
    pos = torch.arange(out.numel(), device=out.device)
    row = torch.searchsorted(indptr[1:].long(), pos, right=True).clamp_max(bs - 1)
    col = pos - indptr[row].long()
    if start is not None:
        col = col + start.long()[row]
    valid = pos < indptr[bs].long()
    src = req_to_token[req_pool_indices.long()[row], col.clamp(0, req_to_token.shape[1] - 1)]
    out.copy_(torch.where(valid, src.to(out.dtype), out))
    return out

# SPDX-License-Identifier: Apache-2.0
"""Fused prefix-split tree-verify attention (Triton).

Every one of a request's N tree nodes sees the whole committed prefix, so all
``N * group`` query rows that share a KV head can share each prefix KV tile
they load. One launch covers the whole batch:

* grid axis 0: tiles of ``BLOCK_M`` query rows, a row being one (node, head of
  the KV group) pair, so a 64-row tile turns one KV tile load into a
  64 x BLOCK_N x D matrix product;
* grid axis 1: ``num_splits`` equal slices of each request's prefix (computed
  in the kernel from the request's length, so the launch shape depends only
  on static sizes and the launch is CUDA-graph capturable); the last split
  then goes on with the tree tail, applying the packed ancestor bitmask (the
  last slice is the shortest, and a program of its own for the tail would
  start a second wave when the slices fill the GPU);
* grid axis 2: request x KV head.

Each split writes a normalised partial output and its base-2 log-sum-exp;
one combine kernel merges all splits per row. For absorbed MLA (V is the
first 512 columns of K) the V tile is the K tile already in shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.tree_verify.configs import (
    TreeVerifyConfig,
    head_dim_blocks,
    select_config,
)

_LOG2E = 1.4426950408889634

# Under TRITON_INTERPRET=1 (the CPU tests load this file that way) there is
# no inline PTX; the interpreter runs a program's threads in lockstep anyway.
_PTX_BARRIER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _cta_barrier(x):
    """bar.sync 0 for the whole CTA, which also orders the global-memory
    accesses of its threads. Inline PTX rather than ``tl.debug_barrier()``:
    Triton 3.6 does not software-pipeline a loop that holds a gpu.barrier.
    ``x``: any scalar (the asm needs an operand)."""
    if _PTX_BARRIER:
        tl.inline_asm_elementwise(
            "bar.sync 0;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _popcount32(x):
    """Set bits of each int32 (SWAR bit counting on the unsigned bits)."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _tree_depth(mask_rows, ok, num_nodes):
    """Depth of the tree nodes whose packed ancestor masks start at ``mask_rows``:
    a row holds the node's ancestors and itself, so depth = set bits - 1 (the
    root, depth 0, sees itself only). Position = committed length + depth."""
    bits = tl.zeros(mask_rows.shape, dtype=tl.int32)
    for w in range(0, tl.cdiv(num_nodes, 32)):
        bits += _popcount32(tl.load(mask_rows + w, mask=ok, other=0))
    return bits - 1


@triton.jit
def _online_softmax_step(m_i, l_i, s):
    """Running max, rescale factor, probabilities and running sum after the
    base-2 scores ``s`` of one more KV tile."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps m = -inf; use 0 there so that
    # exp2(-inf - m) is 0 rather than NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _load_kv_tile(
    K, V, slots, key_ok, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
    offs_d, offs_db, offs_dpe, offs_dv,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr, DV_SPLIT: tl.constexpr,
):  # fmt: skip
    """The gathered K tile of keys ``slots`` (``k``, with ``DV_SPLIT == 2`` also
    the other half ``kb``), its rope part ``kpe`` and the V tile, in the cache's
    dtype; rows past ``key_ok`` are 0. With ``SHARE_KV`` the V tile is ``k``."""
    k_row = K + slots[:, None] * stride_kt + kvh * stride_kh
    if DV_SPLIT > 1:
        k = tl.load(k_row + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        kb = tl.load(k_row + offs_db[None, :], mask=key_ok[:, None], other=0.0)
    elif D_MAIN == BLOCK_D:
        k = tl.load(k_row + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        kb = k
    else:
        k = tl.load(
            k_row + offs_d[None, :],
            mask=key_ok[:, None] & (offs_d[None, :] < D_MAIN),
            other=0.0,
        )
        kb = k
    if BLOCK_DPE > 0:
        kpe = tl.load(
            k_row + D_MAIN + offs_dpe[None, :],
            mask=key_ok[:, None] & (offs_dpe[None, :] < D_PE),
            other=0.0,
        )
    else:
        kpe = k
    if SHARE_KV:
        v = k
    else:
        v_row = V + slots[:, None] * stride_vt + kvh * stride_vh
        if D_V == BLOCK_DV:
            v = tl.load(v_row + offs_dv[None, :], mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(
                v_row + offs_dv[None, :],
                mask=key_ok[:, None] & (offs_dv[None, :] < D_V),
                other=0.0,
            )
    return k, kb, kpe, v


@triton.jit
def _attend_kv(
    acc, m_i, l_i, q, qb, qpe, k, kb, kpe, v, key_ok, visible, qk_scale, logit_cap,
    BLOCK_DPE: tl.constexpr, SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr,
    Q_AS_B: tl.constexpr, DV_SPLIT: tl.constexpr, KV_CAST: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of a query tile over one loaded KV tile
    (``_load_kv_tile``'s tiles).

    With ``DV_SPLIT == 2`` the main head dims come in two halves: ``k`` is the
    half of the value columns this program owns, ``kb`` the other one (only
    needed for the scores), and the V tile is the first half's K tile.
    ``KV_CAST``: an fp8 KV cache, converted to q's dtype here (its scales are
    folded into ``qk_scale`` and the output by the caller).
    """
    if KV_CAST:
        k = k.to(q.dtype)
        kb = kb.to(q.dtype)
        kpe = kpe.to(q.dtype)
        v = v.to(q.dtype)
    if SHARE_KV:
        v = k
    if Q_AS_B:
        # K . Q^T keeps the query tile a shared-memory operand (wgmma takes
        # its B operand from shared memory only); a register-resident 576-wide
        # query tile would not leave room for the 512-wide accumulator.
        qk_t = tl.dot(k, tl.trans(q))
        if BLOCK_DPE > 0:
            qk_t = tl.dot(kpe, tl.trans(qpe), qk_t)
        qk = tl.trans(qk_t)
    else:
        qk = tl.dot(q, tl.trans(k))
        if DV_SPLIT > 1:
            qk = tl.dot(qb, tl.trans(kb), qk)
        if BLOCK_DPE > 0:
            qk = tl.dot(qpe, tl.trans(kpe), qk)

    if HAS_CAP:
        s = qk * qk_scale
        # cap * tanh(s / cap), tanh written through sigmoid.
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
        s = s * 1.4426950408889634
    else:
        s = qk * qk_scale
    if MASKED:
        s = tl.where(visible & key_ok[None, :], s, float("-inf"))
    else:
        s = tl.where(key_ok[None, :], s, float("-inf"))

    m_new, alpha, p, l_i = _online_softmax_step(m_i, l_i, s)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, qb, qpe, K, V, slots, key_ok, visible,
    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
    offs_d, offs_db, offs_dpe, offs_dv,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr, Q_AS_B: tl.constexpr,
    DV_SPLIT: tl.constexpr, KV_CAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Load one KV tile and take one online-softmax step over it."""
    k, kb, kpe, v = _load_kv_tile(
        K, V, slots, key_ok, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
        offs_d, offs_db, offs_dpe, offs_dv,
        D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, DV_SPLIT,
    )  # fmt: skip
    return _attend_kv(
        acc, m_i, l_i, q, qb, qpe, k, kb, kpe, v, key_ok, visible, qk_scale, logit_cap,
        BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, DV_SPLIT, KV_CAST, MASKED,
    )  # fmt: skip


@triton.jit
def _prefix_slice_register_prefetch(
    acc, m_i, l_i, q, qb, qpe, K, V, prefix_indices, kv_start, lo, hi,
    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
    offs_d, offs_dpe, offs_dv, win_lo,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr, Q_AS_B: tl.constexpr,
    KV_CAST: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    """A prefix slice whose next KV tile is loaded into registers while the
    current one is computed (``register_prefetch``).

    For shared memory of 99 KiB per block (sm_120): the query tile and one
    576-wide KV tile fill three quarters of it, so Triton's own pipelining gets
    a single KV buffer and waits for every tile's copy before its compute.
    Here the loads of tile i + 1 are issued before the products of tile i and
    land in registers, the tile is stored to the one shared buffer when its
    turn comes, and the gather latency overlaps a whole tile of compute. Slot
    ids run one tile further ahead, so the KV loads never wait on them.
    """
    offs_k = tl.arange(0, BLOCK_N)
    ok = lo + offs_k < hi
    slots = tl.load(prefix_indices + kv_start + lo + offs_k, mask=ok, other=0)
    k, kb, kpe, v = _load_kv_tile(
        K, V, slots.to(tl.int64), ok, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
        offs_d, offs_d, offs_dpe, offs_dv,
        D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, 1,
    )  # fmt: skip
    offs_n = lo + BLOCK_N + offs_k
    slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
        key_ok = start + offs_k < hi
        k_cur = k
        kpe_cur = kpe
        v_cur = v
        offs_n = start + BLOCK_N + offs_k
        k, kb, kpe, v = _load_kv_tile(
            K, V, slots_next.to(tl.int64), offs_n < hi, kvh, stride_kt, stride_kh,
            stride_vt, stride_vh, offs_d, offs_d, offs_dpe, offs_dv,
            D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, 1,
        )  # fmt: skip
        offs_n = start + 2 * BLOCK_N + offs_k
        slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
        acc, m_i, l_i = _attend_kv(
            acc, m_i, l_i, q, q, qpe, k_cur, k_cur, kpe_cur, v_cur, key_ok,
            (start + offs_k)[None, :] >= win_lo[:, None],
            qk_scale, logit_cap, BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, 1, KV_CAST, SLIDING,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _load_chunks(row_ptr, row_ok, D_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Columns ``[c * BLOCK_C, (c + 1) * BLOCK_C)`` of rows ``row_ptr`` ([R, 1]
    pointers) for each chunk c, as a tuple; rows past ``row_ok`` are 0."""
    offs = tl.arange(0, BLOCK_C)
    chunks = ()
    for c in tl.static_range(D_CHUNKS):
        chunks = chunks + (
            tl.load(row_ptr + c * BLOCK_C + offs[None, :], mask=row_ok[:, None], other=0.0),
        )
    return chunks


@triton.jit
def _load_kv_chunks(
    K, V, slots, key_ok, kvh, stride_kt, stride_kh, stride_vt, stride_vh, offs_dpe,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_DPE: tl.constexpr,
    SHARE_KV: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The K tile of keys ``slots`` as ``D_CHUNKS`` column chunks, its rope
    part, and the V tile's chunks (the K chunks with ``SHARE_KV``)."""
    k_row = K + slots[:, None] * stride_kt + kvh * stride_kh
    ks = _load_chunks(k_row, key_ok, D_CHUNKS, BLOCK_C)
    if BLOCK_DPE > 0:
        kpe = tl.load(
            k_row + D_MAIN + offs_dpe[None, :],
            mask=key_ok[:, None] & (offs_dpe[None, :] < D_PE),
            other=0.0,
        )
    else:
        kpe = ks[0]
    if SHARE_KV:
        vs = ks
    else:
        vs = _load_chunks(V + slots[:, None] * stride_vt + kvh * stride_vh, key_ok, D_CHUNKS, BLOCK_C)
    return ks, kpe, vs


@triton.jit
def _attend_chunks(
    acc, m_i, l_i, qs, qpe, ks, kpe, vs, key_ok, visible, qk_scale, logit_cap,
    BLOCK_DPE: tl.constexpr, SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr,
    Q_AS_B: tl.constexpr, KV_CAST: tl.constexpr, MASKED: tl.constexpr,
    D_CHUNKS: tl.constexpr,
):  # fmt: skip
    """``_attend_kv`` with the main head dims in ``D_CHUNKS`` column chunks:
    ``acc`` is a tuple of one accumulator per value chunk.

    Each chunk's score product is a dot of its own, scaled, then added (an add
    of a plain dot result would be folded back into one accumulating dot). On
    mma.sync a dot over 576 dims is one chain of 36 dependent MMAs per 16 x 8
    output tile; separate chunks give the scheduler independent chains.
    """
    if KV_CAST:
        cast = ()
        for c in tl.static_range(D_CHUNKS):
            cast = cast + (ks[c].to(qpe.dtype),)
        ks = cast
        kpe = kpe.to(qpe.dtype)
        if SHARE_KV:
            vs = ks
        else:
            cast = ()
            for c in tl.static_range(D_CHUNKS):
                cast = cast + (vs[c].to(qpe.dtype),)
            vs = cast
    if Q_AS_B:
        st = tl.dot(ks[0], tl.trans(qs[0])) * qk_scale
        for c in tl.static_range(1, D_CHUNKS):
            st += tl.dot(ks[c], tl.trans(qs[c])) * qk_scale
        if BLOCK_DPE > 0:
            st += tl.dot(kpe, tl.trans(qpe)) * qk_scale
        s = tl.trans(st)
    else:
        s = tl.dot(qs[0], tl.trans(ks[0])) * qk_scale
        for c in tl.static_range(1, D_CHUNKS):
            s += tl.dot(qs[c], tl.trans(ks[c])) * qk_scale
        if BLOCK_DPE > 0:
            s += tl.dot(qpe, tl.trans(kpe)) * qk_scale
    if HAS_CAP:
        # cap * tanh(s / cap), tanh written through sigmoid.
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
        s = s * 1.4426950408889634
    if MASKED:
        s = tl.where(visible & key_ok[None, :], s, float("-inf"))
    else:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = _online_softmax_step(m_i, l_i, s)
    p = p.to(qpe.dtype)
    new = ()
    for c in tl.static_range(D_CHUNKS):
        new = new + (tl.dot(p, vs[c], acc[c] * alpha[:, None]),)
    return new, m_new, l_i


@triton.jit
def _prefix_slice_chunked(
    acc, m_i, l_i, qs, qpe, K, V, prefix_indices, kv_start, lo, hi,
    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap, offs_dpe, win_lo,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_DPE: tl.constexpr,
    SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr, Q_AS_B: tl.constexpr,
    KV_CAST: tl.constexpr, REGISTER_PREFETCH: tl.constexpr,
    D_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    """A prefix slice with chunked head dims (``d_chunks``): Triton's
    pipelined loads, or with ``REGISTER_PREFETCH`` the next tile loaded into
    registers while the current one is computed (see
    ``_prefix_slice_register_prefetch``). ``SLIDING``: row r sees prefix keys
    from ``win_lo[r]`` on."""
    offs_k = tl.arange(0, BLOCK_N)
    if REGISTER_PREFETCH:
        ok = lo + offs_k < hi
        slots = tl.load(prefix_indices + kv_start + lo + offs_k, mask=ok, other=0)
        ks, kpe, vs = _load_kv_chunks(
            K, V, slots.to(tl.int64), ok, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
            offs_dpe, D_MAIN, D_PE, BLOCK_DPE, SHARE_KV, D_CHUNKS, BLOCK_C,
        )  # fmt: skip
        offs_n = lo + BLOCK_N + offs_k
        slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
            key_ok = start + offs_k < hi
            ks_cur = ks
            kpe_cur = kpe
            vs_cur = vs
            offs_n = start + BLOCK_N + offs_k
            ks, kpe, vs = _load_kv_chunks(
                K, V, slots_next.to(tl.int64), offs_n < hi, kvh, stride_kt, stride_kh,
                stride_vt, stride_vh, offs_dpe, D_MAIN, D_PE, BLOCK_DPE, SHARE_KV, D_CHUNKS,
                BLOCK_C,
            )  # fmt: skip
            offs_n = start + 2 * BLOCK_N + offs_k
            slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
            acc, m_i, l_i = _attend_chunks(
                acc, m_i, l_i, qs, qpe, ks_cur, kpe_cur, vs_cur, key_ok,
                (start + offs_k)[None, :] >= win_lo[:, None],
                qk_scale, logit_cap, BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, KV_CAST, SLIDING,
                D_CHUNKS,
            )  # fmt: skip
    else:
        offs_n = lo + offs_k
        slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            offs_n = start + offs_k
            key_ok = offs_n < hi
            # Slot ids one tile ahead: the KV loads are direct loads to the
            # pipeliner (see the default loop in _tree_verify_split_kernel).
            slots = slots_next
            slots_next = tl.load(
                prefix_indices + kv_start + offs_n + BLOCK_N,
                mask=offs_n + BLOCK_N < hi,
                other=0,
            )
            ks, kpe, vs = _load_kv_chunks(
                K, V, slots.to(tl.int64), key_ok, kvh, stride_kt, stride_kh, stride_vt,
                stride_vh, offs_dpe, D_MAIN, D_PE, BLOCK_DPE, SHARE_KV, D_CHUNKS, BLOCK_C,
            )  # fmt: skip
            acc, m_i, l_i = _attend_chunks(
                acc, m_i, l_i, qs, qpe, ks, kpe, vs, key_ok, offs_n[None, :] >= win_lo[:, None],
                qk_scale, logit_cap, BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, KV_CAST, SLIDING,
                D_CHUNKS,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _load_k_part(k_row, offs, n_valid, key_ok, q, KV_CAST: tl.constexpr):
    """Columns ``offs`` (< ``n_valid``) of a gathered K tile, in q's dtype."""
    k = tl.load(k_row + offs[None, :], mask=key_ok[:, None] & (offs[None, :] < n_valid), other=0.0)
    if KV_CAST:
        k = k.to(q.dtype)
    return k


@triton.jit
def _prefix_scores(
    q, qpe, K, slots, key_ok, kvh, stride_kt, stride_kh, qk_scale, logit_cap,
    offs_d, offs_dpe,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, HAS_CAP: tl.constexpr, KV_CAST: tl.constexpr,
):  # fmt: skip
    """Base-2 scaled scores of a query tile against one prefix KV tile, -inf
    for keys past the slice end, and the K tile (in q's dtype)."""
    k_row = K + slots[:, None] * stride_kt + kvh * stride_kh
    k = _load_k_part(k_row, offs_d, D_MAIN, key_ok, q, KV_CAST)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if BLOCK_DPE > 0:
        # Scaled and added, not accumulated into one dot: a dot that feeds
        # another dot is laid out as an attention chain (every warpgroup
        # computing the whole tile), and Triton folds a plain add into it.
        kpe = _load_k_part(k_row + D_MAIN, offs_dpe, D_PE, key_ok, q, KV_CAST)
        s += tl.dot(qpe, tl.trans(kpe)) * qk_scale
    if HAS_CAP:
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
        s = s * 1.4426950408889634
    return tl.where(key_ok[None, :], s, float("-inf")), k


@triton.jit
def _prefix_slice_qk_ahead(
    acc, m_i, l_i, q, qpe, K, V, prefix_indices, kv_start, lo, hi,
    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
    offs_d, offs_dpe, offs_dv,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr, HAS_CAP: tl.constexpr, KV_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """A prefix slice with the scores one tile ahead of the PV product.

    Iteration i computes the scores of tile i + 1 and the softmax + PV of
    tile i. With the score product no longer feeding the PV product inside
    one iteration, Triton does not treat the two as a chained (attention)
    dot, so it splits the score tile's keys across the warpgroups instead of
    having every warpgroup compute the whole tile (Hopper, 8 warps: half the
    score MMAs). For absorbed MLA the K tile of tile i + 1 is carried to the
    next iteration as its V tile (a register copy of the pipelined shared
    tile, stored back for the PV product), so KV is still read once.
    """
    # One extra iteration: the first one only computes the scores of tile 0
    # (its "current" tile is empty), the last one computes none.
    s_next = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
    k_next = tl.zeros([BLOCK_N, BLOCK_D], dtype=q.dtype)
    slots = tl.zeros([BLOCK_N], dtype=tl.int64)
    key_ok = tl.zeros([BLOCK_N], dtype=tl.int1)
    for start in tl.range(lo - BLOCK_N, hi, BLOCK_N, num_stages=NUM_STAGES):
        s = s_next
        k_cur = k_next
        slots_cur = slots
        cur_ok = key_ok
        offs_n = start + BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        slots = tl.load(prefix_indices + kv_start + offs_n, mask=key_ok, other=0).to(tl.int64)
        s_next, k_next = _prefix_scores(
            q, qpe, K, slots, key_ok, kvh, stride_kt, stride_kh, qk_scale, logit_cap,
            offs_d, offs_dpe, D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, HAS_CAP, KV_CAST,
        )  # fmt: skip

        m_new, alpha, p, l_i = _online_softmax_step(m_i, l_i, s)
        if SHARE_KV:
            v = k_cur
        else:
            v_row = V + slots_cur[:, None] * stride_vt + kvh * stride_vh
            v = tl.load(
                v_row + offs_dv[None, :],
                mask=cur_ok[:, None] & (offs_dv[None, :] < D_V),
                other=0.0,
            )
            if KV_CAST:
                v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefix_slice_via_scratch(
    acc, m_i, l_i, q, qpe, K, prefix_indices, kv_start, lo, hi,
    kvh, stride_kt, stride_kh, qk_scale, logit_cap, P_scr, A_scr,
    offs_d, offs_dpe,
    D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, HAS_CAP: tl.constexpr, KV_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """An absorbed-MLA prefix slice whose P reaches the PV product through
    global memory (``scores_via_scratch``).

    The scores are computed transposed, S^T = K . Q^T (the K tile the A
    operand, Q the B operand: both stay in shared memory), with the online
    softmax along the key axis of S^T. P^T and the rescale factor alpha are
    stored to this program's scratch (``P_scr``: BLOCK_M x BLOCK_N in q's
    dtype, P[row, key]; ``A_scr``: BLOCK_M fp32) and read back for
    acc = alpha * acc + P . V, V = K[:, :512] being the K tile already loaded.
    Nothing the PV dot consumes is then computed from the score dot, so
    Triton does not lay the two out as an attention chain (every warpgroup
    computing the whole score tile): the score tile is split across the
    warpgroups. ``m_i``/``l_i`` stay in the scores' layout.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_N)
    # P^T [key, row] stored at P[row, key]; read back as P [row, key].
    pt_ptrs = P_scr + offs_m[None, :] * BLOCK_N + offs_k[:, None]
    p_ptrs = P_scr + offs_m[:, None] * BLOCK_N + offs_k[None, :]
    offs_n = lo + offs_k
    slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + offs_k
        key_ok = offs_n < hi
        # Slot indices one tile ahead (a direct K load for the pipeliner; see
        # the default loop in _tree_verify_split_kernel).
        slots = slots_next.to(tl.int64)
        slots_next = tl.load(
            prefix_indices + kv_start + offs_n + BLOCK_N,
            mask=offs_n + BLOCK_N < hi,
            other=0,
        )
        k_row = K + slots[:, None] * stride_kt + kvh * stride_kh
        k = _load_k_part(k_row, offs_d, D_MAIN, key_ok, q, KV_CAST)
        st = tl.dot(k, tl.trans(q)) * qk_scale
        if BLOCK_DPE > 0:
            # Scaled and added, not accumulated: a dot feeding another dot
            # (here the rope dot) is laid out as a chain, and a plain add
            # would be folded back into an accumulating dot.
            kpe = _load_k_part(k_row + D_MAIN, offs_dpe, D_PE, key_ok, q, KV_CAST)
            st += tl.dot(kpe, tl.trans(qpe)) * qk_scale
        if HAS_CAP:
            st = logit_cap * (2.0 * tl.sigmoid(2.0 * st / logit_cap) - 1.0)
            st = st * 1.4426950408889634
        st = tl.where(key_ok[:, None], st, float("-inf"))
        # Online softmax along the key axis (axis 0 of S^T), base 2.
        m_new = tl.maximum(m_i, tl.max(st, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        pt = tl.math.exp2(st - m_use[None, :])
        l_i = l_i * alpha + tl.sum(pt, 0)
        m_i = m_new
        # The hand-over through the scratch sits in a branch that is always
        # taken: Triton 3.6's loop scheduler moves ops of the loop body across
        # global stores and barriers (it orders by SSA only), and its pipeliner
        # would prefetch the read-back (a load feeding a dot) a tile ahead of
        # its store; a nested region keeps its order and is not prefetched.
        p = tl.zeros([BLOCK_M, BLOCK_N], dtype=q.dtype)
        alpha_v = tl.zeros([BLOCK_M], dtype=tl.float32)
        if start < hi:
            # WAR: every warp has read the previous tile's P and alpha.
            _cta_barrier(start)
            tl.store(pt_ptrs, pt.to(q.dtype))
            tl.store(A_scr + offs_m, alpha)
            # RAW: this tile's P and alpha are in memory, from every warp.
            _cta_barrier(start)
            # .cg: bypass L1 (the addresses are rewritten every tile).
            p = tl.load(p_ptrs, cache_modifier=".cg")
            alpha_v = tl.load(A_scr + offs_m, cache_modifier=".cg")
        acc = acc * alpha_v[:, None]
        acc = tl.dot(p, k, acc)
    return acc, m_i, l_i


@triton.jit
def _tree_verify_split_kernel(
    Q,
    K,
    V,
    O_part,
    Lse_part,
    prefix_indptr,
    prefix_indices,
    tree_indices,
    tree_mask,
    P_scratch,
    A_scratch,
    Ext_o,
    Ext_lse,
    qk_scale,
    logit_cap,
    v_scale,
    ext_lse_scale,
    window,
    num_nodes,
    group,
    num_heads,
    num_kv_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_tib,
    stride_mb,
    stride_mn,
    stride_eob,
    stride_eoq,
    stride_eoh,
    stride_elb,
    stride_elq,
    stride_elh,
    D_MAIN: tl.constexpr,
    D_PE: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr,
    HAS_CAP: tl.constexpr,
    Q_AS_B: tl.constexpr,
    QK_AHEAD: tl.constexpr,
    SCORES_VIA_SCRATCH: tl.constexpr,  # P through P_scratch / A_scratch (MLA, shared KV)
    REGISTER_PREFETCH: tl.constexpr,  # the next prefix KV tile loaded into registers ahead
    DV_SPLIT: tl.constexpr,
    KV_CAST: tl.constexpr,  # fp8 KV cache: tiles converted to q's dtype
    MERGE_EXT: tl.constexpr,  # merge Ext_o/Ext_lse into the tail and write the output
    BLOCK_DV_PROG: tl.constexpr,  # value columns per program: BLOCK_DV / DV_SPLIT
    D_CHUNKS: tl.constexpr,  # main head dims as this many column chunks (d_chunks)
    SLIDING: tl.constexpr,  # a key at distance > window (in positions) is not seen
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # With DV_SPLIT == 2 two neighbouring programs share a row tile and a
    # slice: each computes the whole score tile and owns half of the value
    # columns (see split_partials).
    pid_m = tl.program_id(0) // DV_SPLIT
    half = tl.program_id(0) % DV_SPLIT
    pid_s = tl.program_id(1)
    pid_bk = tl.program_id(2)
    b = pid_bk // num_kv_heads
    kvh = pid_bk % num_kv_heads

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < num_nodes * group
    node = offs_r // group
    head = kvh * group + offs_r % group
    tok = b * num_nodes + node

    q_row = Q + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    BLOCK_C: tl.constexpr = BLOCK_D // D_CHUNKS
    if D_CHUNKS > 1:
        # Tuples of column chunks (Q and the accumulator); see _attend_chunks.
        qs = _load_chunks(q_row, row_ok, D_CHUNKS, BLOCK_C)
        offs_d = tl.arange(0, BLOCK_C)
        offs_db = offs_d
        offs_dv = offs_d
        q = qs[0]
        qb = q
    elif DV_SPLIT > 1:
        # Main dims in two halves, this program's value half first; the
        # scores are the same sum in either order.
        offs_d = half * BLOCK_DV_PROG + tl.arange(0, BLOCK_DV_PROG)
        offs_db = (1 - half) * BLOCK_DV_PROG + tl.arange(0, BLOCK_DV_PROG)
        offs_dv = offs_d
        q = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        qb = tl.load(q_row + offs_db[None, :], mask=row_ok[:, None], other=0.0)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        offs_db = offs_d
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(
            q_row + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d[None, :] < D_MAIN),
            other=0.0,
        )
        qb = q
    if BLOCK_DPE > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(
            q_row + D_MAIN + offs_dpe[None, :],
            mask=row_ok[:, None] & (offs_dpe[None, :] < D_PE),
            other=0.0,
        )
    else:
        offs_dpe = offs_d
        qpe = q

    if D_CHUNKS > 1:
        acc = ()
        for c in tl.static_range(D_CHUNKS):
            acc = acc + (tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32),)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_DV_PROG], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if SLIDING:
        # Node i sits at position prefix_len + depth(i): with the window it sees
        # prefix key t iff prefix_len + depth(i) - t <= window, tree node j iff
        # depth(i) - depth(j) <= window (and j is an ancestor or i itself).
        # Prefix key t is at position t of the prefix passed, which is the last
        # prefix_len committed tokens (all of them, or a window's worth).
        depth = _tree_depth(tree_mask + b * stride_mb + node * stride_mn, row_ok, num_nodes)
    else:
        depth = tl.zeros([BLOCK_M], dtype=tl.int32)
    if pid_s < num_splits:
        # A slice of the committed prefix: no mask (but the window), every row
        # sees every key.
        kv_start = tl.load(prefix_indptr + b)
        prefix_len = tl.load(prefix_indptr + b + 1) - kv_start
        if SLIDING:
            # Keys before prefix_len - window are out of every row's window.
            base = tl.maximum(prefix_len - window, 0)
        else:
            base = 0
        win_lo = prefix_len + depth - window
        chunk = tl.cdiv(tl.cdiv(prefix_len - base, num_splits), BLOCK_N) * BLOCK_N
        lo = base + pid_s * chunk
        hi = tl.minimum(lo + chunk, prefix_len)
        if D_CHUNKS > 1:
            acc, m_i, l_i = _prefix_slice_chunked(
                acc, m_i, l_i, qs, qpe, K, V, prefix_indices, kv_start, lo, hi,
                kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap, offs_dpe,
                win_lo, D_MAIN, D_PE, BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, KV_CAST,
                REGISTER_PREFETCH, D_CHUNKS, BLOCK_C, BLOCK_N, NUM_STAGES, SLIDING,
            )  # fmt: skip
        elif SCORES_VIA_SCRATCH:
            tl.static_assert(not SLIDING, "sliding windows: not with scores_via_scratch")
            # One scratch region per program of the launch grid.
            prog = tl.program_id(0) + tl.num_programs(0) * (
                pid_s + tl.num_programs(1) * pid_bk
            )
            acc, m_i, l_i = _prefix_slice_via_scratch(
                acc, m_i, l_i, q, qpe, K, prefix_indices, kv_start, lo, hi,
                kvh, stride_kt, stride_kh, qk_scale, logit_cap,
                P_scratch + prog.to(tl.int64) * (BLOCK_M * BLOCK_N),
                A_scratch + prog.to(tl.int64) * BLOCK_M,
                offs_d, offs_dpe,
                D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, HAS_CAP, KV_CAST,
                BLOCK_M, BLOCK_N, NUM_STAGES,
            )  # fmt: skip
        elif REGISTER_PREFETCH:
            acc, m_i, l_i = _prefix_slice_register_prefetch(
                acc, m_i, l_i, q, qb, qpe, K, V, prefix_indices, kv_start, lo, hi,
                kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
                offs_d, offs_dpe, offs_dv, win_lo,
                D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, HAS_CAP,
                Q_AS_B, KV_CAST, BLOCK_N, SLIDING,
            )  # fmt: skip
        elif QK_AHEAD:
            tl.static_assert(not SLIDING, "sliding windows: not with qk_ahead")
            acc, m_i, l_i = _prefix_slice_qk_ahead(
                acc, m_i, l_i, q, qpe, K, V, prefix_indices, kv_start, lo, hi,
                kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
                offs_d, offs_dpe, offs_dv,
                D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, HAS_CAP,
                KV_CAST, BLOCK_M, BLOCK_N, NUM_STAGES,
            )  # fmt: skip
        else:
            offs_n = lo + tl.arange(0, BLOCK_N)
            slots_next = tl.load(prefix_indices + kv_start + offs_n, mask=offs_n < hi, other=0)
            for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
                offs_n = start + tl.arange(0, BLOCK_N)
                key_ok = offs_n < hi
                # The next tile's slot indices are loaded one iteration ahead
                # as a loop-carried value: to the pipeliner the K tile load is
                # then a direct load and gets the whole prefetch distance (an
                # index load in the same iteration makes it an indirect chain,
                # and Triton splits the stages between the chain's levels).
                slots = slots_next
                slots_next = tl.load(
                    prefix_indices + kv_start + offs_n + BLOCK_N,
                    mask=offs_n + BLOCK_N < hi,
                    other=0,
                )
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, qb, qpe, K, V, slots.to(tl.int64), key_ok,
                    offs_n[None, :] >= win_lo[:, None],
                    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
                    offs_d, offs_db, offs_dpe, offs_dv,
                    D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, HAS_CAP,
                    Q_AS_B, DV_SPLIT, KV_CAST, MASKED=SLIDING,
                )  # fmt: skip
    if pid_s == tl.maximum(num_splits, 1) - 1:
        # The tree tail: node i sees node j iff bit j of its ancestor mask is set.
        mask_row = tree_mask + b * stride_mb + node * stride_mn
        for start in tl.range(0, num_nodes, BLOCK_N, num_stages=1):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < num_nodes
            slots = tl.load(
                tree_indices + b * stride_tib + offs_n, mask=key_ok, other=0
            )
            words = tl.load(
                mask_row[:, None] + (offs_n // 32)[None, :],
                mask=row_ok[:, None] & key_ok[None, :],
                other=0,
            )
            visible = ((words >> (offs_n % 32)[None, :]) & 1) != 0
            if SLIDING:
                key_depth = _tree_depth(
                    tree_mask + b * stride_mb + offs_n * stride_mn, key_ok, num_nodes
                )
                visible &= (depth[:, None] - key_depth[None, :]) <= window
            if D_CHUNKS > 1:
                ks, kpe, vs = _load_kv_chunks(
                    K, V, slots.to(tl.int64), key_ok, kvh, stride_kt, stride_kh, stride_vt,
                    stride_vh, offs_dpe, D_MAIN, D_PE, BLOCK_DPE, SHARE_KV, D_CHUNKS, BLOCK_C,
                )  # fmt: skip
                acc, m_i, l_i = _attend_chunks(
                    acc, m_i, l_i, qs, qpe, ks, kpe, vs, key_ok, visible, qk_scale, logit_cap,
                    BLOCK_DPE, SHARE_KV, HAS_CAP, Q_AS_B, KV_CAST, True, D_CHUNKS,
                )  # fmt: skip
            else:
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, qb, qpe, K, V, slots.to(tl.int64), key_ok, visible,
                    kvh, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, logit_cap,
                    offs_d, offs_db, offs_dpe, offs_dv,
                    D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, SHARE_KV, HAS_CAP,
                    Q_AS_B, DV_SPLIT, KV_CAST, MASKED=True,
                )  # fmt: skip

    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_row = O_part + pid_s * stride_ps + tok[:, None].to(tl.int64) * stride_pt + head[:, None] * stride_ph
    if D_CHUNKS > 1:
        o_scale = (v_scale / tl.where(seen, l_i, 1.0))[:, None]
        for c in tl.static_range(D_CHUNKS):
            tl.store(
                o_row + c * BLOCK_C + offs_dv[None, :],
                (acc[c] * o_scale).to(O_part.dtype.element_ty),
                mask=row_ok[:, None],
            )
    else:
        _store_partial(
            acc, l_i, lse, v_scale, seen, o_row, Ext_o, Ext_lse, ext_lse_scale, prefix_indptr, b,
            node, head, row_ok, offs_dv, stride_eob, stride_eoq, stride_eoh, stride_elb,
            stride_elq, stride_elh, D_V, MERGE_EXT,
        )  # fmt: skip
    if not MERGE_EXT:
        out_row = (tok * num_heads + head).to(tl.int64)
        tl.store(Lse_part + pid_s * stride_ls + out_row, lse, mask=row_ok & (half == 0))


@triton.jit
def _store_partial(
    acc, l_i, lse, v_scale, seen, o_row, Ext_o, Ext_lse, ext_lse_scale, prefix_indptr, b,
    node, head, row_ok, offs_dv, stride_eob, stride_eoq, stride_eoh, stride_elb,
    stride_elq, stride_elh, D_V: tl.constexpr, MERGE_EXT: tl.constexpr,
):  # fmt: skip
    """Store a program's normalised output at ``o_row + column``; with
    ``MERGE_EXT`` first merged with the external prefix pass by the LSEs."""
    o = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    col_ok = row_ok[:, None] & (offs_dv[None, :] < D_V)
    if MERGE_EXT:
        # The prefix came from another kernel (FlashMLA, FlashInfer): weigh it
        # against the tail by the two LSEs here instead of in a combine launch.
        # A request with no prefix has no pass to merge, whatever it left there.
        has_prefix = tl.load(prefix_indptr + b + 1) > tl.load(prefix_indptr + b)
        ext_lse = tl.load(
            Ext_lse + b * stride_elb + node * stride_elq + head * stride_elh,
            mask=row_ok & has_prefix,
            other=float("-inf"),
        )
        ext_lse = tl.where(has_prefix, ext_lse * ext_lse_scale, float("-inf"))
        ext_o = tl.load(
            Ext_o + b.to(tl.int64) * stride_eob + node[:, None] * stride_eoq
            + head[:, None] * stride_eoh + offs_dv[None, :],
            mask=col_ok & has_prefix,
            other=0.0,
        ).to(tl.float32)
        m = tl.maximum(lse, ext_lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_tail = tl.math.exp2(lse - m)
        w_ext = tl.math.exp2(ext_lse - m)
        den = w_tail + w_ext
        o = (o * w_tail[:, None] + ext_o * w_ext[:, None]) / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(o_row + offs_dv[None, :], o.to(o_row.dtype.element_ty), mask=col_ok)


@triton.jit
def _tree_verify_combine_kernel(
    O_part,
    Lse_part,
    Out,
    Sinks,
    total_rows,
    num_parts,
    num_heads,
    stride_ps,
    stride_pr,
    stride_ls,
    stride_ot,
    stride_oh,
    D_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PARTS_PER_STEP: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Merge every split's partial output of one row (one ``BLOCK_DV`` slice)
    by its log-sum-exp and write ``Out``. All LSEs of the row are read at once,
    and the partial outputs stream in ``PARTS_PER_STEP x BLOCK_DV`` tiles, so
    a row with many splits keeps many loads in flight. ``HAS_SINK``: the head's
    sink logit (natural log, ``Sinks[head]``) joins the softmax denominator
    with no value (gpt-oss attention sinks)."""
    row = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D_V
    offs_p = tl.arange(0, BLOCK_P)
    lse = tl.load(Lse_part + offs_p * stride_ls + row, mask=offs_p < num_parts, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINK:
        sink = tl.load(Sinks + row % num_heads).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.math.exp2(lse - m), 0)
    if HAS_SINK:
        den += tl.math.exp2(sink - m)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    part_row = O_part + row.to(tl.int64) * stride_pr
    for s0 in tl.range(0, num_parts, PARTS_PER_STEP, num_stages=2):
        offs_s = s0 + tl.arange(0, PARTS_PER_STEP)
        s_ok = offs_s < num_parts
        w = tl.math.exp2(
            tl.load(Lse_part + offs_s * stride_ls + row, mask=s_ok, other=float("-inf")) - m
        )
        o = tl.load(
            part_row + offs_s[:, None].to(tl.int64) * stride_ps + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(den > 0.0, den, 1.0)
    tok = row // num_heads
    head = row % num_heads
    tl.store(
        Out + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=d_ok,
    )


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def choose_num_splits(
    row_tiles: int,
    total_prefix_tokens: int,
    bs: int,
    config: TreeVerifyConfig,
    num_sms: int,
    max_splits: int = 256,
) -> int:
    """Prefix splits per request, from static sizes only (no device read).

    ``total_prefix_tokens`` is ``prefix_kv_indices.numel()``: the exact sum of
    prefix lengths in eager mode, the buffer capacity under CUDA-graph capture;
    either way it is known on the host. The cost model counts waves of
    programs times keys per program plus a fixed per-program overhead (query
    load, partial store, combine read), and picks the cheapest split count.
    """
    if total_prefix_tokens <= 0:
        return 0
    avg_prefix = -(-total_prefix_tokens // bs)
    slots = max(1, num_sms * config.ctas_per_sm)
    limit = max(1, min(max_splits, avg_prefix // (2 * config.block_n)))
    best, best_cost = 1, math.inf
    for s in range(1, limit + 1):
        programs = row_tiles * s
        waves = -(-programs // slots)
        keys = -(-avg_prefix // s)
        cost = waves * (keys + config.split_overhead_keys)
        if cost < best_cost * 0.999:
            best, best_cost = s, cost
    return best


def dv_split_for(config: TreeVerifyConfig, dqk: int, dv: int, share_kv: bool) -> int:
    """Programs per row tile: 2 splits the value columns of absorbed MLA.

    A 64 x 512 fp32 accumulator needs two warpgroups, and Triton then has
    both compute the same score tile with narrow MMAs; with the value columns
    split over two programs each program is one warpgroup with a 64 x 256
    accumulator and wide score MMAs, at the price of computing the scores
    twice (65 % useful MMA work, as before, but far fewer shared-memory operand
    reads per MMA). The two programs of a pair read the same KV tile at about
    the same time, so the second read is served by L2.
    """
    if config.dv_split <= 1:
        return 1
    d_main, d_pe, block_d, block_dpe, block_dv = head_dim_blocks(dqk, dv)
    ok = (
        share_kv
        and d_main == dv == block_d == block_dv
        and block_d % (2 * 16) == 0
        and not config.q_as_b
        and not config.qk_ahead
    )
    return config.dv_split if ok else 1


def d_chunks_for(config: TreeVerifyConfig, dqk: int, dv: int, share_kv: bool) -> int:
    """Column chunks of the main head dims (``TreeVerifyConfig.d_chunks``) where
    the chunked loop applies: one program owning all value columns, main dims
    a power of two equal to Dv, chunks of at least 16 columns; 1 elsewhere."""
    if config.d_chunks <= 1 or dv_split_for(config, dqk, dv, share_kv) > 1:
        return 1
    d_main, _, block_d, _, block_dv = head_dim_blocks(dqk, dv)
    ok = d_main == dv == block_d == block_dv and block_d % (16 * config.d_chunks) == 0
    return config.d_chunks if ok else 1


def check_sliding_window(config: TreeVerifyConfig, sliding_window: Optional[int]) -> None:
    """A window is applied by the default prefix loop, the register prefetch and
    the chunked loop; the absorbed-MLA loops (scores via scratch, qk_ahead) have
    none (no MLA model has sliding-window layers). Raises ``ValueError``."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (None: no window), got {sliding_window!r}")
    if config.scores_via_scratch or config.qk_ahead:
        raise ValueError(
            "sliding_window: the scores_via_scratch and qk_ahead prefix loops apply no window; "
            f"got {config}"
        )


def check_scores_via_scratch(config: TreeVerifyConfig, dqk: int, dv: int, share_kv: bool) -> None:
    """``scores_via_scratch`` is written for absorbed MLA only: a power-of-two
    latent part plus rope dims (576 = 512 + 64), V = K[..., :512] (the K tile
    reused as the V tile), 64-key tiles. Raises ``ValueError`` otherwise."""
    if not config.scores_via_scratch:
        return
    if config.block_n != 64:
        raise ValueError(f"scores_via_scratch needs block_n=64, got {config.block_n}")
    d_main, d_pe, block_d, block_dpe, block_dv = head_dim_blocks(dqk, dv)
    if not (share_kv and d_pe > 0 and d_main == dv == block_d == block_dv):
        raise ValueError(
            "scores_via_scratch needs absorbed MLA with a shared KV buffer "
            "(Dqk = Dv + rope dims, v_buffer = k_buffer[..., :Dv], reuse_k_tile); "
            f"got Dqk={dqk}, Dv={dv}, shared={share_kv}"
        )


def kv_shares_storage(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """V is a leading slice of K (absorbed MLA): reuse the K tile as the V tile."""
    return (
        v_buffer.data_ptr() == k_buffer.data_ptr()
        and v_buffer.stride()[:2] == k_buffer.stride()[:2]
        and v_buffer.shape[-1] <= k_buffer.shape[-1]
    )


def call_config(arch, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> TreeVerifyConfig:
    """The tile configuration of one call on kernel arch ``arch``: its head dims, and
    whether V is a view of K."""
    return select_config(arch, q.shape[-1], v_buffer.shape[-1], kv_shares_storage(k_buffer, v_buffer))


def reuses_k_tile(config: TreeVerifyConfig, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    d_main, _, block_d, _, block_dv = head_dim_blocks(k_buffer.shape[2], v_buffer.shape[2])
    return (
        config.reuse_k_tile
        and kv_shares_storage(k_buffer, v_buffer)
        and block_dv == block_d
        and v_buffer.shape[2] == d_main
    )


def split_partials(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    config: TreeVerifyConfig,
    num_splits: int,
    kv_scales: Optional[Tuple[float, float]] = None,
    sliding_window: Optional[int] = None,
):
    """Run the split kernel: ``num_splits`` prefix slices plus the tree tail.

    Returns ``(o_part, lse_part)`` of shapes ``[parts, bs*N*H, Dv]`` and
    ``[parts, bs*N*H]`` (fp32, base-2 LSE), ``parts = max(num_splits, 1)``;
    the tail is folded into the last split (part 0 when ``num_splits`` is 0).
    ``kv_scales``: ``(k_scale, v_scale)`` of an fp8 KV cache (None otherwise).
    ``sliding_window``: see ``tree_verify_fused``.
    """
    bs, n = tree_kv_indices.shape
    h, dv = q.shape[1], v_buffer.shape[2]
    parts = max(num_splits, 1)
    o_part = torch.empty(parts, bs * n * h, dv, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(parts, bs * n * h, dtype=torch.float32, device=q.device)
    _launch_split(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, logit_cap, config, num_splits, kv_scales,
        o_part, (o_part.stride(0), o_part.stride(1) * h, o_part.stride(1)), lse_part,
        sliding_window=sliding_window,
    )  # fmt: skip
    return o_part, lse_part


def _launch_split(
    q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
    tree_mask, sm_scale, logit_cap, config, num_splits, kv_scales,
    o_out, o_strides, lse_part, external=None, sliding_window=None,
):  # fmt: skip
    """``o_out`` is written at ``part * o_strides[0] + token * o_strides[1] +
    head * o_strides[2]``: the fp32 partials, or with ``external = (o, lse,
    lse_scale)`` (a prefix pass merged in the epilogue; num_splits 0) the output."""
    check_sliding_window(config, sliding_window)
    bs, n = tree_kv_indices.shape
    h, dqk = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    dv = v_buffer.shape[2]
    group = h // hkv
    d_main, d_pe, block_d, block_dpe, block_dv = head_dim_blocks(dqk, dv)
    share_kv = reuses_k_tile(config, k_buffer, v_buffer)
    has_cap = logit_cap > 0
    k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
    qk_scale = sm_scale * k_scale * (1.0 if has_cap else _LOG2E)
    if bs == 0:
        return
    dv_split = dv_split_for(config, dqk, dv, share_kv)
    row_tiles = triton.cdiv(n * group, config.block_m)
    grid = (row_tiles * dv_split, max(num_splits, 1), bs * hkv)
    check_scores_via_scratch(config, dqk, dv, share_kv)
    via_scratch = config.scores_via_scratch and num_splits > 0
    if via_scratch:
        # Per program: P [block_m, block_n] in q's dtype and alpha [block_m] fp32.
        programs = grid[0] * grid[1] * grid[2]
        p_scratch = torch.empty(
            programs * config.block_m * config.block_n, dtype=q.dtype, device=q.device
        )
        a_scratch = torch.empty(programs * config.block_m, dtype=torch.float32, device=q.device)
    else:
        p_scratch, a_scratch = q, lse_part  # unused
    if external is not None:
        ext_o, ext_lse, ext_lse_scale = external
        ext_o_strides, ext_lse_strides = ext_o.stride()[:3], ext_lse.stride()
    else:
        ext_o, ext_lse, ext_lse_scale = q, lse_part, 1.0  # unused
        ext_o_strides = ext_lse_strides = (0, 0, 0)
    _tree_verify_split_kernel[grid](
        q, k_buffer, v_buffer, o_out, lse_part,
        prefix_kv_indptr, prefix_kv_indices, tree_kv_indices, tree_mask,
        p_scratch, a_scratch, ext_o, ext_lse,
        qk_scale, float(logit_cap), float(v_scale), float(ext_lse_scale),
        int(sliding_window) if sliding_window is not None else 0,
        n, group, h, hkv, num_splits,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        *o_strides, lse_part.stride(0),
        tree_kv_indices.stride(0),
        tree_mask.stride(0), tree_mask.stride(1),
        *ext_o_strides, *ext_lse_strides,
        D_MAIN=d_main, D_PE=d_pe, D_V=dv,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=block_dv,
        SHARE_KV=share_kv, HAS_CAP=has_cap, Q_AS_B=config.q_as_b,
        QK_AHEAD=config.qk_ahead, SCORES_VIA_SCRATCH=via_scratch,
        REGISTER_PREFETCH=config.register_prefetch,
        DV_SPLIT=dv_split, BLOCK_DV_PROG=block_dv // dv_split,
        D_CHUNKS=d_chunks_for(config, dqk, dv, share_kv),
        SLIDING=sliding_window is not None,
        KV_CAST=k_buffer.dtype != q.dtype, MERGE_EXT=external is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def combine_tiles(dv: int, parts: int):
    """``(BLOCK_DV, PARTS_PER_STEP, num_warps)`` of the combine kernel: few
    parts (compute-bound shapes) read one part per step with one warp; many
    parts (long prefixes split across the GPU) read 16 at a time."""
    block_dv = min(128, triton.next_power_of_2(dv))
    if parts <= 4:
        return block_dv, triton.next_power_of_2(parts), 1
    return block_dv, 16, 4


def combine_partials(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Merge ``[parts, rows, Dv]`` partials by their base-2 LSE into ``out``
    (``[tokens, H, Dv]``, rows = tokens * H); ``sinks``: ``[H]`` sink logits
    (natural log) added to each head's softmax denominator."""
    parts, total_rows, dv = o_part.shape
    if total_rows == 0:
        return out
    block_dv, parts_per_step, warps = combine_tiles(dv, parts)
    _tree_verify_combine_kernel[(total_rows, triton.cdiv(dv, block_dv))](
        o_part, lse_part, out, sinks if sinks is not None else lse_part,
        total_rows, parts, out.shape[1],
        o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        out.stride(0), out.stride(1),
        D_V=dv, BLOCK_P=triton.next_power_of_2(parts), BLOCK_DV=block_dv,
        PARTS_PER_STEP=parts_per_step, HAS_SINK=sinks is not None, num_warps=warps,
    )  # fmt: skip
    return out


def tail_only_config(config: TreeVerifyConfig) -> TreeVerifyConfig:
    """The tile of a launch that runs the tree tail alone (a prefix pass from
    another kernel merged in): a few key tiles per program make it latency-bound,
    so more, smaller programs win. On the H200 (``flashmla_split_parts_epilogue_merge_h200_2026-11-30.json``)
    32 rows, 4 warps and the value columns over two programs take 0.0195 ms at
    H=16 N=65 against 0.0369 with the prefix tile, and are within 15 % of the best
    of 8 tiles at every shape measured."""
    return dataclasses.replace(
        config, block_m=32, num_warps=4, num_stages=1, dv_split=2, q_as_b=False,
        qk_ahead=False, scores_via_scratch=False, register_prefetch=False, d_chunks=1,
    )  # fmt: skip


def tail_partials(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    config: TreeVerifyConfig,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
) -> None:
    """The tree tail alone, with the tail-only tile, into ``o_part [bs*N*H, Dv]``
    and ``lse_part [bs*N*H]`` (fp32, base-2 LSE): for a prefix pass computed
    elsewhere and merged afterwards (flashmla_split, which runs it beside FlashMLA)."""
    h = q.shape[1]
    _launch_split(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, 0.0, tail_only_config(config), 0, None,
        o_part, (0, o_part.stride(0) * h, o_part.stride(0)), lse_part.view(1, -1),
    )  # fmt: skip


def merge_external_prefix(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    config: TreeVerifyConfig,
    o_prefix: torch.Tensor,
    lse_prefix: torch.Tensor,
    out: Optional[torch.Tensor],
    lse_scale: float = 1.0,
) -> torch.Tensor:
    """Our masked tree tail plus a prefix pass another kernel computed (FlashInfer,
    FlashMLA), merged in one launch: ``o_prefix`` is ``[bs, N, H, Dv]`` and
    ``lse_prefix`` ``[bs, N, H]``, any strides (FlashMLA's LSE is head-major),
    ``lse * lse_scale`` a base-2 LSE. What the pass left for a request with an
    empty prefix is ignored."""
    bs, n = tree_kv_indices.shape
    h, dv = q.shape[1], v_buffer.shape[2]
    if o_prefix.shape != (bs, n, h, dv) or lse_prefix.shape != (bs, n, h):
        raise ValueError(
            f"external prefix pass: want o [{bs}, {n}, {h}, {dv}] and lse [{bs}, {n}, {h}]; "
            f"got {tuple(o_prefix.shape)} and {tuple(lse_prefix.shape)}"
        )
    if o_prefix.stride(-1) != 1 or lse_prefix.dtype != torch.float32:
        raise ValueError("external prefix pass: o needs unit stride in Dv and lse fp32")
    if out is None:
        out = q.new_empty(bs * n, h, dv)
    target = out if out.stride(2) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    _launch_split(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, 0.0, tail_only_config(config), 0, None,
        target, (0, target.stride(0), target.stride(1)),
        q.new_empty(1, 1, dtype=torch.float32), external=(o_prefix, lse_prefix, lse_scale),
    )  # fmt: skip
    if target is not out:
        out.copy_(target)
    return out


def num_splits_for(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    bs: int,
    n: int,
    config: TreeVerifyConfig,
    sliding_window: Optional[int] = None,
) -> int:
    """The split count for this launch (``choose_num_splits``); with a sliding
    window only the window's keys of each prefix are split."""
    hkv = k_buffer.shape[1]
    group = q.shape[1] // hkv
    dv_split = dv_split_for(
        config, q.shape[2], v_buffer.shape[2], reuses_k_tile(config, k_buffer, v_buffer)
    )
    row_tiles = triton.cdiv(n * group, config.block_m) * dv_split
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
    keys = prefix_kv_indices.numel()
    if sliding_window is not None:
        keys = min(keys, bs * (sliding_window + 1))
    return choose_num_splits(row_tiles * bs * hkv, keys, bs, config, sms)


def tree_verify_fused(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    out: Optional[torch.Tensor],
    logit_cap: float,
    config: TreeVerifyConfig,
    num_splits: Optional[int] = None,
    kv_scales: Optional[Tuple[float, float]] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Split kernel then combine kernel. Inputs are validated by the
    dispatcher; ``num_splits`` overrides the heuristic (tests, tuning);
    ``kv_scales`` = ``(k_scale, v_scale)`` of an fp8 KV cache.

    ``sliding_window`` (upstream's ``layer.sliding_window_size``): a node at
    position p sees keys at positions >= p - sliding_window only. Node i sits
    at ``prefix_len + depth(i)`` (depth from its ancestor mask), prefix key t at
    ``t``: the prefix passed must be the last ``prefix_len`` committed tokens of
    the request (the whole prefix, or the part inside the window).
    ``sinks``: ``[H]`` per-head sink logits (natural log), one more term of each
    row's softmax denominator with no value."""
    bs, n = tree_kv_indices.shape
    if num_splits is None:
        num_splits = num_splits_for(
            q, k_buffer, v_buffer, prefix_kv_indices, bs, n, config, sliding_window
        )
    if out is None:
        out = q.new_empty(bs * n, q.shape[1], v_buffer.shape[2])
    o_part, lse_part = split_partials(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices,
        tree_kv_indices, tree_mask, sm_scale, logit_cap, config, num_splits,
        kv_scales=kv_scales, sliding_window=sliding_window,
    )  # fmt: skip
    return combine_partials(o_part, lse_part, out, sinks)

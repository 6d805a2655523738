# SPDX-License-Identifier: Apache-2.0
"""One entry point over the tree-verify strategies: validate the call, look the
strategy up in the registry, run it.

Every strategy computes the same attention (each tree node over its request's
committed prefix and the tree nodes its ancestor bitmask allows); each is one
module under ``strategies/``:

* ``fused``: the prefix-split Triton kernels in this package; every arch,
  CUDA-graph capturable with no host work per step;
* ``flashinfer_split``: FlashInfer's prefix pass, our tree tail, LSE merge;
* ``flashmla_split``: the prefix copied into 64-token pages, FlashMLA over them,
  our tree tail, LSE merge (sm_90 / sm_100 only);
* ``upstream_extend``: upstream's Triton extend kernel with a dense mask
  (the baseline);
* ``reference``: plain torch in fp32 (the CPU default).

A caller that names none gets ``fused`` on a GPU and ``reference`` on the CPU.
Which one serves a server's verify is the policy's ranking (``policy.py``) unless
``SGLANG_DDTREE_VERIFY_STRATEGY`` forces one (:func:`forced_strategy`). A strategy
that cannot run here raises :class:`StrategyUnavailable` saying why.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.layers.attention.tree_verify.masks import MAX_TREE_SIZE, mask_words
from sglang.srt.layers.attention.tree_verify.registry import (
    FUSED,
    REFERENCE,
    STRATEGIES,
    StrategyUnavailable,
)
from sglang.srt.layers.attention.tree_verify.strategies import get_strategy
from sglang.srt.utils import gpu_arch

#: KV cache dtypes served next to q's own: scaled fp8 (dequantized in the kernel),
#: by the strategies that read them.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

STRATEGY_ENV = "SGLANG_DDTREE_VERIFY_STRATEGY"


def forced_strategy() -> Optional[str]:
    """The strategy ``SGLANG_DDTREE_VERIFY_STRATEGY`` forces for a server's target
    verify, None when unset; a name that is not a strategy is refused."""
    value = (ddtree_envs.SGLANG_DDTREE_VERIFY_STRATEGY.get() or "").strip()
    if not value:
        return None
    if value not in STRATEGIES:
        raise ValueError(
            f"{STRATEGY_ENV}={value!r} is not a tree-verify strategy; choose from "
            f"{', '.join(STRATEGIES)}, or unset it for the per-arch policy"
        )
    return value


def _validate(q, k_buffer, v_buffer, indptr, indices, tree_idx, tree_mask, out):
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError(
            "expected q [bs*N, H, Dqk], k_buffer [pool, Hkv, Dqk], v_buffer "
            f"[pool, Hkv, Dv]; got {tuple(q.shape)}, {tuple(k_buffer.shape)}, "
            f"{tuple(v_buffer.shape)}"
        )
    if tree_idx.dim() != 2:
        raise ValueError(f"tree_kv_indices must be [bs, N], got {tuple(tree_idx.shape)}")
    bs, n = tree_idx.shape
    h, dqk = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    if not 1 <= n <= MAX_TREE_SIZE:
        raise ValueError(f"tree size N={n} must be in [1, {MAX_TREE_SIZE}]")
    if q.shape[0] != bs * n:
        raise ValueError(f"q has {q.shape[0]} rows, expected bs*N = {bs}*{n}")
    if k_buffer.shape[2] != dqk or v_buffer.shape[1] != hkv:
        raise ValueError("k_buffer must match q's head dim and v_buffer k_buffer's KV heads")
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be fp16 or bf16, got {q.dtype}")
    if k_buffer.dtype != v_buffer.dtype or k_buffer.dtype not in (q.dtype, *FP8_KV_DTYPES):
        raise TypeError(
            f"KV buffers must both have q's dtype {q.dtype} or both one fp8 dtype "
            f"{FP8_KV_DTYPES}; got {k_buffer.dtype} and {v_buffer.dtype}"
        )
    for name, t in (("prefix_kv_indptr", indptr), ("prefix_kv_indices", indices),
                    ("tree_kv_indices", tree_idx), ("tree_mask", tree_mask)):  # fmt: skip
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if indptr.shape != (bs + 1,):
        raise ValueError(f"prefix_kv_indptr must be [bs+1] = [{bs + 1}], got {tuple(indptr.shape)}")
    if tree_mask.shape != (bs, n, mask_words(n)):
        raise ValueError(
            f"tree_mask must be [bs, N, ceil(N/32)] = [{bs}, {n}, {mask_words(n)}], "
            f"got {tuple(tree_mask.shape)}"
        )
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if out is not None and (
        out.shape != (bs * n, h, v_buffer.shape[2]) or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be [bs*N, H, Dv] = [{bs * n}, {h}, {v_buffer.shape[2]}] "
            f"with a contiguous last dim, got {tuple(out.shape)}"
        )


def tree_verify_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    out: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    strategy: Optional[str] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    strategy_options: Optional[dict] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of every tree node over its request's committed prefix and
    its visible tree nodes; returns ``[bs*N, H, Dv]`` (``out`` when given).

    ``strategy``: one of :data:`STRATEGIES`; None is ``fused`` on a GPU and
    ``reference`` on the CPU. ``strategy_options``: keyword arguments for that
    strategy (flashinfer_split: ``prefix_pass``, planned ahead; flashmla_split:
    ``staging`` and ``plan`` or ``max_prefix_len``, which make it
    graph-capturable).

    ``sliding_window`` (upstream's ``layer.sliding_window_size``; None: full
    attention): a node sees keys at most this many positions before its own.
    Node i sits at ``prefix_len + depth(i)``, prefix key t at ``t``: the prefix
    passed is the request's last ``prefix_len`` committed tokens. ``sinks``:
    ``[H]`` per-head sink logits (gpt-oss), added to each softmax denominator.
    Both: ``fused`` and ``reference`` only.

    An fp8 KV cache holds ``K / k_scale`` and ``V / v_scale`` (upstream's
    per-layer scales); the scales are ignored for a KV cache in q's dtype.

    Launch shapes depend only on ``bs``, ``N``, head counts and
    ``prefix_kv_indices.numel()``, so the ``fused`` path is CUDA-graph
    capturable with preallocated index buffers.
    """
    tree_kv_indices = tree_kv_indices.contiguous()
    tree_mask = tree_mask.contiguous()
    _validate(q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices,
              tree_kv_indices, tree_mask, out)  # fmt: skip
    window_and_sinks = _validate_window_and_sinks(q, sliding_window, sinks)
    arch = gpu_arch.kernel_arch(q.device) if q.is_cuda else None
    if strategy is None:
        strategy = REFERENCE if arch is None else FUSED
    unit = get_strategy(strategy)
    if arch is None and not unit.runs_on_cpu and not _interpreting():
        raise StrategyUnavailable(
            f"strategy {strategy!r} needs a CUDA device (q is on {q.device}); "
            "use strategy='reference' on CPU"
        )
    kv_scales = None
    if k_buffer.dtype != q.dtype:
        if not unit.reads_fp8_kv:
            raise StrategyUnavailable(
                f"{strategy}: an fp8 KV cache is served by the fused and reference strategies only"
            )
        kv_scales = (float(k_scale), float(v_scale))
    if window_and_sinks and not unit.applies_window_and_sinks:
        raise StrategyUnavailable(
            f"{strategy}: sliding windows and attention sinks are served by the fused "
            "and reference strategies only"
        )
    return unit.run(
        q=q, k_buffer=k_buffer, v_buffer=v_buffer,
        prefix_kv_indptr=prefix_kv_indptr, prefix_kv_indices=prefix_kv_indices,
        tree_kv_indices=tree_kv_indices, tree_mask=tree_mask,
        sm_scale=float(sm_scale), out=out, logit_cap=float(logit_cap),
        arch=arch or (8, 0), kv_scales=kv_scales, **window_and_sinks, **(strategy_options or {}),
    )  # fmt: skip


def _validate_window_and_sinks(q, sliding_window, sinks) -> dict:
    """The window/sink keyword arguments for the strategy (empty when neither)."""
    extra = {}
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
            raise ValueError(
                f"sliding_window must be an int >= 0 (None for full attention), got {sliding_window!r}"
            )
        extra["sliding_window"] = sliding_window
    if sinks is not None:
        if sinks.shape != (q.shape[1],) or sinks.device != q.device:
            raise ValueError(
                f"sinks must be [H] = [{q.shape[1]}] on {q.device}, got "
                f"{tuple(sinks.shape)} on {sinks.device}"
            )
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
        extra["sinks"] = sinks.contiguous()
    return extra


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

"""One entry point over the tree-verify strategies.

``fused`` (the prefix-split Triton kernels in this package) is the default on
every arch: it needs no host work per step, so it replays in CUDA graphs under
the overlap scheduler. On an H200, ``flashinfer_split`` is faster at most
MLA shapes but plans on the host from the prefix lengths every step
(docs/tree-verify.md, "Strategy choice"). The others stay selectable for
measurement and as fallbacks: ``upstream_extend`` (upstream's Triton extend kernel with a
dense mask), ``flashinfer_split`` (FlashInfer prefix pass + our tail + LSE
merge), ``flashmla_split`` (the prefix copied into 64-token pages, FlashMLA over
them, our tail, LSE merge; sm_90/sm_100), ``reference`` (plain torch, fp32). A strategy that cannot run here
raises :class:`StrategyUnavailable` saying why.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional

import torch

from sglang.srt.layers.attention.tree_verify.configs import select_config
from sglang.srt.layers.attention.tree_verify.masks import MAX_TREE_SIZE, mask_words
from sglang.srt.layers.attention.tree_verify.upstream_extend import (
    StrategyUnavailable,
)

#: Forces a strategy for every call that does not name one (benchmarks, triage).
STRATEGY_ENV = "SGLANG_DDTREE_VERIFY_STRATEGY"
#: Names no strategy and ignores STRATEGY_ENV: the per-arch default (for callers that
#: route the forced strategy themselves, like the tree-verify hook).
AUTO_STRATEGY = "auto"

STRATEGIES = ("fused", "upstream_extend", "flashinfer_split", "flashmla_split", "reference")


def _kernel_arch(device: torch.device):
    from sglang.srt.utils.gpu_arch import kernel_arch

    return kernel_arch(device)


def _config(arch, q, k_buffer, v_buffer):
    from sglang.srt.layers.attention.tree_verify.prefix_split import kv_shares_storage

    share = kv_shares_storage(k_buffer, v_buffer)
    return select_config(arch, q.shape[-1], v_buffer.shape[-1], share)


def _run_fused(args, arch, kv_scales, **window_and_sinks):
    from sglang.srt.layers.attention.tree_verify.prefix_split import tree_verify_fused

    return tree_verify_fused(
        *args, config=_config(arch, *args[:3]), kv_scales=kv_scales, **window_and_sinks
    )


def _run_upstream(args, arch, kv_scales=None):
    from sglang.srt.layers.attention.tree_verify.upstream_extend import (
        tree_verify_upstream_extend,
    )

    return tree_verify_upstream_extend(*args)


def _run_flashinfer(args, arch, kv_scales=None):
    from sglang.srt.layers.attention.tree_verify.flashinfer_split import (
        tree_verify_flashinfer_split,
    )

    return tree_verify_flashinfer_split(*args, config=_config(arch, *args[:3]))


def flashmla_arch_reason(arch) -> Optional[str]:
    if arch[0] in (9, 10):
        return None
    return (
        f"flashmla_split: FlashMLA ships kernels for sm_90a/sm_100a only, "
        f"not compute capability {arch[0]}.{arch[1]}"
    )


def _run_flashmla(args, arch, kv_scales=None, **options):
    reason = flashmla_arch_reason(arch)
    if reason:
        raise StrategyUnavailable(reason)
    from sglang.srt.layers.attention.tree_verify.flashmla_split import (
        tree_verify_flashmla_split,
    )

    return tree_verify_flashmla_split(*args, config=_config(arch, *args[:3]), **options)


def _run_reference(args, arch, kv_scales, **window_and_sinks):
    from sglang.srt.layers.attention.tree_verify.reference import (
        tree_verify_attention_ref,
    )

    return tree_verify_attention_ref(*args, kv_scales=kv_scales, **window_and_sinks)


_RUNNERS: Dict[str, Callable] = {
    "fused": _run_fused,
    "upstream_extend": _run_upstream,
    "flashinfer_split": _run_flashinfer,
    "flashmla_split": _run_flashmla,
    "reference": _run_reference,
}

#: KV cache dtypes served next to q's own: scaled fp8 (dequantized in the kernel),
#: by these strategies only.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_KV_STRATEGIES = ("fused", "reference")
#: Strategies that apply a sliding window and attention sinks.
WINDOW_SINK_STRATEGIES = ("fused", "reference")


def default_strategy(arch, dqk: int, dv: int) -> str:
    """Per-arch/shape choice: ``fused`` everywhere. It is the only fast path with
    a tree mask on sm_12x; on sm_90 FlashInfer's prefix pass is faster at long
    prefixes, but its host-side plan would sync every overlapped step."""
    return "fused"


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

    ``sliding_window`` (upstream's ``layer.sliding_window_size``; None: full
    attention): a node sees keys at most this many positions before its own.
    Node i sits at ``prefix_len + depth(i)``, prefix key t at ``t``: the prefix
    passed is the request's last ``prefix_len`` committed tokens. ``sinks``:
    ``[H]`` per-head sink logits (gpt-oss), added to each softmax denominator.
    Both: ``fused`` and ``reference`` only.

    ``strategy_options``: keyword arguments for the chosen strategy (flashmla_split:
    ``max_prefix_len`` and ``staging``, which make it graph-capturable, and ``plan``).

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
    if strategy == AUTO_STRATEGY:
        strategy = None
    else:
        strategy = strategy or os.environ.get(STRATEGY_ENV) or None
    arch = _kernel_arch(q.device) if q.is_cuda else None
    if strategy is None:
        if arch is None:
            strategy = "reference"
        else:
            strategy = default_strategy(arch, q.shape[-1], v_buffer.shape[-1])
    if strategy not in _RUNNERS:
        raise ValueError(f"unknown tree-verify strategy {strategy!r}; choose from {STRATEGIES}")
    if arch is None and strategy != "reference" and not _interpreting():
        raise StrategyUnavailable(
            f"strategy {strategy!r} needs a CUDA device (q is on {q.device}); "
            "use strategy='reference' on CPU"
        )
    args = (q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices,
            tree_kv_indices, tree_mask, float(sm_scale), out, float(logit_cap))  # fmt: skip
    kv_scales = None
    if k_buffer.dtype != q.dtype:
        if strategy not in FP8_KV_STRATEGIES:
            raise StrategyUnavailable(
                f"{strategy}: an fp8 KV cache is served by the fused and reference strategies only"
            )
        kv_scales = (float(k_scale), float(v_scale))
    if window_and_sinks:
        if strategy not in WINDOW_SINK_STRATEGIES:
            raise StrategyUnavailable(
                f"{strategy}: sliding windows and attention sinks are served by the fused "
                "and reference strategies only"
            )
        return _RUNNERS[strategy](args, arch or (8, 0), kv_scales, **window_and_sinks)
    return _RUNNERS[strategy](args, arch or (8, 0), kv_scales, **(strategy_options or {}))


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

# SPDX-License-Identifier: Apache-2.0
"""The tree-verify hook on each upstream attention backend (called from the patches).

* ``TritonAttnBackend`` (patch 0030): DDTREE trees, DFLASH chains and the DFlash
  drafter's block, MHA/GQA and absorbed MLA;
* ``FlashInferMLAAttnBackend`` (patch 0031): DDTREE trees only (FlashInfer's MLA
  kernels take no tree mask; its own causal kernel serves DFLASH chains);
* ``FlashInferAttnBackend`` (MHA/GQA, patch 0034): DDTREE trees, DFLASH chains
  and the drafter's block, instead of FlashInfer's verify plan (host copies every
  step) and, for trees, the dense per-request mask.

Each ``*_hook`` builds the backend's :class:`TreeVerifyHook`, off (upstream's path)
when the backend runs in a mode the hook does not serve; each ``*_run`` calls it
from the backend's ``forward_extend``. :func:`verify_capture_dense_mask` is the one
place that decides whether a captured verify graph carries upstream's dense mask
(patch 0053).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.hook import (
    FP8_KV_ENV,
    NON_CAUSAL,
    TreeVerifyHook,
    active_hook,
    fp8_kv_enabled,
    is_fp8,
)
from sglang.srt.layers.attention.tree_verify.registry import (
    TREE,
    TargetAttention,
    static_verify_kind,
)
from sglang.srt.runtime_context import get_parallel


def _kv_dtype_reason(model_runner: Any) -> Optional[str]:
    kv = getattr(model_runner, "kv_cache_dtype", None)
    dtype = getattr(model_runner, "dtype", None)
    if kv is not None and dtype is not None and kv != dtype:
        if is_fp8(kv) and fp8_kv_enabled():
            return None
        return (
            f"KV cache dtype {kv} differs from the model dtype {dtype}"
            + (f" ({FP8_KV_ENV}=0)" if is_fp8(kv) else "")
        )
    return None


def _attention_tp_size() -> int:
    try:
        return int(get_parallel().attn_tp_size)
    except Exception:  # no distributed state (a backend built outside a server)
        return 1


def every_layer_has_sinks(model_config: Any) -> bool:
    """gpt-oss: every attention layer has learned sinks (upstream's
    ``has_attention_sinks`` is also true for MiMo-V2 configs that give only some
    layers sinks)."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or ()
    return bool(getattr(model_config, "has_attention_sinks", False)) and "GptOssForCausalLM" in archs


def target_attention(backend: Any, model_runner: Any) -> Optional[TargetAttention]:
    """The target's attention on this rank from the model config, or None when
    the config does not say (the policy then plans nothing ahead)."""
    mc = getattr(model_runner, "model_config", None)
    heads = getattr(backend, "num_head", None)
    try:
        if heads is None:
            heads = int(mc.num_attention_heads) // _attention_tp_size()
        q_dtype = model_runner.dtype
        kv_dtype = getattr(model_runner, "kv_cache_dtype", None) or q_dtype
        if getattr(model_runner, "use_mla_backend", False):
            latent, rope = int(mc.kv_lora_rank), int(mc.qk_rope_head_dim)
            return TargetAttention(
                num_heads=int(heads), head_dim_qk=latent + rope, head_dim_v=latent,
                num_kv_heads=1, sm_scale=float(mc.scaling), q_dtype=q_dtype, kv_dtype=kv_dtype,
            )  # fmt: skip
        head_dim = int(mc.head_dim)
        kv_heads = int(mc.get_num_kv_heads(_attention_tp_size()))
        scaling = float(getattr(mc, "scaling", None) or head_dim**-0.5)
        return TargetAttention(
            num_heads=int(heads), head_dim_qk=head_dim, head_dim_v=int(getattr(mc, "v_head_dim", None) or head_dim),
            num_kv_heads=kv_heads, sm_scale=scaling, q_dtype=q_dtype, kv_dtype=kv_dtype,
            sinks=every_layer_has_sinks(mc),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


def hook_for(backend: Any, model_runner: Any, **kw) -> TreeVerifyHook:
    """A backend's hook from its model runner."""
    spec = getattr(model_runner, "spec_algorithm", None)
    num_draft = None
    server_args = getattr(model_runner, "server_args", None)
    if server_args is not None:
        num_draft = getattr(server_args, "speculative_num_draft_tokens", None)
        kw.setdefault("draft_window", getattr(server_args, "speculative_draft_window_size", None))
    is_draft = bool(getattr(model_runner, "is_draft_worker", False))
    window = getattr(backend, "sliding_window_size", None)
    if window is None:
        window = getattr(model_runner, "sliding_window_size", None)
    kv_pool = getattr(backend, "token_to_kv_pool", None)
    if kv_pool is None:
        kv_pool = getattr(model_runner, "token_to_kv_pool", None)
    return TreeVerifyHook(
        spec_algorithm=spec,
        is_draft_worker=is_draft,
        req_to_token=model_runner.req_to_token_pool.req_to_token,
        max_context_len=model_runner.model_config.context_len,
        num_draft_tokens=int(num_draft) if num_draft else None,
        device=model_runner.device,
        backend_name=type(backend).__name__,
        target=None if is_draft else target_attention(backend, model_runner),
        kv_pool=kv_pool,
        sliding_window_size=window,
        seq_len_fill_value=_seq_len_fill_value(backend),
        **kw,
    )


def _seq_len_fill_value(backend: Any) -> int:
    """The prefix length the backend's CUDA graphs give their padding rows."""
    fill = getattr(backend, "get_cuda_graph_seq_len_fill_value", None)
    try:
        return int(fill()) if callable(fill) else 1
    except NotImplementedError:
        return 1


def _hook(backend: Any, model_runner: Any, checks: List[Tuple[bool, str]], **kw) -> TreeVerifyHook:
    """A backend's hook, off when any of ``checks`` (condition, reason) or the
    conditions every backend shares hold: no prefill, paged KV, a KV dtype the
    kernels do not read."""
    checks = [
        (bool(getattr(backend, "skip_prefill", False)), "prefill disabled on this backend"),
        ((getattr(backend, "page_size", 1) or 1) != 1, "page_size > 1"),
        *checks,
    ]
    reasons = [reason for off, reason in checks if off]
    kv = _kv_dtype_reason(model_runner)
    if kv:
        reasons.append(kv)
    return hook_for(backend, model_runner, unsupported="; ".join(reasons) or None, **kw)


# ---------------------------------------------------------------------------
# Triton (patch 0030)
# ---------------------------------------------------------------------------


def triton_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``TritonAttnBackend`` (MHA/GQA and absorbed MLA)."""
    checks = [
        (getattr(backend, "dcp_size", 1) > 1, "decode context parallelism"),
        (bool(getattr(backend, "enable_deterministic", False)), "deterministic inference"),
        (getattr(backend, "_translate_kv_loc", None) is not None,
         "unified KV pool (translated slot ids)"),
    ]  # fmt: skip
    return _hook(backend, model_runner, checks, serves_draft_block=True)


def triton_layer_unsupported(layer: Any, causal: bool, score_mod: Any) -> Optional[str]:
    """Why the hook cannot serve this layer of ``TritonAttnBackend.forward_extend``
    (None: it can; sliding windows and attention sinks it serves)."""
    if getattr(layer, "is_cross_attention", False):
        return "cross attention"
    if not causal:
        return NON_CAUSAL
    if score_mod is not None:
        return "score_mod"
    return None


# ---------------------------------------------------------------------------
# FlashInfer MLA (patch 0031)
# ---------------------------------------------------------------------------


def flashinfer_mla_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``FlashInferMLAAttnBackend``: DDTREE only (its FA2 MLA kernel
    takes no custom mask, so without the hook a tree would run causally).
    DFLASH chains keep FlashInfer's own causal kernel."""
    updater = getattr(backend, "indices_updater_prefill", None)
    checks = [
        (getattr(updater, "_translate_kv_loc_dense", None) is not None,
         "unified KV pool (translated slot ids)"),
    ]  # fmt: skip
    return _hook(
        backend, model_runner, checks,
        serves_chain=False, require_for_tree=True, dense_mask_fallback=False,
    )  # fmt: skip


def flashinfer_mla_run(
    hook: TreeVerifyHook,
    q: torch.Tensor,
    q_rope: Optional[torch.Tensor],
    layer: Any,
    forward_batch: Any,
    token_to_kv_pool: Any,
) -> Optional[torch.Tensor]:
    """FlashInfer MLA TARGET_VERIFY through the hook: ``q`` is ``[T, H, 512]``
    with ``q_rope`` ``[T, H, 64]``, or the packed ``[T, H, 576]``. Returns
    ``[T, H*512]`` or None."""
    if hook.metadata is None:
        return None
    h = layer.tp_q_head_num
    if q_rope is not None:
        q_all = torch.cat(
            [q.view(-1, h, layer.v_head_dim), q_rope.view(-1, h, layer.head_dim - layer.v_head_dim)],
            dim=-1,
        )
    else:
        q_all = q.reshape(-1, h, layer.head_dim)
    k_buffer = token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_buffer = k_buffer[..., : layer.v_head_dim]
    unsupported = None
    if getattr(forward_batch, "attn_dcp_metadata", None) is not None:
        unsupported = "decode context parallelism"
    o = hook.run(
        q_all.contiguous(), k_buffer, v_buffer, layer, forward_batch,
        logit_cap=layer.logit_cap, unsupported=unsupported,
    )  # fmt: skip
    if o is None:
        return None
    return o.view(-1, h * layer.v_head_dim)


# ---------------------------------------------------------------------------
# FlashInfer MHA/GQA (patch 0034)
# ---------------------------------------------------------------------------


def flashinfer_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``FlashInferAttnBackend`` (MHA/GQA): DDTREE trees, DFLASH chains
    and the DFlash drafter's block, as on the Triton backend. Upstream's verify
    there plans FA2 every step (host copies of the index pointers) and, for a
    tree, applies a dense per-request mask the worker must build; the hook reads
    the tree bits or a cached chain mask instead."""
    checks = [
        (getattr(backend, "num_wrappers", 1) != 1, "sliding-window or cross-attention wrappers"),
        (bool(getattr(backend, "use_sliding_window_kv_pool", False)),
         "SWA KV pool (translated slot ids)"),
        (bool(getattr(backend, "prefill_uses_dequant_workspace", False)),
         "FP4 KV cache read through a dequant workspace"),
        (bool(getattr(backend, "enable_deterministic", False)), "deterministic inference"),
    ]  # fmt: skip
    return _hook(backend, model_runner, checks, serves_draft_block=True)


def flashinfer_verify_metadata(backend: Any, forward_batch: Any, swa_out_cache_loc: Any = None):
    """``FlashInferAttnBackend.init_forward_metadata`` for a verify the hook
    serves: the hook's metadata, and no FlashInfer plan (its host copies would
    sync every step). Returns the backend's ``forward_metadata``, or None when
    the hook does not serve this forward (upstream plans as before)."""
    if backend.tree_verify.prepare(forward_batch) is None:
        return None
    # Upstream's FlashInfer backend imports this module (patch 0034).
    from sglang.srt.layers.attention.flashinfer_backend import PrefillMetadata

    return PrefillMetadata(
        backend.prefill_wrappers_verify, False, False, swa_out_cache_loc=swa_out_cache_loc
    )


def flashinfer_run(
    hook: TreeVerifyHook,
    q: torch.Tensor,
    layer: Any,
    forward_batch: Any,
    token_to_kv_pool: Any,
) -> Optional[torch.Tensor]:
    """FlashInfer (MHA/GQA) TARGET_VERIFY through the hook, once the backend has
    written this step's K/V: ``q`` ``[T, H*D]``; returns ``[T, H*D]`` or None."""
    if hook.metadata is None:
        return None
    unsupported = None
    if getattr(layer, "is_cross_attention", False):
        unsupported = "cross attention"
    elif getattr(getattr(layer, "attn_type", None), "name", "") == "ENCODER_ONLY":
        unsupported = NON_CAUSAL
    h = layer.tp_q_head_num
    o = hook.run(
        q.view(-1, h, layer.head_dim),
        token_to_kv_pool.get_key_buffer(layer.layer_id),
        token_to_kv_pool.get_value_buffer(layer.layer_id),
        layer, forward_batch,
        logit_cap=float(layer.logit_cap or 0.0), unsupported=unsupported,
    )  # fmt: skip
    if o is None:
        return None
    return o.view(-1, h * o.shape[-1])


# ---------------------------------------------------------------------------
# The dense verify mask of captured graphs (patch 0053)
# ---------------------------------------------------------------------------


def verify_capture_dense_mask(attn_backend: Any, spec_algorithm: Any, upstream_choice: bool) -> bool:
    """Whether the TARGET_VERIFY graphs of a DFLASH-family server are captured
    with upstream's dense custom mask. A backend whose hook serves the verify
    reads none (the tree bits or its own chain mask); otherwise a DDTREE tree
    needs the mask even where upstream runs a DFLASH chain causally
    (``upstream_choice``, from ``resolve_dflash_verify_mask_policy``)."""
    if active_hook(attn_backend) is not None:
        return False
    if static_verify_kind(spec_algorithm) == TREE:
        return True
    return upstream_choice

# SPDX-License-Identifier: Apache-2.0
"""GPU bytes per token of the target's KV pool when DFLASH or DDTREE serves.

Upstream sizes the target's token pool (``max_total_num_tokens``) by dividing the
memory left after the weights by a per-token cost. For the DFlash family it
counts the draft model's KV pool, which the draft worker allocates with the same
token count, by scaling the target's cost per layer by ``(target + draft layers) /
target layers``: right only when a draft layer costs what a target layer does.
A DFlash drafter is a GQA model whatever the target is, so on an MLA target (one
576-wide latent per layer and token, 1,152 bytes in bf16) a drafter layer with 8
KV heads of 128 (4,096 bytes) costs 3.6 times the count, and the draft pool's
allocation runs out of memory at start-up under the default memory flags.

:func:`pool_token_bytes` states the whole cost instead, each part as the pool
that holds it allocates it:

* the target's KV: upstream's own per-token formula (its ``_compute_cell_size``);
* the draft model's KV: the same formula applied to the draft model, its layers,
  its KV heads sharded over attention TP as the draft worker shards them, and
  its KV dtype resolved as the draft worker resolves it (fp8 when
  ``--kv-cache-dtype`` asks for it); times the DCP size, since the draft pool is
  replicated over the allocator's whole location space;
* flashmla_split's page staging when the target's verify will use it: one
  target KV layer (the 576-wide latent) per pool token.

The per-request parts of these buffers (a page of padding per pool, a staging
page per request slot) are fixed costs, left to the memory headroom like
upstream's other fixed buffers.

Hybrid sliding-window targets are sized by upstream's ``HybridSWAPoolConfigurator``
(full and SWA pools) instead, which counts no DFlash drafter at all:
:func:`hybrid_swa_draft_bytes` is the draft pool's part for it (patch 0072).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Set, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.dispatch import forced_strategy
from sglang.srt.layers.attention.tree_verify.policy import VerifyShape, choose_strategy
from sglang.srt.layers.attention.tree_verify.registry import (
    FLASHMLA_SPLIT,
    MLA_DIMS,
    VerifyTarget,
    static_verify_kind,
)
from sglang.srt.layers.attention.tree_verify.strategies import available_strategies
from sglang.srt.utils import gpu_arch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolTokenBytes:
    """Bytes per token of ``max_total_num_tokens``, by the buffer that holds them."""

    target_kv: int
    draft_kv: int
    flashmla_staging: int = 0
    #: How the draft KV part was made, for the log line.
    draft_detail: str = ""

    @property
    def total(self) -> int:
        return self.target_kv + self.draft_kv + self.flashmla_staging

    def describe(self) -> str:
        parts = [f"target KV {self.target_kv:,}", f"draft KV {self.draft_kv:,}"]
        if self.draft_detail:
            parts[-1] += f" ({self.draft_detail})"
        if self.flashmla_staging:
            parts.append(f"FlashMLA verify staging {self.flashmla_staging:,}")
        return " + ".join(parts) + f" = {self.total:,} bytes per token"


def uses_dflash_draft_pool(spec_algorithm: Any) -> bool:
    """DFLASH and DDTREE: a DFlash drafter with its own KV pool of the target's
    token count (DDTREE registers as a DFlash-family algorithm that verifies a
    tree). Other algorithms keep upstream's accounting."""
    return static_verify_kind(spec_algorithm) is not None


def draft_model_config(server_args: Any):
    """The draft model's ``ModelConfig``, made as the draft worker makes it."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(
        server_args,
        model_path=server_args.speculative_draft_model_path,
        model_revision=server_args.speculative_draft_model_revision,
        is_draft_model=True,
    )


def draft_kv_configurator(kvc: Any, draft_config: Any = None) -> Any:
    """A ``KVCacheConfigurator`` for the draft worker's KV pool, as the draft
    model runner builds it (its model, dtype, KV dtype and layers; the target's
    parallel state, page size and server arguments)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        ModelLayerInfo,
        _compute_model_num_layers,
    )

    mc = draft_config if draft_config is not None else draft_model_config(kvc.server_args)
    args = kvc.server_args
    resolved, kv_dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=args.kv_cache_dtype,
        model=None,
        model_dtype=mc.dtype,
        is_draft_worker=True,
        is_dflash=True,
        speculative_draft_attention_backend=getattr(
            args, "speculative_draft_attention_backend", None
        ),
    )
    layers = _compute_model_num_layers(model=None, model_config=mc, is_draft_worker=True)
    return dataclasses.replace(
        kvc,
        model=None,
        model_config=mc,
        model_dtype=mc.dtype,
        kv_cache_dtype=kv_dtype,
        kv_cache_dtype_str=resolved if resolved is not None else args.kv_cache_dtype,
        is_draft_worker=True,
        use_mla_backend=mc.attention_arch == AttentionArch.MLA,
        is_hybrid_swa=False,
        is_hybrid_swa_compress=False,
        layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
        memory_pool_config=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )


def _cell_size(kvc: Any) -> int:
    """Upstream's per-token KV formula (``DefaultPoolConfigurator._compute_cell_size``)
    for ``kvc``'s model, layers and KV dtype."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    formula = object.__new__(DefaultPoolConfigurator)
    formula.kv_cache_dtype_str = kvc.kv_cache_dtype_str
    return int(formula._compute_cell_size(kvc, kvc.layer_info.num_effective_layers))


#: Attention backends whose TARGET_VERIFY goes through the tree-verify hook (MLA).
_HOOKED_MLA_BACKENDS = ("triton", "flashinfer")


def flashmla_staging_layers(kvc: Any) -> int:
    """Target KV layers' worth of memory per pool token that flashmla_split's page
    staging will take on this server: 1 when the target's verify will go through
    FlashMLA at any batch size (forced, or the policy's choice), else 0. The KV
    pool is sized with it counted, rather than the staging being taken later from
    the headroom activations and graphs need. Made from the server's arguments, it
    may count the staging for a server whose hook turns itself off for another
    reason (deterministic inference, say); the hook falls back to the fused kernel
    if the staging still does not fit. ``kvc``: upstream's ``KVCacheConfigurator``."""
    if kvc.is_draft_worker or static_verify_kind(kvc.spec_algorithm) is None:
        return 0
    mc = kvc.model_config
    latent = (getattr(mc, "kv_lora_rank", None), getattr(mc, "qk_rope_head_dim", None))
    if not kvc.use_mla_backend or latent != (512, 64):
        return 0
    if (kvc.page_size or 1) != 1 or kvc.kv_cache_dtype != kvc.model_dtype:
        return 0  # the hook is off, or FlashMLA cannot read this KV cache
    if kvc.model_dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not set(kvc.server_args.get_attention_backends()) & set(_HOOKED_MLA_BACKENDS):
        return 0
    forced = forced_strategy()
    if forced is not None:
        return int(forced == FLASHMLA_SPLIT)
    device = torch.device(f"cuda:{kvc.gpu_id}" if str(kvc.device) == "cuda" else kvc.device)
    try:
        real = gpu_arch.device_capability(device)
    except RuntimeError:
        return 0
    target = VerifyTarget.of(*MLA_DIMS, kvc.model_dtype, kvc.kv_cache_dtype)
    available, _ = available_strategies(target, real)
    if FLASHMLA_SPLIT not in available:
        return 0
    arch = gpu_arch.policy_arch(device)
    heads = mc.num_attention_heads // max(1, kvc.ps.attn_tp_size)
    width = int(kvc.server_args.speculative_num_draft_tokens or 0)
    return int(any(
        choose_strategy(arch, VerifyShape(heads, width, bs), available) == FLASHMLA_SPLIT
        for bs in _batch_sizes(kvc.server_args)
    ))  # fmt: skip


def _batch_sizes(server_args: Any) -> List[int]:
    """Batch sizes a verify may run at: powers of two up to the running-request cap."""
    cap = getattr(server_args, "max_running_requests", None) or 256
    sizes, bs = [], 1
    while bs <= cap:
        sizes.append(bs)
        bs *= 2
    return sizes


def flashmla_staging_bytes(kvc: Any) -> int:
    """flashmla_split's page staging per pool token: one target KV layer when the
    target's verify will go through FlashMLA, else 0."""
    layers = flashmla_staging_layers(kvc)
    if not layers:
        return 0
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    dim = calculate_mla_kv_cache_dim(
        model_config=kvc.model_config,
        kv_cache_dtype=kvc.kv_cache_dtype,
        server_args=kvc.server_args,
    )
    return int(layers) * dim * torch._utils._element_size(kvc.kv_cache_dtype)


def draft_kv_bytes(kvc: Any) -> Tuple[int, str]:
    """The draft model's KV bytes per token of the target's ``max_total_num_tokens``
    (the token count its pool is allocated with), and how they were made."""
    draft = draft_kv_configurator(kvc)
    mc = draft.model_config
    dcp = max(1, int(getattr(kvc.server_args, "dcp_size", 1) or 1))
    from sglang.srt.runtime_context import get_parallel

    heads = mc.get_num_kv_heads(get_parallel().attn_tp_size)
    detail = (
        f"{draft.layer_info.num_effective_layers} layers x {heads} KV heads x "
        f"{mc.head_dim}+{mc.v_head_dim} x {draft.kv_cache_dtype}"
        + (f" x DCP {dcp}" if dcp > 1 else "")
    )
    return _cell_size(draft) * dcp, detail


def pool_token_bytes(kvc: Any, target_kv: int) -> Optional[PoolTokenBytes]:
    """What one token of the target's KV pool costs on this GPU when DFLASH or
    DDTREE serves: ``target_kv`` (upstream's per-token target KV bytes) plus the
    draft model's KV and flashmla_split's staging. None on the draft worker and
    for every other algorithm, whose accounting stays upstream's."""
    if kvc.is_draft_worker or not uses_dflash_draft_pool(kvc.spec_algorithm):
        return None
    draft_kv, detail = draft_kv_bytes(kvc)
    return PoolTokenBytes(
        target_kv=int(target_kv),
        draft_kv=draft_kv,
        flashmla_staging=flashmla_staging_bytes(kvc),
        draft_detail=detail,
    )


# The model runner builds a pool configurator several times while sizing; each
# distinct cost is logged once per process.
_logged: Set[str] = set()


def speculative_cell_size(kvc: Any, target_kv: int) -> Optional[int]:
    """The configurator's per-token cost with the draft pool and staging counted
    (logged once), or None where upstream's accounting stands."""
    cost = pool_token_bytes(kvc, target_kv)
    if cost is None:
        return None
    algorithm = getattr(kvc.server_args, "speculative_algorithm", None)
    message = f"KV pool per token for {algorithm}: {cost.describe()}"
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
    return cost.total


def hybrid_swa_draft_bytes(kvc: Any) -> int:
    """DFLASH and DDTREE on a hybrid sliding-window target (gpt-oss, Gemma 4): the
    draft model's KV bytes per token of the target's ``max_total_num_tokens``, which
    upstream's ``HybridSWAPoolConfigurator`` leaves out of its cost (it counts
    EAGLE's draft layers only) and patch 0072 adds. The draft worker's pool is an
    ordinary one with the full pool's token count, so its bytes ride on each full
    pool token (or, for an all-sliding target, on each SWA pool token, which is
    then ``max_total_num_tokens``). Logged once; 0 on the draft worker and for every
    other algorithm."""
    if kvc.is_draft_worker or not uses_dflash_draft_pool(kvc.spec_algorithm):
        return 0
    draft_kv, detail = draft_kv_bytes(kvc)
    algorithm = getattr(kvc.server_args, "speculative_algorithm", None)
    message = (
        f"KV pools per token for {algorithm} on a hybrid SWA target: the draft model's "
        f"KV, {draft_kv:,} bytes ({detail}), added to the full and SWA pools' cost"
    )
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
    return draft_kv

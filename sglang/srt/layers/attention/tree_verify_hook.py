"""Serve speculative TARGET_VERIFY attention through the fused tree-verify path.

An attention backend owns one :class:`TreeVerifyHook`. Per forward it decides
whether this TARGET_VERIFY is

* a DDTREE tree verify: the verify input carries ``tree_mask_bits``
  (``int32 [bs, N, ceil(N/32)]``); the backend then sets
  ``consumes_tree_mask_bits`` so the DDTree worker builds no dense mask;
* a DFLASH chain verify: the block is causal, served with a cached causal
  bitmask (Triton backend only: FlashInfer's MLA kernel runs chains causally
  and fast already);
* on the draft worker of DFLASH / DDTREE, the DFlash drafter's block forward
  (also run as TARGET_VERIFY): its non-causal layers see the whole block
  (an all-ones bitmask), causal ones the chain (Triton backend only);

and gathers what :func:`tree_verify_attention` needs: the committed prefix as
an ``int32`` CSR (the backend's own ``kv_indptr`` is reused when it has one),
the tree's KV slots (``out_cache_loc`` viewed ``[bs, N]``) and the mask.
Everything that depends on the batch is prepared outside the forward
(``prepare``), in persistent buffers when CUDA graphs are captured, so the
captured kernels read fixed addresses and launch with fixed shapes.

``SGLANG_DDTREE_VERIFY_STRATEGY=upstream_extend`` turns the hook off: verify
then runs upstream's own path (the dense custom mask for DDTREE), for A/B runs.
``=flashmla_split`` (sm_90/sm_100, absorbed MLA) runs the target's verify prefix
through FlashMLA over pages copied into a staging buffer of about one KV layer,
graph-capturable; the drafter's block keeps the default kernels. Unset, the same
happens on sm_90 for wide trees (``FLASHMLA_MIN_ROWS``); ``=fused`` turns that off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.dispatch import (
    AUTO_STRATEGY,
    STRATEGY_ENV,
    flashmla_arch_reason,
)
from sglang.srt.layers.attention.tree_verify.masks import (
    causal_tree_mask,
    full_tree_mask,
    mask_words,
)

logger = logging.getLogger(__name__)

TREE = "tree"
CHAIN = "chain"
BLOCK = "block"  # the DFlash drafter's block on the draft worker

#: The backend-side reason a layer gives for non-causal self-attention; the
#: draft block serves such layers (with the all-ones mask), verify does not.
NON_CAUSAL = "non-causal attention"

#: Strategy name that keeps the backend's upstream verify path (A/B runs).
UPSTREAM_STRATEGY = "upstream_extend"
#: Strategy name that routes the target's verify prefix through FlashMLA.
FLASHMLA_STRATEGY = "flashmla_split"
#: Query rows per request (tree nodes x query heads on this rank) from which the
#: default sends the target's verify prefix to FlashMLA on sm_90. On the H200
#: (``benchmarks/results/verify_attention_flashmla_split_matrix_h200_2026-11-30.json``, ``flashmla_split_parts_kv_chunks_h200_2026-11-30.json``)
#: flashmla_split beats the fused kernel 2.2-2.8x at 1,040+ rows from 16K prefixes on
#: and is level at 1K (0.044 against 0.047 ms; the B=64 server step 12.29 against
#: 12.46 ms). At 272 rows (H=16, N=17) it now wins at 16K (0.063 against 0.075) but
#: loses at 1K (0.037 against 0.036), and the server step at B=16 was not measured
#: with it since, so narrow trees keep the fused kernel.
FLASHMLA_MIN_ROWS = 1024

#: An fp8 KV cache is served through the fused kernels (converted per tile);
#: ``=0`` hands it back to upstream's dense-mask path (A/B runs, a suspected bug).
FP8_KV_ENV = "SGLANG_DDTREE_FP8_KV_VERIFY"


def fp8_kv_enabled() -> bool:
    return os.environ.get(FP8_KV_ENV, "1") != "0"


def _is_fp8(dtype: Any) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

# Backends whose TARGET_VERIFY applies a dense custom mask when the verify
# input carries one. The others in upstream's DFlash skip list run the block
# causally whatever the input says.
DENSE_MASK_VERIFY_BACKENDS = frozenset({"TritonAttnBackend", "FlashInferAttnBackend"})


class TreeVerifyUnavailable(RuntimeError):
    """A tree verify reached a backend that cannot apply its mask."""


def static_verify_kind(spec_algorithm: Any) -> Optional[str]:
    """TREE for DDTREE, CHAIN for DFLASH, None for every other algorithm."""
    if spec_algorithm is None:
        return None
    if getattr(spec_algorithm, "verify_uses_tree_mask", False):
        return TREE
    is_dflash = getattr(spec_algorithm, "is_dflash", None)
    if callable(is_dflash) and is_dflash():
        return CHAIN
    return None


def innermost_attention_backend(attn_backend: Any) -> Any:
    """The backend that runs full attention, below hybrid/wrapper backends."""
    backend = attn_backend
    for _ in range(4):
        inner = getattr(backend, "full_attn_backend", None)
        if inner is None:
            break
        backend = inner
    return backend


def active_hook(attn_backend: Any) -> Optional["TreeVerifyHook"]:
    """The backend's hook when it serves TARGET_VERIFY itself, else None."""
    hook = getattr(innermost_attention_backend(attn_backend), "tree_verify", None)
    if isinstance(hook, TreeVerifyHook) and hook.kind is not None:
        return hook
    return None


def dflash_verify_mask_policy(attn_backend: Any, build_custom_mask: bool) -> bool:
    """Upstream's DFlash mask policy, relaxed: a backend whose hook serves
    verify never reads a dense mask, so none is built (or captured) for it."""
    if active_hook(attn_backend) is not None:
        return False
    return build_custom_mask


def check_runtime_tree_verify(attn_backend: Any) -> None:
    """Raise unless ``attn_backend`` applies a DDTree tree mask in TARGET_VERIFY,
    either through its hook (reads ``tree_mask_bits``) or upstream's dense mask.

    The startup check (``backend_support.check_tree_verify_backend``) refuses
    such servers first; this guards paths that did not go through ServerArgs.
    """
    backend = innermost_attention_backend(attn_backend)
    hook = active_hook(backend)
    if hook is not None and hook.kind == TREE:
        return
    name = type(backend).__name__
    if name in DENSE_MASK_VERIFY_BACKENDS:
        return
    raise TreeVerifyUnavailable(
        f"DDTREE verify needs a tree mask, and the attention backend {name} "
        f"applies none in TARGET_VERIFY (it would verify the tree causally). "
        f"Use --attention-backend triton (or flashinfer)."
    )


@dataclass
class TreeVerifyMetadata:
    kind: str
    prefix_kv_indptr: torch.Tensor  # int32 [bs + 1]
    prefix_kv_indices: torch.Tensor  # int32, >= prefix_kv_indptr[-1] entries
    tree_kv_indices: torch.Tensor  # int32 [bs, N]
    tree_mask: torch.Tensor  # int32 [bs, N, ceil(N/32)]
    # BLOCK only: the mask of the drafter's causal layers (tree_mask is the
    # all-ones mask of its non-causal ones).
    causal_mask: Optional[torch.Tensor] = None


def _flashmla_device_reason(device: Any, forced: bool) -> Optional[str]:
    """Why FlashMLA cannot serve verify on ``device`` (None: it can). Forced, any
    arch FlashMLA ships kernels for; by default sm_90 only, where it was measured,
    and only if sgl_kernel's FlashMLA loads. Gated on the real GPU, not
    SGLANG_DDTREE_KERNEL_ARCH."""
    from sglang.srt.utils.gpu_arch import device_capability

    try:
        cap = device_capability(torch.device(device))
    except RuntimeError as e:
        return str(e)
    if forced:
        return flashmla_arch_reason(cap)
    if cap[0] != 9:
        return f"compute capability {cap[0]}.{cap[1]} (the default uses it on sm_90 only)"
    from sglang.srt.layers.attention.tree_verify.flashmla_split import flash_mla_reason

    return flash_mla_reason()


#: Attention backends whose TARGET_VERIFY goes through the hook (for MLA).
_HOOKED_MLA_BACKENDS = ("triton", "flashinfer")


def flashmla_staging_layers(kvc: Any) -> int:
    """Target KV layers' worth of memory per pool token that flashmla_split's page
    staging will take on this server: 1 when the target's verify will go through
    FlashMLA (forced, or the default's choice as the hook makes it), else 0. The KV
    pool is sized with it counted (``pool_configurator``, patch 0070), rather than
    the staging being taken later from the headroom activations and graphs need.
    Made from the server's arguments, it may count the staging for a server whose
    hook turns itself off for another reason (deterministic inference, say); the
    hook falls back to the fused kernel if the staging still does not fit.
    ``kvc``: upstream's ``KVCacheConfigurator``."""
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
    env = os.environ.get(STRATEGY_ENV)
    if env:
        return int(env == FLASHMLA_STRATEGY)
    heads = mc.num_attention_heads // max(1, kvc.ps.attn_tp_size)
    width = kvc.server_args.speculative_num_draft_tokens or 0
    if int(width) * heads < FLASHMLA_MIN_ROWS:
        return 0
    device = f"cuda:{kvc.gpu_id}" if str(kvc.device) == "cuda" else kvc.device
    return int(_flashmla_device_reason(device, forced=False) is None)


def fill_prefix_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[indptr[b] : indptr[b+1]] = req_to_token[req_pool_indices[b], :seq_lens[b]]``
    as int32, without reading a device value on the host."""
    bs = req_pool_indices.shape[0]
    if bs == 0 or out.numel() == 0:
        return out
    if out.is_cuda:
        from sglang.kernels.ops.kvcache.kv_indices import (
            create_flashinfer_kv_indices_triton,
        )

        create_flashinfer_kv_indices_triton[(bs,)](
            req_to_token, req_pool_indices, seq_lens, indptr, None, out,
            req_to_token.stride(0),
        )  # fmt: skip
        return out
    pos = torch.arange(out.numel(), device=out.device)
    row = torch.searchsorted(indptr[1:].long(), pos, right=True).clamp_max(bs - 1)
    col = pos - indptr[row].long()
    valid = pos < indptr[bs].long()
    src = req_to_token[req_pool_indices.long()[row], col.clamp(0, req_to_token.shape[1] - 1)]
    out.copy_(torch.where(valid, src.to(out.dtype), out))
    return out


class TreeVerifyHook:
    """The tree-verify path of one attention backend.

    ``kind`` is what this backend serves (TREE, CHAIN or None = nothing, in
    which case every call is a no-op and upstream's path runs). It is fixed
    at construction from the speculative algorithm, so the CUDA graphs
    captured for TARGET_VERIFY know which path they record.
    """

    def __init__(
        self,
        *,
        spec_algorithm: Any,
        is_draft_worker: bool,
        req_to_token: torch.Tensor,
        max_context_len: int,
        num_draft_tokens: Optional[int],
        device: Any,
        backend_name: str,
        serves_chain: bool = True,
        serves_draft_block: bool = False,
        draft_window: Optional[int] = None,
        unsupported: Optional[str] = None,
        require_for_tree: bool = False,
        dense_mask_fallback: bool = True,
    ):
        self.backend_name = backend_name
        # Whether upstream's path of this backend applies a dense custom mask
        # (so a layer the hook cannot serve may fall back to it).
        self.dense_mask_fallback = dense_mask_fallback
        self.req_to_token = req_to_token
        self.max_context_len = int(max_context_len)
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        wanted = static_verify_kind(spec_algorithm)
        if is_draft_worker:
            wanted = BLOCK if wanted is not None and serves_draft_block else None
        if wanted == CHAIN and not serves_chain:
            wanted = None
        reason = None
        if os.environ.get(STRATEGY_ENV) == UPSTREAM_STRATEGY:
            reason = f"{STRATEGY_ENV}={UPSTREAM_STRATEGY} keeps upstream's verify path"
        elif unsupported:
            reason = unsupported
        elif wanted == BLOCK and draft_window is not None:
            reason = "draft sliding window (compact draft KV cache)"
        self.kind = wanted if reason is None else None
        if wanted is not None and reason is not None:
            if wanted == TREE and require_for_tree:
                raise TreeVerifyUnavailable(
                    f"DDTREE verify on {backend_name} needs the tree-verify path, "
                    f"which is off: {reason}. {backend_name} has no other way to "
                    f"apply a tree mask; use --attention-backend triton."
                )
            logger.info("Tree-verify path off on %s: %s.", backend_name, reason)
        elif self.kind is not None:
            logger.info("%s serves %s verify through the tree-verify path.", backend_name, self.kind)
        # FlashMLA for the target's verify prefix: forced by the env, or by default
        # on the H200 class for wide trees (FLASHMLA_MIN_ROWS), where it measured
        # faster; the drafter's block and anything FlashMLA cannot serve keep the
        # fused kernel.
        env = os.environ.get(STRATEGY_ENV)
        targets_verify = self.kind in (TREE, CHAIN)
        self.flashmla_prefix = env == FLASHMLA_STRATEGY and targets_verify
        self._route_strategy = AUTO_STRATEGY if env == FLASHMLA_STRATEGY else None
        self.flashmla_by_default = False
        self._flashmla_staging: Optional[torch.Tensor] = None
        # The forward's plan (page layout, FlashMLA schedule) and what it was made for.
        self._flashmla_plan: Any = None
        self._flashmla_plan_at: Tuple[Any, int] = (None, -1)  # (metadata, last layer id)
        if self.flashmla_prefix:
            reason = _flashmla_device_reason(device, forced=True)
            if reason is not None:
                raise TreeVerifyUnavailable(f"{STRATEGY_ENV}={FLASHMLA_STRATEGY}: {reason}")
            logger.info("%s: the target's verify prefix runs through FlashMLA.", backend_name)
        elif targets_verify and not env:
            reason = _flashmla_device_reason(device, forced=False)
            self.flashmla_by_default = reason is None
            if self.flashmla_by_default:
                logger.info(
                    "%s: a verify with >= %d query rows per request (tree nodes x heads) "
                    "runs its prefix through FlashMLA; %s=fused keeps the fused kernel.",
                    backend_name, FLASHMLA_MIN_ROWS, STRATEGY_ENV,
                )  # fmt: skip
        self.metadata: Optional[TreeVerifyMetadata] = None
        # Eager-mode chain / all-ones masks, built once per (kind, bs, N).
        self._masks: Dict[Tuple[Any, int, int], torch.Tensor] = {}
        self._graph: Optional[Dict[str, torch.Tensor]] = None

    # ------------------------------------------------------------ construction

    @classmethod
    def for_backend(cls, backend: Any, model_runner: Any, **kw) -> "TreeVerifyHook":
        spec = getattr(model_runner, "spec_algorithm", None)
        num_draft = None
        server_args = getattr(model_runner, "server_args", None)
        if server_args is not None:
            num_draft = getattr(server_args, "speculative_num_draft_tokens", None)
            kw.setdefault(
                "draft_window", getattr(server_args, "speculative_draft_window_size", None)
            )
        return cls(
            spec_algorithm=spec,
            is_draft_worker=bool(getattr(model_runner, "is_draft_worker", False)),
            req_to_token=model_runner.req_to_token_pool.req_to_token,
            max_context_len=model_runner.model_config.context_len,
            num_draft_tokens=int(num_draft) if num_draft else None,
            device=model_runner.device,
            backend_name=type(backend).__name__,
            **kw,
        )

    @property
    def consumes_tree_mask_bits(self) -> bool:
        return self.kind == TREE

    # ------------------------------------------------------------ metadata

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Persistent buffers the captured TARGET_VERIFY graphs read."""
        if self.kind is None:
            return
        n = self.num_draft_tokens or max(1, max_num_tokens // max(1, max_bs))
        if self.kind == BLOCK:
            # The drafter's block, which DDTREE keeps narrower than its verify.
            n = max(1, max_num_tokens // max(1, max_bs))
        words = mask_words(n)
        self._graph = {
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            "prefix": torch.zeros(
                max_bs * self.max_context_len, dtype=torch.int32, device=self.device
            ),
            "tree": torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device),
            # Capture runs with a chain; a tree replay overwrites its rows.
            "mask": causal_tree_mask(max_bs, n, self.device),
        }
        if self.kind == BLOCK:
            self._graph["causal"] = self._graph["mask"]
            self._graph["mask"] = full_tree_mask(max_bs, n, self.device)
        assert self._graph["mask"].shape[-1] == words

    def _verify_kind(self, forward_batch: Any, graph: bool) -> Optional[str]:
        if self.kind is None or not forward_batch.forward_mode.is_target_verify():
            return None
        if graph:
            return self.kind
        spec_info = forward_batch.spec_info
        if spec_info is None or getattr(spec_info, "ragged_verify_layout", None) is not None:
            return None
        if self.kind == TREE:
            return TREE if getattr(spec_info, "tree_mask_bits", None) is not None else None
        from sglang.srt.speculative.spec_info import SpecInputType

        if getattr(spec_info, "spec_input_type", None) != SpecInputType.DFLASH_VERIFY:
            return None
        return self.kind  # CHAIN, or BLOCK on the draft worker

    def _width(self, forward_batch: Any, bs: int) -> int:
        n = getattr(forward_batch.spec_info, "draft_token_num", None)
        if n is None and self.kind != BLOCK:  # the draft block is not the verify width
            n = self.num_draft_tokens
        if n is None:
            n = forward_batch.out_cache_loc.shape[0] // max(1, bs)
        return int(n)

    def _static_mask(self, build, bs: int, n: int) -> torch.Tensor:
        key = (build, bs, n)
        if key not in self._masks:
            self._masks[key] = build(bs, n, self.device)
        return self._masks[key]

    def prepare(
        self,
        forward_batch: Any,
        kv_indptr: Optional[torch.Tensor] = None,
        graph: bool = False,
    ) -> Optional[TreeVerifyMetadata]:
        """Per-forward metadata, built outside the forward (eager, capture, replay).

        ``kv_indptr``: the backend's prefix CSR row pointers (int32, at least
        ``bs + 1`` long, ``cumsum(seq_lens)``) when it already built them for
        this verify.
        ``graph``: fill the persistent capture buffers (capture and replay).
        """
        kind = self._verify_kind(forward_batch, graph)
        self.metadata = None
        causal = None
        if kind is None:
            return None
        bs = int(forward_batch.req_pool_indices.shape[0])
        n = self._width(forward_batch, bs)
        seq_lens = forward_batch.seq_lens[:bs]
        req_pool_indices = forward_batch.req_pool_indices[:bs]
        out_cache_loc = forward_batch.out_cache_loc
        bits = getattr(forward_batch.spec_info, "tree_mask_bits", None)
        if kv_indptr is not None:
            kv_indptr = kv_indptr[: bs + 1]
        if graph:
            buf = self._graph
            if buf is None:
                raise RuntimeError("TreeVerifyHook.init_graph_state was not called")
            if kv_indptr is None:
                kv_indptr = buf["indptr"][: bs + 1]
                kv_indptr[1:] = torch.cumsum(seq_lens, 0)
            indices = buf["prefix"][: bs * self.max_context_len]
            tree = buf["tree"][: bs * n]
            rows = out_cache_loc.shape[0]
            tree[:rows].copy_(out_cache_loc)
            tree[rows:].zero_()
            if kind == TREE:
                mask = buf["mask"][:bs]
                if mask.shape[1] != n:
                    raise ValueError(
                        f"tree width {n} differs from the captured width {mask.shape[1]}"
                    )
                if bits is not None:
                    mask[: bits.shape[0]].copy_(bits)
            elif kind == BLOCK:
                width = buf["mask"].shape[1]
                if n > width:
                    raise ValueError(f"draft block {n} is wider than the captured {width}")
                words = mask_words(n)
                mask = buf["mask"][:bs, :n, :words]
                causal = buf["causal"][:bs, :n, :words]
            else:
                mask = buf["mask"][:bs]
        else:
            if kv_indptr is None:
                kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
                kv_indptr[1:] = torch.cumsum(seq_lens, 0)
            total = forward_batch.seq_lens_sum
            if total is None:
                total = bs * self.max_context_len
            indices = torch.empty(int(total), dtype=torch.int32, device=seq_lens.device)
            tree = out_cache_loc.to(torch.int32)
            if kind == TREE:
                mask = bits
            elif kind == BLOCK:
                mask = self._static_mask(full_tree_mask, bs, n)
                causal = self._static_mask(causal_tree_mask, bs, n)
            else:
                mask = self._static_mask(causal_tree_mask, bs, n)
        fill_prefix_indices(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, indices)
        self.metadata = TreeVerifyMetadata(
            kind=kind,
            prefix_kv_indptr=kv_indptr,
            prefix_kv_indices=indices,
            tree_kv_indices=tree.view(bs, n),
            tree_mask=mask,
            causal_mask=causal,
        )
        return self.metadata

    # ------------------------------------------------------------ forward

    def _layer_unsupported(
        self, layer: Any, q: torch.Tensor, k_buffer: torch.Tensor, extra: Optional[str]
    ) -> Optional[str]:
        if extra:
            return extra
        if getattr(layer, "sliding_window_size", -1) not in (None, -1):
            return "sliding-window layer"
        fp8 = _is_fp8(k_buffer.dtype) and fp8_kv_enabled()
        if getattr(layer, "k_scale", None) is not None and not fp8:
            return "scaled (fp8) KV cache"
        if getattr(layer, "xai_temperature_len", -1) not in (None, -1):
            return "xai temperature scaling"
        if k_buffer.dtype != q.dtype and not fp8:
            return f"KV cache dtype {k_buffer.dtype} differs from the query dtype {q.dtype}"
        return None

    def run(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        out: Optional[torch.Tensor] = None,
        logit_cap: float = 0.0,
        unsupported: Optional[str] = None,
    ) -> Optional[torch.Tensor]:
        """Attention of this TARGET_VERIFY layer, or None when the hook does not
        serve it (upstream's path then runs). The tree's KV must already be in
        the pool. ``q``: ``[bs*N, H, Dqk]``; returns ``[bs*N, H, Dv]``.

        ``unsupported``: a backend-side reason this layer cannot take the
        path (sinks, score_mod, non-causal...).
        """
        meta = self.metadata
        if meta is None or not forward_batch.forward_mode.is_target_verify():
            return None
        mask = meta.tree_mask
        if meta.kind == BLOCK:
            if unsupported == NON_CAUSAL:
                unsupported = None  # the block sees itself whole: all-ones mask
            else:
                mask = meta.causal_mask
        reason = self._layer_unsupported(layer, q, k_buffer, unsupported)
        if reason is not None:
            has_dense = getattr(forward_batch.spec_info, "custom_mask", None) is not None
            if meta.kind == TREE and not (self.dense_mask_fallback and has_dense):
                raise TreeVerifyUnavailable(
                    f"DDTREE verify on {self.backend_name}, layer "
                    f"{getattr(layer, 'layer_id', '?')}: the tree-verify path cannot "
                    f"serve it ({reason}) and no dense mask applies. Use "
                    f"--attention-backend triton with {STRATEGY_ENV}={UPSTREAM_STRATEGY} "
                    f"for the dense-mask path."
                )
            return None
        from sglang.srt.layers.attention.tree_verify import tree_verify_attention

        strategy, options = self._route_strategy, None
        if meta.kind in (TREE, CHAIN) and (
            self.flashmla_prefix or self._flashmla_serves(meta, q, k_buffer, v_buffer, logit_cap)
        ):
            options = self._flashmla_options(meta, q, k_buffer, getattr(layer, "layer_id", 0))
            if options is not None:
                strategy = FLASHMLA_STRATEGY
        return tree_verify_attention(
            q,
            k_buffer,
            v_buffer,
            meta.prefix_kv_indptr,
            meta.prefix_kv_indices,
            meta.tree_kv_indices,
            mask,
            layer.scaling,
            out=out,
            logit_cap=float(logit_cap or 0.0),
            k_scale=float(getattr(layer, "k_scale_float", None) or 1.0),
            v_scale=float(getattr(layer, "v_scale_float", None) or 1.0),
            strategy=strategy,
            strategy_options=options,
        )

    def _flashmla_serves(self, meta, q, k_buffer, v_buffer, logit_cap) -> bool:
        """The default's choice for this layer: a wide tree, a layer FlashMLA serves."""
        if not self.flashmla_by_default:
            return False
        if meta.tree_kv_indices.shape[1] * q.shape[1] < FLASHMLA_MIN_ROWS:
            return False
        from sglang.srt.layers.attention.tree_verify.flashmla_split import check_supported
        from sglang.srt.layers.attention.tree_verify.upstream_extend import StrategyUnavailable

        try:
            check_supported(q, k_buffer, v_buffer, float(logit_cap or 0.0))
        except StrategyUnavailable:
            return False
        return True

    def _flashmla_options(
        self, meta: TreeVerifyMetadata, q: torch.Tensor, k_buffer: torch.Tensor, layer_id: int
    ) -> Optional[dict]:
        """flashmla_split's inputs: one page staging for every layer (room for every
        running request's prefix, which all live in the pool: about one KV layer),
        and the forward's plan. The plan is made by the forward's first layer: a new
        metadata, or a layer id not above the last one (the graph runner re-runs
        one batch's forward for warm-up and capture, and the capture must record
        the planning so replays plan for their own batch).

        None when the default cannot have its staging (no room, or first asked
        inside a graph capture): the default then stays off for this server, so
        captured graphs and eager forwards agree; a forced strategy raises."""
        from sglang.srt.layers.attention.tree_verify.flashmla_split import (
            new_staging,
            plan_flashmla,
            side_stream,
            staging_pages,
        )

        if self._flashmla_staging is None:
            pages = staging_pages(int(self.req_to_token.shape[0]), int(k_buffer.shape[0]))
            problem = None
            if k_buffer.is_cuda and torch.cuda.is_current_stream_capturing():
                problem = (
                    "the page staging must be allocated before graph capture (by an "
                    "eager TARGET_VERIFY forward, e.g. the warm-up run)"
                )
            else:
                try:
                    self._flashmla_staging = new_staging(pages, k_buffer)
                    if k_buffer.is_cuda:
                        side_stream(k_buffer.device)  # the tail's stream, before any capture
                except torch.cuda.OutOfMemoryError as e:
                    problem = f"no room for its page staging ({pages} pages of 64 tokens): {e}"
            if problem is not None:
                if self.flashmla_prefix:
                    raise RuntimeError(f"flashmla_split: {problem}")
                logger.warning(
                    "%s: FlashMLA verify off, the fused kernel serves it: %s",
                    self.backend_name, problem,
                )  # fmt: skip
                self.flashmla_by_default = False
                return None
        planned_for, last_layer = self._flashmla_plan_at
        if planned_for is not meta or layer_id <= last_layer:
            self._flashmla_plan = plan_flashmla(
                meta.prefix_kv_indptr, meta.tree_kv_indices.shape[1], q.shape[1],
                self.max_context_len, self._flashmla_staging.shape[0],
            )  # fmt: skip
        self._flashmla_plan_at = (meta, layer_id)
        return dict(staging=self._flashmla_staging, plan=self._flashmla_plan)


# ---------------------------------------------------------------------------
# Backend-specific construction (called from the patched backends)
# ---------------------------------------------------------------------------


def _kv_dtype_reason(model_runner: Any) -> Optional[str]:
    kv = getattr(model_runner, "kv_cache_dtype", None)
    dtype = getattr(model_runner, "dtype", None)
    if kv is not None and dtype is not None and kv != dtype:
        if _is_fp8(kv) and fp8_kv_enabled():
            return None
        return (
            f"KV cache dtype {kv} differs from the model dtype {dtype}"
            + (f" ({FP8_KV_ENV}=0)" if _is_fp8(kv) else "")
        )
    return None


def _hook_for(
    backend: Any, model_runner: Any, checks: List[Tuple[bool, str]], **kw
) -> TreeVerifyHook:
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
    return TreeVerifyHook.for_backend(
        backend, model_runner, unsupported="; ".join(reasons) or None, **kw
    )


def triton_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``TritonAttnBackend`` (MHA/GQA and absorbed MLA)."""
    checks = [
        ((getattr(backend, "sliding_window_size", None) or -1) > 0, "sliding-window model"),
        (getattr(backend, "dcp_size", 1) > 1, "decode context parallelism"),
        (bool(getattr(backend, "enable_deterministic", False)), "deterministic inference"),
        (getattr(backend, "_translate_kv_loc", None) is not None,
         "unified KV pool (translated slot ids)"),
    ]  # fmt: skip
    return _hook_for(backend, model_runner, checks, serves_draft_block=True)


def triton_layer_unsupported(
    layer: Any, causal: bool, sinks: Any, score_mod: Any
) -> Optional[str]:
    if getattr(layer, "is_cross_attention", False):
        return "cross attention"
    if not causal:
        return NON_CAUSAL
    if sinks is not None:
        return "attention sinks"
    if score_mod is not None:
        return "score_mod"
    return None


def flashinfer_mla_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``FlashInferMLAAttnBackend``: DDTREE only (its FA2 MLA kernel
    takes no custom mask, so without the hook a tree would run causally).
    DFLASH chains keep FlashInfer's own causal kernel."""
    updater = getattr(backend, "indices_updater_prefill", None)
    checks = [
        (getattr(updater, "_translate_kv_loc_dense", None) is not None,
         "unified KV pool (translated slot ids)"),
    ]  # fmt: skip
    return _hook_for(
        backend, model_runner, checks,
        serves_chain=False, require_for_tree=True, dense_mask_fallback=False,
    )  # fmt: skip


def flashinfer_hook(backend: Any, model_runner: Any) -> TreeVerifyHook:
    """Hook for ``FlashInferAttnBackend`` (MHA/GQA): DDTREE only. Upstream's
    verify there plans FA2 with a dense per-request mask that the worker must
    build every step; the hook reads the tree bits instead. DFLASH chains and
    the drafter keep FlashInfer's own causal kernel."""
    checks = [
        (getattr(backend, "num_wrappers", 1) != 1, "sliding-window or cross-attention wrappers"),
        (bool(getattr(backend, "use_sliding_window_kv_pool", False)),
         "SWA KV pool (translated slot ids)"),
        (bool(getattr(backend, "prefill_uses_dequant_workspace", False)),
         "FP4 KV cache read through a dequant workspace"),
        (bool(getattr(backend, "enable_deterministic", False)), "deterministic inference"),
    ]  # fmt: skip
    return _hook_for(backend, model_runner, checks, serves_chain=False)


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

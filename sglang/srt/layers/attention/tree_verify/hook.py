# SPDX-License-Identifier: Apache-2.0
"""Serve speculative TARGET_VERIFY attention through the tree-verify strategies.

An attention backend owns one :class:`TreeVerifyHook` (``backends.py`` builds it
for each hooked backend). Per forward the hook decides whether this
TARGET_VERIFY is

* a DDTREE tree verify (``TREE``): the verify input carries ``tree_mask_bits``
  (``int32 [bs, N, ceil(N/32)]``); the backend sets ``consumes_tree_mask_bits``
  so the DDTree worker builds no dense mask;
* a DFLASH chain verify (``CHAIN``): the block is causal, served with a cached
  causal bitmask;
* on the draft worker of DFLASH / DDTREE, the DFlash drafter's block forward
  (``BLOCK``, also run as TARGET_VERIFY): its non-causal layers see the whole
  block (an all-ones bitmask), causal ones the chain;

and gathers what :func:`tree_verify_attention` needs: the committed prefix as an
``int32`` CSR (the backend's own ``kv_indptr`` is reused when it has one), the
tree's KV slots (``out_cache_loc`` viewed ``[bs, N]``) and the mask.

Sliding-window layers (gpt-oss, Gemma 4) pass their window to the kernel, which
places a tree node at ``prefix_len + depth`` (upstream's dense-mask path counts
a node's index instead, right for a chain only). On a hybrid SWA KV pool their
KV lives in the SWA pool under translated slot ids: the hook also gathers each
request's last ``sliding_window_size`` committed tokens and the tree's slots in
that pool's ids (:class:`SWAIndices`). Attention sinks reach the kernel as they
reach the backend.

Everything that depends on the batch is prepared outside the forward
(:meth:`prepare`), in persistent buffers when CUDA graphs are captured, so the
captured kernels read fixed addresses and launch with fixed shapes. Which
strategy serves the target's verify, and what it plans per forward, is
:class:`VerifyRoutes`'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.layers.attention.tree_verify.dispatch import (
    STRATEGY_ENV,
    forced_strategy,
    tree_verify_attention,
)
from sglang.srt.layers.attention.tree_verify.masks import (
    causal_tree_mask,
    full_tree_mask,
    mask_words,
)
from sglang.srt.layers.attention.tree_verify.registry import (
    BLOCK,
    CHAIN,
    TREE,
    UPSTREAM_EXTEND,
    TargetAttention,
    TreeVerifyUnavailable,
    static_verify_kind,
)
from sglang.srt.layers.attention.tree_verify.routes import VerifyRoutes
from sglang.srt.layers.attention.tree_verify.verify_indices import (
    fill_prefix_indices,
    verify_indices,
    verify_indices_reference,
)
from sglang.srt.speculative.spec_info import SpecInputType

logger = logging.getLogger(__name__)

#: The backend-side reason a layer gives for non-causal self-attention; the
#: draft block serves such layers (with the all-ones mask), verify does not.
NON_CAUSAL = "non-causal attention"

FP8_KV_ENV = "SGLANG_DDTREE_FP8_KV_VERIFY"


def fp8_kv_enabled() -> bool:
    """Whether the fused kernels read an fp8 KV cache (``SGLANG_DDTREE_FP8_KV_VERIFY``)."""
    return bool(ddtree_envs.SGLANG_DDTREE_FP8_KV_VERIFY.get())


def is_fp8(dtype: Any) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def innermost_attention_backend(attn_backend: Any) -> Any:
    """The backend that runs full attention, below hybrid/wrapper backends."""
    backend = attn_backend
    for _ in range(4):
        inner = getattr(backend, "full_attn_backend", None)
        if inner is None:
            break
        backend = inner
    return backend


def is_swa_pool(kv_pool: Any) -> bool:
    """Whether ``kv_pool`` is a hybrid SWA pool: full and sliding-window layers in
    pools of their own, the latter addressed by translated slot ids (upstream's
    ``SWAKVPool``)."""
    return callable(getattr(kv_pool, "translate_loc_from_full_to_swa", None)) and isinstance(
        getattr(kv_pool, "layers_mapping", None), dict
    )


def layer_window(layer: Any) -> Optional[int]:
    """A layer's sliding window (``layer.sliding_window_size``; upstream stores -1
    for full attention), None for full attention."""
    window = getattr(layer, "sliding_window_size", None)
    if window is None or int(window) < 0:
        return None
    return int(window)


def window_refusal(backend_name: str, reason: str) -> str:
    """Why a DDTREE tree on a sliding-window model cannot be verified without the
    tree-verify path, and what to use instead."""
    return (
        f"DDTREE verify on {backend_name} of a model with sliding-window layers needs "
        f"the tree-verify path, which cannot serve it here: {reason}. Upstream's "
        f"dense-mask verify counts a tree node's sliding window from its index in the "
        f"tree instead of its depth, which changes the output of a tree. Use "
        f"--attention-backend triton without that, or --speculative-algorithm DFLASH "
        f"(a chain, which upstream's path serves exactly)."
    )


def active_hook(attn_backend: Any) -> Optional["TreeVerifyHook"]:
    """The backend's hook when it serves TARGET_VERIFY itself, else None."""
    hook = getattr(innermost_attention_backend(attn_backend), "tree_verify", None)
    if isinstance(hook, TreeVerifyHook) and hook.kind is not None:
        return hook
    return None


def stage_verify_prefix_lens(attn_backend: Any, seq_lens: torch.Tensor) -> None:
    """A speculative step's committed lengths, handed to the target backend's hook
    before the step queues its draft (:meth:`TreeVerifyHook.stage_prefix_lens`)."""
    hook = active_hook(attn_backend)
    if hook is not None:
        hook.stage_prefix_lens(seq_lens)


@dataclass
class SWAIndices:
    """A verify's KV slots in a hybrid SWA pool, for the layers whose KV lives there."""

    prefix_kv_indptr: torch.Tensor  # int32 [bs + 1]: min(seq_len, window) per request
    prefix_kv_indices: torch.Tensor  # int32: those last committed tokens' SWA slots
    tree_kv_indices: torch.Tensor  # int32 [bs, N]: the tree's SWA slots


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
    # Hybrid SWA pool only: the slots its sliding-window layers read.
    swa: Optional[SWAIndices] = None
    # The exact prefix lengths on their way to the host, when the worker staged
    # them ahead of this verify (``TreeVerifyHook.stage_prefix_lens``).
    staged_prefix_lens: Optional["StagedPrefixLens"] = None
    # Built in the persistent buffers a CUDA graph reads (capture and replay).
    graph: bool = False


@dataclass
class StagedPrefixLens:
    """A verify's prefix lengths on their way to the host: ``lens`` is valid once
    ``ready`` (a CUDA event; None on the CPU) has completed. Only a planner that
    reads them waits for that (:meth:`for_rows`)."""

    lens: torch.Tensor  # int32 [raw bs], pinned on a GPU
    ready: Any
    fill_value: int  # a CUDA graph's padding rows

    def for_rows(self, bs: int) -> Optional[torch.Tensor]:
        """The lengths of a verify of ``bs`` rows (the raw batch's, then padding
        rows at the fill value), or None when they cannot be this verify's."""
        raw = self.lens.shape[0]
        if raw > bs:
            return None
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if raw == bs:
            return self.lens
        out = torch.full((bs,), self.fill_value, dtype=torch.int32)
        out[:raw] = self.lens
        return out


class TreeVerifyHook:
    """The tree-verify path of one attention backend.

    ``kind`` is what this backend serves (TREE, CHAIN, BLOCK or None = nothing,
    in which case every call is a no-op and upstream's path runs). It is fixed
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
        target: Optional[TargetAttention] = None,
        serves_chain: bool = True,
        serves_draft_block: bool = False,
        draft_window: Optional[int] = None,
        unsupported: Optional[str] = None,
        require_for_tree: bool = False,
        dense_mask_fallback: bool = True,
        kv_pool: Any = None,
        sliding_window_size: Optional[int] = None,
        seq_len_fill_value: int = 1,
    ):
        self.backend_name = backend_name
        # The prefix length a CUDA graph's padding rows get (the backend's
        # ``get_cuda_graph_seq_len_fill_value``).
        self.seq_len_fill_value = int(seq_len_fill_value)
        # The model's sliding window (upstream's ``model_runner.sliding_window_size``,
        # its layers' largest), and the hybrid SWA pool its sliding layers' KV lives in.
        self.sliding_window_size = (
            int(sliding_window_size) if sliding_window_size is not None and sliding_window_size > 0 else None
        )
        self.swa_pool = kv_pool if is_swa_pool(kv_pool) else None
        # Whether upstream's path of this backend applies a dense custom mask
        # (so a layer the hook cannot serve may fall back to it).
        self.dense_mask_fallback = dense_mask_fallback
        self.req_to_token = req_to_token
        self.max_context_len = int(max_context_len)
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.fp8_kv = fp8_kv_enabled()
        forced = forced_strategy()
        wanted = static_verify_kind(spec_algorithm)
        if is_draft_worker:
            wanted = BLOCK if wanted is not None and serves_draft_block else None
        if wanted == CHAIN and not serves_chain:
            wanted = None
        reason = None
        if forced == UPSTREAM_EXTEND:
            reason = f"{STRATEGY_ENV}={UPSTREAM_EXTEND} keeps upstream's verify path"
        elif unsupported:
            reason = unsupported
        elif wanted == BLOCK and draft_window is not None:
            reason = "draft sliding window (compact draft KV cache)"
        elif self.swa_pool is not None and self.sliding_window_size is None:
            reason = "hybrid SWA KV pool without a sliding window size"
        self.kind = wanted if reason is None else None
        windowed = self.sliding_window_size is not None or self.swa_pool is not None
        if wanted is not None and reason is not None:
            if wanted == TREE and require_for_tree:
                raise TreeVerifyUnavailable(
                    f"DDTREE verify on {backend_name} needs the tree-verify path, "
                    f"which is off: {reason}. {backend_name} has no other way to "
                    f"apply a tree mask; use --attention-backend triton."
                )
            if wanted == TREE and windowed:
                raise TreeVerifyUnavailable(window_refusal(backend_name, reason))
            logger.info("Tree-verify path off on %s: %s.", backend_name, reason)
        elif self.kind is not None:
            logger.info("%s serves %s verify through the tree-verify path.", backend_name, self.kind)
        # The target's verify takes the policy's strategy; the drafter's block
        # always runs the fused kernel (its shape is the drafter's, not measured).
        self.routes: Optional[VerifyRoutes] = None
        if self.kind in (TREE, CHAIN):
            self.routes = VerifyRoutes(
                backend_name=backend_name, device=device, target=target, forced=forced,
                pool_requests=int(req_to_token.shape[0]) if req_to_token is not None else 0,
                max_context_len=self.max_context_len,
            )  # fmt: skip
        self.metadata: Optional[TreeVerifyMetadata] = None
        self._staged: Optional[StagedPrefixLens] = None
        self._staging: Optional[torch.Tensor] = None  # host buffer of the staged lengths
        # Eager-mode chain / all-ones masks, built once per (kind, bs, N).
        self._masks: Dict[Tuple[Any, int, int], torch.Tensor] = {}
        self._graph: Optional[Dict[str, torch.Tensor]] = None
        # Whether a TARGET_VERIFY layer was left to upstream's path (then upstream's verify
        # buffers are read), whether a graph's layers took this one, and whether the next
        # replay's prefix row pointers are the hook's to fill (``claims_replay_indptr``).
        self._left_to_upstream = False
        self._served_in_graph = False
        self._indptr_claimed = False
        self._always_refill = bool(ddtree_envs.SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM.get())
        self._fill_indices = (
            verify_indices_reference if ddtree_envs.SGLANG_DDTREE_VERIFY_INDICES_TORCH.get() else verify_indices
        )

    @property
    def consumes_tree_mask_bits(self) -> bool:
        return self.kind == TREE

    # ------------------------------------------------------------ host lengths

    @property
    def wants_prefix_lens(self) -> bool:
        """Whether the next verify's plan most likely reads the lengths on the host
        (the last one's did)."""
        return self.routes is not None and self.routes.reads_host_lengths

    def stage_prefix_lens(self, seq_lens: torch.Tensor) -> None:
        """Start copying the next target verify's prefix lengths (``seq_lens``, the
        committed lengths the verify's ``forward_batch.seq_lens`` will hold) to the
        host. Called by the speculative worker before it queues the draft: the copy
        then waits for the previous step's work only, and a planner that reads the
        lengths on the host does not wait for the draft. The next :meth:`prepare`
        of a target verify takes them; any other forward drops them."""
        if not self.wants_prefix_lens:
            return
        bs = int(seq_lens.shape[0])
        if self._staging is None or self._staging.shape[0] < bs:
            rows = int(self.req_to_token.shape[0]) if self.req_to_token is not None else bs
            size = max(bs, rows)
            self._staging = torch.zeros(size, dtype=torch.int32, pin_memory=seq_lens.is_cuda)
        lens = self._staging[:bs]
        ready = None
        if seq_lens.is_cuda:
            lens.copy_(seq_lens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            lens.copy_(seq_lens)
        self._staged = StagedPrefixLens(lens, ready, self.seq_len_fill_value)

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
        if self.swa_pool is not None:
            room = max_bs * self.sliding_window_size
            self._graph.update(
                swa_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                # Full-pool slots of each window, then their SWA slots: the
                # translation reads the first and never its own output.
                swa_full=torch.zeros(room, dtype=torch.int32, device=self.device),
                swa_prefix=torch.zeros(room, dtype=torch.int32, device=self.device),
                swa_tree=torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device),
            )

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

    def claims_replay_indptr(self, forward_batch: Any) -> bool:
        """Before a TARGET_VERIFY graph's replay: True when every layer of the captured graphs
        took this path. The backend's own verify buffers (query and mask row pointers, prefix
        indices, dense mask) then go unread, and refilling them is most of a small model's
        replay preparation; the :meth:`prepare` that follows fills the prefix row pointers the
        capture handed the hook (the backend's ``kv_indptr``). False where a layer was ever
        left to upstream's path (it reads them), or the hook serves no verify."""
        self._indptr_claimed = not (
            self.kind is None
            or self._always_refill
            or self._left_to_upstream
            or not self._served_in_graph
            or not forward_batch.forward_mode.is_target_verify()
        )
        return self._indptr_claimed

    def prepare(
        self,
        forward_batch: Any,
        kv_indptr: Optional[torch.Tensor] = None,
        graph: bool = False,
    ) -> Optional[TreeVerifyMetadata]:
        """Per-forward metadata, built outside the forward (eager, capture, replay).

        ``kv_indptr``: the backend's prefix CSR row pointers (int32, at least
        ``bs + 1`` long, ``cumsum(seq_lens)``) when it already built them for
        this verify, or when it left them to the hook (:meth:`claims_replay_indptr`).
        ``graph``: fill the persistent capture buffers (capture and replay).
        """
        kind = self._verify_kind(forward_batch, graph)
        self.metadata = None
        causal = None
        staged, self._staged = self._staged, None  # a stage serves the next verify only
        fill_indptr = kv_indptr is None or self._indptr_claimed
        self._indptr_claimed = False  # a claim serves the replay it was made for only
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
            indices = buf["prefix"][: bs * self.max_context_len]
            tree = buf["tree"][: bs * n]
            # The row pointers, the prefix's slots and the tree's (zero on padding rows).
            self._fill_indices(
                self.req_to_token, req_pool_indices, seq_lens, kv_indptr, indices,
                fill_indptr=fill_indptr, tree_src=out_cache_loc, tree_out=tree, width=n,
            )  # fmt: skip
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
                kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=seq_lens.device)
            total = forward_batch.seq_lens_sum
            if total is None:
                total = bs * self.max_context_len
            indices = torch.empty(int(total), dtype=torch.int32, device=seq_lens.device)
            self._fill_indices(
                self.req_to_token, req_pool_indices, seq_lens, kv_indptr, indices, fill_indptr=fill_indptr
            )
            tree = out_cache_loc.to(torch.int32)
            if kind == TREE:
                mask = bits
            elif kind == BLOCK:
                mask = self._static_mask(full_tree_mask, bs, n)
                causal = self._static_mask(causal_tree_mask, bs, n)
            else:
                mask = self._static_mask(causal_tree_mask, bs, n)
        swa = None
        if self.swa_pool is not None:
            swa = self._swa_indices(req_pool_indices, seq_lens, out_cache_loc, bs, n, graph)
        self.metadata = TreeVerifyMetadata(
            kind=kind,
            prefix_kv_indptr=kv_indptr,
            prefix_kv_indices=indices,
            tree_kv_indices=tree.view(bs, n),
            tree_mask=mask,
            causal_mask=causal,
            swa=swa,
            staged_prefix_lens=staged if kind in (TREE, CHAIN) else None,
            graph=graph,
        )
        if self.routes is not None:
            self.routes.prepare(self.metadata, graph)
        return self.metadata

    def _swa_indices(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        bs: int,
        n: int,
        graph: bool,
    ) -> SWAIndices:
        """The SWA pool's slots of this verify: each request's last
        ``min(seq_len, sliding_window_size)`` committed tokens (what upstream's
        ``update_sliding_window_buffer`` gathers; the pool keeps at least those)
        and the tree's, translated as upstream translates ``out_cache_loc``."""
        window = self.sliding_window_size
        room = bs * window
        lens = torch.clamp(seq_lens, max=window)
        if graph:
            buf = self._graph
            indptr = buf["swa_indptr"][: bs + 1]
            full = buf["swa_full"][:room]
            prefix = buf["swa_prefix"][:room]
            tree = buf["swa_tree"][: bs * n]
        else:
            indptr = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
            full = torch.zeros(room, dtype=torch.int32, device=seq_lens.device)
            prefix, tree = None, None
        indptr[1:] = torch.cumsum(lens, 0)
        fill_prefix_indices(
            self.req_to_token, req_pool_indices, lens, indptr, full, start=seq_lens - lens
        )
        translate = self.swa_pool.translate_loc_from_full_to_swa
        swa_prefix = translate(full.long()).to(torch.int32)
        swa_tree = translate(out_cache_loc.long()).to(torch.int32)
        if graph:
            prefix.copy_(swa_prefix)
            rows = swa_tree.shape[0]
            tree[:rows].copy_(swa_tree)
            tree[rows:].zero_()
        else:
            prefix, tree = swa_prefix, swa_tree
        return SWAIndices(prefix_kv_indptr=indptr, prefix_kv_indices=prefix, tree_kv_indices=tree.view(bs, n))

    # ------------------------------------------------------------ forward

    def _on_swa_pool(self, layer: Any) -> bool:
        if self.swa_pool is None:
            return False
        return bool(self.swa_pool.layers_mapping.get(getattr(layer, "layer_id", None), (None, False))[1])

    def _layer_unsupported(
        self, layer: Any, q: torch.Tensor, k_buffer: torch.Tensor, extra: Optional[str]
    ) -> Optional[str]:
        if extra:
            return extra
        window = layer_window(layer)
        if self._on_swa_pool(layer) and (window is None or window > self.sliding_window_size):
            return (
                f"a layer in the SWA KV pool with window {window}, which the pool's "
                f"window {self.sliding_window_size} does not cover"
            )
        fp8 = is_fp8(k_buffer.dtype) and self.fp8_kv
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
        sinks: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Attention of this TARGET_VERIFY layer, or None when the hook does not
        serve it (upstream's path then runs). The tree's KV must already be in
        the pool. ``q``: ``[bs*N, H, Dqk]``; returns ``[bs*N, H, Dv]``.
        ``k_buffer``/``v_buffer``: the pool's buffers of this layer (the SWA
        pool's for its sliding layers).

        ``unsupported``: a backend-side reason this layer cannot take the
        path (score_mod, non-causal...). ``sinks``: the layer's ``[H]`` attention
        sink logits (gpt-oss), as the model hands them to the backend.
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
        window = layer_window(layer)
        reason = self._layer_unsupported(layer, q, k_buffer, unsupported)
        if reason is not None:
            self._left_to_upstream = True
            where = f"layer {getattr(layer, 'layer_id', '?')}: {reason}"
            if meta.kind == TREE and window is not None:
                raise TreeVerifyUnavailable(window_refusal(self.backend_name, where))
            has_dense = getattr(forward_batch.spec_info, "custom_mask", None) is not None
            if meta.kind == TREE and not (self.dense_mask_fallback and has_dense):
                raise TreeVerifyUnavailable(
                    f"DDTREE verify on {self.backend_name}, {where}: the tree-verify "
                    f"path cannot serve it and no dense mask applies. Use "
                    f"--attention-backend triton with {STRATEGY_ENV}={UPSTREAM_EXTEND} "
                    f"for the dense-mask path."
                )
            return None
        prefix_indptr, prefix_indices, tree_indices = (
            meta.prefix_kv_indptr, meta.prefix_kv_indices, meta.tree_kv_indices,
        )  # fmt: skip
        if self._on_swa_pool(layer):
            swa = meta.swa
            prefix_indptr, prefix_indices, tree_indices = (
                swa.prefix_kv_indptr, swa.prefix_kv_indices, swa.tree_kv_indices,
            )  # fmt: skip
        if meta.graph:
            self._served_in_graph = True
        logit_cap = float(logit_cap or 0.0)
        strategy, options = None, None  # the dispatcher's default: fused on a GPU
        if self.routes is not None and meta.kind in (TREE, CHAIN):
            strategy, options = self.routes.for_layer(
                meta, q, k_buffer, v_buffer, layer, logit_cap,
                window_or_sinks=window is not None or sinks is not None,
            )  # fmt: skip
        return tree_verify_attention(
            q,
            k_buffer,
            v_buffer,
            prefix_indptr,
            prefix_indices,
            tree_indices,
            mask,
            layer.scaling,
            out=out,
            logit_cap=logit_cap,
            k_scale=float(getattr(layer, "k_scale_float", None) or 1.0),
            v_scale=float(getattr(layer, "v_scale_float", None) or 1.0),
            strategy=strategy,
            strategy_options=options,
            sliding_window=window,
            sinks=sinks,
        )


def check_runtime_tree_verify(attn_backend: Any) -> None:
    """Raise unless ``attn_backend`` applies a DDTree tree mask in TARGET_VERIFY,
    either through its hook (reads ``tree_mask_bits``) or upstream's dense mask.

    The startup check (``support.check_tree_verify_backend``) refuses such
    servers first; this guards paths that did not go through ServerArgs.
    """
    backend = innermost_attention_backend(attn_backend)
    hook = active_hook(backend)
    if hook is not None and hook.kind == TREE:
        return
    if getattr(backend, "tree_verify", None) is not None and hook is None:
        if getattr(backend.tree_verify, "dense_mask_fallback", False):
            return  # the hook is off; upstream's path applies the dense mask
    name = type(backend).__name__
    raise TreeVerifyUnavailable(
        f"DDTREE verify needs a tree mask, and the attention backend {name} "
        f"applies none in TARGET_VERIFY (it would verify the tree causally). "
        f"Use --attention-backend triton (or flashinfer)."
    )

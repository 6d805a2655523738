# SPDX-License-Identifier: Apache-2.0
"""Which strategy serves a target verify's layers, and what it plans per forward.

The hook asks :class:`VerifyRoutes` once per forward (:meth:`VerifyRoutes.prepare`,
outside any CUDA graph) and once per layer (:meth:`VerifyRoutes.for_layer`):

* the strategy is the policy's (``policy.choose_strategy``) for this batch size,
  or the one ``SGLANG_DDTREE_VERIFY_STRATEGY`` forces; a layer the chosen prefix
  pass cannot serve (a logit cap, other head sizes) runs the fused kernel;
* ``flashinfer_split`` plans FlashInfer in :meth:`prepare` from the device's
  prefix lengths: FlashInfer's kernels take each request's length from the plan,
  and the host's ``seq_lens_cpu`` of a speculative verify is only an upper bound
  (it may lag the device under the overlap scheduler), so the plan copies the
  exact lengths to the host once per forward, as upstream's FlashInfer MLA
  backend does for its own verify. Under CUDA graphs each captured batch size
  keeps one pass whose buffers the replays re-plan;
* ``flashmla_split`` shares one page staging (room for every pool token: about
  one KV layer) and one plan per forward (page layout and FlashMLA schedule, made
  on the device by the forward's first layer, so a captured graph records it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.dispatch import (
    FLASHINFER_SPLIT,
    FLASHMLA_SPLIT,
    FUSED,
    StrategyUnavailable,
)
from sglang.srt.layers.attention.tree_verify.policy import (
    MLA_KIND,
    STRATEGY_ENV,
    VerifyShape,
    VerifyTarget,
    available_strategies,
    choose_strategy,
    flashinfer_backend,
    flashmla_reason,
    layer_strategy,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetAttention:
    """The target model's attention on this rank, known before any forward."""

    num_heads: int
    head_dim_qk: int
    head_dim_v: int
    num_kv_heads: int
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    #: Every layer has attention sinks (gpt-oss), which only the fused kernel applies.
    sinks: bool = False

    @property
    def verify_target(self) -> VerifyTarget:
        return VerifyTarget.of(
            self.head_dim_qk, self.head_dim_v, self.num_kv_heads, self.q_dtype, self.kv_dtype
        )


class VerifyRoutes:
    """The target verify's strategy per forward, and the prefix passes' state."""

    def __init__(
        self,
        *,
        backend_name: str,
        device: Any,
        target: Optional[TargetAttention],
        forced: Optional[str],
        pool_requests: int,
        max_context_len: int,
    ):
        from sglang.srt.layers.attention.tree_verify.hook import TreeVerifyUnavailable
        from sglang.srt.utils.gpu_arch import device_capability, policy_arch

        self.backend_name = backend_name
        self.target = target
        self.forced = forced
        self.pool_requests = pool_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device) if device is not None else None
        try:
            real = device_capability(self.device) if self.device is not None else None
        except (RuntimeError, ValueError):  # no GPU, or not a CUDA device
            real = None
        self.arch = policy_arch(self.device) if real is not None else None
        if target is not None:
            self.available, why_not = available_strategies(target.verify_target, real)
            if target.sinks:
                # No layer can take a prefix pass: plan none.
                why_not = {
                    **why_not,
                    **{s: "the model's attention sinks, which only the fused kernel applies"
                       for s in self.available - {FUSED}},
                }  # fmt: skip
                self.available = frozenset({FUSED})
        else:
            # Without the target's shape the policy cannot plan ahead: FlashMLA,
            # which plans inside the forward, is decided per layer.
            reason = flashmla_reason(real)
            self.available = frozenset({FUSED} | ({FLASHMLA_SPLIT} if reason is None else set()))
            why_not = {FLASHINFER_SPLIT: "the target's attention shape is not known ahead"}
            if reason:
                why_not[FLASHMLA_SPLIT] = reason
        if forced in (FLASHMLA_SPLIT, FLASHINFER_SPLIT) and forced in why_not:
            raise TreeVerifyUnavailable(f"{STRATEGY_ENV}={forced}: {why_not[forced]}")
        self._by_shape: Dict[Tuple[int, int, int], str] = {}
        # flashmla_split: one staging for every layer and forward; the forward's plan
        # and what it was made for (metadata, last layer id).
        self.flashmla_staging: Optional[torch.Tensor] = None
        self.flashmla_off = False
        self._flashmla_plan: Any = None
        self._flashmla_plan_at: Tuple[Any, int] = (None, -1)
        # flashinfer_split: this forward's planned pass; one pass per (graph or eager,
        # batch size, width), re-planned every forward.
        self._prefix_pass: Any = None
        self._prefix_passes: Dict[Tuple[bool, int, int], Any] = {}
        self._forward: Tuple[Optional[str], int] = (None, 0)  # (strategy, batch)
        self._window_layers_logged = False
        if forced is not None:
            logger.info("%s: target verify forced to %s (%s).", backend_name, forced, STRATEGY_ENV)
        elif self.arch is not None:
            logger.info(
                "%s: target verify strategy per batch size from the policy for "
                "compute capability %d.%d (candidates: %s).",
                backend_name, self.arch[0], self.arch[1], ", ".join(sorted(self.available)),
            )  # fmt: skip

    # ------------------------------------------------------------ the choice

    def strategy(self, bs: int, width: int, heads: int) -> Optional[str]:
        """The strategy for a verify of ``bs`` requests of ``width`` nodes and
        ``heads`` query heads; None (the dispatcher's default) without a GPU."""
        if self.forced is not None:
            return self.forced
        if self.arch is None:
            return None
        key = (bs, width, heads)
        if key not in self._by_shape:
            kind = self.target.verify_target.kind if self.target is not None else MLA_KIND
            shape = VerifyShape(heads=heads, width=width, batch=bs, kind=kind)
            choice = choose_strategy(self.arch, shape, self.available)
            if choice == FLASHMLA_SPLIT and self.flashmla_off:
                choice = FUSED
            self._by_shape[key] = choice
            logger.info(
                "%s: %s serves the target verify of %d x %d nodes, %d heads.",
                self.backend_name, choice, bs, width, heads,
            )  # fmt: skip
        return self._by_shape[key]

    # ------------------------------------------------------------ per forward

    def prepare(self, meta: Any, graph: bool) -> None:
        """Per forward, outside any graph: the strategy of this batch and, for
        flashinfer_split, FlashInfer's plan (one device-to-host copy of the
        prefix row pointers)."""
        bs, width = meta.tree_kv_indices.shape
        self._prefix_pass = None
        strategy = self.strategy(bs, width, self.target.num_heads) if self.target else None
        self._forward = (strategy, bs)
        if strategy != FLASHINFER_SPLIT:
            return
        from sglang.srt.layers.attention.tree_verify.flashinfer_split import (
            FlashInferPrefixPass,
            PrefixPassShape,
        )

        t = self.target
        shape = PrefixPassShape(
            num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim_qk=t.head_dim_qk,
            head_dim_v=t.head_dim_v, width=width, q_dtype=t.q_dtype, kv_dtype=t.kv_dtype,
            sm_scale=t.sm_scale,
        )  # fmt: skip
        key = (graph, bs, width)
        if key not in self._prefix_passes:
            self._prefix_passes[key] = FlashInferPrefixPass.create(
                shape, bs, meta.prefix_kv_indices.device, backend=flashinfer_backend(),
                graph_prefix_indices=meta.prefix_kv_indices if graph else None,
            )  # fmt: skip
        prefix_pass = self._prefix_passes[key]
        prefix_pass.plan(meta.prefix_kv_indptr, meta.prefix_kv_indices)
        self._prefix_pass = prefix_pass

    # ------------------------------------------------------------ per layer

    def for_layer(
        self, meta: Any, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
        layer: Any, logit_cap: float, window_or_sinks: bool = False,
    ) -> Tuple[Optional[str], Optional[dict]]:  # fmt: skip
        """``(strategy, its options)`` for this layer of the forward.
        ``window_or_sinks``: the layer has a sliding window or attention sinks,
        which only the fused kernel (and the reference) apply."""
        bs, width = meta.tree_kv_indices.shape
        strategy, planned_bs = self._forward
        if strategy is None or planned_bs != bs:
            strategy = self.strategy(bs, width, q.shape[1])
        if window_or_sinks:
            chosen = layer_strategy(strategy, True)
            if chosen != strategy and not self._window_layers_logged:
                self._window_layers_logged = True
                logger.info(
                    "%s: sliding-window and attention-sink layers take %s (%s applies neither).",
                    self.backend_name, chosen, strategy,
                )  # fmt: skip
            return chosen, None
        if strategy == FLASHINFER_SPLIT:
            options = self._flashinfer_options(q, k_buffer, layer, logit_cap)
        elif strategy == FLASHMLA_SPLIT:
            options = self._flashmla_options(meta, q, k_buffer, v_buffer, layer, logit_cap)
        else:
            return strategy, None
        if options is None:
            return FUSED, None
        return strategy, options

    def _flashinfer_options(self, q, k_buffer, layer, logit_cap) -> Optional[dict]:
        """The planned pass, when it was planned for this layer's shape (a model
        whose layers differ, Gemma 4's full and sliding ones, plans for one)."""
        prefix_pass = self._prefix_pass
        problem = None
        if prefix_pass is None:
            problem = "no FlashInfer plan for this forward"
        elif logit_cap > 0:
            problem = "a logit cap"
        elif (
            q.shape[1] != prefix_pass.shape.num_heads
            or q.shape[2] != prefix_pass.shape.head_dim_qk
            or k_buffer.shape[1] != prefix_pass.shape.num_kv_heads
            or float(layer.scaling) != prefix_pass.shape.sm_scale
        ):
            problem = "heads, head size or scale other than the planned ones"
        if problem is None:
            return dict(prefix_pass=prefix_pass)
        if self.forced == FLASHINFER_SPLIT:
            raise StrategyUnavailable(f"flashinfer_split on {self.backend_name}: {problem}")
        return None

    def _flashmla_options(self, meta, q, k_buffer, v_buffer, layer, logit_cap) -> Optional[dict]:
        """flashmla_split's inputs: one page staging for every layer (room for every
        running request's prefix, which all live in the pool: about one KV layer),
        and the forward's plan. The plan is made by the forward's first layer: a new
        metadata, or a layer id not above the last one (the graph runner re-runs
        one batch's forward for warm-up and capture, and the capture must record
        the planning so replays plan for their own batch).

        None when the policy's choice cannot be served here (this layer's shape, no
        room for the staging, or first asked inside a graph capture): the fused
        kernel serves, and after a staging problem for good, so captured graphs
        and eager forwards agree. A forced strategy raises instead."""
        from sglang.srt.layers.attention.tree_verify.flashmla_split import (
            check_supported,
            new_staging,
            plan_flashmla,
            side_stream,
            staging_pages,
        )

        forced = self.forced == FLASHMLA_SPLIT
        if self.flashmla_off:
            return None
        if not forced:
            try:
                check_supported(q, k_buffer, v_buffer, logit_cap)
            except StrategyUnavailable:
                return None
        if self.flashmla_staging is None:
            pages = staging_pages(self.pool_requests, int(k_buffer.shape[0]))
            problem = None
            if k_buffer.is_cuda and torch.cuda.is_current_stream_capturing():
                problem = (
                    "the page staging must be allocated before graph capture (by an "
                    "eager TARGET_VERIFY forward, e.g. the warm-up run)"
                )
            else:
                try:
                    self.flashmla_staging = new_staging(pages, k_buffer)
                    if k_buffer.is_cuda:
                        side_stream(k_buffer.device)  # the tail's stream, before any capture
                except torch.cuda.OutOfMemoryError as e:
                    problem = f"no room for its page staging ({pages} pages of 64 tokens): {e}"
            if problem is not None:
                if forced:
                    raise RuntimeError(f"flashmla_split: {problem}")
                logger.warning(
                    "%s: FlashMLA verify off, the fused kernel serves it: %s",
                    self.backend_name, problem,
                )  # fmt: skip
                self.flashmla_off = True
                self._by_shape = {k: (FUSED if v == FLASHMLA_SPLIT else v) for k, v in self._by_shape.items()}
                return None
        layer_id = getattr(layer, "layer_id", 0)
        planned_for, last_layer = self._flashmla_plan_at
        if planned_for is not meta or layer_id <= last_layer:
            self._flashmla_plan = plan_flashmla(
                meta.prefix_kv_indptr, meta.tree_kv_indices.shape[1], q.shape[1],
                self.max_context_len, self.flashmla_staging.shape[0],
            )  # fmt: skip
        self._flashmla_plan_at = (meta, layer_id)
        return dict(staging=self.flashmla_staging, plan=self._flashmla_plan)

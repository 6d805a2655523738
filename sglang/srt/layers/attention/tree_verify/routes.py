# SPDX-License-Identifier: Apache-2.0
"""Which strategy serves a target verify's layers, and what it plans per forward.

The hook asks :class:`VerifyRoutes` once per forward (:meth:`VerifyRoutes.prepare`,
outside any CUDA graph) and once per layer (:meth:`VerifyRoutes.for_layer`):

* the strategy is the one ``SGLANG_DDTREE_VERIFY_STRATEGY`` forces, or the
  policy's ranking (``policy.choose_strategy``) for this batch size among the
  strategies that can run here (``strategies.available_strategies``);
* the chosen strategy plans (its ``planner``: FlashInfer's plan per forward,
  FlashMLA's page staging and plan), and a layer it cannot serve (a sliding
  window or attention sinks, a logit cap, other head sizes) runs the fused kernel.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.dispatch import STRATEGY_ENV
from sglang.srt.layers.attention.tree_verify.policy import VerifyShape, choose_strategy
from sglang.srt.layers.attention.tree_verify.registry import (
    FUSED,
    MLA_KIND,
    TargetAttention,
    TreeVerifyUnavailable,
    VerifyPlanner,
)
from sglang.srt.layers.attention.tree_verify.strategies import available_strategies, get_strategy
from sglang.srt.utils import gpu_arch

logger = logging.getLogger(__name__)


def layer_strategy(strategy: Optional[str], window_or_sinks: bool) -> Optional[str]:
    """The strategy for one layer of a verify whose strategy is ``strategy``: a
    sliding-window or attention-sink layer (gpt-oss, Gemma 4) takes the fused
    kernel unless the strategy applies both (the prefix passes of FlashInfer and
    FlashMLA apply neither); None stays the dispatcher's default (fused on a GPU,
    reference on the CPU)."""
    if window_or_sinks and strategy is not None and not get_strategy(strategy).applies_window_and_sinks:
        return FUSED
    return strategy


class VerifyRoutes:
    """The target verify's strategy per forward, and the planners of the strategies
    that plan."""

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
        self.backend_name = backend_name
        self.target = target
        self.forced = forced
        self.device = torch.device(device) if device is not None else None
        try:
            real = gpu_arch.device_capability(self.device) if self.device is not None else None
        except (RuntimeError, ValueError):  # no GPU, or not a CUDA device
            real = None
        self.arch = gpu_arch.policy_arch(self.device) if real is not None else None
        # Without the target's shape nothing is planned ahead: only FlashMLA, which
        # plans inside the forward, can join the fused kernel.
        self.available, why_not = available_strategies(
            target.verify_target if target is not None else None, real
        )
        if forced in why_not:
            raise TreeVerifyUnavailable(f"{STRATEGY_ENV}={forced}: {why_not[forced]}")
        self.planners: Dict[str, VerifyPlanner] = {}
        for name in self.available:
            planner = get_strategy(name).planner(
                backend_name=backend_name, target=target, forced=name == forced,
                pool_requests=pool_requests, max_context_len=max_context_len,
            )  # fmt: skip
            if planner is not None:
                self.planners[name] = planner
        self._by_shape: Dict[Tuple[int, int, int], str] = {}
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

    @property
    def reads_host_lengths(self) -> bool:
        """Whether the last verify's strategy planned from the exact prefix lengths on
        the host: the next one most likely takes it again (a batch size that changes
        strategy plans its first forward from the device)."""
        planner = self.planners.get(self._forward[0])
        return planner is not None and planner.reads_host_lengths and not planner.off

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
            layout = {}
            if kind != MLA_KIND:
                layout = dict(kv_heads=self.target.num_kv_heads, head_dim=self.target.head_dim_qk)
            shape = VerifyShape(heads=heads, width=width, batch=bs, kind=kind, **layout)
            choice = choose_strategy(self.arch, shape, self.available)
            if self._off(choice):
                choice = FUSED
            self._by_shape[key] = choice
            logger.info(
                "%s: %s serves the target verify of %d x %d nodes, %d heads.",
                self.backend_name, choice, bs, width, heads,
            )  # fmt: skip
        return self._by_shape[key]

    def _off(self, strategy: Optional[str]) -> bool:
        planner = self.planners.get(strategy)
        return planner is not None and planner.off

    # ------------------------------------------------------------ per forward

    def prepare(self, meta: Any, graph: bool) -> None:
        """Per forward, outside any graph: the strategy of this batch, and what it
        plans (flashinfer_split: FlashInfer's plan, one device-to-host copy of the
        prefix row pointers)."""
        bs, width = meta.tree_kv_indices.shape
        strategy = self.strategy(bs, width, self.target.num_heads) if self.target else None
        self._forward = (strategy, bs)
        planner = self.planners.get(strategy)
        if planner is not None:
            planner.prepare(meta, graph)

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
        planner = self.planners.get(strategy)
        if planner is None:
            return strategy, None
        options = planner.layer_options(meta, q, k_buffer, v_buffer, layer, logit_cap)
        if planner.off:  # for good: the batch sizes chosen before take the fused kernel too
            self._by_shape = {k: (FUSED if v == strategy else v) for k, v in self._by_shape.items()}
        if options is None:
            return FUSED, None
        return strategy, options

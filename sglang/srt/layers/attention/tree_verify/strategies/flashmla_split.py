# SPDX-License-Identifier: Apache-2.0
"""``flashmla_split``: the prefix copied into 64-token pages, FlashMLA over them,
our tree tail, an LSE merge (``tree_verify/flashmla_split.py``).

Absorbed MLA with the KV cache in q's dtype, on the GPUs FlashMLA ships kernels
for (sm_90a, sm_100a), with sgl_kernel's FlashMLA loading; never under the sm_120
proxy. A server shares one page staging (room for every pool token: about one KV
layer) and one plan per forward (page layout and FlashMLA's schedule, made on the
device by the forward's first layer, so a captured graph records it):
:class:`FlashMLAPlanner`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify import flashmla_split
from sglang.srt.layers.attention.tree_verify.prefix_split import call_config
from sglang.srt.layers.attention.tree_verify.registry import (
    FLASHMLA_SPLIT,
    MLA_KIND,
    Capability,
    StrategyUnavailable,
    TreeVerifyStrategy,
    VerifyPlanner,
    register_strategy,
)
from sglang.srt.utils import gpu_arch

logger = logging.getLogger(__name__)


def _no_kernels(arch: Capability) -> Optional[str]:
    if arch[0] in flashmla_split.FLASHMLA_MAJORS:
        return None
    return (
        f"flashmla_split: FlashMLA ships kernels for sm_90a/sm_100a only, "
        f"not compute capability {arch[0]}.{arch[1]}"
    )


@register_strategy
class FlashMLASplit(TreeVerifyStrategy):
    name = FLASHMLA_SPLIT

    def unavailable(self, target, device_cap):
        """The one answer to "can FlashMLA serve this verify's prefix here"."""
        if target is not None:
            if target.kind != MLA_KIND:
                return "FlashMLA serves absorbed MLA only"
            if target.kv_dtype != target.q_dtype:
                return f"KV cache {target.kv_dtype} is not in q's dtype"
        if gpu_arch.sm120_proxy():
            return f"{gpu_arch.SM120_PROXY_ENV}=1 (sm_120 has no FlashMLA kernels)"
        if device_cap is None:
            return "no CUDA device"
        reason = _no_kernels(device_cap)
        if reason is None:
            try:
                flashmla_split._flash_mla()
            except StrategyUnavailable as e:
                reason = str(e)
        return reason

    def planner(self, **context):
        return FlashMLAPlanner(**context)

    def run(self, *, arch, kv_scales, staging=None, plan=None, max_prefix_len=None, **call):
        reason = _no_kernels(arch)
        if reason:
            raise StrategyUnavailable(reason)
        config = call_config(arch, call["q"], call["k_buffer"], call["v_buffer"])
        return flashmla_split.tree_verify_flashmla_split(
            **call, config=config, staging=staging, plan=plan, max_prefix_len=max_prefix_len
        )


class FlashMLAPlanner(VerifyPlanner):
    """One page staging for every layer and forward, and each forward's plan."""

    def __init__(self, *, backend_name: str, forced: bool, pool_requests: int, max_context_len: int, **_):
        self.backend_name = backend_name
        self.forced = forced
        self.pool_requests = pool_requests
        self.max_context_len = max_context_len
        self.staging: Optional[torch.Tensor] = None
        self._plan: Any = None
        self._plan_at: Tuple[Any, int] = (None, -1)  # the metadata planned for, its last layer id

    def layer_options(self, meta, q, k_buffer, v_buffer, layer, logit_cap) -> Optional[dict]:
        """The staging (room for every running request's prefix, which all live in
        the pool: about one KV layer) and the forward's plan. The plan is made by
        the forward's first layer: a new metadata, or a layer id not above the last
        one (the graph runner re-runs one batch's forward for warm-up and capture,
        and the capture must record the planning so replays plan for their own
        batch).

        None when this layer's shape cannot be served, or there is no room for the
        staging, or it is first asked for inside a graph capture: the fused kernel
        serves, and after a staging problem for good (:attr:`off`), so captured
        graphs and eager forwards agree. A forced strategy raises instead."""
        if self.off:
            return None
        if not self.forced:
            try:
                flashmla_split.check_supported(q, k_buffer, v_buffer, logit_cap)
            except StrategyUnavailable:
                return None
        if self.staging is None and not self._allocate_staging(k_buffer):
            return None
        layer_id = getattr(layer, "layer_id", 0)
        planned_for, last_layer = self._plan_at
        if planned_for is not meta or layer_id <= last_layer:
            self._plan = flashmla_split.plan_flashmla(
                meta.prefix_kv_indptr, meta.tree_kv_indices.shape[1], q.shape[1],
                self.max_context_len, self.staging.shape[0],
            )  # fmt: skip
        self._plan_at = (meta, layer_id)
        return dict(staging=self.staging, plan=self._plan)

    def _allocate_staging(self, k_buffer: torch.Tensor) -> bool:
        pages = flashmla_split.staging_pages(self.pool_requests, int(k_buffer.shape[0]))
        problem = None
        if k_buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            problem = (
                "the page staging must be allocated before graph capture (by an "
                "eager TARGET_VERIFY forward, e.g. the warm-up run)"
            )
        else:
            try:
                self.staging = flashmla_split.new_staging(pages, k_buffer)
                if k_buffer.is_cuda:
                    flashmla_split.side_stream(k_buffer.device)  # the tail's stream, before any capture
            except torch.cuda.OutOfMemoryError as e:
                problem = f"no room for its page staging ({pages} pages of 64 tokens): {e}"
        if problem is None:
            return True
        if self.forced:
            raise RuntimeError(f"flashmla_split: {problem}")
        logger.warning(
            "%s: FlashMLA verify off, the fused kernel serves it: %s", self.backend_name, problem
        )
        self.off = True
        return False

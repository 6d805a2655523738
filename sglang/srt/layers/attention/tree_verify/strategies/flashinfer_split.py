# SPDX-License-Identifier: Apache-2.0
"""``flashinfer_split``: FlashInfer's prefix pass, our tree tail, the two merged in
the tail's epilogue (``tree_verify/flashinfer_split.py``).

Absorbed MLA and MHA/GQA with Dqk == Dv, the KV cache in q's dtype, FlashInfer
installed. Its plan runs on the host over the exact prefix lengths, once per
forward, outside any graph (:class:`FlashInferPlanner`): FlashInfer's kernels
take each request's length from the plan, and the host's ``seq_lens_cpu`` of a
speculative verify is only an upper bound (it may lag the device under the
overlap scheduler). The exact lengths come from the worker, copied to the host
before it queued the draft (``TreeVerifyHook.stage_prefix_lens``), or else from
the device once per forward, as upstream's FlashInfer MLA backend does for its
own verify. Under CUDA graphs each captured batch size keeps one pass whose
buffers the replays re-plan.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from sglang.srt.layers.attention.tree_verify import flashinfer_split
from sglang.srt.layers.attention.tree_verify.prefix_split import call_config
from sglang.srt.layers.attention.tree_verify.registry import (
    FLASHINFER_SPLIT,
    MLA_KIND,
    StrategyUnavailable,
    TreeVerifyStrategy,
    VerifyPlanner,
    register_strategy,
)
from sglang.srt.utils import gpu_arch


def flashinfer_backend() -> str:
    """The FlashInfer MLA kernels asked for: fa2, what sm_120 runs, under the sm_120
    proxy; FlashInfer's own choice otherwise."""
    return "fa2" if gpu_arch.sm120_proxy() else "auto"


@register_strategy
class FlashInferSplit(TreeVerifyStrategy):
    name = FLASHINFER_SPLIT

    def unavailable(self, target, device_cap):
        if target is None:
            return "the target's attention shape is not known ahead"
        if target.kv_dtype != target.q_dtype:
            return f"KV cache {target.kv_dtype} is not in q's dtype"
        if target.kind != MLA_KIND and target.head_dim_qk != target.head_dim_v:
            return "FlashInfer's paged prefill needs Dqk == Dv"
        return flashinfer_split.flashinfer_reason()

    def planner(self, **context):
        return FlashInferPlanner(**context)

    def run(self, *, arch, kv_scales, prefix_pass=None, **call):
        config = call_config(arch, call["q"], call["k_buffer"], call["v_buffer"])
        return flashinfer_split.tree_verify_flashinfer_split(**call, config=config, prefix_pass=prefix_pass)


class FlashInferPlanner(VerifyPlanner):
    """One planned prefix pass per (graph or eager, batch size, width), re-planned
    every forward that takes this strategy."""

    reads_host_lengths = True

    def __init__(self, *, backend_name: str, target: Any, forced: bool, **_):
        self.backend_name = backend_name
        self.target = target
        self.forced = forced
        self._passes: Dict[Tuple[bool, int, int], Any] = {}
        # The forward's metadata and the pass planned for it.
        self._planned: Tuple[Any, Any] = (None, None)

    def prepare(self, meta, graph):
        """FlashInfer's plan for this forward, from the prefix lengths staged on the
        host ahead of the draft when the worker staged them, else from the device
        (FlashInfer copies them to the host: a sync that waits for the draft)."""
        bs, width = meta.tree_kv_indices.shape
        key = (graph, bs, width)
        if key not in self._passes:
            t = self.target
            shape = flashinfer_split.PrefixPassShape(
                num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim_qk=t.head_dim_qk,
                head_dim_v=t.head_dim_v, width=width, q_dtype=t.q_dtype, kv_dtype=t.kv_dtype,
                sm_scale=t.sm_scale,
            )  # fmt: skip
            self._passes[key] = flashinfer_split.FlashInferPrefixPass.create(
                shape, bs, meta.prefix_kv_indices.device, backend=flashinfer_backend(),
                graph_prefix_indices=meta.prefix_kv_indices if graph else None,
            )  # fmt: skip
        prefix_pass = self._passes[key]
        staged = meta.staged_prefix_lens
        host_lens = staged.for_rows(bs) if staged is not None else None
        prefix_pass.plan(meta.prefix_kv_indptr, meta.prefix_kv_indices, prefix_lens=host_lens)
        self._planned = (meta, prefix_pass)

    def layer_options(self, meta, q, k_buffer, v_buffer, layer, logit_cap) -> Optional[dict]:
        """The pass planned for this forward, when it was planned for this layer's
        shape (a model whose layers differ, Gemma 4's full and sliding ones, plans
        for one)."""
        planned_for, prefix_pass = self._planned
        problem = None
        if prefix_pass is None or planned_for is not meta:
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
        if self.forced:
            raise StrategyUnavailable(f"flashinfer_split on {self.backend_name}: {problem}")
        return None

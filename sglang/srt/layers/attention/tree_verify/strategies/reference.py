# SPDX-License-Identifier: Apache-2.0
"""``reference``: the plain torch fp32 definition (``tree_verify/reference.py``),
the default on the CPU and the documented fallback where no kernel runs."""

from __future__ import annotations

from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref
from sglang.srt.layers.attention.tree_verify.registry import REFERENCE, TreeVerifyStrategy, register_strategy


@register_strategy
class Reference(TreeVerifyStrategy):
    name = REFERENCE
    reads_fp8_kv = True
    applies_window_and_sinks = True
    runs_on_cpu = True

    def run(self, *, arch, kv_scales, **call):
        return tree_verify_attention_ref(**call, kv_scales=kv_scales)

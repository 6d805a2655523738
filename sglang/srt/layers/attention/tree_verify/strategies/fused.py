# SPDX-License-Identifier: Apache-2.0
"""``fused``: the prefix-split Triton kernels of this package (``prefix_split.py``).

Every arch, MLA and MHA/GQA, an fp8 KV cache, sliding windows and attention
sinks; device work only, so it is CUDA-graph capturable with no host work per
step. The strategy every other one falls back to.
"""

from __future__ import annotations

from sglang.srt.layers.attention.tree_verify.prefix_split import call_config, tree_verify_fused
from sglang.srt.layers.attention.tree_verify.registry import FUSED, TreeVerifyStrategy, register_strategy


@register_strategy
class Fused(TreeVerifyStrategy):
    name = FUSED
    reads_fp8_kv = True
    applies_window_and_sinks = True

    def run(self, *, arch, kv_scales, **call):
        config = call_config(arch, call["q"], call["k_buffer"], call["v_buffer"])
        return tree_verify_fused(**call, config=config, kv_scales=kv_scales)

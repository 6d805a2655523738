# SPDX-License-Identifier: Apache-2.0
"""``upstream_extend``: upstream's Triton extend kernel with a dense mask
(``tree_verify/upstream_extend.py``), the baseline. Forced for a server's verify
(``SGLANG_DDTREE_VERIFY_STRATEGY``), it turns the tree-verify hook off instead:
upstream's own path then runs."""

from __future__ import annotations

from sglang.srt.layers.attention.tree_verify.registry import (
    UPSTREAM_EXTEND,
    TreeVerifyStrategy,
    register_strategy,
)
from sglang.srt.layers.attention.tree_verify.upstream_extend import tree_verify_upstream_extend


@register_strategy
class UpstreamExtend(TreeVerifyStrategy):
    name = UPSTREAM_EXTEND

    def run(self, *, arch, kv_scales, **call):
        return tree_verify_upstream_extend(**call)

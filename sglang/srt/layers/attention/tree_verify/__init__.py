# SPDX-License-Identifier: Apache-2.0
"""Tree-verify attention: every node of a speculative token tree attends to its
request's committed prefix and to the tree nodes its ancestor bitmask allows.

Public API: :func:`tree_verify_attention` (one dispatcher over the strategies,
``dispatch.py``), :class:`StrategyUnavailable`, and the bitmask helpers
(``masks.py``; :func:`causal_tree_mask` is the chain as a tree). The strategies
are registered units (``registry.py``, one module each under ``strategies/``).
How a server uses it: ``hook.py`` (the per-backend path, built by ``backends.py``
from the patches), ``routes.py`` (which strategy serves which verify, from
``policy.py``'s ranking), ``support.py`` (which attention backends verify trees).
"""

from sglang.srt.layers.attention.tree_verify.dispatch import tree_verify_attention
from sglang.srt.layers.attention.tree_verify.masks import (
    causal_tree_mask,
    full_tree_mask,
    pack_tree_mask,
    tree_mask_from_parents,
    unpack_tree_mask,
)
from sglang.srt.layers.attention.tree_verify.registry import STRATEGIES, StrategyUnavailable

__all__ = [
    "STRATEGIES",
    "StrategyUnavailable",
    "causal_tree_mask",
    "full_tree_mask",
    "pack_tree_mask",
    "tree_mask_from_parents",
    "tree_verify_attention",
    "unpack_tree_mask",
]

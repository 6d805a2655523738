# SPDX-License-Identifier: Apache-2.0
"""When a linear-attention (Gated DeltaNet / mamba) target verifies a token tree.

Upstream already verifies trees on hybrid linear-attention models: during a
TARGET_VERIFY forward the causal-conv kernel derives every node's parent from
``retrieve_next_token`` / ``retrieve_next_sibling`` and convolves along the
node's root path, the gated-delta-rule kernel starts each node from its
parent's cached state, and both write one intermediate state per node, so the
state after any accepted node can be committed afterwards. Upstream switches
this on with ``speculative_eagle_topk > 1`` in two places: the linear-attention
backend (which then hands the tree links to the kernels) and the mamba state
pool (which then keeps one dense conv window per node instead of the
overlapping windows a chain can share).

DDTREE verifies a tree at any ``--speculative-ddtree-topk`` while running with
EAGLE's ``speculative_eagle_topk`` at 1 (it rides on DFlash's server
arguments), so both places read ``linear_verify_topk`` instead (patches 0054,
0055): the topk upstream's linear-attention code should act on.
"""

from __future__ import annotations

from typing import Optional

#: The ``topk`` that makes upstream's linear-attention code treat a verify as a
#: tree; it only ever compares ``topk > 1``.
TREE_TOPK = 2


def verifies_token_tree(speculative_algorithm: Optional[str], eagle_topk: Optional[int]) -> bool:
    """Whether TARGET_VERIFY forwards carry a token tree rather than a chain:
    EAGLE with ``topk > 1``, or an algorithm whose registry entry declares a
    tree verify (``verify_uses_tree_mask``, as DDTREE's does)."""
    if (eagle_topk or 0) > 1:
        return True
    if not speculative_algorithm:
        return False
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        algo = SpeculativeAlgorithm.from_string(speculative_algorithm)
    except ValueError:
        return False
    return bool(getattr(algo, "verify_uses_tree_mask", False))


def linear_verify_topk(speculative_algorithm: Optional[str], eagle_topk: Optional[int]) -> int:
    """``speculative_eagle_topk`` as upstream's linear-attention backend and
    mamba pool should see it: at least ``TREE_TOPK`` when the verify is a tree."""
    topk = int(eagle_topk or 0)
    if verifies_token_tree(speculative_algorithm, eagle_topk):
        return max(topk, TREE_TOPK)
    return topk


def running_linear_verify_topk(eagle_topk: Optional[int]) -> int:
    """``linear_verify_topk`` for the speculative algorithm this process serves
    (the published server arguments); ``eagle_topk`` alone where none are
    published (a pool built outside a server, as in unit tests)."""
    from sglang.srt.runtime_context import get_spec

    try:
        algorithm = get_spec().speculative_algorithm
    except ValueError:  # the "spec" namespace is not published
        return int(eagle_topk or 0)
    return linear_verify_topk(algorithm, eagle_topk)

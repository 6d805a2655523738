# SPDX-License-Identifier: Apache-2.0
"""Benchmark-only expert routing in which a tree verify's siblings go to the same experts.

A target with dummy weights routes by a random router, which sends the near-identical tokens
of a step to a few experts and flatters a narrow verify against a wide one; upstream's
``SGLANG_SIMULATE_UNIFORM_EXPERTS`` instead sends every token to ``k`` experts from its own
random offset, as a trained router spreads unrelated tokens. In a DDTREE tree, siblings are
alternatives for one position after one context, and a trained router may well send them
alike. ``SGLANG_DDTREE_SIMULATE_TREE_ROUTING=1`` routes as uniform routing does, except that
the nodes of a tree verify that share a parent share the offset, hence the experts: the other
end of the range a real router lies in, which the step-cost benchmark measures beside the two
others (``benchmarks/e2e_step.py --expert-routing tree``). A chain (DFLASH) has no siblings,
and a plain decode one token per request, so both route as under uniform routing.

The DDTREE worker writes each verify row's group (``sibling_groups``) into a buffer that the
routing reads by address, so a verify graph's replay routes by the tree of the step that
replays it, and puts the identity back after the verify, which every other forward reads.
Do not use in production.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Tuple

import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

#: Rows of a forward whose groups the buffer holds: every verify a graph captures (256
#: requests of 257 tree nodes fit); a longer forward (a prefill) routes uniformly.
CAPACITY = 1 << 17

_groups: Optional[torch.Tensor] = None  # [CAPACITY] int64: the row whose offset each row takes
_identity: Optional[torch.Tensor] = None
_warned = False


def enabled() -> bool:
    """``SGLANG_DDTREE_SIMULATE_TREE_ROUTING``, refused beside upstream's own simulations."""
    if not ddtree_envs.SGLANG_DDTREE_SIMULATE_TREE_ROUTING.get():
        return False
    if envs.SGLANG_SIMULATE_UNIFORM_EXPERTS.get() or envs.SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS.get():
        raise ValueError(
            "SGLANG_DDTREE_SIMULATE_TREE_ROUTING routes like SGLANG_SIMULATE_UNIFORM_EXPERTS except for a "
            "tree's siblings: set one of SGLANG_DDTREE_SIMULATE_TREE_ROUTING, SGLANG_SIMULATE_UNIFORM_EXPERTS "
            "and SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS"
        )
    return True


def _buffer(device: torch.device) -> Optional[torch.Tensor]:
    """The group buffer, made on first use outside a graph capture (upstream's graph runners
    run each forward eagerly before capturing it); None while capturing without it."""
    global _groups, _identity, _warned
    if _groups is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if not _warned:
                _warned = True
                logger.warning("tree routing: a graph was captured before any eager forward; it routes uniformly.")
            return None
        _identity = torch.arange(CAPACITY, dtype=torch.int64, device=device)
        _groups = _identity.clone()
    return _groups


def route(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing's ids and weights (``k`` experts ``num_experts // k`` apart from a
    random offset, equal weights), the offset drawn per group of rows."""
    num_tokens, k = topk_ids.shape
    if k == 0:
        return topk_ids, topk_weights
    offsets = torch.randint(0, num_experts, (num_tokens, 1), device=topk_ids.device)
    groups = _buffer(topk_ids.device) if num_tokens <= CAPACITY else None
    if groups is not None:
        offsets = offsets.index_select(0, groups[:num_tokens])
    steps = torch.arange(k, device=topk_ids.device).unsqueeze(0) * max(num_experts // k, 1)
    return ((offsets + steps) % num_experts).to(topk_ids.dtype), torch.ones_like(topk_weights) / k


def sibling_groups(parent: torch.Tensor) -> torch.Tensor:
    """``[bs * N]``: for each row of a verify of ``parent`` (``[bs, N]``, the root -1), a row
    of the same request that stands for its siblings: the root itself, the children of node
    ``p`` row ``p + 1`` (a node's parent comes before it, so ``p + 1 < N``; a padding node,
    parent -1, goes with the root)."""
    bs, n = parent.shape
    base = torch.arange(bs, device=parent.device, dtype=torch.int64).unsqueeze(1) * n
    return (base + parent.to(torch.int64).clamp(min=-1) + 1).reshape(-1)


@contextlib.contextmanager
def siblings_share(parent: torch.Tensor):
    """Within: the rows of a verify of ``parent`` routed by their sibling groups."""
    groups = _buffer(parent.device)
    rows = parent.numel()
    if groups is None or rows > CAPACITY:
        yield
        return
    groups[:rows].copy_(sibling_groups(parent))
    try:
        yield
    finally:
        groups[:rows].copy_(_identity[:rows])

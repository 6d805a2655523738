# SPDX-License-Identifier: Apache-2.0
"""DDTREE's tree size: one typed value, resolved once from the flags at start-up.

The budget B (draft nodes per tree, the root on top), the candidates per depth K and the
DFlash block drafted per step; the verify width N = B + 1 and the deepest node follow from
them. ``flags.handle_ddtree_server_args`` resolves and checks it and writes it back into
``ServerArgs`` (upstream's generic pieces size verify buffers, KV headroom and CUDA graphs
by ``speculative_num_draft_tokens``, which for DDTREE is N); the worker reads it back with
``TreeBudget.of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from sglang.srt.layers.attention.tree_verify.masks import MAX_BUDGET

# Default tree budget, from the H200 step times of 2026-11-29
# (benchmarks/results/e2e_step_dummy_routing_matrix_h200_2026-11-30.json, DeepSeek-V2-Lite shape, 16K
# context, batch 1): DFLASH 6.59 ms, DDTREE B=16 10.82 ms, B=64 19.26 ms per
# step. A 65-token verify spends 9.3 ms in the MoE experts (1.6 ms for 16
# tokens) and 5.7 ms in verify attention (1.5 ms), so B=64 must accept 2.9x
# the DFLASH tokens per step to pay and B=16 1.6x. The acceptance gain of the
# larger tree is not measured here (no real checkpoints on the test host),
# so the default is the cheaper tree; raise it for dense targets or short
# contexts, where a verify token costs less (docs/ddtree.md).
DEFAULT_BUDGET = 16
MIN_BUDGET = 1


@dataclass(frozen=True)
class TreeBudget:
    budget: int  # B: draft nodes per tree (the root, the bonus token, comes on top)
    topk: int  # K: candidates taken from each depth's draft distribution
    draft_block: int  # the DFlash block drafted per step: [bonus, MASK x (draft_block - 1)]
    #: Smaller budgets whose verify replays CUDA graphs of its own width (``verify_graphs``).
    graph_budgets: Tuple[int, ...] = ()

    @property
    def verify_width(self) -> int:
        """N: the tokens one tree verifies."""
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        """Deepest node a tree can have: bounded by the budget and by the drafted depths."""
        return min(self.budget, self.draft_block - 1)

    def at(self, budget: int) -> "TreeBudget":
        """A smaller tree drafted from the same block: the budget-``budget`` tree is the
        first ``budget`` nodes of this one (both builders number nodes best-first)."""
        if not MIN_BUDGET <= budget <= self.budget:
            raise ValueError(f"DDTREE step budget must be in [{MIN_BUDGET}, {self.budget}], got {budget}.")
        return TreeBudget(budget=budget, topk=min(self.topk, budget), draft_block=self.draft_block,
                          graph_budgets=tuple(b for b in self.graph_budgets if b < budget))  # fmt: skip

    @classmethod
    def resolve(
        cls,
        budget: Optional[int],
        topk: Optional[int],
        checkpoint_block: int,
        vocab_size: int,
        graph_budgets: Optional[str] = None,
    ) -> "TreeBudget":
        """The flags' values checked, defaults filled in."""
        b = DEFAULT_BUDGET if budget is None else _check_int("--speculative-ddtree-budget", budget, MIN_BUDGET,
                                                             MAX_BUDGET)  # fmt: skip
        limit = min(b, vocab_size)  # more than B candidates are never used, more than V do not exist
        k = limit if topk is None else _check_int(
            f"--speculative-ddtree-topk (at most min(budget={b}, vocab={vocab_size}))", topk, 1, limit)
        if checkpoint_block < 2:
            raise ValueError(
                "DDTREE needs a DFlash draft block of at least 2 tokens "
                f"(bonus + one MASK position), got block_size={checkpoint_block}."
            )
        # A tree of B nodes is at most B deep: the block is cut to B + 1, which also keeps the
        # per-step KV headroom (sized by the verify width) enough for the draft block.
        return cls(budget=b, topk=k, draft_block=min(checkpoint_block, b + 1),
                   graph_budgets=parse_graph_budgets(graph_budgets, b))  # fmt: skip

    @classmethod
    def of(cls, server_args: Any) -> "TreeBudget":
        """The value ``flags.handle_ddtree_server_args`` resolved into ``server_args``."""
        tree = cls(
            budget=int(server_args.speculative_ddtree_budget),
            topk=int(server_args.speculative_ddtree_topk),
            draft_block=int(server_args.speculative_dflash_block_size),
            graph_budgets=parse_graph_budgets(getattr(server_args, "speculative_ddtree_graph_budgets", None),
                                              int(server_args.speculative_ddtree_budget)),
        )  # fmt: skip
        if int(server_args.speculative_num_draft_tokens) != tree.verify_width:
            raise ValueError(
                "DDTREE expects speculative_num_draft_tokens == budget + 1 "
                f"({tree.verify_width}), got {server_args.speculative_num_draft_tokens}."
            )
        return tree


def parse_graph_budgets(value: Optional[str], budget: int) -> Tuple[int, ...]:
    """``--speculative-ddtree-graph-budgets`` (``"16"``, ``"4,16"``): distinct budgets below
    ``budget``, ascending."""
    if value is None or str(value).strip() == "":
        return ()
    flag = "--speculative-ddtree-graph-budgets"
    out = set()
    for part in str(value).split(","):
        try:
            b = int(part.strip())
        except ValueError:
            raise ValueError(f"DDTREE {flag} takes comma-separated integers, got {value!r}.") from None
        if not MIN_BUDGET <= b < budget:
            raise ValueError(
                f"DDTREE {flag} must lie in [{MIN_BUDGET}, {budget - 1}] (below --speculative-ddtree-budget "
                f"{budget}, whose verify graphs the server captures anyway), got {b}."
            )
        out.add(b)
    return tuple(sorted(out))


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"DDTREE {name} must be an integer, got {value!r}.")
    if not lo <= value <= hi:
        raise ValueError(f"DDTREE {name} must be in [{lo}, {hi}], got {value}.")
    return value

# SPDX-License-Identifier: Apache-2.0
"""Row tile of the fused-MoE kernel's default config, from the rows each expert gets.

Without a tuned config file, upstream's default keeps its 16-row tile only while the batch
has no more tokens than there are experts (``M <= E``). With top-k routing an expert sees
about ``M * topk / E`` rows, so a tree-verify batch just above ``E`` tokens (DDTREE B=64 at
batch 1 is 65 tokens: ~6 rows per expert on a 64-expert top-6 model) runs 64-row tiles that
are mostly padding; on DeepSeek-V2-Lite's shape (H200, realistic routing) that took the MoE
from 7.4 to 10.1 ms per step. Upstream's tuned configs for such shapes keep the small tile
until an expert's rows fill it; this is that rule for the untuned case, which is the common
one on sm_120 (few tuned configs ship for it).

``SGLANG_MOE_DEFAULT_TILE_RULE=upstream`` restores upstream's ``M <= E`` switch.
"""

from __future__ import annotations

import math

from sglang.srt.ddtree_environ import ddtree_envs

TILE_RULE_ENV = "SGLANG_MOE_DEFAULT_TILE_RULE"
TILE_RULES = ("rows_per_expert", "upstream")


def tile_rule_from_env() -> str:
    rule = (ddtree_envs.SGLANG_MOE_DEFAULT_TILE_RULE.get() or "").strip() or TILE_RULES[0]
    if rule not in TILE_RULES:
        raise ValueError(
            f"{TILE_RULE_ENV}={rule!r} is not a tile rule; use one of {', '.join(TILE_RULES)}"
        )
    return rule


#: Read once: the config is chosen on every MoE call outside CUDA graphs.
TILE_RULE = tile_rule_from_env()


def rows_per_expert(num_tokens: int, num_experts: int, top_k: int) -> int:
    """Rows an expert gets on average when the router spreads the tokens evenly."""
    return math.ceil(num_tokens * top_k / num_experts)


def fits_small_row_tile(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    small_tile_rows: int,
    rule: str | None = None,
) -> bool:
    """Whether the default config should use its small row tile for this batch."""
    if num_tokens <= num_experts:  # upstream's test; never changed
        return True
    if (rule or TILE_RULE) == "upstream":
        return False
    return rows_per_expert(num_tokens, num_experts, top_k) <= small_tile_rows

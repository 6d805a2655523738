# SPDX-License-Identifier: Apache-2.0
"""The tree-verify strategies, one module each, registered in ``registry.py`` on
import. Import this package (not a strategy module) to look strategies up; a
strategy module imports the kernels it runs and the registry, never the
dispatcher, the policy or the hook."""

from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Tuple

from sglang.srt.layers.attention.tree_verify.registry import (
    FUSED,
    SERVING_STRATEGIES,
    STRATEGIES,
    Capability,
    VerifyTarget,
    get_strategy,
)
from sglang.srt.layers.attention.tree_verify.strategies import (  # noqa: F401  (registers them)
    flashinfer_split,
    flashmla_split,
    fused,
    reference,
    upstream_extend,
)

__all__ = ["available_strategies", "get_strategy"]

#: Why a strategy that applies no sliding window or attention sinks cannot serve a
#: model with sinks on every layer.
_SINKS = "the model's attention sinks, which only the fused kernel applies"


def available_strategies(
    target: Optional[VerifyTarget], device_cap: Optional[Capability]
) -> Tuple[FrozenSet[str], Dict[str, str]]:
    """The serving strategies that can run for ``target`` on a GPU of compute
    capability ``device_cap`` (``fused`` always can), and why each other one cannot.
    Without a ``target`` only the strategies that plan inside the forward can."""
    reasons: Dict[str, str] = {}
    for name in SERVING_STRATEGIES:
        strategy = get_strategy(name)
        why = strategy.unavailable(target, device_cap)
        if why is None and target is not None and target.sinks and not strategy.applies_window_and_sinks:
            why = _SINKS
        if why:
            reasons[name] = why
    assert FUSED not in reasons
    return frozenset(s for s in SERVING_STRATEGIES if s not in reasons), reasons


assert all(get_strategy(name).name == name for name in STRATEGIES)

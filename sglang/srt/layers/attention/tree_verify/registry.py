# SPDX-License-Identifier: Apache-2.0
"""The tree-verify strategies by name, and what the modules of this package share.

Each strategy is one :class:`TreeVerifyStrategy` in its own module under
``strategies/`` (what it is called, why it cannot run on this GPU for this
target, what it plans per forward, how it runs), registered here with
:func:`register_strategy`, as upstream registers its attention backends in
``attention_registry.py``. The dispatcher looks strategies up here, the policy
ranks them by name, and the routes ask the chosen one to plan.

This module imports nothing else of the package, so every other module can
import it: the error classes, the names, the verify kinds and the target's
attention as the strategies see it live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

Capability = Tuple[int, int]


class StrategyUnavailable(RuntimeError):
    """A tree-verify strategy cannot run here; the message says why."""


class TreeVerifyUnavailable(RuntimeError):
    """A tree verify reached a backend that cannot apply its mask."""


# ---------------------------------------------------------------------------
# Strategy names
# ---------------------------------------------------------------------------

FUSED = "fused"
UPSTREAM_EXTEND = "upstream_extend"
FLASHINFER_SPLIT = "flashinfer_split"
FLASHMLA_SPLIT = "flashmla_split"
REFERENCE = "reference"
STRATEGIES = (FUSED, UPSTREAM_EXTEND, FLASHINFER_SPLIT, FLASHMLA_SPLIT, REFERENCE)
#: The strategies a server's verify may be routed to by the policy (the others are
#: baselines), in the order that keeps ties: the fused kernel first.
SERVING_STRATEGIES = (FUSED, FLASHINFER_SPLIT, FLASHMLA_SPLIT)

# ---------------------------------------------------------------------------
# Verify kinds: what a backend's TARGET_VERIFY is
# ---------------------------------------------------------------------------

TREE = "tree"  # a DDTREE tree: the verify input carries the ancestor bitmask
CHAIN = "chain"  # a DFLASH chain: causal
BLOCK = "block"  # the DFlash drafter's block on the draft worker


def static_verify_kind(spec_algorithm: Any) -> Optional[str]:
    """TREE for DDTREE, CHAIN for DFLASH, None for every other algorithm."""
    if spec_algorithm is None:
        return None
    if getattr(spec_algorithm, "verify_uses_tree_mask", False):
        return TREE
    is_dflash = getattr(spec_algorithm, "is_dflash", None)
    if callable(is_dflash) and is_dflash():
        return CHAIN
    return None


# ---------------------------------------------------------------------------
# The target's attention
# ---------------------------------------------------------------------------

MLA_KIND = "mla"  # absorbed MLA: 576-wide keys (512 latent + 64 rope), 512-wide values, one KV head
MHA_KIND = "mha"  # MHA / GQA
MLA_DIMS = (576, 512, 1)  # Dqk, Dv, KV heads of absorbed MLA


@dataclass(frozen=True)
class VerifyTarget:
    """The target's attention as the strategies judge it."""

    kind: str  # MLA_KIND or MHA_KIND
    head_dim_qk: int
    head_dim_v: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    #: Every layer has attention sinks (gpt-oss).
    sinks: bool = False

    @classmethod
    def of(cls, dqk: int, dv: int, num_kv_heads: int, q_dtype, kv_dtype, sinks: bool = False) -> "VerifyTarget":
        kind = MLA_KIND if (dqk, dv, num_kv_heads) == MLA_DIMS else MHA_KIND
        return cls(kind, dqk, dv, q_dtype, kv_dtype, sinks)


@dataclass(frozen=True)
class TargetAttention:
    """The target model's attention on this rank, known before any forward."""

    num_heads: int
    head_dim_qk: int
    head_dim_v: int
    num_kv_heads: int
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    #: Every layer has attention sinks (gpt-oss), which only the fused kernel applies.
    sinks: bool = False

    @property
    def verify_target(self) -> VerifyTarget:
        return VerifyTarget.of(
            self.head_dim_qk, self.head_dim_v, self.num_kv_heads, self.q_dtype, self.kv_dtype,
            self.sinks,
        )  # fmt: skip


# ---------------------------------------------------------------------------
# A strategy, and the registry
# ---------------------------------------------------------------------------


class VerifyPlanner:
    """What one strategy prepares for one backend's target verify: per forward,
    outside any CUDA graph (:meth:`prepare`), and per layer (:meth:`layer_options`).
    ``routes.VerifyRoutes`` holds one per strategy that plans."""

    #: Set when the strategy gave up on this server for good (the fused kernel
    #: serves from then on, so captured graphs and eager forwards agree).
    off: bool = False
    #: Its plan reads the exact prefix lengths on the host: given them ahead
    #: (``TreeVerifyHook.stage_prefix_lens``) it does not wait for the draft. The
    #: worker stages them while the last verify's strategy is one that does.
    reads_host_lengths: bool = False

    def prepare(self, meta: Any, graph: bool) -> None:
        """Per forward of this strategy, outside any graph."""

    def layer_options(
        self, meta: Any, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
        layer: Any, logit_cap: float,
    ) -> Optional[dict]:  # fmt: skip
        """The strategy's keyword arguments for this layer, or None when it cannot
        serve the layer (the fused kernel does); a forced strategy raises instead."""
        return {}


class TreeVerifyStrategy:
    """One way to compute tree-verify attention (``tree_verify_attention``'s
    contract). A subclass lives in its own module under ``strategies/`` and
    registers one instance with :func:`register_strategy`."""

    name: str = ""
    #: Reads an fp8 KV cache holding ``K / k_scale`` and ``V / v_scale``.
    reads_fp8_kv: bool = False
    #: Applies a sliding window and attention sinks.
    applies_window_and_sinks: bool = False
    #: Runs without a CUDA device.
    runs_on_cpu: bool = False

    def unavailable(self, target: Optional[VerifyTarget], device_cap: Optional[Capability]) -> Optional[str]:
        """Why this strategy cannot serve ``target``'s verify on a GPU of compute
        capability ``device_cap`` (None: no GPU), or None when it can. Without a
        ``target`` it is judged by the GPU and the install alone."""
        return None

    def planner(self, **context: Any) -> Optional[VerifyPlanner]:
        """A planner for one backend's target verify, or None when the strategy
        plans nothing. ``context``: ``backend_name``, ``target``
        (:class:`TargetAttention` or None), ``forced`` (this strategy was forced),
        ``pool_requests``, ``max_context_len``."""
        return None

    def run(self, *, arch: Capability, kv_scales: Optional[Tuple[float, float]], **call) -> torch.Tensor:
        """The attention of a validated call: ``call`` holds the arguments of
        ``tree_verify_attention`` by name and the strategy's options; ``arch`` is
        the kernel arch, ``kv_scales`` the fp8 KV scales (None: q's dtype)."""
        raise NotImplementedError


_REGISTRY: Dict[str, TreeVerifyStrategy] = {}


def register_strategy(cls):
    """Class decorator: register one instance of a strategy under its name."""
    if cls.name not in STRATEGIES:
        raise ValueError(f"{cls.name!r} is not a tree-verify strategy name ({STRATEGIES})")
    _REGISTRY[cls.name] = cls()
    return cls


def get_strategy(name: str) -> TreeVerifyStrategy:
    """The registered strategy ``name``; importing the ``strategies`` package
    registers them all (it re-exports this function)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown tree-verify strategy {name!r}; choose from {STRATEGIES}")
    if name not in _REGISTRY:
        raise LookupError(f"{name!r} is not registered: import tree_verify.strategies first")
    return _REGISTRY[name]

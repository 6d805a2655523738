# SPDX-License-Identifier: Apache-2.0
"""Which attention backends can verify a token tree, per arch family and model kind.

A tree verify needs a real ancestor mask over the tree tokens plus the dense
prefix. Upstream's DFlash chain verify runs causally on most backends; the ones
below apply the tree's mask: through the tree-verify hook (``hook.py``, patches
0030, 0031, 0034), or upstream's own dense custom mask (Triton, FlashInfer MHA).
``ServerArgs`` refuses any other verify backend for DDTREE at startup
(``speculative/ddtree/flags.py``), before any weight is loaded.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Tuple

from sglang.srt.layers.attention.backend_support import (
    MHA,
    MLA,
    NO_ROLES,
    UnsupportedAttentionBackendError,
)
from sglang.srt.utils.gpu_arch import ARCH_FAMILIES, arch_family

__all__ = [
    "TREE_VERIFY_SUPPORT",
    "check_tree_verify_backend",
    "supports_tree_verify",
    "tree_verify_backends",
]

TREE_VERIFY_SUPPORT: Dict[str, Dict[str, FrozenSet[str]]] = {
    # The fused tree-verify attention through the hook (patch 0030); upstream's
    # extend kernel with the dense mask when the hook is off.
    "triton": {family: frozenset((MLA, MHA)) for family in ARCH_FAMILIES},
    # MHA: the hook (patch 0034), or FlashInfer's paged prefill with the dense mask.
    # MLA: FlashInfer's MLA kernels take no mask; the hook serves the tree (0031).
    "flashinfer": {family: frozenset((MLA, MHA)) for family in ARCH_FAMILIES},
}


def supports_tree_verify(backend: str, cap: Tuple[int, int], kind: str) -> bool:
    """Whether ``backend`` can verify a token tree on ``cap`` for ``kind``."""
    return kind in TREE_VERIFY_SUPPORT.get(backend, {}).get(arch_family(cap), NO_ROLES)


def tree_verify_backends(kind: str, cap: Optional[Tuple[int, int]] = None) -> Tuple[str, ...]:
    """Backends that verify a token tree for ``kind`` on ``cap`` (any known arch
    when ``cap`` is None)."""
    families = ARCH_FAMILIES if cap is None else (arch_family(cap),)
    return tuple(
        name
        for name, per_family in TREE_VERIFY_SUPPORT.items()
        if any(kind in per_family.get(f, NO_ROLES) for f in families)
    )


def check_tree_verify_backend(
    backend: Optional[str], kind: str, cap: Optional[Tuple[int, int]] = None
) -> None:
    """Refuse a DDTREE verify backend that cannot apply the tree mask (it would
    verify the tree causally). ``cap`` None judges by any known arch."""
    if backend in tree_verify_backends(kind, cap):
        return
    where = "" if cap is None else f" on compute capability {cap[0]}.{cap[1]}"
    works = ", ".join(tree_verify_backends(kind, cap)) or "none"
    raise UnsupportedAttentionBackendError(
        f"DDTREE needs a tree-masked verify attention; the verify backend "
        f"{backend!r} has none for {kind.upper()} models{where}. Backends that "
        f"verify trees here: {works}. Pass e.g. --attention-backend triton."
    )

# SPDX-License-Identifier: Apache-2.0
"""Exact GPU architecture predicates and per-arch limits.

Upstream's helpers in ``sglang.srt.utils.common`` group by major version only:
``is_blackwell_supported()`` is true for majors 10, 11 *and* 12, so code that
means "datacenter Blackwell" (tcgen05/TMEM, 227 KB shared memory) also admits
the workstation parts (RTX PRO 6000, RTX 5090: 12.0; DGX Spark GB10: 12.1),
which have neither. The predicates here take an explicit ``(major, minor)``
capability so a caller states which GPU it means, and tests can ask about any
GPU on a machine without one.

It also says which capability the fork's kernels and verify policy serve for:
``SGLANG_DDTREE_KERNEL_ARCH`` picks another arch's kernel tiles, and
``SGLANG_DDTREE_SM120_PROXY`` makes the whole policy an sm_120 GPU's (both for
measurement on other GPUs; neither changes backend gating).

This module imports torch lazily and never initialises CUDA at import time.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Optional, Tuple, Union

logger = logging.getLogger(__name__)

Capability = Tuple[int, int]

#: Environment variable that overrides the arch used for kernel-config selection.
KERNEL_ARCH_ENV = "SGLANG_DDTREE_KERNEL_ARCH"
#: Environment variable that makes the fork serve as on an sm_120 GPU.
SM120_PROXY_ENV = "SGLANG_DDTREE_SM120_PROXY"
#: The capability the sm_120 proxy serves for.
SM120 = (12, 0)

# Largest dynamic shared memory one thread block may opt into, in bytes
# (cudaDevAttrMaxSharedMemoryPerBlockOptin), from the "Technical Specifications
# per Compute Capability" table of the CUDA C++ Programming Guide.
# The per-SM capacity is 1 KB larger on each of these; the driver reserves it.
_MAX_SMEM_PER_BLOCK_BY_MAJOR_MINOR = {
    (7, 0): 96 * 1024,
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,  # A100
    (8, 6): 99 * 1024,  # RTX 30xx, A10, A40
    (8, 7): 163 * 1024,  # Jetson Orin
    (8, 9): 99 * 1024,  # RTX 40xx, L4, L40
    (9, 0): 227 * 1024,  # H100, H200
}
_MAX_SMEM_PER_BLOCK_BY_MAJOR = {
    10: 227 * 1024,  # B200/B300 (10.0, 10.3), legacy Thor numbering 10.1
    11: 227 * 1024,  # Thor
    12: 99 * 1024,  # RTX PRO 6000 / RTX 5090 (12.0), GB10 (12.1)
}


def _as_capability(cap) -> Capability:
    if (
        not isinstance(cap, (tuple, list))
        or len(cap) != 2
        or not all(isinstance(x, int) and x >= 0 for x in cap)
    ):
        raise TypeError(
            f"expected a compute capability (major, minor) of two ints, got {cap!r}"
        )
    return int(cap[0]), int(cap[1])


def _resolve(cap: Optional[Capability]) -> Optional[Capability]:
    """``cap`` itself, or the current device's capability; None without a GPU."""
    if cap is not None:
        return _as_capability(cap)
    try:
        return device_capability()
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------
# Predicates. Each takes an explicit capability; None means "the current GPU"
# and is False on a machine without one.
# ---------------------------------------------------------------------------


def is_sm120(cap: Optional[Capability] = None) -> bool:
    """Exactly 12.0: RTX PRO 6000 Blackwell, RTX 5090 / 5080 ..."""
    return _resolve(cap) == (12, 0)


def is_sm121(cap: Optional[Capability] = None) -> bool:
    """Exactly 12.1: DGX Spark (GB10)."""
    return _resolve(cap) == (12, 1)


def is_sm12x(cap: Optional[Capability] = None) -> bool:
    """The workstation/consumer Blackwell family: mma.sync, 99 KiB smem/block."""
    c = _resolve(cap)
    return c is not None and c[0] == 12


def is_datacenter_blackwell(cap: Optional[Capability] = None) -> bool:
    """10.x / 11.x (B200, B300, Thor): tcgen05 + TMEM, 227 KiB smem/block."""
    c = _resolve(cap)
    return c is not None and c[0] in (10, 11)


def is_sm100(cap: Optional[Capability] = None) -> bool:
    """Major 10 only (B200 10.0, B300 10.3); what upstream calls "SM100"."""
    c = _resolve(cap)
    return c is not None and c[0] == 10


def is_hopper(cap: Optional[Capability] = None) -> bool:
    """Exactly 9.0 (H100, H200): wgmma, 227 KiB smem/block."""
    return _resolve(cap) == (9, 0)


def has_wgmma(cap: Optional[Capability] = None) -> bool:
    """Warpgroup MMA exists only on sm_90a."""
    return is_hopper(cap)


def has_tcgen05(cap: Optional[Capability] = None) -> bool:
    """tcgen05 / tensor memory exist only on datacenter Blackwell."""
    return is_datacenter_blackwell(cap)


# ---------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------


def max_shared_memory_per_block(cap: Capability) -> int:
    """Largest opt-in shared memory per thread block, in bytes.

    Kernel configs for an arch must fit this, e.g. 101376 B on sm_12x versus
    232448 B on sm_90, which is why Hopper tile shapes do not port.
    """
    c = _as_capability(cap)
    if c in _MAX_SMEM_PER_BLOCK_BY_MAJOR_MINOR:
        return _MAX_SMEM_PER_BLOCK_BY_MAJOR_MINOR[c]
    if c[0] in _MAX_SMEM_PER_BLOCK_BY_MAJOR:
        return _MAX_SMEM_PER_BLOCK_BY_MAJOR[c[0]]
    raise ValueError(
        f"no shared-memory limit recorded for compute capability {c[0]}.{c[1]}; "
        f"add it to {__name__} from the CUDA programming guide"
    )


#: The arch families, one key per group of GPUs that share kernels and limits.
ARCH_FAMILIES = ("sm80", "sm90", "sm100", "sm12x")


def arch_family(cap: Capability) -> Optional[str]:
    """The arch family of ``cap``, the key of the per-arch tables (backend gating,
    tree-verify support, the verify-strategy table):

    * ``sm12x``: 12.x (RTX PRO 6000 and RTX 5090: 12.0; GB10: 12.1);
    * ``sm100``: 10.x and 11.x (B200, B300, Thor);
    * ``sm90``: 9.0 (H100, H200);
    * ``sm80``: 8.x (A100, Orin, RTX 30xx and 40xx, L4, L40);
    * None: any other capability.

    Kernel tiles follow shared memory per block instead
    (:func:`max_shared_memory_per_block`), which differs inside ``sm80``."""
    c = _as_capability(cap)
    if is_sm12x(c):
        return "sm12x"
    if is_datacenter_blackwell(c):
        return "sm100"
    if is_hopper(c):
        return "sm90"
    if c[0] == 8:
        return "sm80"
    return None


def arch_name(cap: Capability) -> str:
    """``(12, 0) -> "sm_120"``, the spelling used in error messages."""
    c = _as_capability(cap)
    return f"sm_{c[0]}{c[1]}"


# ---------------------------------------------------------------------------
# The current device
# ---------------------------------------------------------------------------


def _device_index(device) -> int:
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def device_capability(device=None) -> Capability:
    """Compute capability of ``device`` (default: the current CUDA device).

    Raises RuntimeError when no CUDA device is visible, rather than returning a
    made-up capability that gating would then trust.
    """
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(f"torch is not importable ({e}); no CUDA device") from e

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available to query its capability")
    if device is None:
        major, minor = torch.cuda.get_device_capability()
    else:
        major, minor = torch.cuda.get_device_capability(_device_index(device))
    return int(major), int(minor)


def device_name(device=None) -> str:
    """Marketing name of ``device`` for messages; "unknown GPU" when unavailable."""
    try:
        import torch

        if torch.cuda.is_available():
            if device is None:
                return torch.cuda.get_device_name()
            return torch.cuda.get_device_name(_device_index(device))
    except Exception:  # a message helper must never raise
        pass
    return "unknown GPU"


# ---------------------------------------------------------------------------
# Kernel-config arch (with the developer override)
# ---------------------------------------------------------------------------

_DOTTED_RE = re.compile(r"^(\d+)\.(\d)$")
_SM_RE = re.compile(r"^sm_?(\d+)(\d)[af]?$", re.IGNORECASE)


def parse_capability(value: str) -> Capability:
    """Parse "12.0" or "sm_120" / "sm120" / "sm_90a" into ``(major, minor)``.

    Only capabilities with known limits are accepted, so a typo fails here
    instead of as a kernel config that does not fit the GPU.
    """
    text = str(value).strip()
    m = _DOTTED_RE.match(text) or _SM_RE.match(text)
    cap = (int(m.group(1)), int(m.group(2))) if m else None
    if cap is None or not _is_known(cap):
        known = ", ".join(f"{a}.{b}" for a, b in _known_capabilities())
        raise ValueError(
            f"{value!r} is not a compute capability this fork knows; "
            f"use MAJOR.MINOR such as 12.0, or sm_120 (known: {known})"
        )
    return cap


# Shipping capabilities of the families in _MAX_SMEM_PER_BLOCK_BY_MAJOR.
_KNOWN_FAMILY_MEMBERS = {(10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)}


def _known_capabilities():
    return sorted(set(_MAX_SMEM_PER_BLOCK_BY_MAJOR_MINOR) | _KNOWN_FAMILY_MEMBERS)


def _is_known(cap: Capability) -> bool:
    return cap in _known_capabilities()


@functools.lru_cache(maxsize=None)
def _override_from_env(value: str) -> Capability:
    """Parse the override once per distinct value, and warn once per value."""
    try:
        cap = parse_capability(value)
    except ValueError as e:
        raise ValueError(f"{KERNEL_ARCH_ENV}: {e}") from None
    logger.warning(
        "%s=%s is set: DDTree kernels will select their configurations for "
        "compute capability %d.%d (%s) regardless of the GPU present. This is "
        "for testing sm_120 configurations on other GPUs; it does NOT change "
        "attention-backend gating. Unset it for production.",
        KERNEL_ARCH_ENV,
        value,
        cap[0],
        cap[1],
        arch_name(cap),
    )
    return cap


def _envs():
    # Imported when first needed: the registry imports the sglang package.
    from sglang.srt.ddtree_environ import ddtree_envs

    return ddtree_envs


def sm120_proxy() -> bool:
    """Whether ``SGLANG_DDTREE_SM120_PROXY`` is set: sm_120 tiles and the sm_12x
    verify policy on whatever GPU is present."""
    return bool(_envs().SGLANG_DDTREE_SM120_PROXY.get())


@functools.lru_cache(maxsize=None)
def _warn_proxy(device_cap: Optional[Capability]) -> None:
    logger.warning(
        "%s=1 is set: this server runs as an sm_120 GPU would (sm_120 kernel tiles, "
        "the sm_12x verify-strategy policy, no FlashMLA, FlashInfer's fa2 kernels) on "
        "a GPU of compute capability %s. Results measure the sm_120 policy, not this "
        "GPU's. Backend gating is unchanged.",
        SM120_PROXY_ENV,
        format_capability(device_cap),
    )


def kernel_arch_override() -> Optional[Capability]:
    """The capability forced by ``SGLANG_DDTREE_KERNEL_ARCH`` (or 12.0 by the
    sm_120 proxy), or None."""
    value = (_envs().SGLANG_DDTREE_KERNEL_ARCH.get() or "").strip()
    proxy = sm120_proxy()
    if not value:
        return SM120 if proxy else None
    cap = _override_from_env(value)
    if proxy and cap != SM120:
        raise ValueError(
            f"{SM120_PROXY_ENV}=1 serves with the sm_120 tiles, but "
            f"{KERNEL_ARCH_ENV}={value} asks for {arch_name(cap)}'s; unset one of them"
        )
    return cap


def kernel_arch(device=None) -> Capability:
    """Capability to select kernel configurations for.

    Equal to :func:`device_capability` unless ``SGLANG_DDTREE_KERNEL_ARCH`` or
    ``SGLANG_DDTREE_SM120_PROXY`` is set. Use this for tile/config choice only;
    gating decisions must use the real :func:`device_capability`.
    """
    override = kernel_arch_override()
    if override is not None:
        return override
    return device_capability(device)


def policy_arch(device=None) -> Capability:
    """Capability whose verify-strategy policy this server follows: the GPU's own,
    or 12.0 under the sm_120 proxy (which it announces once, loudly).
    ``SGLANG_DDTREE_KERNEL_ARCH`` alone changes tiles, not the policy."""
    if sm120_proxy():
        try:
            real = device_capability(device)
        except RuntimeError:
            real = None
        _warn_proxy(real)
        return SM120
    return device_capability(device)


def format_capability(cap: Union[Capability, None]) -> str:
    if cap is None:
        return "no GPU"
    c = _as_capability(cap)
    return f"{c[0]}.{c[1]}"

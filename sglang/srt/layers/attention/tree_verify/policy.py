# SPDX-License-Identifier: Apache-2.0
"""Which tree-verify strategy serves a server's verify, per arch and shape.

One function decides, :func:`choose_strategy`: given the arch whose policy the
server follows, the verify's shape (query heads on this rank, tree nodes per
request, requests in the batch, MLA or not) and the strategies that can run here,
it returns the fastest strategy of a measured table
(``strategy_table.json`` next to this file, or the file
``SGLANG_DDTREE_STRATEGY_TABLE`` names). Each section of the table holds the
timings of one arch family, with the date, hardware and command that measured
them (``benchmarks/verify_strategy_table.py`` writes them). Per (heads, nodes,
batch) the policy takes the nearest measured point (in log2 distance) and the
strategy with the least total time over that point's prefix lengths: a server's
prefixes vary from step to step while its captured CUDA graphs keep one
strategy per batch size.

Without measured rows for a family the policy keeps what was measured before
the table existed: FlashMLA's prefix pass on sm_90 from
:data:`FLASHMLA_MIN_ROWS` query rows per request (tree nodes x heads; see
docs/tree-verify.md), the fused kernel everywhere else.

``SGLANG_DDTREE_VERIFY_STRATEGY`` overrides the choice (:func:`forced_strategy`),
and ``SGLANG_DDTREE_SM120_PROXY`` makes any GPU follow the sm_12x policy
(``gpu_arch.policy_arch``): no FlashMLA, FlashInfer's fa2 kernels.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Dict, FrozenSet, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.dispatch import (
    FLASHINFER_SPLIT,
    FLASHMLA_SPLIT,
    FUSED,
    STRATEGIES,
    UPSTREAM_EXTEND,
    WINDOW_SINK_STRATEGIES,
    flashmla_arch_reason,
)
from sglang.srt.layers.attention.tree_verify.support import arch_family

Capability = Tuple[int, int]

STRATEGY_ENV = "SGLANG_DDTREE_VERIFY_STRATEGY"
TABLE_ENV = "SGLANG_DDTREE_STRATEGY_TABLE"
DEFAULT_TABLE = Path(__file__).with_name("strategy_table.json")
#: The strategy that keeps upstream's own verify path (the tree-verify hook off).
UPSTREAM_STRATEGY = UPSTREAM_EXTEND
#: Without measured rows: query rows per request (tree nodes x query heads on this
#: rank) from which sm_90 runs the target's verify prefix through FlashMLA.
FLASHMLA_MIN_ROWS = 1024
#: Strategies a measured table may choose between (the others are baselines).
SERVING_STRATEGIES = (FUSED, FLASHINFER_SPLIT, FLASHMLA_SPLIT)

MLA_KIND = "mla"
MHA_KIND = "mha"


def forced_strategy() -> Optional[str]:
    """The strategy ``SGLANG_DDTREE_VERIFY_STRATEGY`` forces, None when unset."""
    from sglang.srt.ddtree_environ import ddtree_envs

    value = (ddtree_envs.SGLANG_DDTREE_VERIFY_STRATEGY.get() or "").strip()
    if not value:
        return None
    if value not in STRATEGIES:
        raise ValueError(
            f"{STRATEGY_ENV}={value!r} is not a tree-verify strategy; choose from "
            f"{', '.join(STRATEGIES)}, or unset it for the per-arch policy"
        )
    return value


@dataclass(frozen=True)
class VerifyShape:
    """A target verify as the policy sees it."""

    heads: int  # query heads on this rank
    width: int  # tree nodes per request (N)
    batch: int  # requests
    kind: str = MLA_KIND  # absorbed MLA (576/512, one KV head) or MHA/GQA
    prefix: Optional[int] = None  # committed tokens per request, when one length is asked about

    @property
    def rows(self) -> int:
        return self.heads * self.width


# ---------------------------------------------------------------------------
# The measured table
# ---------------------------------------------------------------------------


class StrategyTableError(ValueError):
    """A strategy table that does not follow the format; the message says where."""


@dataclass(frozen=True)
class TableSection:
    """The timings of one arch family from one run."""

    arch: str  # policy family: "sm12x", "sm90", "sm100", "sm80"
    date: str
    hardware: str
    proxy: bool  # measured as the sm_120 proxy on other hardware
    command: str
    rows: Tuple[Dict[str, Any], ...]  # {kind, H, N, P, bs, ms: {strategy: ms}}


@dataclass(frozen=True)
class StrategyTable:
    sections: Tuple[TableSection, ...] = ()
    path: str = ""

    def rows_for(self, family: str, kind: str) -> List[Dict[str, Any]]:
        """The rows of the latest section measured for ``family`` and ``kind``."""
        sections = [s for s in self.sections if s.arch == family]
        for section in sorted(sections, key=lambda s: s.date, reverse=True):
            rows = [r for r in section.rows if r.get("kind", MLA_KIND) == kind]
            if rows:
                return rows
        return []

    @classmethod
    def from_json(cls, data: Any, path: str = "") -> "StrategyTable":
        where = path or "strategy table"
        if not isinstance(data, dict) or not isinstance(data.get("sections"), list):
            raise StrategyTableError(f"{where}: expected an object with a 'sections' list")
        sections = []
        for i, s in enumerate(data["sections"]):
            at = f"{where}: sections[{i}]"
            missing = [k for k in ("arch", "date", "hardware", "command", "rows") if k not in s]
            if missing:
                raise StrategyTableError(f"{at} lacks {', '.join(missing)}")
            if s["arch"] not in ("sm12x", "sm90", "sm100", "sm80"):
                raise StrategyTableError(f"{at}: arch {s['arch']!r} is not a policy family")
            for j, r in enumerate(s["rows"]):
                _check_row(r, f"{at}.rows[{j}]")
            sections.append(TableSection(
                arch=s["arch"], date=str(s["date"]), hardware=str(s["hardware"]),
                proxy=bool(s.get("proxy", False)), command=str(s["command"]),
                rows=tuple(s["rows"]),
            ))  # fmt: skip
        return cls(tuple(sections), path)


def _check_row(row: Any, at: str) -> None:
    if not isinstance(row, dict):
        raise StrategyTableError(f"{at}: expected an object")
    for key in ("H", "N", "P", "bs"):
        if not isinstance(row.get(key), int) or row[key] < (0 if key == "P" else 1):
            raise StrategyTableError(f"{at}: {key} must be a positive integer, got {row.get(key)!r}")
    if row.get("kind", MLA_KIND) not in (MLA_KIND, MHA_KIND):
        raise StrategyTableError(f"{at}: kind must be {MLA_KIND!r} or {MHA_KIND!r}")
    ms = row.get("ms")
    if not isinstance(ms, dict) or not ms:
        raise StrategyTableError(f"{at}: 'ms' must map strategies to milliseconds")
    for name, value in ms.items():
        if name not in SERVING_STRATEGIES:
            raise StrategyTableError(f"{at}: {name!r} is not one of {SERVING_STRATEGIES}")
        if not isinstance(value, (int, float)) or not value > 0:
            raise StrategyTableError(f"{at}: ms[{name!r}] must be a positive number")


@functools.lru_cache(maxsize=4)
def _load_table(path: str, mtime: float) -> StrategyTable:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StrategyTableError(f"strategy table {path}: {e}") from e
    return StrategyTable.from_json(data, path)


def load_table() -> StrategyTable:
    """The table ``SGLANG_DDTREE_STRATEGY_TABLE`` names, else the shipped one."""
    from sglang.srt.ddtree_environ import ddtree_envs

    path = (ddtree_envs.SGLANG_DDTREE_STRATEGY_TABLE.get() or "").strip() or str(DEFAULT_TABLE)
    if not os.path.exists(path):
        raise StrategyTableError(f"{TABLE_ENV}: no strategy table at {path}")
    return _load_table(path, os.path.getmtime(path))


# ---------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------


def _distance(row: Dict[str, Any], shape: VerifyShape) -> float:
    return sum(
        math.log2(row[key] / value) ** 2
        for key, value in (("H", shape.heads), ("N", shape.width), ("bs", shape.batch))
    )


def measured_choice(
    rows: List[Dict[str, Any]], shape: VerifyShape, available: Collection[str]
) -> Optional[str]:
    """The fastest available strategy at the measured point nearest ``shape``
    (least total time over its prefix lengths, or at the prefix nearest
    ``shape.prefix``); None when no available strategy was measured there."""
    if not rows:
        return None
    nearest = min(_distance(r, shape) for r in rows)
    point = [r for r in rows if _distance(r, shape) == nearest]
    if shape.prefix is not None:
        gap = min(abs(math.log2(max(r["P"], 1) / max(shape.prefix, 1))) for r in point)
        point = [r for r in point if abs(math.log2(max(r["P"], 1) / max(shape.prefix, 1))) == gap]
    totals = {}
    for name in SERVING_STRATEGIES:  # fused first: it keeps ties
        if name in available and all(name in r["ms"] for r in point):
            totals[name] = sum(r["ms"][name] for r in point)
    if not totals:
        return None
    return min(totals, key=totals.get)


def choose_strategy(
    arch: Capability,
    shape: VerifyShape,
    available: Collection[str],
    table: Optional[StrategyTable] = None,
) -> str:
    """The strategy that serves a target verify of ``shape`` on a GPU following
    ``arch``'s policy, out of ``available`` (``fused`` always is)."""
    table = load_table() if table is None else table
    family = arch_family(arch)
    choice = measured_choice(table.rows_for(family, shape.kind), shape, available)
    if choice is not None:
        return choice
    if (
        family == "sm90"
        and shape.kind == MLA_KIND
        and FLASHMLA_SPLIT in available
        and shape.rows >= FLASHMLA_MIN_ROWS
    ):
        return FLASHMLA_SPLIT
    return FUSED


def layer_strategy(strategy: Optional[str], window_or_sinks: bool) -> Optional[str]:
    """The strategy for one layer of a verify whose strategy is ``strategy``: a
    sliding-window or attention-sink layer (gpt-oss, Gemma 4) takes the fused
    kernel, since the prefix passes of FlashInfer and FlashMLA apply neither;
    None stays the dispatcher's default (fused on a GPU, reference on the CPU)."""
    if window_or_sinks and strategy not in (None, *WINDOW_SINK_STRATEGIES):
        return FUSED
    return strategy


# ---------------------------------------------------------------------------
# What can run here
# ---------------------------------------------------------------------------


def flashmla_reason(device_cap: Optional[Capability]) -> Optional[str]:
    """Why FlashMLA cannot serve the verify prefix on this GPU (None: it can)."""
    from sglang.srt.utils.gpu_arch import SM120_PROXY_ENV, sm120_proxy

    if sm120_proxy():
        return f"{SM120_PROXY_ENV}=1 (sm_120 has no FlashMLA kernels)"
    if device_cap is None:
        return "no CUDA device"
    reason = flashmla_arch_reason(device_cap)
    if reason is not None:
        return reason
    from sglang.srt.layers.attention.tree_verify.flashmla_split import flash_mla_reason

    return flash_mla_reason()


def flashinfer_backend() -> str:
    """The FlashInfer MLA kernels flashinfer_split asks for: fa2, what sm_120 runs,
    under the sm_120 proxy; FlashInfer's own choice otherwise."""
    from sglang.srt.utils.gpu_arch import sm120_proxy

    return "fa2" if sm120_proxy() else "auto"


@dataclass(frozen=True)
class VerifyTarget:
    """The target's attention as the strategies see it."""

    kind: str  # MLA_KIND or MHA_KIND
    head_dim_qk: int
    head_dim_v: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def of(cls, dqk: int, dv: int, num_kv_heads: int, q_dtype, kv_dtype) -> "VerifyTarget":
        kind = MLA_KIND if (dqk, dv, num_kv_heads) == (576, 512, 1) else MHA_KIND
        return cls(kind, dqk, dv, q_dtype, kv_dtype)


def available_strategies(
    target: VerifyTarget, device_cap: Optional[Capability]
) -> Tuple[FrozenSet[str], Dict[str, str]]:
    """The serving strategies that can run for ``target`` here, and why each other
    one cannot."""
    reasons: Dict[str, str] = {}
    same_dtype = target.kv_dtype == target.q_dtype
    if target.kind != MLA_KIND:
        reasons[FLASHMLA_SPLIT] = "FlashMLA serves absorbed MLA only"
    elif not same_dtype:
        reasons[FLASHMLA_SPLIT] = f"KV cache {target.kv_dtype} is not in q's dtype"
    else:
        why = flashmla_reason(device_cap)
        if why:
            reasons[FLASHMLA_SPLIT] = why
    if not same_dtype:
        reasons[FLASHINFER_SPLIT] = f"KV cache {target.kv_dtype} is not in q's dtype"
    elif target.kind != MLA_KIND and target.head_dim_qk != target.head_dim_v:
        reasons[FLASHINFER_SPLIT] = "FlashInfer's paged prefill needs Dqk == Dv"
    else:
        from sglang.srt.layers.attention.tree_verify.flashinfer_split import flashinfer_reason

        why = flashinfer_reason()
        if why:
            reasons[FLASHINFER_SPLIT] = why
    available = frozenset(s for s in SERVING_STRATEGIES if s not in reasons)
    return available, reasons


# ---------------------------------------------------------------------------
# The KV pool's budget (patch 0071)
# ---------------------------------------------------------------------------

#: Attention backends whose TARGET_VERIFY goes through the tree-verify hook (MLA).
_HOOKED_MLA_BACKENDS = ("triton", "flashinfer")


def flashmla_staging_layers(kvc: Any) -> int:
    """Target KV layers' worth of memory per pool token that flashmla_split's page
    staging will take on this server: 1 when the target's verify will go through
    FlashMLA at any batch size (forced, or the policy's choice), else 0. The KV
    pool is sized with it counted (``pool_configurator``, patch 0071), rather than
    the staging being taken later from the headroom activations and graphs need.
    Made from the server's arguments, it may count the staging for a server whose
    hook turns itself off for another reason (deterministic inference, say); the
    hook falls back to the fused kernel if the staging still does not fit.
    ``kvc``: upstream's ``KVCacheConfigurator``."""
    from sglang.srt.layers.attention.tree_verify.hook import static_verify_kind

    if kvc.is_draft_worker or static_verify_kind(kvc.spec_algorithm) is None:
        return 0
    mc = kvc.model_config
    latent = (getattr(mc, "kv_lora_rank", None), getattr(mc, "qk_rope_head_dim", None))
    if not kvc.use_mla_backend or latent != (512, 64):
        return 0
    if (kvc.page_size or 1) != 1 or kvc.kv_cache_dtype != kvc.model_dtype:
        return 0  # the hook is off, or FlashMLA cannot read this KV cache
    if kvc.model_dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not set(kvc.server_args.get_attention_backends()) & set(_HOOKED_MLA_BACKENDS):
        return 0
    target = VerifyTarget.of(576, 512, 1, kvc.model_dtype, kvc.kv_cache_dtype)
    forced = forced_strategy()
    if forced is not None:
        return int(forced == FLASHMLA_SPLIT)
    from sglang.srt.utils.gpu_arch import device_capability, policy_arch

    device = f"cuda:{kvc.gpu_id}" if str(kvc.device) == "cuda" else kvc.device
    try:
        real = device_capability(torch.device(device))
    except RuntimeError:
        return 0
    available, _ = available_strategies(target, real)
    if FLASHMLA_SPLIT not in available:
        return 0
    arch = policy_arch(torch.device(device))
    heads = mc.num_attention_heads // max(1, kvc.ps.attn_tp_size)
    width = int(kvc.server_args.speculative_num_draft_tokens or 0)
    batches = _batch_sizes(kvc.server_args)
    return int(any(
        choose_strategy(arch, VerifyShape(heads, width, bs), available) == FLASHMLA_SPLIT
        for bs in batches
    ))  # fmt: skip


def _batch_sizes(server_args: Any) -> List[int]:
    """Batch sizes a verify may run at: powers of two up to the running-request cap."""
    cap = getattr(server_args, "max_running_requests", None) or 256
    sizes, bs = [], 1
    while bs <= cap:
        sizes.append(bs)
        bs *= 2
    return sizes

# SPDX-License-Identifier: Apache-2.0
"""Which tree-verify strategy serves a server's verify: a ranking, per arch and shape.

One function ranks, :func:`choose_strategy`: given the arch whose policy the
server follows, the verify's shape (query heads on this rank, tree nodes per
request, requests in the batch, MLA or not) and the strategies that can run here
(``strategies.available_strategies``), it returns the fastest strategy of a
measured table (``strategy_table.json`` next to this file, or the file
``SGLANG_DDTREE_STRATEGY_TABLE`` names). Each section of the table holds the
timings of one arch family, with the date, hardware and command that measured
them (``benchmarks/verify_strategy_table.py`` writes them). Per (heads, nodes,
batch; for MHA/GQA also KV heads and head dim) the policy takes the nearest
measured point (in log2 distance) and the strategy whose time is nearest the
fastest one's over that point's prefix lengths (least geometric mean of the
ratios): a server's prefixes vary from step to step while its captured CUDA
graphs keep one strategy per batch size.

Without measured rows for a family a rule applies, what was measured before the
table existed: FlashMLA's prefix pass on sm_90 from :data:`FLASHMLA_MIN_ROWS`
query rows per request (tree nodes x heads; see docs/tree-verify.md), the fused
kernel everywhere else.

``SGLANG_DDTREE_VERIFY_STRATEGY`` overrides the ranking (``dispatch.forced_strategy``),
and ``SGLANG_DDTREE_SM120_PROXY`` makes any GPU follow the sm_12x policy
(``gpu_arch.policy_arch``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Tuple

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.layers.attention.tree_verify.dispatch import (  # noqa: F401  (flags.py reads them here)
    STRATEGY_ENV,
    forced_strategy,
)
from sglang.srt.layers.attention.tree_verify.registry import (
    FLASHMLA_SPLIT,
    FUSED,
    MHA_KIND,
    MLA_KIND,
    SERVING_STRATEGIES,
    UPSTREAM_EXTEND,
    Capability,
)
from sglang.srt.utils import gpu_arch

#: The forced strategy that keeps upstream's own verify path (the tree-verify hook
#: off), as speculative/ddtree/flags.py reads it with the override above.
UPSTREAM_STRATEGY = UPSTREAM_EXTEND

TABLE_ENV = "SGLANG_DDTREE_STRATEGY_TABLE"
DEFAULT_TABLE = Path(__file__).with_name("strategy_table.json")
#: Without measured rows: query rows per request (tree nodes x query heads on this
#: rank) from which sm_90 runs the target's verify prefix through FlashMLA.
FLASHMLA_MIN_ROWS = 1024


@dataclass(frozen=True)
class VerifyShape:
    """A target verify as the policy sees it."""

    heads: int  # query heads on this rank
    width: int  # tree nodes per request (N)
    batch: int  # requests
    kind: str = MLA_KIND  # absorbed MLA (576/512, one KV head) or MHA/GQA
    prefix: Optional[int] = None  # committed tokens per request, when one length is asked about
    kv_heads: Optional[int] = None  # MHA/GQA: KV heads on this rank
    head_dim: Optional[int] = None  # MHA/GQA: the query/key head dim

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

    arch: str  # arch family (gpu_arch.arch_family): "sm12x", "sm90", "sm100", "sm80"
    date: str
    hardware: str
    proxy: bool  # measured as the sm_120 proxy on other hardware
    command: str
    rows: Tuple[Dict[str, Any], ...]  # {kind, H, N, P, bs, ms: {strategy: ms}}; mha rows also Hkv, D


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
            if s["arch"] not in gpu_arch.ARCH_FAMILIES:
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
    for key in _GQA_KEYS.values():
        if key in row and (not isinstance(row[key], int) or row[key] < 1):
            raise StrategyTableError(f"{at}: {key} must be a positive integer, got {row[key]!r}")
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
    path = (ddtree_envs.SGLANG_DDTREE_STRATEGY_TABLE.get() or "").strip() or str(DEFAULT_TABLE)
    if not os.path.exists(path):
        raise StrategyTableError(f"{TABLE_ENV}: no strategy table at {path}")
    return _load_table(path, os.path.getmtime(path))


# ---------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------


#: VerifyShape field -> table key of the MHA/GQA layout, compared where both have it.
_GQA_KEYS = {"kv_heads": "Hkv", "head_dim": "D"}


def _distance(row: Dict[str, Any], shape: VerifyShape) -> float:
    pairs = [("H", shape.heads), ("N", shape.width), ("bs", shape.batch)]
    pairs += [(key, getattr(shape, field)) for field, key in _GQA_KEYS.items()
              if key in row and getattr(shape, field) is not None]  # fmt: skip
    return sum(math.log2(row[key] / value) ** 2 for key, value in pairs)


def measured_choice(
    rows: List[Dict[str, Any]], shape: VerifyShape, available: Collection[str]
) -> Optional[str]:
    """The available strategy closest to the fastest at the measured point nearest
    ``shape``: the least geometric mean, over the point's prefix lengths (or the
    prefix nearest ``shape.prefix``), of its time over the fastest one's there.
    A ratio, not a sum of times, so the long prefixes' milliseconds do not
    outvote the short ones: one graph serves them all. None when no available
    strategy was measured there."""
    if not rows:
        return None
    nearest = min(_distance(r, shape) for r in rows)
    point = [r for r in rows if _distance(r, shape) == nearest]
    if shape.prefix is not None:
        gap = min(abs(math.log2(max(r["P"], 1) / max(shape.prefix, 1))) for r in point)
        point = [r for r in point if abs(math.log2(max(r["P"], 1) / max(shape.prefix, 1))) == gap]
    # fused first: it keeps ties
    names = [n for n in SERVING_STRATEGIES if n in available and all(n in r["ms"] for r in point)]
    if not names:
        return None
    fastest = [min(r["ms"][n] for n in names) for r in point]
    log_ratio = {n: sum(math.log(r["ms"][n] / f) for r, f in zip(point, fastest)) for n in names}
    return min(names, key=log_ratio.get)


def choose_strategy(
    arch: Capability,
    shape: VerifyShape,
    available: Collection[str],
    table: Optional[StrategyTable] = None,
) -> str:
    """The strategy that serves a target verify of ``shape`` on a GPU following
    ``arch``'s policy, out of ``available`` (``fused`` always is)."""
    table = load_table() if table is None else table
    family = gpu_arch.arch_family(arch)
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

"""DDTree step statistics without host syncs in the decode loop.

Accepted length per step already reaches the logs and ``/metrics`` through the
scheduler's spec-v2 plumbing (``accept_lens`` -> ``spec_accept_length``,
``spec_accept_rate`` = accepted draft nodes / budget). This adds what is
specific to a tree: the histogram of accepted depths and the depth of the
trees drafted. Counters live on the device; every ``interval`` steps a
snapshot is copied to pinned host memory asynchronously and logged at the next
snapshot, once its copy has landed, so logging never blocks the step.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_DEFAULT_INTERVAL = int(os.environ.get("SGLANG_DDTREE_STATS_INTERVAL", "256"))


class DDTreeStepStats:
    def __init__(self, budget: int, tp_rank: int = 0, interval: int = _DEFAULT_INTERVAL):
        self.budget = int(budget)
        self.enabled = tp_rank == 0 and interval > 0
        self.interval = interval
        self.steps = 0
        self._accept_hist: Optional[torch.Tensor] = None  # [budget + 1] int64
        self._depth_sum: Optional[torch.Tensor] = None  # [2] int64: sum max depth, requests
        self._pending = None

    def record(self, num_accepted: torch.Tensor, depth: torch.Tensor) -> None:
        """``num_accepted`` ``[bs]`` accepted draft nodes, ``depth`` ``[bs, N]``."""
        if not self.enabled or num_accepted.numel() == 0:
            return
        if self._accept_hist is None:
            self._accept_hist = torch.zeros(
                (self.budget + 1,), dtype=torch.int64, device=num_accepted.device
            )
            self._depth_sum = torch.zeros((2,), dtype=torch.int64, device=num_accepted.device)
        self._accept_hist.index_add_(
            0,
            num_accepted.to(torch.int64),
            torch.ones_like(num_accepted, dtype=torch.int64),
        )
        self._depth_sum[0] += depth.max(dim=1).values.to(torch.int64).sum()
        self._depth_sum[1] += num_accepted.shape[0]
        self.steps += 1
        if self.steps % self.interval == 0:
            self._snapshot()

    def _snapshot(self) -> None:
        if self._pending is not None and self._pending[2].query():
            self._log(self._pending[0], self._pending[1])
            self._pending = None
        if self._pending is None:
            hist = torch.empty_like(self._accept_hist, device="cpu").pin_memory()
            depth = torch.empty_like(self._depth_sum, device="cpu").pin_memory()
            hist.copy_(self._accept_hist, non_blocking=True)
            depth.copy_(self._depth_sum, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (hist, depth, event)

    def _log(self, hist: torch.Tensor, depth: torch.Tensor) -> None:
        summary = summarize(hist, depth)
        if summary is None:
            return
        logger.info(
            "DDTREE stats: steps(req)=%d, mean accepted drafts=%.2f, mean commit=%.2f, "
            "mean tree depth=%.2f, accepted-depth histogram=%s",
            summary["requests"],
            summary["mean_accepted"],
            summary["mean_accepted"] + 1,
            summary["mean_tree_depth"],
            summary["histogram"],
        )


def summarize(hist: torch.Tensor, depth: torch.Tensor) -> Optional[dict]:
    """Host-side summary of a counters snapshot (cumulative since start)."""
    hist = hist.to(torch.int64).tolist()
    requests = int(sum(hist))
    if requests == 0:
        return None
    last = max(i for i, c in enumerate(hist) if c) if any(hist) else 0
    return {
        "requests": requests,
        "mean_accepted": sum(i * c for i, c in enumerate(hist)) / requests,
        "mean_tree_depth": int(depth[0]) / max(1, int(depth[1])),
        "histogram": hist[: last + 1],
    }

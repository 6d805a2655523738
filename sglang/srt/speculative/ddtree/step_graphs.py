# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs of the eager segments of a DDTREE decode step.

The drafter's forward and the target's verify replay the model runners' CUDA graphs, but what
runs between and after them is a few dozen small launches, each a Python call: on a small
target, or at a small batch, the step is host time (the learned pair's DDTREE step keeps the
GPU busy 0.42 of its 3.3 ms, docs/benchmarks.md). ``SegmentGraphs`` captures such a segment
once per shape and replays it as one launch.

A segment is a function of tensors (after a few hashable constants) with no host sync and no
host-visible side effect. Its tensor arguments are of two kinds: ``fixed`` tensors, whose storage is the same on every call (the
verify graph's output buffers, ``req_to_token``, the statistics counters), are read in place
and their addresses are part of the key; ``fed`` tensors (this step's tree, the prefix lengths)
are copied into the graph's own buffers before each replay (a None stays None). The first call at a key runs
eagerly, which compiles and sizes what the segment uses; the second captures, and every later
one replays. ``guard`` names what else a capture holds the address of (a workspace that may be
reallocated): a new value is a new key. What the segment returns lives in the graph's memory until the next replay at
that key: a caller clones what outlives the step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence, Tuple

import torch

from sglang.srt.ddtree_environ import ddtree_envs

logger = logging.getLogger(__name__)

#: A server's segments: a graph per raw batch size met (they are not padded to the model
#: graphs' buckets), each small, so room for every size up to 256 with some keys moving.
SERVER_LIMITS = dict(max_graphs=256, max_captures=1024)


def enabled(server_args) -> bool:
    """Whether a server replays its step segments as CUDA graphs: on CUDA, with the model's
    CUDA graphs on and ``SGLANG_DDTREE_STEP_GRAPHS`` not 0."""
    return (
        ddtree_envs.SGLANG_DDTREE_STEP_GRAPHS.get()
        and torch.cuda.is_available()
        and not getattr(server_args, "disable_cuda_graph", False)
    )


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    fed: Tuple[Optional[torch.Tensor], ...]  # the graph's copies of the fed arguments
    out: Any


def _signature(tensors: Sequence[Optional[torch.Tensor]], with_address: bool) -> Tuple:
    """What a graph's key holds of each argument; built every step, so kept to the fields
    that tell captures apart (one process, one device: the address names the storage)."""
    if with_address:
        return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in tensors)


class SegmentGraphs:
    """One CUDA graph of ``fn(*consts, *fixed, *fed)`` per key (the constants, the guard, the
    arguments' shapes and the fixed ones' addresses), the ``max_graphs`` most recently used
    kept. Past ``max_captures`` (keys that keep changing: a capture syncs the device) the
    segment stays eager."""

    def __init__(self, name: str, fn: Callable[..., Any], *, max_graphs: int = 16, max_captures: int = 64):
        self.name = name
        self._fn = fn
        self._max_graphs = max(1, int(max_graphs))
        self._max_captures = max(1, int(max_captures))
        self._graphs: "OrderedDict[Hashable, _Graph]" = OrderedDict()
        # Keys run eagerly once, captured on the next call (bounded: fixed arguments that
        # move every call never come back).
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()
        self._pool = None
        self.disabled_reason: Optional[str] = None
        self.replays = 0
        self.captures = 0
        #: Whether the last ``run`` replayed a graph (its outputs sit at the same addresses as
        #: the previous replay's at that key), and the graph's copies of its fed arguments
        #: (which a later segment of the step may read in place).
        self.last_replayed = False
        self.last_fed: Tuple[torch.Tensor, ...] = ()

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()

    def run(
        self,
        consts: Tuple[Hashable, ...],
        fixed: Sequence[Optional[torch.Tensor]],
        fed: Sequence[Optional[torch.Tensor]],
        guard: Hashable = (),
    ) -> Any:
        """``fn(*consts, *fixed, *fed)``: replayed, captured, or (first call at a key, or
        graphs turned off after a failed capture) run eagerly."""
        self.last_replayed, self.last_fed = False, ()
        if self.disabled_reason is not None:
            return self._fn(*consts, *fixed, *fed)
        full_key = (tuple(consts), guard, _signature(fixed, True), _signature(fed, False))
        entry = self._graphs.get(full_key)
        if entry is not None:
            self._graphs.move_to_end(full_key)
            _copy_fed(entry.fed, fed)
            entry.graph.replay()
            self.replays += 1
            self.last_replayed, self.last_fed = True, entry.fed
            return entry.out
        if full_key not in self._seen:
            self._seen[full_key] = None
            while len(self._seen) > 4 * self._max_graphs:
                self._seen.popitem(last=False)
            return self._fn(*consts, *fixed, *fed)
        return self._capture(full_key, consts, fixed, fed)

    def _capture(self, full_key: Hashable, consts, fixed, fed) -> Any:
        if self.captures >= self._max_captures:
            self._disable(f"{self.captures} captures: its keys keep changing")
            return self._fn(*consts, *fixed, *fed)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        mine = tuple(None if t is None else t.clone() for t in fed)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the scheduler's other threads may call CUDA while this captures.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._fn(*consts, *fixed, *mine)
        except Exception as e:  # an op that cannot be captured: keep the segment eager
            self._disable(f"capture failed: {type(e).__name__}: {e}")
            return self._fn(*consts, *fixed, *fed)
        self.captures += 1
        self._graphs[full_key] = _Graph(graph, mine, out)
        while len(self._graphs) > self._max_graphs:
            old, _ = self._graphs.popitem(last=False)
            self._seen.pop(old, None)
        # Capture runs nothing: this call's work is the first replay.
        graph.replay()
        self.replays += 1
        self.last_replayed, self.last_fed = True, mine
        return out

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self.clear()
        logger.warning("%s: running eagerly from now on (%s).", self.name, reason)


def _copy_fed(mine: Sequence[Optional[torch.Tensor]], theirs: Sequence[Optional[torch.Tensor]]) -> None:
    """The fed arguments into the graph's copies: one grouped copy per dtype (a sampled step
    feeds four parameter tensors), not one launch each."""
    groups: dict = {}
    for dst, src in zip(mine, theirs):
        if dst is not None:
            dsts, srcs = groups.setdefault(dst.dtype, ([], []))
            dsts.append(dst)
            srcs.append(src)
    for dsts, srcs in groups.values():
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        else:
            torch._foreach_copy_(dsts, srcs)

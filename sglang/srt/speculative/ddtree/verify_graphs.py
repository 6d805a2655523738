# SPDX-License-Identifier: Apache-2.0
"""Target verify CUDA graphs at the widths of DDTREE's graph budgets
(``--speculative-ddtree-graph-budgets``).

Upstream's target graph runner is captured at one width, the full budget's N = B + 1, and
falls back to an eager forward for any other width; a smaller tree then costs the eager
forward's host time, more than it saves on a small or lightly loaded target. For each graph
budget b this captures a second ``DecodeCudaGraphRunner`` at width b + 1 over the same batch
sizes, with an attention backend of its own: a runner's capture (re)allocates its backend's
graph buffers, so two runners cannot share one. A verify of that width runs with the two
swapped into the target's model runner (``active``), for its planning and its forward both:
the forward replays on the runner that planned it.

The per-step KV reservation stays at the full width (the spec config's
``speculative_num_draft_tokens`` is set to b + 1 only while a runner captures), so a
narrower tree always fits in it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence

from sglang.srt.layers.attention.tree_verify.hook import active_hook
from sglang.srt.runtime_context import get_context, get_spec
from sglang.srt.utils import get_available_gpu_memory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyGraphRunner:
    """One width's target verify graphs: the runner and the backend its graphs read."""

    width: int
    attn_backend: Any
    graph_runner: Any
    max_bs: int


class VerifyGraphs:
    """The target's extra verify graph runners, by tree width."""

    def __init__(self, model_runner: Any, runners: Sequence[VerifyGraphRunner] = ()):
        self.model_runner = model_runner
        self._by_width: Dict[int, VerifyGraphRunner] = {r.width: r for r in runners}

    @property
    def widths(self) -> tuple:
        return tuple(sorted(self._by_width))

    def lookup(self, width: int, batch_size: int) -> Optional[VerifyGraphRunner]:
        """The runner whose graphs serve a ``width``-token verify of ``batch_size`` requests,
        or None (the full width is the model runner's own runner; a larger batch than the
        captured ones runs eagerly, as upstream's runner does)."""
        entry = self._by_width.get(int(width))
        if entry is None or batch_size > entry.max_bs:
            return None
        return entry

    @contextlib.contextmanager
    def active(self, entry: Optional[VerifyGraphRunner]) -> Iterator[Any]:
        """The target's model runner with ``entry``'s backend and graph runner in place of
        its own, restored on leaving (None: the runner's own). Yields the active backend."""
        mr = self.model_runner
        if entry is None:
            yield mr.attn_backend
            return
        saved = (mr.attn_backend, mr.decode_cuda_graph_runner)
        mr.attn_backend, mr.decode_cuda_graph_runner = entry.attn_backend, entry.graph_runner
        try:
            yield entry.attn_backend
        finally:
            mr.attn_backend, mr.decode_cuda_graph_runner = saved

    @classmethod
    def capture(cls, model_runner: Any, widths: Sequence[int], full_width: int) -> "VerifyGraphs":
        """A runner per width (each below ``full_width``), captured now."""
        runners = []
        for width in sorted(set(int(w) for w in widths)):
            if not 1 <= width < full_width:
                raise ValueError(f"a graph budget's verify width must lie in [1, {full_width - 1}], got {width}")
            runners.append(_capture_width(model_runner, width, full_width))
        return cls(model_runner, runners)


def _capture_width(mr: Any, width: int, full_width: int) -> VerifyGraphRunner:
    tic = time.perf_counter()
    before = get_available_gpu_memory(mr.device, mr.gpu_id)
    saved = (mr.attn_backend, mr.decode_cuda_graph_runner, mr.init_new_workspace)
    server_width = get_spec().speculative_num_draft_tokens
    if server_width != full_width:
        raise ValueError(f"the spec config's verify width is {server_width}, not the full budget's {full_width}")
    # The backend and the runner size their graph state by the spec config's width.
    get_context().override("ddtree.verify_graphs.capture", speculative_num_draft_tokens=width)
    try:
        # FlashInfer's workspace is shared: the tree-verify path plans no FlashInfer verify,
        # and forwards run one at a time.
        backend = mr._get_attention_backend(init_new_workspace=False)
        hook = active_hook(backend)
        if hook is not None:
            hook.num_draft_tokens = width  # the hook took the server's full width
        # The capture reads some settings from the model runner's backend.
        mr.attn_backend = backend
        graph_runner = mr._decode_cuda_graph_runner_cls()(
            mr, attn_backend=backend, speculative_num_draft_tokens=width
        )
    finally:
        get_context().override("ddtree.verify_graphs.restore", speculative_num_draft_tokens=full_width)
        mr.attn_backend, mr.decode_cuda_graph_runner, mr.init_new_workspace = saved
    after = get_available_gpu_memory(mr.device, mr.gpu_id)
    logger.info(
        "DDTREE verify graphs at width %d (budget %d): batch sizes up to %d, %.2f GB, %.1f s.",
        width, width - 1, graph_runner.max_bs, before - after, time.perf_counter() - tic,
    )  # fmt: skip
    return VerifyGraphRunner(width=width, attn_backend=backend, graph_runner=graph_runner,
                             max_bs=int(graph_runner.max_bs))  # fmt: skip

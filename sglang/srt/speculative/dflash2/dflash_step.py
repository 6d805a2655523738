# SPDX-License-Identifier: Apache-2.0
"""What upstream's ``DFlashWorkerV2`` (the ``DFLASH`` algorithm) does differently with a
DFlash 2 drafter. Called from patch 0056; a no-op for any other drafter.

- ``attach``: at start-up, hand the drafter the block the worker drafts with (its
  convolution stops at block boundaries; DDTREE may draft a shorter block than the
  checkpoint's).
- ``propose``: the chain to verify is the selector's greedy path, not each slot's
  argmax: candidates, lattice and the argmax walk from the draft forward's hidden
  states, for every request at every temperature.

The verify is the same as with a DFlash drafter (patch 0082, ``speculative/verify_sampling``):
the target's token at every chain position (argmax, or one draw per position by the
server's sampler), accepted by the greedy rule. That is lossless because the chain is a
deterministic function of the context.

The draft folded into the draft CUDA graph (upstream's greedy head) is not used
with a DFlash 2 drafter: the draft graph returns hidden states and the selector
runs after it, as a CUDA graph of its own on one rank (``step_graphs.SegmentGraphs``,
keyed by where the hidden states lie: the draft graph's output buffer once it replays).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from sglang.srt.speculative.ddtree import step_graphs
from sglang.srt.speculative.ddtree.step_graphs import SegmentGraphs
from sglang.srt.speculative.dflash2.selector import greedy_walk

logger = logging.getLogger(__name__)

_UNSET = object()


def is_selector_drafter(model) -> bool:
    return getattr(model, "candidate_selector", None) is not None and hasattr(model, "selector_lattice")


def attach(worker) -> None:
    model = getattr(worker, "draft_model", None)
    if not is_selector_drafter(model):
        return
    model.set_block_size(int(worker.block_size))
    if getattr(worker.ps, "tp_rank", 0) == 0:
        logger.info(
            "DFlash 2 drafter: block %d, selector top-K %d; the draft chain is the selector's greedy path.",
            int(worker.block_size),
            model.candidate_selector.top_k,
        )


def propose(
    worker,
    draft_logits_output,
    *,
    bs: int,
    anchor_ids: torch.Tensor,
    lm_head,
) -> Optional[torch.Tensor]:
    """The chain's draft tokens ``[bs, block - 1]``: the selector's greedy path, or None
    for a drafter without a selector."""
    model = getattr(worker, "draft_model", None)
    if not is_selector_drafter(model):
        return None
    hidden = draft_logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("DFLASH: the DFlash 2 draft forward returned no hidden states.")
    block = int(worker.block_size)
    slots = hidden.view(bs, block, -1)[:, 1:, :]
    graphs = _path_graphs(worker, model, lm_head)
    if graphs is None:
        return greedy_path(model, lm_head, slots, anchor_ids.view(bs))
    # A replay's output lives in the graph's memory until its next replay.
    return graphs.run((), (slots,), (anchor_ids.view(bs),)).clone()


def greedy_path(model, lm_head, slots: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """The selector's greedy path ``[bs, S]`` from the block's mask slots: the candidates
    through the target's LM head, their lattice after ``anchor_ids``, the argmax walk."""
    ids, scores = model.selector_lattice(slots, anchor_ids, lm_head)
    return greedy_walk(ids, scores)


def _path_graphs(worker, model, lm_head) -> Optional[SegmentGraphs]:
    """The worker's graphs of ``greedy_path``, made on first use; None where it runs eagerly:
    no CUDA, CUDA graphs off, ``SGLANG_DDTREE_STEP_GRAPHS=0``, or tensor parallelism (the
    candidates are all-gathered across the vocabulary shards)."""
    graphs = getattr(worker, "_dflash2_path_graphs", _UNSET)
    if graphs is _UNSET:
        graphs = None
        if step_graphs.enabled(worker.server_args) and _tp_size() == 1:
            path = functools.partial(greedy_path, model, lm_head)
            graphs = SegmentGraphs("DFLASH selector path", path, **step_graphs.SERVER_LIMITS)
        worker._dflash2_path_graphs = graphs
    return graphs


def _tp_size() -> int:
    from sglang.srt.distributed import get_tp_group

    return get_tp_group().world_size

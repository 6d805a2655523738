# SPDX-License-Identifier: Apache-2.0
"""What upstream's ``DFlashWorkerV2`` (the ``DFLASH`` algorithm) does differently with a
DFlash 2 drafter. Called from patch 0056; a no-op for any other drafter.

- ``attach``: at start-up, hand the drafter the block the worker drafts with (its
  convolution stops at block boundaries; DDTREE may draft a shorter block than the
  checkpoint's).
- ``propose``: the chain to verify is the selector's path, not each slot's argmax:
  candidates, lattice and walk from the draft forward's hidden states. Greedy rows
  walk the argmax; at T > 0 each request's path is drawn at its temperature and the
  walk's q (over the K candidates of each slot) is kept for the verify.
- ``sampling_accept``: at T > 0, accept the path by rejection sampling against that
  q (accept a token with probability min(1, p / q), on rejection draw from
  max(p - q, 0)), upstream's chain kernel for draft distributions
  (``dspark_accept.accept_sampling``). Lossless: the path was drawn from q. Without
  it upstream's target-only chain rule would still be lossless, at a lower accept
  rate.

The draft folded into the draft CUDA graph (upstream's greedy head) is not used
with a DFlash 2 drafter: the draft graph returns hidden states and the selector
runs after it.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from sglang.srt.speculative.dflash2.selector import walk

logger = logging.getLogger(__name__)


def is_selector_drafter(model) -> bool:
    return getattr(model, "candidate_selector", None) is not None and hasattr(model, "selector_lattice")


def attach(worker) -> None:
    worker._dflash2_sample = None
    worker._dflash2_probs = None
    model = getattr(worker, "draft_model", None)
    if not is_selector_drafter(model):
        return
    model.set_block_size(int(worker.block_size))
    if getattr(worker.ps, "tp_rank", 0) == 0:
        logger.info(
            "DFlash 2 drafter: block %d, selector top-K %d; the draft chain is the selector's path.",
            int(worker.block_size),
            model.candidate_selector.top_k,
        )


def greedy_rows(sampling_info, bs: int, device) -> torch.Tensor:
    """Requests that decode greedily (top-k 1) inside a sampling batch."""
    if sampling_info is None or sampling_info.is_all_greedy:
        return torch.ones(bs, dtype=torch.bool, device=device)
    return (sampling_info.top_ks.view(-1)[:bs] <= 1).to(device)


def propose(
    worker,
    draft_logits_output,
    *,
    bs: int,
    anchor_ids: torch.Tensor,
    lm_head,
    sampling_info,
    sampling_verify: bool,
) -> Optional[torch.Tensor]:
    """The chain's draft tokens ``[bs, block - 1]``, or None for a drafter without a
    selector. ``sampling_verify``: the verify will sample (T > 0 rows present and
    the sampling kernels available); otherwise every row walks the argmax."""
    model = getattr(worker, "draft_model", None)
    worker._dflash2_sample = None
    if not is_selector_drafter(model):
        return None
    hidden = draft_logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("DFLASH: the DFlash 2 draft forward returned no hidden states.")
    block = int(worker.block_size)
    slots = hidden.view(bs, block, -1)[:, 1:, :]
    ids, scores = model.selector_lattice(slots, anchor_ids.view(bs), lm_head)
    device = scores.device
    sampling = bool(sampling_verify) and sampling_info is not None and not sampling_info.is_all_greedy
    if sampling:
        temperatures = sampling_info.temperatures.view(-1)[:bs].float().clamp_min(1e-5)
        greedy = greedy_rows(sampling_info, bs, device)
    else:
        temperatures = torch.ones(bs, dtype=torch.float32, device=device)
        greedy = torch.ones(bs, dtype=torch.bool, device=device)
    uniforms = torch.rand((bs, block - 1), dtype=torch.float32, device=device)
    tokens, q, _ = walk(ids, scores, uniforms, temperatures, greedy)
    if sampling:
        worker._dflash2_sample = (ids, q)
    return tokens


def dense_draft_probs(worker, ids: torch.Tensor, q: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[bs, S, vocab]`` float32 holding q at the candidates and zeros elsewhere,
    in a buffer kept on the worker (``release_draft_probs`` zeroes it again)."""
    bs, slots, _ = ids.shape
    buf = getattr(worker, "_dflash2_probs", None)
    if buf is None or buf.shape[0] < bs or buf.shape[1:] != (slots, vocab) or buf.device != ids.device:
        cap = bs if buf is None else max(bs, buf.shape[0] * 2)
        buf = torch.zeros((cap, slots, vocab), dtype=torch.float32, device=ids.device)
        worker._dflash2_probs = buf
    probs = buf[:bs]
    probs.scatter_(2, ids, q.float())
    return probs


def release_draft_probs(worker, ids: torch.Tensor) -> None:
    bs = ids.shape[0]
    worker._dflash2_probs[:bs].scatter_(2, ids, 0.0)


def sampling_accept(
    worker,
    *,
    candidates: torch.Tensor,
    next_token_logits: torch.Tensor,
    sampling_info,
    draft_input,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(accept_len int32 [bs], bonus int64 [bs])`` by rejection sampling against the
    selector's q, or None when this step's chain carries no q (another drafter, or
    an all-greedy batch)."""
    sample = getattr(worker, "_dflash2_sample", None)
    worker._dflash2_sample = None
    if sample is None:
        return None
    from sglang.kernels.ops.speculative.dspark.dspark_accept import accept_sampling

    ids, q = sample
    bs, block = candidates.shape
    probs = dense_draft_probs(worker, ids, q, int(next_token_logits.shape[-1]))
    try:
        accept_len, bonus, _ = accept_sampling(
            candidates=candidates,
            target_logits=next_token_logits,
            draft_probs=probs,
            sampling_info=sampling_info,
            draft_input=draft_input,
            gamma=block - 1,
            verify_num_draft_tokens=block,
        )
    finally:
        release_draft_probs(worker, ids)
    return accept_len.to(torch.int32), bonus.to(torch.int64)

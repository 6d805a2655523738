# SPDX-License-Identifier: Apache-2.0
"""The DFlash 2 candidate selector: candidates, transition lattice, path walk.

For a drafted block with S mask slots:

1. **Candidates.** Each slot's drafter output goes through the target's LM head;
   its top-K logits (``selector_top_k``) are the slot's candidates, sorted by
   logit, and the logits (times ``output_multiplier``, soft-capped) their unary
   scores.
2. **Lattice.** Candidate c at slot s following candidate p at slot s - 1 scores

       scores[s, p, c] = unary[s, c] + < P[tok(s-1, p)] * W h_s , Q[tok(s, c)] >

   with ``P`` / ``Q`` the ``[vocab, rank]`` predecessor / successor codebooks,
   ``W`` the ``[rank, hidden]`` hidden projection and ``h_s`` the slot's drafter
   output. Slot 0's predecessor is the block's anchor (the verified bonus
   token), so its K rows are equal.
3. **Walk.** One path through the lattice: slot 0 picks from row 0, slot s from
   the row of the candidate picked at slot s - 1. The server walks greedily at
   every temperature (``greedy_walk``: the first argmax of each row). ``walk``
   is the reference's full walk: greedy rows as above, sampled rows drawn by
   inverse CDF with one uniform per slot from ``softmax(row / T)``, with the
   distribution q each slot was drawn from (one-hot for greedy rows); the server
   does not sample the path (docs/drafters.md, "DFLASH").

Pure tensor code, no scheduler state; runs on any device.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class CandidateSelector(nn.Module):
    """The selector's weights (checkpoint prefix ``candidate_selector.``)."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = int(top_k)
        self.rank = int(rank)
        # Every rank holds the whole tables: a candidate can be any token.
        self.predecessor_codebook = nn.Parameter(torch.zeros(int(vocab_size), self.rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(int(vocab_size), self.rank), requires_grad=False)
        self.hidden_projection = nn.Linear(int(hidden_size), self.rank, bias=False)

    def lattice(
        self,
        candidate_ids: torch.Tensor,
        unary: torch.Tensor,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``scores [bs, S, K, K]`` (float32) from ``candidate_ids [bs, S, K]``,
        ``unary [bs, S, K]`` float32, ``hidden [bs, S, H]``, ``anchor_ids [bs]``."""
        bs, slots, k = candidate_ids.shape
        state = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [bs, S, r]
        previous = torch.cat(
            [anchor_ids.view(bs, 1, 1).to(candidate_ids.dtype).expand(bs, 1, k), candidate_ids[:, :-1]],
            dim=1,
        )
        left = self.predecessor_codebook[previous] * state.unsqueeze(2)  # [bs, S, K(p), r]
        right = self.successor_codebook[candidate_ids]  # [bs, S, K(c), r]
        pair = torch.einsum("blpr,blcr->blpc", left, right)
        return unary.float().unsqueeze(2) + pair


def transform_unary_logits(
    values: torch.Tensor, output_multiplier: float = 1.0, softcap: Optional[float] = None
) -> torch.Tensor:
    """The candidates' unary scores from their LM-head logits (float32)."""
    out = values.float()
    if output_multiplier != 1.0:
        out = out * output_multiplier
    if softcap is not None:
        out = torch.tanh(out / softcap) * softcap
    return out


# Rows scored per LM-head matmul: bounds the ``rows x vocabulary`` logits, which a CUDA graph
# of the selector (DDTREE's tree from transitions) keeps in its memory pool.
_CHUNK_ELEMS = 1 << 26


def head_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    num_valid: Optional[int] = None,
    id_offset: int = 0,
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` logits of ``hidden [N, H]`` under an LM head ``weight [V_local, H]``.

    Only the first ``num_valid`` rows of ``weight`` are real tokens (ids
    ``id_offset + j``). ``gather`` (TP) all-gathers a ``[N, k]`` tensor along
    dim -1 across the vocabulary shards; the global top-``k`` is then taken over
    the ranks' local top-``k``s. Returns ``(ids [N, k] int64, values [N, k])``,
    values sorted descending.
    """
    rows = weight if num_valid is None else weight[: int(num_valid)]
    hidden = hidden.to(weight.dtype)
    chunk = max(1, _CHUNK_ELEMS // max(1, rows.shape[0]))
    if hidden.shape[0] <= chunk:
        values, ids = torch.topk(torch.matmul(hidden, rows.T), k, dim=-1)
    else:
        values = hidden.new_empty((hidden.shape[0], k))
        ids = torch.empty((hidden.shape[0], k), dtype=torch.int64, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            part = torch.topk(torch.matmul(hidden[start : start + chunk], rows.T), k, dim=-1)
            values[start : start + chunk], ids[start : start + chunk] = part.values, part.indices
    ids = ids.long()
    if gather is None:
        return ids + int(id_offset) if id_offset else ids, values
    all_values = gather(values.float())
    all_ids = gather(ids + int(id_offset))
    values, pick = torch.topk(all_values, k, dim=-1)
    return torch.gather(all_ids, -1, pick), values


def candidate_topk(hidden: torch.Tensor, lm_head: nn.Module, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``head_topk`` through the target's (possibly vocabulary-sharded) LM head."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise RuntimeError(
            "The DFlash 2 candidate selector needs a dense floating-point target lm_head."
        )
    shard = getattr(lm_head, "shard_indices", None)
    tp_group = _tp_group()
    if shard is None or tp_group is None:
        num_valid = int(getattr(lm_head, "org_vocab_size", weight.shape[0]))
        return head_topk(hidden, weight, k, num_valid=min(num_valid, weight.shape[0]))
    return head_topk(
        hidden,
        weight,
        k,
        num_valid=int(shard.num_org_elements),
        id_offset=int(shard.org_vocab_start_index),
        gather=lambda t: tp_group.all_gather(t.contiguous(), dim=-1),
    )


def _tp_group():
    """The TP group when the vocabulary is sharded over more than one rank."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return group if group.world_size > 1 else None


def walk(
    candidate_ids: torch.Tensor,
    scores: torch.Tensor,
    uniforms: torch.Tensor,
    temperatures: torch.Tensor,
    greedy_mask: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One path per request through the lattice.

    ``candidate_ids [bs, S, K]``, ``scores [bs, S, K, K]``, ``uniforms [bs, S]``
    in [0, 1), ``temperatures [bs]`` (> 0), ``greedy_mask [bs]`` bool. Returns
    ``(tokens [bs, S] int64, q [bs, S, K] float32, path [bs, S] int64)``: the
    path's tokens, the distribution each slot's candidate was drawn from, and
    the candidate index picked at each slot.
    """
    bs, slots, k = candidate_ids.shape
    temp = temperatures.float().view(bs, 1, 1, 1)
    probs = torch.softmax(scores.float() / temp, dim=-1)  # [bs, S, K(p), K(c)]
    drawn = (uniforms.float().view(bs, slots, 1, 1) >= probs.cumsum(dim=-1)).sum(dim=-1).clamp_max(k - 1)
    greedy = greedy_mask.view(bs, 1, 1)
    path = _follow(torch.where(greedy, scores.argmax(dim=-1), drawn))
    rows = torch.cat([path.new_zeros((bs, 1)), path[:, :-1]], dim=1)
    q = probs.gather(2, rows.view(bs, slots, 1, 1).expand(bs, slots, 1, k)).squeeze(2)
    q = torch.where(greedy, F.one_hot(path, k).to(q.dtype), q)
    tokens = candidate_ids.gather(2, path.unsqueeze(2)).squeeze(2)
    return tokens, q, path


def greedy_walk(candidate_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The argmax path's tokens ``[bs, S]`` int64 (``walk`` with every row greedy)."""
    path = _follow(scores.argmax(dim=-1))
    return candidate_ids.gather(2, path.unsqueeze(2)).squeeze(2)


def _follow(step: torch.Tensor) -> torch.Tensor:
    """The path ``[bs, S]`` (candidate index per slot) from ``step [bs, S, K(p)]``, where
    each predecessor row leads at each slot; slot 0 follows row 0 (the anchor)."""
    index = step[:, 0, 0]
    picks = [index]
    for s in range(1, step.shape[1]):
        index = step[:, s].gather(1, index.unsqueeze(1)).squeeze(1)
        picks.append(index)
    return torch.stack(picks, dim=1)

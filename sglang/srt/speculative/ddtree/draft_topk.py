# SPDX-License-Identifier: Apache-2.0
"""Per-depth top-K of the drafter's log-softmax under the target's LM head.

The DFlash drafter has no head of its own; DDTREE scores its hidden states with
the target's LM head, which under tensor parallelism holds one contiguous slice
of the vocabulary per rank. The full-vocabulary top-K is then the top-K of the
ranks' local top-Ks, and the log-softmax normaliser is the log-sum-exp of the
ranks' local log-sum-exps; each rank gathers ``K`` values, ``K`` ids and one
normaliser per row instead of its whole logit slice. On one rank the local
top-K is the answer. Either way the logits are scored a bounded number of rows
at a time (``lm_head_topk``).

Under TP, ties are broken towards the lower token id on every rank alike, so
all ranks build the same tree; one rank needs no such agreement and takes
``torch.topk``'s order.

On one rank with CUDA graphs, ``DraftTopKHead`` runs ``lm_head_topk`` inside the
drafter's graph (upstream's capture tail hook, as DFLASH folds its greedy head),
so a step replays it instead of launching it op by op.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

# Rows scored per matmul: bounds the transient ``rows x local_vocab`` fp32 logits.
_CHUNK_ELEMS = 1 << 26


def local_vocab_topk(
    logits: torch.Tensor, k: int, id_offset: int, num_valid: int, *, stable: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of one rank's logit slice.

    ``logits``: ``[R, V_local]`` fp32; only the first ``num_valid`` columns are
    real tokens (``id_offset + j``), the rest is padding or past the model's
    vocabulary. Returns ``(values [R, k], ids [R, k], lse [R])``; a slice with
    fewer than ``k`` real tokens pads with ``-inf`` (id 0), never chosen while
    the vocabulary as a whole holds ``k`` tokens. ``stable`` orders equal
    values by id (a full sort); without it ``torch.topk`` picks among ties.
    """
    rows = logits.shape[0]
    num_valid = max(0, min(int(num_valid), logits.shape[1]))
    real = logits[:, :num_valid]
    if num_valid == 0:
        lse = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    else:
        lse = torch.logsumexp(real, dim=-1)
    take = min(k, num_valid)
    values = torch.full((rows, k), float("-inf"), dtype=torch.float32, device=logits.device)
    ids = torch.zeros((rows, k), dtype=torch.int64, device=logits.device)
    if take > 0:
        if stable:
            # Columns are in id order; a stable descending sort keeps the lower
            # id first among equal values.
            order = torch.sort(real, dim=-1, descending=True, stable=True)
            top_v, top_i = order.values[:, :take], order.indices[:, :take]
        else:
            top_v, top_i = torch.topk(real, take, dim=-1, largest=True, sorted=True)
        values[:, :take] = top_v
        ids[:, :take] = top_i + int(id_offset)
    return values, ids, lse


def merge_vocab_shards(
    values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge the ranks' local top-Ks (``[tp, R, k]``) and normalisers
    (``[tp, R]``) into the global ``(logprobs [R, k] descending, ids [R, k])``."""
    tp, rows, width = values.shape
    cand_v = values.permute(1, 0, 2).reshape(rows, tp * width)
    cand_i = ids.permute(1, 0, 2).reshape(rows, tp * width)
    # Ties towards the lower token id: order the candidates by id first.
    by_id = torch.argsort(cand_i, dim=-1, stable=True)
    cand_v = torch.gather(cand_v, 1, by_id)
    cand_i = torch.gather(cand_i, 1, by_id)
    order = torch.sort(cand_v, dim=-1, descending=True, stable=True)
    top_v = order.values[:, :k]
    top_i = torch.gather(cand_i, 1, order.indices[:, :k])
    norm = torch.logsumexp(lse.transpose(0, 1), dim=-1, keepdim=True)
    return top_v - norm, top_i


def lm_head_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    id_offset: int,
    num_valid: int,
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probs (``[R, k]`` float32, descending) and ids (int64) of
    ``log_softmax(hidden @ weight.T)`` over the whole vocabulary.

    ``weight``: this rank's LM-head slice (``[V_local, H]``), whose first
    ``num_valid`` rows are the tokens ``id_offset ...``. ``gather(x)`` stacks
    ``x`` from every tensor-parallel rank along a new leading dim; ``None``
    means this rank holds the whole vocabulary.
    """
    rows = hidden.shape[0]
    cols = max(1, min(int(num_valid), weight.shape[0]))
    if gather is None and rows <= max(1, _CHUNK_ELEMS // cols) and k <= num_valid == cols:
        # One rank, one chunk, every column a real token: the same ops as the
        # general path below without its staging buffers.
        logits = torch.matmul(hidden.to(weight.dtype), weight[:cols].T).float()
        values, ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
        if id_offset:
            ids = ids + int(id_offset)
        return values - torch.logsumexp(logits, dim=-1, keepdim=True), ids
    local_v = torch.empty((rows, k), dtype=torch.float32, device=hidden.device)
    local_i = torch.empty((rows, k), dtype=torch.int64, device=hidden.device)
    local_lse = torch.empty((rows,), dtype=torch.float32, device=hidden.device)
    chunk = max(1, _CHUNK_ELEMS // cols)
    w = weight[:cols]
    for start in range(0, rows, chunk):
        end = min(rows, start + chunk)
        logits = torch.matmul(hidden[start:end].to(w.dtype), w.T).float()
        v, i, lse = local_vocab_topk(logits, k, id_offset, num_valid, stable=gather is not None)
        local_v[start:end], local_i[start:end], local_lse[start:end] = v, i, lse
    if gather is None:
        return local_v - local_lse.unsqueeze(1), local_i
    return merge_vocab_shards(gather(local_v), gather(local_i), gather(local_lse), k)



def leading_candidates(
    logprobs: torch.Tensor, ids: torch.Tensor, topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each depth's ``topk`` most likely candidates of wider, descending top-K buffers (a
    smaller tree's: its top-K is the wider one's first columns)."""
    if logprobs.shape[-1] > topk:
        return logprobs[..., :topk].contiguous(), ids[..., :topk].contiguous()
    return logprobs, ids


class DraftTopKHead:
    """``lm_head_topk`` of the draft block's depth rows, captured in the drafter's CUDA graph.

    Registered as a capture tail hook of the draft model runner: every captured batch size
    scores its block's rows ``1 .. block - 1`` (row 0 is the bonus token) into static
    buffers, so a replay leaves each depth's top-``topk`` log-probs and ids there. An eager
    draft forward (a batch larger than the graphs) does not run the hook: the worker reads
    the buffers only after a replay. Ops and chunking are ``lm_head_topk``'s, so a replay
    gives what the eager path gives; its transient logits live in the graph pool.
    """

    def __init__(self, *, weight, block_size: int, topk: int, id_offset: int, num_valid: int, max_bs: int):
        if block_size < 2:
            raise ValueError(f"a draft block has the bonus token and at least one depth, got {block_size}")
        self.weight = weight
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.id_offset = int(id_offset)
        self.num_valid = int(num_valid)
        rows = int(max_bs) * (self.block_size - 1)
        self.logprobs = torch.empty((rows, self.topk), dtype=torch.float32, device=weight.device)
        self.ids = torch.empty((rows, self.topk), dtype=torch.int64, device=weight.device)

    def __call__(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> None:
        del input_ids
        width = hidden_states.shape[-1]
        depth_rows = hidden_states.view(-1, self.block_size, width)[:, 1:, :].reshape(-1, width)
        logprobs, ids = lm_head_topk(depth_rows, self.weight, self.topk, self.id_offset, self.num_valid)
        rows = depth_rows.shape[0]
        self.logprobs[:rows].copy_(logprobs)
        self.ids[:rows].copy_(ids)

    def read(self, bs: int, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The last replay's ``[bs, block - 1, topk]`` log-probs and ids (``topk`` at most
        the head's: a smaller tree takes the leading, most likely, columns)."""
        if not 1 <= topk <= self.topk:
            raise ValueError(f"the draft head holds the top {self.topk}, asked for {topk}")
        rows = bs * (self.block_size - 1)
        logprobs = self.logprobs[:rows].view(bs, self.block_size - 1, self.topk)
        ids = self.ids[:rows].view(bs, self.block_size - 1, self.topk)
        return leading_candidates(logprobs, ids, topk)

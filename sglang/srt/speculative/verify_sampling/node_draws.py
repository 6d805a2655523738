# SPDX-License-Identifier: Apache-2.0
"""One target token per verified node, drawn by the server's own sampler.

Speculative acceptance is lossless when every emitted token is what the target would
have drawn for that context. Drawing one token at *every* node from the sampler's own
distribution, then walking from the root while the draw is one of the node's children
(the greedy walk, with draws in place of argmaxes), emits exactly the sequence the
target samples alone: the draw at an accepted node is the target's draw for that
node's context, and the first draw that leaves the tree is the step's last token.
Children are accepted with the target's probability of their tokens, as often as
any lossless rule allows for drafts that are deterministic given the context.

Unseeded rows are drawn by a fused Gumbel-max kernel (``gumbel_draw``) over the logits
scaled by the temperature, restricted to each row's top-k/top-p/min-p set by a per-row
logit floor (``sampling_filters``): an exact draw from the distribution the sampler draws
from (the backend's own filter order), with uniforms keyed by a seed from torch's CPU
generator, no device RNG state, no probabilities written and no host synchronisation.
Seeded rows (``--enable-deterministic-inference``) keep the sampler's own seeded path
(``Sampler._sample_from_probs``, after the same temperature and softmax as
``Sampler.forward``), each node drawn at its own position, so a seeded request emits the
same tokens with and without speculation. ``SGLANG_DDTREE_VERIFY_DRAW=sampler`` draws the
unseeded rows with the sampler's kernels too (FlashInfer's), for comparisons.

Rows are handled in chunks so the temporaries stay within a fixed workspace (reserved
when the KV pool is sized: ``workspace.py``).

A request's nodes are consecutive rows (row = request * nodes + node). The fused draw's kernels
read each request's own parameters at ``row // nodes``, so a sampled step copies none of them
per node (a launch each on a launch-bound step); the sampler's paths (``Sampler._sample_from_probs``)
read one row per node, so the parameters are repeated there only (``NodeSamplingInfo.per_row``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.speculative.verify_sampling.gumbel_draw import gumbel_draw
from sglang.srt.speculative.verify_sampling.sampling_filters import Candidates, FilterRule, logit_floors

#: Bytes per logit a chunk's draw may allocate besides the logits, by path: the fused
#: draw's floors take the candidates' top-k (their torch reference also scales the logits
#: once for the log-sum-exp; a row cut deeper than its candidates is sorted, in chunks of
#: its own: "sort"); the sampler's FlashInfer kernels
#: need the softmax's output and torch.multinomial's noise (plus the min-p path's two
#: renormalised copies); the pytorch backend sorts (values and int64 indices), takes a
#: cumulative sum and, seeded, float64 log-probs and hashed noise.
BYTES_PER_LOGIT = {"fused": 8, "sort": 48, "flashinfer": 16, "pytorch": 48}
DEFAULT_BYTES_PER_LOGIT = 48


@dataclass
class NodeSamplingInfo:
    """A batch's sampling parameters for its verified nodes: one entry per request, whose
    ``nodes`` rows are consecutive (row = request * nodes + node; ``nodes=1``: one per row, the
    layout ``Sampler._sample_from_probs`` reads)."""

    temperatures: torch.Tensor  # [requests, 1] float32
    top_ks: Optional[torch.Tensor]  # [requests] int32
    top_ps: Optional[torch.Tensor]  # [requests] float32
    min_ps: Optional[torch.Tensor]  # [requests] float32
    sampling_seed: Optional[torch.Tensor]  # [requests] int64
    need_top_k_sampling: bool
    need_top_p_sampling: bool
    need_min_p_sampling: bool
    nodes: int = 1

    @classmethod
    def for_nodes(cls, sampling_info: Any, nodes: int) -> "NodeSamplingInfo":
        """The batch's own tensors (no copy) for ``nodes`` rows per request: the fused draw's
        kernels index them per row, so a step launches nothing to spread them over nodes."""
        return cls(
            temperatures=sampling_info.temperatures.view(-1, 1),
            top_ks=sampling_info.top_ks,
            top_ps=sampling_info.top_ps,
            min_ps=sampling_info.min_ps,
            sampling_seed=sampling_info.sampling_seed,
            need_top_k_sampling=bool(sampling_info.need_top_k_sampling),
            need_top_p_sampling=bool(sampling_info.need_top_p_sampling),
            need_min_p_sampling=bool(sampling_info.need_min_p_sampling),
            nodes=nodes,
        )

    def per_row(self) -> "NodeSamplingInfo":
        """Each request's parameters repeated for each of its nodes (``nodes=1``): for the
        sampler's own paths, which read one row per node. A launch per tensor, so only they
        call it."""
        if self.nodes == 1:
            return self

        def rep(t):
            return None if t is None else torch.repeat_interleave(t, self.nodes, dim=0)

        return NodeSamplingInfo(
            temperatures=rep(self.temperatures),
            top_ks=rep(self.top_ks),
            top_ps=rep(self.top_ps),
            # Read by the sampler's paths only under need_min_p_sampling.
            min_ps=rep(self.min_ps) if self.need_min_p_sampling else None,
            sampling_seed=rep(self.sampling_seed),
            need_top_k_sampling=self.need_top_k_sampling,
            need_top_p_sampling=self.need_top_p_sampling,
            need_min_p_sampling=self.need_min_p_sampling,
        )

    @property
    def simple(self) -> bool:
        """No top-k, top-p or min-p anywhere in the batch: the sampler's plain draw."""
        return not (self.need_top_k_sampling or self.need_top_p_sampling or self.need_min_p_sampling)

    def rows(self, start: int, end: int) -> "NodeSamplingInfo":
        """Rows ``start:end`` of a per-row info (``per_row``)."""
        if self.nodes != 1:
            raise ValueError(f"rows() cuts one row per node; this info holds {self.nodes} rows per request")

        def cut(t):
            return None if t is None else t[start:end]

        return NodeSamplingInfo(
            cut(self.temperatures), cut(self.top_ks), cut(self.top_ps), cut(self.min_ps),
            cut(self.sampling_seed), self.need_top_k_sampling, self.need_top_p_sampling,
            self.need_min_p_sampling,
        )  # fmt: skip


def chunk_rows(vocab_size: int, workspace_bytes: int, path: Optional[str]) -> int:
    """Rows one chunk may cover so its temporaries fit the workspace (``path``: a key of
    ``BYTES_PER_LOGIT``, the sampling backend for the sampler's own kernels)."""
    per_row = vocab_size * BYTES_PER_LOGIT.get(path or "", DEFAULT_BYTES_PER_LOGIT)
    return max(1, int(workspace_bytes) // max(1, per_row))


@dataclass(frozen=True)
class FusedDraw:
    """How the fused draw cuts: the backend's filter rule, the candidates a row's floor is
    looked for among, the chunk sizes and whether the whole-row search splits rows
    (``SGLANG_DDTREE_FLOORS_SPLIT_ROWS``)."""

    rule: FilterRule
    candidates: Candidates
    max_rows: int
    max_sorted_rows: int
    split_rows: bool = True


def draw_node_tokens(
    probs_from_logits: torch.Tensor,
    info: NodeSamplingInfo,
    sample_from_probs,
    positions: torch.Tensor,
    max_rows: int,
    fused: Optional[FusedDraw] = None,
    seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[rows]`` int64 draws. ``probs_from_logits`` ``[rows, V]`` float32 holds the adjusted
    logits, ``info.nodes`` rows per request. With ``fused`` (or in the plain case) unseeded rows
    are drawn by the fused kernel, which only reads them; otherwise they are overwritten with
    the sampling probabilities (as ``Sampler.forward`` does) and
    ``sample_from_probs(probs, info, positions, simple)``, the sampler's draw, picks the tokens
    (with the parameters repeated per row). ``seed`` (``gumbel_draw``'s) keys the fused draw's
    uniforms; only the fused draw takes one."""
    if info.sampling_seed is None and (info.simple or fused is not None):
        if info.simple:
            return gumbel_draw(probs_from_logits, info.temperatures, nodes=info.nodes, seed=seed)
        return _fused_filtered_draw(probs_from_logits, info, fused, seed)
    if seed is not None:
        raise ValueError("a seed tensor keys the fused draw only; this batch takes the sampler's path")
    info = info.per_row()
    rows = probs_from_logits.shape[0]
    out = torch.empty((rows,), dtype=torch.int64, device=probs_from_logits.device)
    for start in range(0, rows, max_rows):
        end = min(rows, start + max_rows)
        x = probs_from_logits[start:end]
        part = info.rows(start, end)
        x.div_(part.temperatures)
        x[:] = torch.softmax(x, dim=-1)
        out[start:end] = sample_from_probs(x, part, positions[start:end], info.simple).view(-1)
    return out


def _fused_filtered_draw(
    logits: torch.Tensor, info: NodeSamplingInfo, fused: FusedDraw, seed: Optional[torch.Tensor] = None
) -> torch.Tensor:
    rows = logits.shape[0]

    def floors_of(start: int, end: int) -> torch.Tensor:
        # A chunk may start inside a request: the kernels find each row's request from its
        # global row.
        return logit_floors(
            logits[start:end],
            info.temperatures,
            info.top_ks if info.need_top_k_sampling else None,
            info.top_ps if info.need_top_p_sampling else None,
            info.min_ps if info.need_min_p_sampling else None,
            fused.rule,
            fused.candidates,
            max_sorted_rows=fused.max_sorted_rows,
            split_rows=fused.split_rows,
            nodes=info.nodes,
            first_row=start,
        )

    if rows <= fused.max_rows:
        floors = floors_of(0, rows)
    else:
        floors = torch.empty((rows,), dtype=torch.float32, device=logits.device)
        for start in range(0, rows, fused.max_rows):
            end = min(rows, start + fused.max_rows)
            floors[start:end] = floors_of(start, end)
    return gumbel_draw(logits, info.temperatures, floors, nodes=info.nodes, seed=seed)

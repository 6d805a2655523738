# SPDX-License-Identifier: Apache-2.0
"""Where each row's top-k, top-p and min-p cut the vocabulary, as one logit value.

Each filter keeps an upper set of the row's distribution (the most likely tokens down to
some probability), so together they keep every token whose logit is at least a per-row
*floor*: the smallest logit that survives all three. A Gumbel-max draw over the logits at
or above the floor (``gumbel_draw``) is then an exact draw from the filtered, renormalised
distribution, with no probabilities materialised, no device RNG state and no host sync.

The filters follow SGLang's sampler on the configured backend:

- top-k keeps a token when fewer than ``k`` tokens are more likely (ties at the k-th
  probability all stay, as in FlashInfer's kernels);
- top-p keeps a token when the mass of the strictly more likely tokens is below ``top_p``
  (the pytorch backend: at most ``top_p``), measured on the original distribution
  (``filter_apply_order="joint"``) — except on FlashInfer with min-p in the batch, where the
  sampler renormalises the top-k set first and top-p measures that renormalised mass;
- min-p keeps a token at least ``min_p`` times as likely as the most likely one.

The floor is found among the row's largest logits (``torch.topk``, as many as the batch's
largest top-k: ``Candidates``); where a row filters by top-p or min-p without a top-k, more
candidates are taken and a row whose cut is not decided among them is recomputed from its
fully sorted row (the only case that synchronises with the host).
``filtered_probs_reference`` beside it builds the filtered distribution itself, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

#: Candidates a row without top-k is cut within before it falls back to a full sort.
TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class FilterRule:
    """How the configured sampling backend combines the filters."""

    top_p_inclusive: bool  # pytorch: keep while the mass before is <= top_p; FlashInfer: <
    top_p_of_top_k_mass: bool  # FlashInfer's min-p path: top-p on the renormalised top-k set

    @classmethod
    def for_backend(cls, backend: Optional[str], need_min_p: bool) -> "FilterRule":
        flashinfer = backend == "flashinfer"
        return cls(top_p_inclusive=not flashinfer, top_p_of_top_k_mass=flashinfer and need_min_p)


@dataclass(frozen=True)
class Candidates:
    """How many of a row's largest logits its floor is looked for among, and whether a row
    may cut deeper (top-p or min-p without a top-k): then undecided rows are sorted."""

    k: int
    deep: bool

    @classmethod
    def for_requests(
        cls, top_ks: Iterable[int], top_ps: Iterable[float], min_ps: Iterable[float], vocab: int
    ) -> "Candidates":
        """From the requests' parameters on the host, so it costs no sync."""
        bound, deep = 1, False
        for k, p, m in zip(top_ks, top_ps, min_ps):
            if 0 < k < vocab:
                bound = max(bound, k)
            elif p < 1.0 or m > 0.0:
                bound, deep = max(bound, TOP_P_CANDIDATES), True
        return cls(min(bound, vocab), deep and bound < vocab)


def logit_floors(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor],
    top_ps: Optional[torch.Tensor],
    min_ps: Optional[torch.Tensor],
    rule: FilterRule,
    candidates: Candidates,
    max_sorted_rows: Optional[int] = None,
) -> torch.Tensor:
    """``[rows]`` float32: each row's smallest kept logit (``-inf`` where nothing is cut).

    ``logits`` ``[rows, V]`` float32 (read only), ``temperatures`` ``[rows, 1]``;
    ``top_ks`` int ``[rows]`` (``>= V``: none), ``top_ps`` / ``min_ps`` float ``[rows]``, each
    None when no row uses it. Rows that need a full sort are sorted ``max_sorted_rows`` at a
    time (default: all at once)."""
    rows, vocab = logits.shape
    k = max(1, min(int(candidates.k), vocab))
    floors, decided = _floors_among(logits, temperatures, top_ks, top_ps, min_ps, rule, k)
    if candidates.deep and k < vocab:
        redo = torch.nonzero(~decided).view(-1)
        step = max(1, int(max_sorted_rows or rows))
        for start in range(0, redo.numel(), step):  # a host sync, only where a row cut deeper
            idx = redo[start : start + step]
            sub = lambda t: None if t is None else t[idx]  # noqa: E731
            floors[idx], _ = _floors_among(
                logits[idx], temperatures[idx], sub(top_ks), sub(top_ps), sub(min_ps), rule, vocab
            )
    return floors


def _floors_among(logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, k: int):
    """Floors from each row's ``k`` largest logits, and whether the candidates decided them."""
    rows, vocab = logits.shape
    dev = logits.device
    if k < vocab:
        vals = torch.topk(logits, k, dim=-1, sorted=True).values
    else:
        vals = logits.sort(dim=-1, descending=True).values
    t = temperatures.view(rows, 1)
    lse = torch.logsumexp(logits / t, dim=-1, keepdim=True)
    p = torch.exp(vals / t - lse)  # [rows, k]: the candidates' probabilities, descending
    rank = torch.arange(k, device=dev).view(1, k)
    keep = torch.ones_like(p, dtype=torch.bool)
    active = torch.zeros(rows, dtype=torch.bool, device=dev)
    top_k_mass = torch.ones(rows, 1, dtype=p.dtype, device=dev)
    bounded = torch.zeros(rows, dtype=torch.bool, device=dev)  # a top-k within the candidates
    mass_unknown = torch.zeros(rows, dtype=torch.bool, device=dev)  # a top-k beyond them
    if top_ks is not None:
        kk = top_ks.view(rows, 1).to(torch.int64)
        active |= (kk < vocab).view(-1)
        bounded = (kk <= k).view(-1)
        # Fewer than k tokens strictly more likely: every candidate >= the k-th largest value.
        kth = vals.gather(1, kk.clamp(1, k) - 1)
        keep &= (rank < kk) | (vals >= kth)
        if rule.top_p_of_top_k_mass:
            # The top-k set's mass: the candidates above the k-th value, and every token tied
            # with it (a tie may run past the candidates).
            ties = (logits == kth).sum(-1, keepdim=True)
            p_kth = torch.exp(kth / t - lse)
            mass = torch.where(vals > kth, p, 0.0).sum(-1, keepdim=True) + ties * p_kth
            top_k_mass = torch.where(kk < vocab, mass, top_k_mass)
            mass_unknown = ((kk < vocab) & (kk > k)).view(-1)
    if top_ps is not None:
        tp = top_ps.view(rows, 1).to(p.dtype)
        on = tp < 1.0
        active |= on.view(-1)
        if rule.top_p_of_top_k_mass:
            tp = tp * top_k_mass
        # The mass of the strictly more likely tokens; a tie's later members follow its first
        # through the floor.
        before = torch.cumsum(p, dim=-1) - p
        keep &= ~on | ((before <= tp) if rule.top_p_inclusive else (before < tp))
    if min_ps is not None:
        mp = min_ps.view(rows, 1).to(p.dtype)
        active |= (mp > 0).view(-1)
        keep &= p >= mp * p[:, :1]
    kept = keep.to(torch.int32).cumprod(dim=-1).sum(-1).clamp(min=1)  # a prefix of the sorted row
    floors = vals.gather(1, (kept - 1).to(torch.int64).view(rows, 1)).view(-1)
    floors = torch.where(active, floors, torch.full_like(floors, float("-inf")))
    if k == vocab:
        return floors, torch.ones_like(active)
    return floors, ~active | bounded | ((kept < k) & ~mass_unknown)


def filtered_probs_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor],
    top_ps: Optional[torch.Tensor],
    min_ps: Optional[torch.Tensor],
    rule: FilterRule,
) -> torch.Tensor:
    """``[rows, V]`` float64: the distribution the filtered draw samples, from the definitions
    token by token (strictly more likely tokens counted and summed per token, ties included)."""
    rows, vocab = logits.shape
    out = torch.zeros(rows, vocab, dtype=torch.float64)
    for r in range(rows):
        z = logits[r].double()
        p = torch.softmax(z / float(temperatures.view(-1)[r]), dim=-1)
        greater = z.view(1, -1) > z.view(-1, 1)  # [i, j]: token j strictly more likely than i
        keep = torch.ones(vocab, dtype=torch.bool)
        if top_ks is not None and int(top_ks[r]) < vocab:
            keep &= greater.sum(-1) < int(top_ks[r])
        if top_ps is not None and float(top_ps[r]) < 1.0:
            limit = float(top_ps[r])
            if rule.top_p_of_top_k_mass:
                limit *= float(p[keep].sum())
            mass_above = (greater.double() * p.view(1, -1)).sum(-1)
            keep &= (mass_above <= limit) if rule.top_p_inclusive else (mass_above < limit)
        if min_ps is not None and float(min_ps[r]) > 0.0:
            keep &= p >= float(min_ps[r]) * p.max()
        out[r, keep] = p[keep] / p[keep].sum()
    return out

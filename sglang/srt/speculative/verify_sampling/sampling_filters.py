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
candidates are taken. From the candidates, one Triton launch per chunk of rows (a program per
row: the row's log-sum-exp in one pass over the vocabulary, then the three filters over the
candidates) gives the floors; ``floors_among_reference`` is the same computation in torch. A
row whose cut lies beyond its candidates is then found by a search over the whole row
(``_whole_row_floors_kernel``, one launch for every row, the decided ones leave at once, no host
sync): every filter keeps a logit if it keeps every larger one, so the floor is a threshold
on the logits, found 16-way over the ordered float32 bit patterns, nine passes of the row. While
the rows are too few to fill the GPU one program each, every row is split over several
programs (``_split_row_floors_triton``: a launch per pass, partials summed by the next launch in a
fixed order; ``row_slices`` chooses from the shapes). The torch path sorts such rows instead
(``floors_among_reference`` over the whole row, with a host sync).
``filtered_probs_reference`` builds the filtered distribution itself, token by token, for
tests.

The parameters are the requests' own, ``nodes`` consecutive rows per request: the kernels read
request ``(first_row + row) // nodes`` in place (``first_row``: where a chunk of rows starts in
the batch), so a step copies no parameter per node; the torch paths gather them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import triton
import triton.language as tl

# The smallest positive normal float32 (the Gumbel draw's clamp): here the floor of a row's
# sum of exponentials.
from sglang.srt.speculative.verify_sampling.gumbel_draw import _TINY, _TINY_C, request_rows

#: Candidates a row without top-k is cut within before it falls back to a full sort.
TOP_P_CANDIDATES = 1024
#: The most candidates the kernel holds per row; more (a full sort) take the torch path.
KERNEL_CANDIDATES = 4096


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
    *,
    nodes: int = 1,
    first_row: int = 0,
    split_rows: bool = True,
) -> torch.Tensor:
    """``[rows]`` float32: each row's smallest kept logit (``-inf`` where nothing is cut).

    ``logits`` ``[rows, V]`` float32 (read only). The parameters are per request, row ``r``
    being request ``(first_row + r) // nodes``'s (``nodes=1``, ``first_row=0``: one per row):
    ``temperatures`` ``[requests, 1]``; ``top_ks`` int ``[requests]`` (``>= V``: none),
    ``top_ps`` / ``min_ps`` float ``[requests]``, each None when no row uses it. A row the
    candidates leave undecided is searched over its whole vocabulary by
    ``_whole_row_floors_kernel`` on the GPU (``split_rows``: each row over several programs
    while the rows are few, ``row_slices``); the torch path sorts such rows,
    ``max_sorted_rows`` at a time (default: all at once)."""
    rows, vocab = logits.shape
    at = dict(nodes=nodes, first_row=first_row)
    k = max(1, min(int(candidates.k), vocab))
    use_kernel = k <= KERNEL_CANDIDATES and (logits.is_cuda or _interpreted())
    floors_among = _floors_among_triton if use_kernel else floors_among_reference
    floors, decided = floors_among(logits, temperatures, top_ks, top_ps, min_ps, rule, k, **at)
    if candidates.deep and k < vocab and use_kernel:
        _whole_row_floors_triton(logits, temperatures, top_ks, top_ps, min_ps, rule, floors, decided,
                                 slices=None if split_rows else 1, **at)  # fmt: skip
    elif candidates.deep and k < vocab:
        redo = torch.nonzero(~decided).view(-1)
        step = max(1, int(max_sorted_rows or rows))
        for start in range(0, redo.numel(), step):  # a host sync, only where a row cut deeper
            idx = redo[start : start + step]
            req = (first_row + idx) // nodes
            sub = lambda t: None if t is None else t[req]  # noqa: E731
            floors[idx], _ = floors_among_reference(
                logits[idx], temperatures[req], sub(top_ks), sub(top_ps), sub(min_ps), rule, vocab
            )
    return floors


def _check_requests(rows: int, nodes: int, first_row: int, *params: Optional[torch.Tensor]) -> None:
    """Every request the rows read has its parameters (the kernels do not bound the index)."""
    if nodes < 1 or first_row < 0:
        raise ValueError(f"nodes must be >= 1 and first_row >= 0, got {nodes}, {first_row}")
    need = (first_row + rows - 1) // nodes + 1 if rows else 0
    for t in params:
        if t is not None and t.shape[0] < need:
            raise ValueError(f"rows {first_row}..{first_row + rows} of {nodes} per request read {need} "
                             f"requests' parameters, got {tuple(t.shape)}")  # fmt: skip


def _largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest logits, descending (the whole row sorted when ``k`` is all)."""
    if k < logits.shape[1]:
        return torch.topk(logits, k, dim=-1, sorted=True).values
    return logits.sort(dim=-1, descending=True).values


def floors_among_reference(
    logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, k: int, *, nodes: int = 1, first_row: int = 0
):
    """Floors from each row's ``k`` largest logits, and whether the candidates decided them
    (a row cut no deeper than the candidates, or bounded by its top-k). Per-request parameters
    as ``logit_floors`` takes them, gathered per row here."""
    rows, vocab = logits.shape
    dev = logits.device
    _check_requests(rows, nodes, first_row, temperatures, top_ks, top_ps, min_ps)
    temperatures, top_ks, top_ps, min_ps = (
        request_rows(t, rows, nodes, first_row) for t in (temperatures, top_ks, top_ps, min_ps)
    )
    vals = _largest(logits, k)
    t = temperatures.view(rows, 1)
    # A row of -inf has probabilities 0 (not NaN), as in the kernel.
    lse = torch.logsumexp(logits / t, dim=-1, keepdim=True).clamp(min=math.log(_TINY))
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


#: How far from a top-p or min-p cut, in float64, a token may be for two float32 floors to
#: disagree about it by rounding: a top-p cut sums up to a vocabulary of float32
#: probabilities, in an order each implementation chooses.
CUT_ROUNDING = 1e-5


def floors_differ(a, b, logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, tol: float = CUT_ROUNDING):
    """``[rows]`` bool: where floors ``a`` and ``b`` keep different tokens that are not all
    at a top-p or min-p cut within ``tol`` in float64. Two float32 implementations of the
    same filters (the whole-row search, a sort, the sampler's own kernels) agree everywhere
    else; at a cut neither is exact."""
    out = torch.zeros(a.shape[0], dtype=torch.bool)
    for r in torch.nonzero(a != b).view(-1).tolist():
        x = logits[r].double()
        lo, hi = sorted((float(a[r]), float(b[r])))
        between = (x >= lo) & (x < hi)  # kept by one floor only
        if top_ks is not None and int((x >= hi).sum()) >= int(top_ks[r]):
            out[r] = True  # the top-k alone decides: counts do not round
            continue
        p = torch.softmax(x / float(temperatures.view(-1)[r]), dim=-1)
        at_cut = torch.zeros_like(between)
        if top_ps is not None and float(top_ps[r]) < 1.0:
            limit = float(top_ps[r])
            if rule.top_p_of_top_k_mass and top_ks is not None and int(top_ks[r]) < x.numel():
                kth = torch.topk(x, int(top_ks[r])).values[-1]
                limit *= float(p[x >= kth].sum())
            sorted_x, order = torch.sort(x, descending=True)
            above = torch.cumsum(p[order], 0) - p[order]
            # Ties: each member's mass is that of the strictly larger logits.
            first = torch.searchsorted(-sorted_x, -sorted_x, side="left")
            mass_above = torch.empty_like(p)
            mass_above[order] = above[first]
            at_cut |= (mass_above - limit).abs() <= tol
        if min_ps is not None and float(min_ps[r]) > 0:
            at_cut |= (p / p.max() - float(min_ps[r])).abs() <= tol * float(min_ps[r])
        out[r] = bool((between & ~at_cut).any())
    return out


def _interpreted() -> bool:
    return type(_floors_kernel).__name__ == "InterpretedFunction"


#: Vocabulary elements per loop step of the log-sum-exp pass.
_BLOCK_V = 2048


def _filter_params(top_ks, top_ps, min_ps, unused: torch.Tensor) -> tuple:
    """The filters' parameter pointers; ``unused`` stands in for a filter that is off (never read)."""
    return tuple(unused if t is None else t for t in (top_ks, top_ps, min_ps))


def _filter_flags(top_ks, top_ps, min_ps, rule: FilterRule) -> dict:
    """The kernels' compile-time switches for the filters in use and the backend's rule."""
    return dict(
        HAS_TOP_K=top_ks is not None,
        HAS_TOP_P=top_ps is not None,
        HAS_MIN_P=min_ps is not None,
        TOP_P_INCLUSIVE=rule.top_p_inclusive,
        TOP_P_OF_TOP_K_MASS=rule.top_p_of_top_k_mass,
    )


def _floors_among_triton(
    logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, k: int, *, nodes: int = 1, first_row: int = 0
):
    rows, vocab = logits.shape
    _check_requests(rows, nodes, first_row, temperatures, top_ks, top_ps, min_ps)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    vals = _largest(logits, k)
    floors = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    decided = torch.empty((rows,), dtype=torch.bool, device=logits.device)
    if rows == 0:
        return floors, decided
    _floors_kernel[(rows,)](
        logits,
        logits.stride(0),
        vals,
        vals.stride(0),
        temperatures,
        temperatures.stride(0),
        *_filter_params(top_ks, top_ps, min_ps, unused=floors),
        floors,
        decided,
        vocab,
        k,
        nodes,
        first_row,
        **_filter_flags(top_ks, top_ps, min_ps, rule),
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return floors, decided


@triton.jit(do_not_specialize=["nodes", "first_row"])
def _floors_kernel(
    logits_ptr,
    stride_logits,
    vals_ptr,
    stride_vals,
    temp_ptr,  # the parameters per request: row r reads request (first_row + r) // nodes
    stride_temp,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    floor_ptr,
    decided_ptr,
    vocab,
    k,
    nodes,
    first_row,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr,
    TOP_P_OF_TOP_K_MASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    req = (first_row + row) // nodes
    offs = tl.arange(0, BLOCK_K)
    live = offs < k
    v = tl.load(vals_ptr + row * stride_vals + offs, mask=live, other=float("-inf"))
    inv_t = 1.0 / tl.load(temp_ptr + req * stride_temp)
    if HAS_TOP_K:
        kk = tl.load(top_k_ptr + req).to(tl.int64)
        kth = tl.sum(tl.where(offs == tl.minimum(tl.maximum(kk, 1), k) - 1, v, 0.0))
    else:
        kk = vocab
        kth = float("-inf")
    # The row's log-sum-exp of logits / T in one pass (and, for the top-k set's mass, the
    # tokens tied with the k-th value: a tie may run past the candidates).
    top = tl.max(v) * inv_t
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: no NaN from -inf - -inf
    acc = tl.zeros((BLOCK_V,), tl.float32)
    ties = tl.zeros((BLOCK_V,), tl.int32)
    row_ptr = logits_ptr + row * stride_logits
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        acc += tl.exp(x * inv_t - top)
        if TOP_P_OF_TOP_K_MASS:
            ties += (x == kth).to(tl.int32)
    lse = top + tl.log(tl.maximum(tl.sum(acc), _TINY_C))  # a row of -inf: probabilities 0
    p = tl.where(live, tl.exp(v * inv_t - lse), 0.0)
    keep = live
    active = kk < vocab
    bounded = kk <= k
    mass_unknown = False
    limit_scale = 1.0
    if HAS_TOP_K:
        keep = keep & ((offs < kk) | (v >= kth))
        if TOP_P_OF_TOP_K_MASS:
            mass = tl.sum(tl.where(v > kth, p, 0.0)) + tl.sum(ties).to(tl.float32) * tl.exp(kth * inv_t - lse)
            limit_scale = tl.where(active, mass, 1.0)
            mass_unknown = active & (kk > k)
    if HAS_TOP_P:
        tp = tl.load(top_p_ptr + req)
        on = tp < 1.0
        active = active | on
        before = tl.cumsum(p, 0) - p
        limit = tl.where(on, tp * limit_scale, float("inf"))  # top_p 1: no cut
        if TOP_P_INCLUSIVE:
            keep = keep & (before <= limit)
        else:
            keep = keep & (before < limit)
    if HAS_MIN_P:
        mp = tl.load(min_p_ptr + req)
        active = active | (mp > 0.0)
        keep = keep & (p >= mp * tl.max(p))
    # The filters keep a prefix of the sorted candidates: its length, at least one.
    kept = tl.maximum(tl.min(tl.where(keep, BLOCK_K, offs)), 1)
    kept = tl.minimum(kept, k)
    floor = tl.sum(tl.where(offs == kept - 1, v, 0.0))
    floor = tl.where(active, floor, float("-inf"))
    decided = (active == 0) | bounded | ((kept < k) & (mass_unknown == 0)) | (k == vocab)
    tl.store(floor_ptr + row, floor)
    tl.store(decided_ptr + row, decided)


#: Thresholds one pass of the whole-row search tests; nine passes narrow 2**32 keys to one.
_SPLIT = 16
_SEARCH_PASSES = 9
#: Vocabulary elements per loop step of the whole-row search (a [block, SPLIT] tile per step):
#: 1,024 with 8 warps was the fastest tile from 17 to 1,088 rows of 152k logits on an H100
#: (docs/benchmarks.md, 2026-12-06).
_SEARCH_BLOCK_V = 1024
_SEARCH_WARPS = 8
#: The split-row search (``_split_row_floors_triton``): programs per SM it aims for, the
#: fewest and most slices a row is split into below the rows per SM from which one program per
#: row takes over, the fewest search tiles a slice of a row spans, and the SMs counted without
#: a CUDA device (an H100's; the interpreter). On an H100 (152k logits, 2026-12-06) 16 slices
#: were the fastest at 17 and 65 rows (2.8x to 6.3x one program per row), 8 at 272 and 1,088
#: (1.9x to 2.3x and 1.1x to 1.65x): about half the rows are decided and leave at once, so the
#: rows alone fill the GPU only well past two per SM.
_SLICE_PROGRAMS_PER_SM = 16
_MIN_SLICES = 8
_MAX_SLICES = 16
_SINGLE_PROGRAM_ROWS_PER_SM = 16
_SLICE_MIN_TILES = 4
_HOST_SMS = 132


def _whole_row_floors_triton(
    logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, floors, decided, *, nodes: int = 1,
    first_row: int = 0, slices: Optional[int] = None, block_v: Optional[int] = None,
) -> None:  # fmt: skip
    """The floors of the rows ``decided`` says are not, searched over their whole row, in place
    (per-request parameters as ``logit_floors`` takes them). Each row is split over ``slices``
    programs (default ``row_slices``: 1, one program per row, once the rows fill the GPU);
    ``block_v``: the logits a program reads per loop step (default ``_SEARCH_BLOCK_V``)."""
    rows, vocab = logits.shape
    _check_requests(rows, nodes, first_row, temperatures, top_ks, top_ps, min_ps)
    if rows == 0:
        return
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v = min(block_v or _SEARCH_BLOCK_V, triton.next_power_of_2(vocab))
    if slices is None:
        slices = row_slices(rows, vocab, logits.device, block_v)
    if slices > 1:
        _split_row_floors_triton(logits, temperatures, top_ks, top_ps, min_ps, rule, floors, decided, slices, block_v,
                                 nodes, first_row)  # fmt: skip
        return
    _whole_row_floors_kernel[(rows,)](
        logits,
        logits.stride(0),
        temperatures,
        temperatures.stride(0),
        *_filter_params(top_ks, top_ps, min_ps, unused=floors),
        floors,
        decided,
        vocab,
        nodes,
        first_row,
        **_filter_flags(top_ks, top_ps, min_ps, rule),
        SPLIT=_SPLIT,
        PASSES=_SEARCH_PASSES,
        BLOCK_V=block_v,
        num_warps=_SEARCH_WARPS,
    )


@triton.jit
def _order_key(x):
    """float32 -> int32 in the same order (its own inverse on the bit pattern)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _first_kept_key(
    row_ptr, vocab, span, inv_t, lse, top_logit, kk, limit, min_prob,
    TOP_P_INCLUSIVE: tl.constexpr, SPLIT: tl.constexpr, PASSES: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The smallest float32 key whose value the filters keep: fewer than ``kk`` logits strictly
    above it, their probability mass below ``limit`` (at most, inclusive), its probability at
    least ``min_prob``. Each of these holds for every larger value too, so the keys from
    -inf (not kept) to the row's largest logit (kept) are searched SPLIT-way, one pass over the
    row per step."""
    lo = _order_key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)
    hi = _order_key(top_logit).to(tl.int64)
    lane = tl.arange(0, SPLIT)
    for _ in range(PASSES):
        keys = lo + ((hi - lo) * lane) // SPLIT
        at = _key_value(keys.to(tl.int32))
        mass = tl.zeros((SPLIT,), tl.float32)  # of the logits strictly above each key
        count = tl.zeros((SPLIT,), tl.int32)
        for start in range(0, tl.where(hi - lo > 1, span, 0), BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
            p = tl.exp(x * inv_t - lse)
            above = x[:, None] > at[None, :]
            mass += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
            count += tl.sum(above.to(tl.int32), axis=0)
        if TOP_P_INCLUSIVE:
            keep = mass <= limit
        else:
            keep = mass < limit
        # (keys near -inf would overflow x / T: their probability is 0 either way)
        prob_at = tl.exp(tl.maximum(at, -1e30) * inv_t - lse)
        keep = keep & (count < kk) & (prob_at >= min_prob) & (lane > 0)
        first = tl.min(tl.where(keep, lane, SPLIT))
        last = tl.sum(tl.where(lane == SPLIT - 1, keys, 0))
        new_lo = tl.where(first == SPLIT, last, tl.sum(tl.where(lane == first - 1, keys, 0)))
        new_hi = tl.where(first == SPLIT, hi, tl.sum(tl.where(lane == first, keys, 0)))
        # Once hi is lo's successor the search is done: a pass then reads no logit, and its
        # empty counts must not move hi down onto lo (a key the filters cut).
        searching = hi - lo > 1
        lo = tl.where(searching, new_lo, lo)
        hi = tl.where(searching, new_hi, hi)
    return hi


@triton.jit(do_not_specialize=["nodes", "first_row"])
def _whole_row_floors_kernel(
    logits_ptr,
    stride_logits,
    temp_ptr,  # the parameters per request: row r reads request (first_row + r) // nodes
    stride_temp,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    floor_ptr,
    decided_ptr,
    vocab,
    nodes,
    first_row,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr,
    TOP_P_OF_TOP_K_MASS: tl.constexpr,
    SPLIT: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # The floor is the smallest logit every filter keeps (``_first_kept_key``), as in
    # ``floors_among_reference`` over the whole row.
    row = tl.program_id(0).to(tl.int64)
    req = (first_row + row) // nodes
    todo = tl.load(decided_ptr + row).to(tl.int32) == 0
    span = tl.where(todo, vocab, 0)  # a decided row runs no pass
    row_ptr = logits_ptr + row * stride_logits
    inv_t = 1.0 / tl.load(temp_ptr + req * stride_temp)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    for start in range(0, span, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        best = tl.maximum(best, tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")))
    top_logit = tl.max(best)
    top = top_logit * inv_t
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: no NaN from -inf - -inf
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, span, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        acc += tl.exp(x * inv_t - top)
    lse = top + tl.log(tl.maximum(tl.sum(acc), _TINY_C))
    if HAS_TOP_K:
        kk = tl.minimum(tl.maximum(tl.load(top_k_ptr + req).to(tl.int64), 1), vocab).to(tl.int32)
    else:
        kk = vocab
    limit = float("inf")
    if HAS_TOP_P:
        tp = tl.load(top_p_ptr + req)
        scale = 1.0
        if HAS_TOP_K and TOP_P_OF_TOP_K_MASS:
            # FlashInfer's min-p path: top-p of the renormalised top-k set, whose mass is that
            # of every logit at or above the k-th largest (ties included).
            kth = _key_value(_first_kept_key(row_ptr, vocab, tl.where(kk < vocab, span, 0), inv_t, lse, top_logit,
                                             kk, float("inf"), 0.0, TOP_P_INCLUSIVE, SPLIT, PASSES,
                                             BLOCK_V).to(tl.int32))
            mass = tl.zeros((BLOCK_V,), tl.float32)
            for start in range(0, tl.where(kk < vocab, span, 0), BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                mass += tl.where(x >= kth, tl.exp(x * inv_t - lse), 0.0)
            scale = tl.where(kk < vocab, tl.sum(mass), 1.0)
        limit = tl.where(tp < 1.0, tp * scale, float("inf"))  # top_p 1: no cut
    if HAS_MIN_P:
        min_prob = tl.load(min_p_ptr + req) * tl.exp(top_logit * inv_t - lse)
    else:
        min_prob = 0.0
    hi = _first_kept_key(row_ptr, vocab, span, inv_t, lse, top_logit, kk, limit, min_prob, TOP_P_INCLUSIVE, SPLIT,
                         PASSES, BLOCK_V)
    # The floor: the smallest logit at or above the first kept key.
    at_hi = _key_value(hi.to(tl.int32))
    low = tl.full((BLOCK_V,), float("inf"), tl.float32)
    for start in range(0, span, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("inf"))
        low = tl.minimum(low, tl.where(x >= at_hi, x, float("inf")))
    tl.store(floor_ptr + row, tl.min(low), mask=todo)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _HOST_SMS


def row_slices(rows: int, vocab: int, device, block_v: int = _SEARCH_BLOCK_V) -> int:
    """How many programs the whole-row search splits each row over: 1 once the rows alone fill
    the GPU, else about ``_SLICE_PROGRAMS_PER_SM`` programs per SM within ``_MIN_SLICES`` to
    ``_MAX_SLICES``, each slice at least ``_SLICE_MIN_TILES`` tiles of ``block_v`` logits. From
    shapes only (the undecided rows are not counted: that would be a host sync)."""
    sms = _sm_count(torch.device(device))
    if rows >= _SINGLE_PROGRAM_ROWS_PER_SM * sms:
        return 1
    tiles = triton.cdiv(vocab, min(block_v, triton.next_power_of_2(vocab)))
    aim = min(max(triton.cdiv(_SLICE_PROGRAMS_PER_SM * sms, max(rows, 1)), _MIN_SLICES), _MAX_SLICES)
    return max(1, min(aim, tiles // _SLICE_MIN_TILES))


def _slice_width(vocab: int, slices: int) -> int:
    """Logits per slice of a split row, a multiple of 16 (the last slices may hold fewer, or none)."""
    return triton.cdiv(triton.cdiv(vocab, slices), 16) * 16


def _split_row_floors_triton(
    logits, temperatures, top_ks, top_ps, min_ps, rule: FilterRule, floors, decided, slices: int, block_v: int,
    nodes: int, first_row: int,
) -> None:  # fmt: skip
    """The whole-row search with each row split over ``slices`` programs, for batches too small
    to fill the GPU with one program per row (each streaming its whole row a dozen times). Each
    pass of ``_whole_row_floors_kernel`` becomes a launch over ``(rows, slices)`` whose programs
    write their slice's partials (maximum and sum of exponentials; mass and count above the 16
    keys; the top-k set's mass; the smallest logit kept) to a workspace. The next launch's
    programs each sum their row's partials over the same reduction tree and narrow the keys
    (each pass's recorded by the row's first program) as ``_first_kept_key`` does, so all
    programs of a row agree; a launch never reads what it writes. No atomics (the floors are the
    same run to run), no host sync, buffers by shape only; programs of decided rows leave at
    once. Launches: the log-sum-exp, 9 search passes (on FlashInfer's min-p path 9 more and the
    top-k mass before them), the floors' partials, the floors."""
    rows, vocab = logits.shape
    dev = logits.device
    width = _slice_width(vocab, slices)
    kth_search = top_ks is not None and top_ps is not None and rule.top_p_of_top_k_mass
    passes = _SEARCH_PASSES * (2 if kth_search else 1)
    stats = torch.empty((rows, slices, 2), dtype=torch.float32, device=dev)  # maximum, sum of exponentials
    bounds = torch.empty((rows, passes, 2), dtype=torch.int64, device=dev)  # each pass's (lo, hi)
    mass = torch.empty((rows, passes, slices, _SPLIT), dtype=torch.float32, device=dev)
    count = torch.empty((rows, passes, slices, _SPLIT), dtype=torch.int32, device=dev)
    top_k_mass = torch.empty((rows, slices), dtype=torch.float32, device=dev)
    low = torch.empty((rows, slices), dtype=torch.float32, device=dev)
    args = (
        logits, logits.stride(0), temperatures, temperatures.stride(0),
        *_filter_params(top_ks, top_ps, min_ps, unused=floors),
        decided, stats, bounds, mass, count, top_k_mass, low, vocab, width, slices, passes, nodes, first_row,
    )  # fmt: skip
    flags = dict(
        **_filter_flags(top_ks, top_ps, min_ps, rule),
        SPLIT=_SPLIT,
        BLOCK_V=min(block_v, triton.next_power_of_2(width)),
        BLOCK_S=triton.next_power_of_2(slices),
        num_warps=_SEARCH_WARPS,
    )
    grid = (rows, slices)
    _slice_lse_kernel[grid](*args, 0, **flags)
    first_step = 0
    if kth_search:  # the k-th largest logit, then the top-k set's mass
        for step in range(_SEARCH_PASSES):
            _slice_search_kernel[grid](*args, step, 0, KTH=True, **flags)
        _slice_top_k_mass_kernel[grid](*args, _SEARCH_PASSES - 1, **flags)
        first_step = _SEARCH_PASSES
    for step in range(first_step, passes):
        _slice_search_kernel[grid](*args, step, first_step, KTH=False, **flags)
    _slice_low_kernel[grid](*args, passes - 1, **flags)
    _split_floors_kernel[(rows,)](decided, low, floors, slices, BLOCK_S=triton.next_power_of_2(slices))


@triton.jit
def _slice_program(decided_ptr, temp_ptr, stride_temp, vocab, width, nodes, first_row):
    """This program's row, slice, request, whether the row is searched, 1 / T, and its slice's
    logits ``[begin, end)`` (none for a decided row)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    req = (first_row + row) // nodes
    todo = tl.load(decided_ptr + row).to(tl.int32) == 0
    inv_t = 1.0 / tl.load(temp_ptr + req * stride_temp)
    begin = part * width
    end = tl.where(todo, tl.minimum(begin + width, vocab), begin)
    return row, part, req, todo, inv_t, begin, end


@triton.jit
def _split_row_lse(stats_ptr, row, parts, inv_t, todo, BLOCK_S: tl.constexpr):
    """The row's largest logit and its log-sum-exp of logits / T, from its slices' partials."""
    part = tl.arange(0, BLOCK_S)
    live = (part < parts) & todo
    top_part = tl.load(stats_ptr + (row * parts + part) * 2, mask=live, other=float("-inf"))
    sums = tl.load(stats_ptr + (row * parts + part) * 2 + 1, mask=live, other=0.0)
    top_logit = tl.max(top_part)
    top = top_logit * inv_t
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: no NaN from -inf - -inf
    # Each slice's sum is relative to its own maximum (0 for a slice of -inf, whose sum is 0).
    total = tl.sum(sums * tl.exp(top_part * inv_t - top))
    return top_logit, top + tl.log(tl.maximum(total, _TINY_C))


@triton.jit
def _row_top_k(top_k_ptr, req, vocab, HAS_TOP_K: tl.constexpr):
    if HAS_TOP_K:
        kk = tl.minimum(tl.maximum(tl.load(top_k_ptr + req).to(tl.int64), 1), vocab).to(tl.int32)
    else:
        kk = vocab
    return kk


@triton.jit
def _split_row_limits(
    top_p_ptr, min_p_ptr, top_k_mass_ptr, req, row, parts, vocab, kk, top_logit, inv_t, lse, todo,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, TOP_P_OF_TOP_K_MASS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The row's top-p mass limit and least kept probability, as ``_whole_row_floors_kernel``
    sets them (the top-k set's mass summed from its slices' partials)."""
    limit = tl.full((), float("inf"), tl.float32)
    if HAS_TOP_P:
        tp = tl.load(top_p_ptr + req)
        scale = 1.0
        if HAS_TOP_K and TOP_P_OF_TOP_K_MASS:
            part = tl.arange(0, BLOCK_S)
            mass = tl.sum(tl.load(top_k_mass_ptr + row * parts + part, mask=(part < parts) & todo, other=0.0))
            scale = tl.where(kk < vocab, mass, 1.0)
        limit = tl.where(tp < 1.0, tp * scale, float("inf"))  # top_p 1: no cut
    if HAS_MIN_P:
        min_prob = tl.load(min_p_ptr + req) * tl.exp(top_logit * inv_t - lse)
    else:
        min_prob = tl.full((), 0.0, tl.float32)
    return limit, min_prob


@triton.jit
def _split_narrowed(
    bounds_ptr, mass_ptr, count_ptr, row, step, parts, passes, kk, limit, min_prob, inv_t, lse, todo,
    TOP_P_INCLUSIVE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The keys ``(lo, hi)`` after pass ``step``: that pass's keys, and the row's mass and count
    above each (its slices' partials summed), narrowed as ``_first_kept_key`` narrows them."""
    lo = tl.load(bounds_ptr + (row * passes + step) * 2, mask=todo, other=0)
    hi = tl.load(bounds_ptr + (row * passes + step) * 2 + 1, mask=todo, other=0)
    lane = tl.arange(0, SPLIT)
    part = tl.arange(0, BLOCK_S)
    at_parts = ((row * passes + step) * parts + part[:, None]) * SPLIT + lane[None, :]
    live = (part[:, None] < parts) & (lane[None, :] < SPLIT) & todo
    mass = tl.sum(tl.load(mass_ptr + at_parts, mask=live, other=0.0), axis=0)
    count = tl.sum(tl.load(count_ptr + at_parts, mask=live, other=0), axis=0)
    keys = lo + ((hi - lo) * lane) // SPLIT
    at = _key_value(keys.to(tl.int32))
    if TOP_P_INCLUSIVE:
        keep = mass <= limit
    else:
        keep = mass < limit
    # (keys near -inf would overflow x / T: their probability is 0 either way)
    prob_at = tl.exp(tl.maximum(at, -1e30) * inv_t - lse)
    keep = keep & (count < kk) & (prob_at >= min_prob) & (lane > 0)
    first = tl.min(tl.where(keep, lane, SPLIT))
    last = tl.sum(tl.where(lane == SPLIT - 1, keys, 0))
    new_lo = tl.where(first == SPLIT, last, tl.sum(tl.where(lane == first - 1, keys, 0)))
    new_hi = tl.where(first == SPLIT, hi, tl.sum(tl.where(lane == first, keys, 0)))
    # As in ``_first_kept_key``: a finished search (hi is lo's successor) stays where it is.
    searching = hi - lo > 1
    return tl.where(searching, new_lo, lo), tl.where(searching, new_hi, hi)


@triton.jit(do_not_specialize=["nodes", "first_row"])
def _slice_lse_kernel(
    logits_ptr, stride_logits, temp_ptr, stride_temp, top_k_ptr, top_p_ptr, min_p_ptr, decided_ptr, stats_ptr,
    bounds_ptr, mass_ptr, count_ptr, top_k_mass_ptr, low_ptr, vocab, width, parts, passes, nodes, first_row,
    step, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr, TOP_P_OF_TOP_K_MASS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    # The slice's largest logit and its sum of exp(x / T - largest / T), in one pass.
    row, part, req, todo, inv_t, begin, end = _slice_program(decided_ptr, temp_ptr, stride_temp, vocab, width,
                                                             nodes, first_row)  # fmt: skip
    row_ptr = logits_ptr + row * stride_logits
    top = tl.full((), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(begin, end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(x))
        base = tl.where(new_top == float("-inf"), 0.0, new_top * inv_t)
        acc = acc * tl.exp(tl.where(top == float("-inf"), base, top * inv_t) - base) + tl.exp(x * inv_t - base)
        top = new_top
    tl.store(stats_ptr + (row * parts + part) * 2, top, mask=todo)
    tl.store(stats_ptr + (row * parts + part) * 2 + 1, tl.sum(acc), mask=todo)


@triton.jit(do_not_specialize=["nodes", "first_row", "step", "first_step"])
def _slice_search_kernel(
    logits_ptr, stride_logits, temp_ptr, stride_temp, top_k_ptr, top_p_ptr, min_p_ptr, decided_ptr, stats_ptr,
    bounds_ptr, mass_ptr, count_ptr, top_k_mass_ptr, low_ptr, vocab, width, parts, passes, nodes, first_row,
    step, first_step, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr, TOP_P_OF_TOP_K_MASS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr, KTH: tl.constexpr,
):  # fmt: skip
    # Pass ``step`` of a search (``KTH``: for the k-th largest logit, else for the floor's key):
    # the keys narrowed from the previous pass (the first: -inf to the row's largest logit), and
    # the slice's mass and count of logits strictly above each.
    row, part, req, todo, inv_t, begin, end = _slice_program(decided_ptr, temp_ptr, stride_temp, vocab, width,
                                                             nodes, first_row)  # fmt: skip
    top_logit, lse = _split_row_lse(stats_ptr, row, parts, inv_t, todo, BLOCK_S)
    kk = _row_top_k(top_k_ptr, req, vocab, HAS_TOP_K)
    if KTH:
        limit = tl.full((), float("inf"), tl.float32)
        min_prob = tl.full((), 0.0, tl.float32)
        end = tl.where(kk < vocab, end, begin)
    else:
        limit, min_prob = _split_row_limits(top_p_ptr, min_p_ptr, top_k_mass_ptr, req, row, parts, vocab, kk,
                                            top_logit, inv_t, lse, todo, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
                                            TOP_P_OF_TOP_K_MASS, BLOCK_S)  # fmt: skip
    if step == first_step:
        lo = _order_key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)
        hi = _order_key(top_logit).to(tl.int64)
    else:
        lo, hi = _split_narrowed(bounds_ptr, mass_ptr, count_ptr, row, step - 1, parts, passes, kk, limit, min_prob,
                                 inv_t, lse, todo, TOP_P_INCLUSIVE, SPLIT, BLOCK_S)  # fmt: skip
    tl.store(bounds_ptr + (row * passes + step) * 2, lo, mask=todo & (part == 0))
    tl.store(bounds_ptr + (row * passes + step) * 2 + 1, hi, mask=todo & (part == 0))
    lane = tl.arange(0, SPLIT)
    keys = lo + ((hi - lo) * lane) // SPLIT
    at = _key_value(keys.to(tl.int32))
    mass = tl.zeros((SPLIT,), tl.float32)
    count = tl.zeros((SPLIT,), tl.int32)
    row_ptr = logits_ptr + row * stride_logits
    for start in range(begin, tl.where(hi - lo > 1, end, begin), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf"))
        p = tl.exp(x * inv_t - lse)
        above = x[:, None] > at[None, :]
        mass += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
        count += tl.sum(above.to(tl.int32), axis=0)
    at_parts = ((row * passes + step) * parts + part) * SPLIT + lane
    tl.store(mass_ptr + at_parts, mass, mask=(lane < SPLIT) & todo)
    tl.store(count_ptr + at_parts, count, mask=(lane < SPLIT) & todo)


@triton.jit(do_not_specialize=["nodes", "first_row", "step"])
def _slice_top_k_mass_kernel(
    logits_ptr, stride_logits, temp_ptr, stride_temp, top_k_ptr, top_p_ptr, min_p_ptr, decided_ptr, stats_ptr,
    bounds_ptr, mass_ptr, count_ptr, top_k_mass_ptr, low_ptr, vocab, width, parts, passes, nodes, first_row,
    step, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr, TOP_P_OF_TOP_K_MASS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    # FlashInfer's min-p path: the k-th largest logit from the k-th search's last pass (pass
    # ``step``), then the slice's mass at or above it (ties included).
    row, part, req, todo, inv_t, begin, end = _slice_program(decided_ptr, temp_ptr, stride_temp, vocab, width,
                                                             nodes, first_row)  # fmt: skip
    top_logit, lse = _split_row_lse(stats_ptr, row, parts, inv_t, todo, BLOCK_S)
    kk = _row_top_k(top_k_ptr, req, vocab, HAS_TOP_K)
    _, hi = _split_narrowed(bounds_ptr, mass_ptr, count_ptr, row, step, parts, passes, kk,
                            tl.full((), float("inf"), tl.float32), tl.full((), 0.0, tl.float32), inv_t, lse, todo,
                            TOP_P_INCLUSIVE, SPLIT, BLOCK_S)  # fmt: skip
    kth = _key_value(hi.to(tl.int32))
    row_ptr = logits_ptr + row * stride_logits
    mass = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(begin, tl.where(kk < vocab, end, begin), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf"))
        mass += tl.where(x >= kth, tl.exp(x * inv_t - lse), 0.0)
    tl.store(top_k_mass_ptr + row * parts + part, tl.sum(mass), mask=todo)


@triton.jit(do_not_specialize=["nodes", "first_row", "step"])
def _slice_low_kernel(
    logits_ptr, stride_logits, temp_ptr, stride_temp, top_k_ptr, top_p_ptr, min_p_ptr, decided_ptr, stats_ptr,
    bounds_ptr, mass_ptr, count_ptr, top_k_mass_ptr, low_ptr, vocab, width, parts, passes, nodes, first_row,
    step, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    TOP_P_INCLUSIVE: tl.constexpr, TOP_P_OF_TOP_K_MASS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    # The first kept key from the search's last pass (pass ``step``), then the slice's smallest
    # logit at or above it.
    row, part, req, todo, inv_t, begin, end = _slice_program(decided_ptr, temp_ptr, stride_temp, vocab, width,
                                                             nodes, first_row)  # fmt: skip
    top_logit, lse = _split_row_lse(stats_ptr, row, parts, inv_t, todo, BLOCK_S)
    kk = _row_top_k(top_k_ptr, req, vocab, HAS_TOP_K)
    limit, min_prob = _split_row_limits(top_p_ptr, min_p_ptr, top_k_mass_ptr, req, row, parts, vocab, kk, top_logit,
                                        inv_t, lse, todo, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, TOP_P_OF_TOP_K_MASS,
                                        BLOCK_S)  # fmt: skip
    _, hi = _split_narrowed(bounds_ptr, mass_ptr, count_ptr, row, step, parts, passes, kk, limit, min_prob, inv_t,
                            lse, todo, TOP_P_INCLUSIVE, SPLIT, BLOCK_S)  # fmt: skip
    at_hi = _key_value(hi.to(tl.int32))
    row_ptr = logits_ptr + row * stride_logits
    low = tl.full((BLOCK_V,), float("inf"), tl.float32)
    for start in range(begin, end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("inf"))
        low = tl.minimum(low, tl.where(x >= at_hi, x, float("inf")))
    tl.store(low_ptr + row * parts + part, tl.min(low), mask=todo)


@triton.jit
def _split_floors_kernel(decided_ptr, low_ptr, floor_ptr, parts, BLOCK_S: tl.constexpr):
    # The floor of an undecided row: the smallest of its slices' smallest kept logits.
    row = tl.program_id(0).to(tl.int64)
    todo = tl.load(decided_ptr + row).to(tl.int32) == 0
    part = tl.arange(0, BLOCK_S)
    low = tl.load(low_ptr + row * parts + part, mask=(part < parts) & todo, other=float("inf"))
    tl.store(floor_ptr + row, tl.min(low), mask=todo)


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

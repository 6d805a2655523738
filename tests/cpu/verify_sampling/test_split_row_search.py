# SPDX-License-Identifier: Apache-2.0
"""The whole-row search split over several programs per row (``_split_row_floors_triton``,
interpreted) against the single-program search and a full sort of each row: every filter
combination and both backends' rules, ties, -inf entries and a row of -inf, decided rows left
as they are, per-request parameters read in place; the slice count chosen from the shapes; and
a server splitting rows unless ``SGLANG_DDTREE_FLOORS_SPLIT_ROWS=0``."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.speculative.verify_sampling import sampling_filters as sf
from sglang.srt.speculative.verify_sampling.gumbel_draw import request_rows
from sglang.srt.speculative.verify_sampling.sampling_filters import Candidates, FilterRule
from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

#: A tile of 32 logits, so that a row of a few hundred spans several slices of several tiles.
BLOCK = 32
#: The floor a decided row holds before the search (and must still hold after).
KEPT = 123.0

PYTORCH = FilterRule.for_backend("pytorch", need_min_p=True)
FLASHINFER = FilterRule.for_backend("flashinfer", need_min_p=False)
FLASHINFER_MIN_P = FilterRule.for_backend("flashinfer", need_min_p=True)

#: name -> (rule, which filters are on)
SETTINGS = {
    "top-p (at most top_p)": (PYTORCH, ("top_p",)),
    "top-p (below top_p)": (FLASHINFER, ("top_p",)),
    "min-p": (PYTORCH, ("min_p",)),
    "top-k + top-p": (FLASHINFER, ("top_k", "top_p")),
    "top-k + top-p + min-p, top-p of the top-k mass": (FLASHINFER_MIN_P, ("top_k", "top_p", "min_p")),
}


def _batch(seed: int, rows: int, vocab: int, requests: int):
    """Logits with ties on every other row (a coarse grid, as bf16 logits have), masked tokens on
    row 0 and, from 4 rows on, a row of -inf; parameters per request."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 1.5
    logits[1::2] = (logits[1::2] * 2).round() / 2
    logits[0, 7 : vocab // 3] = float("-inf")
    if rows >= 4:
        logits[3] = float("-inf")
    pick = lambda values: torch.tensor(values)[torch.randint(0, len(values), (requests,), generator=gen)]  # noqa: E731
    temps = pick([0.5, 0.8, 1.0, 1.3]).view(requests, 1)
    params = dict(
        top_k=pick([3, 40, 200, vocab + 3, 1 << 30]).to(torch.int32),
        top_p=pick([0.5, 0.8, 0.95, 0.999]),
        min_p=pick([0.002, 0.02, 0.2]),
    )
    return logits, temps, params


def _search(logits, temps, filters, rule, decided, slices, **at):
    floors = torch.full((logits.shape[0],), KEPT)
    sf._whole_row_floors_triton(logits, temps, *filters, rule, floors, decided, slices=slices, block_v=BLOCK, **at)
    return floors


def _sorted(logits, temps, filters, rule, decided, **at):
    """The full sort's floors where the row is undecided, ``KEPT`` elsewhere."""
    want, _ = sf.floors_among_reference(logits, temps, *filters, rule, logits.shape[1], **at)
    return torch.where(decided, torch.full_like(want, KEPT), want)


def _differ(a, b, logits, temps, filters, rule, rows, **at):
    """Rows where ``a`` and ``b`` keep different tokens beyond float32 rounding at a cut (the
    parameters gathered per row, as ``floors_differ`` reads them)."""
    per_row = [request_rows(t, rows, **at) for t in (temps, *filters)]
    return torch.nonzero(sf.floors_differ(a, b, logits, *per_row, rule)).view(-1).tolist()


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("slices", [2, 3, 5, None], ids=lambda s: f"slices={s or 'auto'}")
def test_split_rows_give_the_single_program_floors(setting, slices):
    """Each row over ``slices`` programs (``None``: as ``row_slices`` chooses from the shapes):
    the single-program search's floors and the full sort's, but at a cut within float32
    rounding; decided rows keep the floor they had, a row of -inf is not cut."""
    rule, on = SETTINGS[setting]
    rows, vocab = 6, 300 + 29 * (slices or 0)  # not a whole number of tiles or slices
    logits, temps, params = _batch(3 + (slices or 0), rows, vocab, rows)
    filters = tuple(params[f] if f in on else None for f in ("top_k", "top_p", "min_p"))
    decided = torch.tensor([False, False, True, False, False, True])
    if slices is None:
        assert sf.row_slices(rows, vocab, logits.device, BLOCK) > 1
    got = _search(logits, temps, filters, rule, decided, slices)
    single = _search(logits, temps, filters, rule, decided, 1)
    want = _sorted(logits, temps, filters, rule, decided)
    assert bool((got[decided] == KEPT).all())
    assert bool(torch.isneginf(got[3])), "a row of -inf keeps everything"
    assert _differ(got, single, logits, temps, filters, rule, rows) == []
    assert _differ(got, want, logits, temps, filters, rule, rows) == []
    # The filters cut somewhere in most rows (the comparison is not between two empty cuts).
    assert int(torch.isfinite(got[~decided]).sum()) >= 3


@pytest.mark.parametrize("slices", [1, 3])
def test_one_row_and_a_single_slice_per_row(slices):
    """One row (a batch of one, no draft); ``slices=1`` is the single-program kernel itself."""
    logits, temps, params = _batch(5, 1, 200, 1)
    filters = (None, torch.tensor([0.97]), torch.tensor([0.001]))
    got = _search(logits, temps, filters, PYTORCH, torch.tensor([False]), slices)
    assert _differ(got, _sorted(logits, temps, filters, PYTORCH, torch.tensor([False])), logits, temps, filters,
                   PYTORCH, 1) == []  # fmt: skip


def test_parameters_are_read_per_request_in_place():
    """Rows ``first_row..`` of ``nodes`` rows per request read their request's parameters (every
    filter, FlashInfer's min-p path: each kernel of the split search reads them), as the
    single-program kernel does and as the per-row parameters give."""
    rule = FLASHINFER_MIN_P
    rows, vocab, nodes, first_row = 8, 260, 3, 2
    requests = (first_row + rows - 1) // nodes + 1
    logits, temps, params = _batch(13, rows, vocab, requests)
    params["top_p"] = torch.tensor([0.9, 0.97, 0.6, 0.999])[:requests]  # every request cuts deep
    filters = (params["top_k"], params["top_p"], params["min_p"])
    at = dict(nodes=nodes, first_row=first_row)
    decided = torch.zeros(rows, dtype=torch.bool)
    decided[4] = True
    got = _search(logits, temps, filters, rule, decided, 3, **at)
    per_row = [request_rows(t, rows, **at) for t in (temps, *filters)]
    single = _search(logits, per_row[0], tuple(per_row[1:]), rule, decided, 1)
    assert _differ(got, single, logits, temps, filters, rule, rows, **at) == []
    assert _differ(got, _sorted(logits, temps, filters, rule, decided, **at), logits, temps, filters, rule, rows,
                   **at) == []  # fmt: skip
    assert float(got[4]) == KEPT
    # Read from the batch's first row instead, the rows get other requests' floors.
    shifted = _search(logits, temps, filters, rule, decided, 1, nodes=nodes, first_row=0)
    assert _differ(shifted, got, logits, temps, filters, rule, rows, **at) != []


def test_the_comparison_fails_where_the_slices_miss_logits_or_decided_rows_are_searched(monkeypatch):
    """The checks above can fail: slices that leave the end of each row unread give other
    floors, and with ``decided`` ignored the decided rows' floors are overwritten."""
    rows, vocab = 5, 300
    logits, temps, params = _batch(21, rows, vocab, rows)
    filters = (None, torch.full((rows,), 0.9), None)
    decided = torch.tensor([False, True, False, False, False])
    want = _sorted(logits, temps, filters, PYTORCH, decided)
    assert _differ(_search(logits, temps, filters, PYTORCH, decided, 3), want, logits, temps, filters, PYTORCH,
                   rows) == []  # fmt: skip
    all_rows = torch.zeros(rows, dtype=torch.bool)
    assert float(_search(logits, temps, filters, PYTORCH, all_rows, 3)[1]) != KEPT
    width = sf._slice_width
    monkeypatch.setattr(sf, "_slice_width", lambda vocab, slices: width(vocab, slices) - 16)
    short = _search(logits, temps, filters, PYTORCH, decided, 3)
    assert _differ(short, want, logits, temps, filters, PYTORCH, rows) != []


def test_logit_floors_splits_few_rows_at_the_default_tile():
    """The server's entry point: few rows of a vocabulary of several tiles are split (the
    default tile, chosen from the shapes), and the floors are the full sort's."""
    rows, vocab = 3, 8192
    assert sf.row_slices(rows, vocab, "cpu") == 2
    logits, temps, params = _batch(8, rows, vocab, rows)
    filters = (None, torch.tensor([0.95, 0.8, 0.99]), torch.tensor([0.0, 0.001, 0.0]))
    cand = Candidates.for_requests([1 << 30] * rows, filters[1].tolist(), filters[2].tolist(), vocab)
    got = sf.logit_floors(logits, temps, *filters, PYTORCH, cand)
    want, _ = sf.floors_among_reference(logits, temps, *filters, PYTORCH, vocab)
    _, decided = sf._floors_among_triton(logits, temps, *filters, PYTORCH, cand.k)
    assert int((~decided).sum()) >= 1, "the whole-row search was not exercised"
    assert _differ(got, want, logits, temps, filters, PYTORCH, rows) == []


def test_the_slice_count_follows_the_rows_and_the_gpu():
    """About 16 programs per SM (132 counted without CUDA) within 8 to 16 slices a row, slices
    of at least 4 tiles, none once the rows reach 16 per SM."""
    vocab = 152064  # 149 tiles of 1,024
    assert sf.row_slices(1, vocab, "cpu") == sf.row_slices(17, vocab, "cpu") == 16
    assert sf.row_slices(65, vocab, "cpu") == sf.row_slices(132, vocab, "cpu") == 16
    assert sf.row_slices(133, vocab, "cpu") == 16 and sf.row_slices(141, vocab, "cpu") == 15
    assert sf.row_slices(263, vocab, "cpu") == 9
    assert sf.row_slices(264, vocab, "cpu") == sf.row_slices(1088, vocab, "cpu") == sf.row_slices(2111, vocab, "cpu") == 8
    assert sf.row_slices(2112, vocab, "cpu") == 1
    assert sf.row_slices(17, 4096, "cpu") == 1  # 4 tiles: one slice
    assert sf.row_slices(17, 700, "cpu", block_v=32) == 5  # 22 tiles of 32


def test_a_server_splits_rows_unless_told_not_to(monkeypatch):
    """``SGLANG_DDTREE_FLOORS_SPLIT_ROWS`` (on by default) reaches the fused draw's floors
    through the verify sampler: off, the search runs one program per row; on, as
    ``row_slices`` chooses; the floors are the same either way."""
    launched = []
    real = sf._split_row_floors_triton
    monkeypatch.setattr(sf, "_split_row_floors_triton", lambda *a, **k: launched.append(a[8]) or real(*a, **k))
    rows, vocab = 3, 9000  # 9 tiles of 1,024: two slices a row
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(rows, vocab, generator=gen)
    temps, top_ps = torch.ones(rows, 1), torch.full((rows,), 0.9)
    cand = Candidates.for_requests([0] * rows, [0.9] * rows, [0.0] * rows, vocab)
    default = VerifySampler(vocab_size=vocab, device="cpu", sampler=SimpleNamespace(_sample_from_probs=None),
                            sampling_backend="pytorch")  # fmt: skip
    assert default.split_rows is True
    floors = {}
    for on in (False, True):
        with ddtree_envs.SGLANG_DDTREE_FLOORS_SPLIT_ROWS.override(on):
            vs = VerifySampler(vocab_size=vocab, device="cpu", sampler=SimpleNamespace(_sample_from_probs=None),
                               sampling_backend="pytorch")  # fmt: skip
        assert vs.split_rows is on
        launched.clear()
        floors[on] = sf.logit_floors(logits, temps, None, top_ps, None, PYTORCH, cand, split_rows=vs.split_rows)
        assert launched == ([sf.row_slices(rows, vocab, "cpu")] if on else []), launched
    assert sf.row_slices(rows, vocab, "cpu") == 2
    assert _differ(floors[True], floors[False], logits, temps, (None, top_ps, None), PYTORCH, rows) == []
    assert bool(torch.isfinite(floors[False]).all())  # every row cut, past its candidates

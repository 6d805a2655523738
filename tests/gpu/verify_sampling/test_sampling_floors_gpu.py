# SPDX-License-Identifier: Apache-2.0
"""The filters' floors on the GPU at a real vocabulary: rows whose top-p or min-p cut lies
beyond the candidates are searched over the whole row (``_whole_row_floors_kernel``, or split
over several programs per row when the rows are few: ``_split_row_floors_triton``; compiled for
this GPU, not interpreted); every floor must equal the one a full sort of the row gives, but
where a token sits at the top-p or min-p cut within float32 rounding (``floors_differ``).
No server. GPU host only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from sglang.srt.speculative.verify_sampling import sampling_filters as sf  # noqa: E402

VOCAB = 151936  # Qwen's
ROWS = 272  # 16 requests x (B=16 + 1)


def _rows(seed: int, ties: bool, rows: int = ROWS) -> torch.Tensor:
    """Flat rows (the cut deep in the row) and peaked ones; with ``ties``, values on a coarse grid."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 1.5
    logits[1::2, :8] += 10.0
    if ties:
        logits = (logits * 4).round() / 4
    logits[3] = float("-inf")
    return logits.cuda()


@pytest.mark.parametrize("backend", ["flashinfer", "pytorch"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.95, 0.0), (0, 1.0, 0.005), (0, 0.9, 0.01), (3000, 0.97, 0.0)])
def test_whole_row_floors_equal_the_full_sort(backend, ties, top_k, top_p, min_p):
    logits = _rows(7 + ties, ties)
    temps = torch.full((ROWS, 1), 0.8, device="cuda")
    top_ks = torch.full((ROWS,), top_k, dtype=torch.int32, device="cuda") if top_k else None
    top_ps = torch.full((ROWS,), top_p, device="cuda") if top_p < 1.0 else None
    min_ps = torch.full((ROWS,), min_p, device="cuda") if min_p > 0 else None
    rule = sf.FilterRule.for_backend(backend, need_min_p=min_p > 0)
    cand = sf.Candidates.for_requests([top_k] * ROWS, [top_p] * ROWS, [min_p] * ROWS, VOCAB)
    _, decided = sf._floors_among_triton(logits, temps, top_ks, top_ps, min_ps, rule, cand.k)
    if top_k == 0:
        assert int((~decided).sum()) >= ROWS // 4, "the whole-row search was not exercised"
    got = sf.logit_floors(logits, temps, top_ks, top_ps, min_ps, rule, cand)
    want, _ = sf.floors_among_reference(logits, temps, top_ks, top_ps, min_ps, rule, VOCAB)
    # Where they differ, only tokens at the cut within float32 rounding may be in between (on
    # an H100, 2026-12-06, the flat rows at top-p 0.95: the mass above within 3e-6 of the cut,
    # where a flat row's tokens each hold 7e-6).
    bad = torch.nonzero(sf.floors_differ(got, want, logits, temps, top_ks, top_ps, min_ps, rule)).view(-1)
    assert bad.numel() == 0, f"rows {bad[:8].tolist()}: {got[bad[:8]].tolist()} != {want[bad[:8]].tolist()}"


FEW_ROWS = 17  # a batch of one at budget 16


@pytest.mark.parametrize("backend,top_k,top_p,min_p", [("pytorch", 0, 0.95, 0.0), ("flashinfer", 0, 1.0, 0.005),
                                                       ("pytorch", 3000, 0.97, 0.0), ("flashinfer", 3000, 0.97, 0.01)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("slices", [1, 2, 8, None], ids=lambda s: f"slices={s or 'auto'}")
def test_split_row_search_equals_the_full_sort(backend, top_k, top_p, min_p, ties, slices):
    """Few rows, each searched over ``slices`` programs (``None``: as ``row_slices`` chooses for
    this GPU), every row but two decided rows searched (a top-k too, FlashInfer's min-p path
    with its k-th search included): the full sort's floors, the single-program search's, the
    same floors run to run, the decided rows' floors left as they were."""
    rows = FEW_ROWS
    logits = _rows(11 + ties, ties, rows)
    temps = torch.full((rows, 1), 0.8, device="cuda")
    top_ks = torch.full((rows,), top_k, dtype=torch.int32, device="cuda") if top_k else None
    top_ps = torch.full((rows,), top_p, device="cuda") if top_p < 1.0 else None
    min_ps = torch.full((rows,), min_p, device="cuda") if min_p > 0 else None
    rule = sf.FilterRule.for_backend(backend, need_min_p=min_p > 0)
    filters = (top_ks, top_ps, min_ps)
    if slices is None:
        assert sf.row_slices(rows, VOCAB, logits.device) > 1
    decided = torch.zeros(rows, dtype=torch.bool, device="cuda")
    decided[[2, 9]] = True

    def search(n):
        floors = torch.full((rows,), 123.0, device="cuda")
        sf._whole_row_floors_triton(logits, temps, *filters, rule, floors, decided, slices=n)
        return floors

    got = search(slices)
    assert torch.equal(got, search(slices)), "not the same floors run to run"
    assert bool((got[decided] == 123.0).all())
    want, _ = sf.floors_among_reference(logits, temps, *filters, rule, VOCAB)
    want = torch.where(decided, got, want)
    for other in (want, search(1)):
        bad = torch.nonzero(sf.floors_differ(got, other, logits, temps, *filters, rule)).view(-1)
        assert bad.numel() == 0, f"rows {bad[:8].tolist()}: {got[bad[:8]].tolist()} != {other[bad[:8]].tolist()}"

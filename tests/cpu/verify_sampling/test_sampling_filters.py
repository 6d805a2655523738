# SPDX-License-Identifier: Apache-2.0
"""The per-row logit floors against the filters' definitions (token by token, ties included),
for both backends' filter orders, with and without the full-sort fallback; and the fused draw
with floors (kernel, interpreted, and its reference) against the filtered distribution."""

import pytest
import torch

from sglang.srt.speculative.verify_sampling import gumbel_draw as gd
from sglang.srt.speculative.verify_sampling import sampling_filters as sf
from sglang.srt.speculative.verify_sampling.sampling_filters import (
    TOP_P_CANDIDATES,
    FilterRule,
    Candidates,
    filtered_probs_reference,
    logit_floors,
)

V = 64
RULES = {
    "pytorch": FilterRule.for_backend("pytorch", need_min_p=True),
    "flashinfer": FilterRule.for_backend("flashinfer", need_min_p=False),
    "flashinfer, min-p in the batch": FilterRule.for_backend("flashinfer", need_min_p=True),
}


def _rows(gen, rows, ties: bool):
    logits = torch.randn(rows, V, generator=gen) * 2.0
    if ties:  # coarse values, as bf16 logits have: many tokens share a logit
        logits = (logits * 2).round() / 2
    logits[0, 5:9] = float("-inf")  # penalties, bias or grammar masked some tokens
    temps = torch.tensor([0.5, 0.7, 1.0, 1.3])[torch.randint(0, 4, (rows,), generator=gen)].view(rows, 1)
    top_ks = torch.tensor([1, 3, 20, V + 7, 1 << 30])[torch.randint(0, 5, (rows,), generator=gen)]
    top_ps = torch.tensor([1.0, 0.95, 0.8, 0.5, 0.1])[torch.randint(0, 5, (rows,), generator=gen)]
    min_ps = torch.tensor([0.0, 0.0, 0.05, 0.2])[torch.randint(0, 4, (rows,), generator=gen)]
    return logits, temps, top_ks, top_ps, min_ps


def _support(logits, floors):
    return logits >= floors.view(-1, 1)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("candidates", [V, 24, 2], ids=["all", "some", "fallback"])
def test_floors_keep_exactly_the_filtered_tokens(rule, ties, candidates):
    gen = torch.Generator().manual_seed(11 + candidates + 3 * ties)
    logits, temps, top_ks, top_ps, min_ps = _rows(gen, 48, ties)
    got = _support(logits, logit_floors(logits, temps, top_ks, top_ps, min_ps, RULES[rule], Candidates(candidates, True)))
    want = filtered_probs_reference(logits, temps, top_ks, top_ps, min_ps, RULES[rule]) > 0
    assert torch.equal(got & torch.isfinite(logits), want)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("candidates", [V, 24], ids=["all", "some"])
def test_the_kernel_and_its_reference_agree(rule, ties, candidates):
    """The Triton floors (interpreted) against the torch reference on the same candidates: the
    same floor, the same verdict on whether the candidates decided the row."""
    assert sf._interpreted()
    gen = torch.Generator().manual_seed(29 + candidates + ties)
    logits, temps, top_ks, top_ps, min_ps = _rows(gen, 40, ties)
    logits[1] = float("-inf")  # a row with nothing left
    args = (logits, temps, top_ks, top_ps, min_ps, RULES[rule], candidates)
    floors, decided = sf._floors_among_triton(*args)
    want_floors, want_decided = sf.floors_among_reference(*args)
    assert torch.equal(floors, want_floors)
    assert torch.equal(decided, want_decided)


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_each_filter_alone(which):
    gen = torch.Generator().manual_seed(5)
    logits, temps, top_ks, top_ps, min_ps = _rows(gen, 32, ties=True)
    kw = dict(top_ks=top_ks if which == "top_k" else None, top_ps=top_ps if which == "top_p" else None,
              min_ps=min_ps if which == "min_p" else None)  # fmt: skip
    rule = RULES["flashinfer"]
    got = _support(logits, logit_floors(logits, temps, rule=rule, candidates=Candidates(8, True), **kw))
    want = filtered_probs_reference(logits, temps, rule=rule, **kw) > 0
    assert torch.equal(got & torch.isfinite(logits), want)


def test_ties_at_the_kth_value_all_stay():
    """FlashInfer keeps a token while fewer than k tokens are strictly more likely."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    floors = logit_floors(logits, torch.ones(1, 1), torch.tensor([2]), None, None, RULES["flashinfer"], Candidates(2, False))
    assert _support(logits, floors).tolist() == [[True, True, True, True, False, False]]


def test_top_p_measures_the_original_mass_except_on_flashinfers_min_p_path():
    """p = [.4, .3, .2, .1], top_k=2, top_p=0.5: joint keeps two tokens; FlashInfer's min-p
    path (top-k renormalised to [.571, .429] first) keeps one."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    args = (logits, torch.ones(1, 1), torch.tensor([2]), torch.tensor([0.5]), torch.tensor([0.0]))
    joint = _support(logits, logit_floors(*args, RULES["flashinfer"], Candidates(2, False)))
    renormalised = _support(logits, logit_floors(*args, RULES["flashinfer, min-p in the batch"], Candidates(2, False)))
    assert joint.tolist() == [[True, True, False, False]]
    assert renormalised.tolist() == [[True, False, False, False]]


def test_top_p_boundary_follows_the_backend():
    """Mass before the third token exactly 0.75 with top_p=0.75: the pytorch backend keeps it
    (at most top_p), FlashInfer does not (strictly below)."""
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    args = (logits, torch.ones(1, 1), None, torch.tensor([0.75]), None)
    assert _support(logits, logit_floors(*args, RULES["pytorch"], Candidates(4, False))).tolist() == [[True] * 4]
    assert _support(logits, logit_floors(*args, RULES["flashinfer"], Candidates(4, False))).tolist() == [
        [True, True, False, False]
    ]


def test_a_row_without_filters_is_not_cut():
    logits = torch.randn(3, V)
    floors = logit_floors(logits, torch.ones(3, 1), torch.full((3,), 1 << 30), torch.ones(3), torch.zeros(3),
                          RULES["pytorch"], Candidates(4, True))  # fmt: skip
    assert bool(torch.isneginf(floors).all())


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_the_whole_row_search_and_the_full_sort_agree(rule, ties):
    """Rows the candidates leave undecided: the Triton search over the whole row (interpreted)
    gives the floor the sorted row gives, top-k beyond the candidates, ties and a row of -inf
    included; decided rows keep their floors."""
    gen = torch.Generator().manual_seed(41 + ties)
    logits, temps, top_ks, top_ps, min_ps = _rows(gen, 48, ties)
    logits[2] = float("-inf")
    top_ps[3], min_ps[3], top_ks[3] = 0.999, 0.0, 1 << 30  # deep in the row
    floors, decided = sf._floors_among_triton(logits, temps, top_ks, top_ps, min_ps, RULES[rule], 2)
    assert 10 < int((~decided).sum()) < 48
    want = floors.clone()
    redo = torch.nonzero(~decided).view(-1)
    want[redo], _ = sf.floors_among_reference(logits[redo], temps[redo], top_ks[redo], top_ps[redo], min_ps[redo],
                                              RULES[rule], V)
    got = floors.clone()
    sf._whole_row_floors_triton(logits, temps, top_ks, top_ps, min_ps, RULES[rule], got, decided)
    assert torch.equal(got, want)


def test_rows_sorted_in_chunks_give_the_same_floors(monkeypatch):
    """The torch path (no GPU, no interpreter) sorts undecided rows, a few at a time."""
    monkeypatch.setattr(sf, "_interpreted", lambda: False)
    gen = torch.Generator().manual_seed(9)
    logits, temps, _, top_ps, min_ps = _rows(gen, 40, ties=False)
    rule = RULES["pytorch"]
    whole = logit_floors(logits, temps, None, top_ps, min_ps, rule, Candidates(2, True))
    chunked = logit_floors(logits, temps, None, top_ps, min_ps, rule, Candidates(2, True), max_sorted_rows=3)
    assert torch.equal(whole, chunked)


def test_candidates_read_the_requests():
    c = Candidates.for_requests
    assert c([20, 1 << 30], [0.8, 1.0], [0.0, 0.0], 152064) == Candidates(20, False)
    assert c([1, 50], [1.0, 1.0], [0.0, 0.0], 152064) == Candidates(50, False)
    assert c([20, 1 << 30], [0.8, 0.9], [0.0, 0.0], 152064) == Candidates(TOP_P_CANDIDATES, True)
    assert c([1 << 30], [1.0], [0.05], 152064) == Candidates(TOP_P_CANDIDATES, True)
    assert c([1 << 30], [1.0], [0.0], 152064) == Candidates(1, False)
    assert c([1 << 30], [0.9], [0.0], 100) == Candidates(100, False)  # every logit is a candidate


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rows_with_a_top_k_are_decided_among_that_many_candidates(rule):
    """What the server passes when every filtering row has a top-k (no sort, no sync): exact,
    ties at the k-th value running past the candidates included."""
    gen = torch.Generator().manual_seed(17)
    logits, temps, _, top_ps, min_ps = _rows(gen, 48, ties=True)
    top_ks = torch.tensor([1, 3, 9])[torch.randint(0, 3, (48,), generator=gen)]
    got = _support(logits, logit_floors(logits, temps, top_ks, top_ps, min_ps, RULES[rule], Candidates(9, False)))
    want = filtered_probs_reference(logits, temps, top_ks, top_ps, min_ps, RULES[rule]) > 0
    assert torch.equal(got & torch.isfinite(logits), want)


DRAWS = {
    "kernel": lambda logits, temps, floors: gd.gumbel_draw(logits, temps, floors, use_triton=True),
    "reference": lambda logits, temps, floors: gd.gumbel_draw(logits, temps, floors, use_triton=False),
}


@pytest.mark.parametrize("impl", sorted(DRAWS))
def test_the_draw_with_floors_samples_the_filtered_distribution(impl):
    """Per setting 12,000 rows of one node; a chi-squared fit to the filtered distribution,
    nothing drawn outside it."""
    from scipy import stats

    base = torch.randn(V, generator=torch.Generator().manual_seed(21)) * 1.5
    settings = [(0.7, 20, 0.8, 0.0), (1.0, 1 << 30, 0.9, 0.0), (0.6, 1 << 30, 1.0, 0.1), (1.2, 5, 1.0, 0.0)]
    per = 12000
    rule = RULES["flashinfer"]
    for t, k, p, m in settings:
        logits = base.expand(per, V).contiguous()
        temps = torch.full((per, 1), t)
        top_ks, top_ps, min_ps = torch.full((per,), k), torch.full((per,), p), torch.full((per,), m)
        # One row's floor (every row is the same node), for every row.
        floors = logit_floors(logits[:1], temps[:1], top_ks[:1], top_ps[:1], min_ps[:1], rule,
                              Candidates(32, True)).expand(per).contiguous()  # fmt: skip
        want = filtered_probs_reference(logits[:1], temps[:1], top_ks[:1], top_ps[:1], min_ps[:1], rule)[0]
        got = torch.bincount(DRAWS[impl](logits, temps, floors), minlength=V).double()
        live = want > 0
        assert not bool((got[~live] > 0).any()), (t, k, p, m)
        assert stats.chisquare(got[live].numpy(), (want[live] * per).numpy()).pvalue > 1e-4, (t, k, p, m)


def test_floors_differ_only_beyond_rounding_at_the_cut():
    """Two floors a token apart at a top-p cut that float32 cannot settle agree; a floor off by
    a token away from any cut, or cut by the top-k count, does not."""
    rule = FilterRule.for_backend("pytorch", need_min_p=False)
    # Probabilities 0.5, 0.3, 0.15, 0.05 (T=1): the mass above the third token is 0.8.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    temps = torch.ones(1, 1)
    second, third, fourth = logits[:, 1], logits[:, 2], logits[:, 3]
    at_cut = torch.tensor([0.8 + 3e-6])  # third token's mass above, 0.8, within rounding of the cut
    assert not sf.floors_differ(second, third, logits, temps, None, at_cut, None, rule).any()
    assert sf.floors_differ(second, fourth, logits, temps, None, at_cut, None, rule).all()  # 0.95: far
    assert sf.floors_differ(second, third, logits, temps, None, torch.tensor([0.9]), None, rule).all()
    top2 = torch.tensor([2], dtype=torch.int32)
    assert sf.floors_differ(second, third, logits, temps, top2, at_cut, None, rule).all()  # the count decides
    # min-p: the fourth token is 0.1 of the first; a min-p of 0.1 * (1 + 1e-6) cuts it by rounding.
    min_p = torch.tensor([0.1 * (1 + 1e-6)])
    assert not sf.floors_differ(third, fourth, logits, temps, None, None, min_p, rule).any()
    assert sf.floors_differ(third, fourth, logits, temps, None, None, torch.tensor([0.2]), rule).all()


@pytest.mark.parametrize("slices", [1, 2, 3])
def test_a_logit_one_ulp_under_the_floor_stays_cut(slices):
    """The search narrows the keys to a floor and the key just under it; the passes after that
    read no logit and must leave them there (moving the floor's key onto the one under it
    kept the logit one float32 step below the floor)."""
    under = torch.nextafter(torch.tensor(0.5), torch.tensor(float("-inf"))).item()
    logits = torch.full((1, 64), float("-inf"))
    logits[0, :4] = torch.tensor([2.0, 1.0, 0.5, under])
    temps, top_ps = torch.ones(1, 1), torch.tensor([0.8])  # keeps 2, 1 and 0.5 (mass above 0.5: 0.754)
    want, _ = sf.floors_among_reference(logits, temps, None, top_ps, None, RULES["pytorch"], 64)
    assert want.item() == 0.5
    got = torch.full((1,), float("nan"))
    sf._whole_row_floors_triton(logits, temps, None, top_ps, None, RULES["pytorch"], got,
                                torch.zeros(1, dtype=torch.bool), slices=slices, block_v=16)  # fmt: skip
    assert got.item() == 0.5

# SPDX-License-Identifier: Apache-2.0
"""Per-request sampling parameters read in place: the floors kernels and the Gumbel draw
(interpreted) and their torch references, given each request's parameters and its number of
nodes (row = request * nodes + node), give exactly the floors and the draws they give with the
parameters repeated per row, in chunks of rows that start inside a request too; and the fused
draw spreads the parameters over the nodes without a single op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.speculative.verify_sampling import gumbel_draw as gd
from sglang.srt.speculative.verify_sampling import sampling_filters as sf
from sglang.srt.speculative.verify_sampling.node_draws import FusedDraw, NodeSamplingInfo, draw_node_tokens
from sglang.srt.speculative.verify_sampling.sampling_filters import Candidates, FilterRule, logit_floors

V = 96
NODES = 4
# Five requests, each unlike the others: top-k alone, top-k with top-p or min-p, top-p or
# min-p without a top-k (cut deeper than a few candidates), a top-k of 1.
TEMPS = [0.5, 0.7, 1.0, 1.3, 0.9]
TOP_KS = [3, 20, 1 << 30, 1, 1 << 30]
TOP_PS = [0.8, 1.0, 0.95, 0.5, 1.0]
MIN_PS = [0.0, 0.05, 0.0, 0.2, 0.1]
REQUESTS = len(TEMPS)
ROWS = REQUESTS * NODES
RULES = {
    "pytorch": FilterRule.for_backend("pytorch", need_min_p=True),
    "flashinfer": FilterRule.for_backend("flashinfer", need_min_p=False),
    "flashinfer, min-p in the batch": FilterRule.for_backend("flashinfer", need_min_p=True),
}
#: Candidates: every logit, some, too few for the rows without a top-k (the whole-row search
#: on the kernel path, the chunked sort on the torch path).
CANDIDATES = {"all": Candidates(V, False), "some": Candidates(24, True), "few": Candidates(2, True)}
#: Rows per chunk: all at once, and chunks that start inside a request.
CHUNKS = [ROWS, 3, 7]


def _requests():
    return (torch.tensor(TEMPS).view(-1, 1), torch.tensor(TOP_KS, dtype=torch.int32), torch.tensor(TOP_PS),
            torch.tensor(MIN_PS))  # fmt: skip


def _per_row(params, nodes=NODES):
    return tuple(None if t is None else t.repeat_interleave(nodes, dim=0) for t in params)


def _logits(seed: int, ties: bool = False):
    logits = torch.randn(ROWS, V, generator=torch.Generator().manual_seed(seed)) * 2.0
    if ties:  # coarse values, as bf16 logits have
        logits = (logits * 2).round() / 2
    logits[1, 5:9] = float("-inf")
    logits[NODES + 2] = float("-inf")  # a row with nothing left
    return logits


@pytest.fixture(params=["kernel", "torch"])
def impl(request, monkeypatch):
    """The Triton kernels (interpreted), or the torch path a host without a GPU takes."""
    if request.param == "torch":
        monkeypatch.setattr(sf, "_interpreted", lambda: False)
        monkeypatch.setattr(gd, "_interpreted", lambda: False)
    else:
        assert sf._interpreted() and gd._interpreted()
    return request.param


def _chunked_floors(logits, params, rule, candidates, chunk, nodes=NODES, first_row=None):
    """The per-request floors, ``chunk`` rows at a time (``first_row``: what each chunk passes,
    by default where it starts)."""
    parts = []
    for start in range(0, logits.shape[0], chunk):
        at = start if first_row is None else first_row
        parts.append(logit_floors(logits[start : start + chunk], *params, rule, candidates, max_sorted_rows=2,
                                  nodes=nodes, first_row=at))  # fmt: skip
    return torch.cat(parts)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("candidates", sorted(CANDIDATES))
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_floors_per_request_are_the_floors_per_row(impl, rule, candidates, chunk, ties):
    logits = _logits(3 + ties, ties)
    params, cand = _requests(), CANDIDATES[candidates]
    want = logit_floors(logits, *_per_row(params), RULES[rule], cand, max_sorted_rows=2)
    got = _chunked_floors(logits, params, RULES[rule], cand, chunk)
    assert torch.equal(got, want)
    assert int(torch.isfinite(want).sum()) >= ROWS - 2 * NODES  # most rows are cut


def test_floors_follow_the_request_of_each_row(impl):
    """The comparison has the power to fail: requests laid out row by row instead of node by
    node, or a chunk that forgets where it starts, give other floors."""
    logits = _logits(3)
    params, rule, cand = _requests(), RULES["pytorch"], CANDIDATES["few"]
    want = logit_floors(logits, *_per_row(params), rule, cand)
    interleaved = tuple(t.repeat((NODES,) + (1,) * (t.dim() - 1)) for t in params)  # request r % 5
    assert not torch.equal(logit_floors(logits, *interleaved, rule, cand), want)
    assert not torch.equal(_chunked_floors(logits, params, rule, cand, 7, first_row=0), want)


@pytest.mark.parametrize("first_row", [0, 6])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_floors_function_reads_the_request_of_its_rows(rule, first_row):
    """The candidates' kernel, its torch reference and the whole-row search, on a chunk of rows
    from ``first_row`` (inside a request): the floors and verdicts of the per-row parameters."""
    rows = ROWS - first_row
    logits = _logits(5)[first_row:]
    params = _requests()
    per_row = tuple(t[first_row:] for t in _per_row(params))
    at = dict(nodes=NODES, first_row=first_row)
    for among in (sf._floors_among_triton, sf.floors_among_reference):
        floors, decided = among(logits, *params, RULES[rule], 2, **at)
        want_floors, want_decided = among(logits, *per_row, RULES[rule], 2)
        assert torch.equal(floors, want_floors) and torch.equal(decided, want_decided), among.__name__
    assert 0 < int((~decided).sum()) < rows
    got, want = floors.clone(), floors.clone()
    sf._whole_row_floors_triton(logits, *params, RULES[rule], got, decided, **at)
    sf._whole_row_floors_triton(logits, *per_row, RULES[rule], want, decided)
    assert torch.equal(got, want) and not torch.equal(got, floors)


def test_parameters_for_too_few_requests_are_refused():
    logits = _logits(1)
    temps, top_ks, top_ps, min_ps = _requests()
    with pytest.raises(ValueError, match="requests' parameters"):
        logit_floors(logits, temps, top_ks[:-1], top_ps, min_ps, RULES["pytorch"], CANDIDATES["all"], nodes=NODES)
    with pytest.raises(ValueError, match="requests' parameters"):
        logit_floors(logits[8:], temps, top_ks, top_ps, min_ps, RULES["pytorch"], CANDIDATES["all"], nodes=NODES,
                     first_row=9)  # fmt: skip
    with pytest.raises(ValueError, match="divide rows"):
        gd.gumbel_draw(logits[:-1], temps, nodes=NODES)
    with pytest.raises(ValueError, match=r"temperatures must be \[requests=5, 1\]"):
        gd.gumbel_draw(logits, temps.repeat_interleave(NODES, dim=0), nodes=NODES)


@pytest.mark.parametrize("use_triton", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("floored", [False, True], ids=["plain", "floors"])
def test_draws_per_request_are_the_draws_per_row(use_triton, floored):
    """The same seed, the same tokens; the temperatures laid out by request instead of by node
    draw other tokens (the comparison can fail)."""
    logits = _logits(7)
    temps = _requests()[0]
    floors = None
    if floored:
        floors = logit_floors(logits, *_per_row(_requests()), RULES["flashinfer"], CANDIDATES["all"])
    interleaved_differ = False
    for seed in range(8):
        torch.manual_seed(seed)
        got = gd.gumbel_draw(logits, temps, floors, nodes=NODES, use_triton=use_triton)
        torch.manual_seed(seed)
        want = gd.gumbel_draw(logits, temps.repeat_interleave(NODES, dim=0), floors, use_triton=use_triton)
        assert torch.equal(got, want), seed
        torch.manual_seed(seed)
        wrong = gd.gumbel_draw(logits, temps.repeat(NODES, 1), floors, use_triton=use_triton)
        interleaved_differ |= not torch.equal(wrong, want)
    assert interleaved_differ


def test_the_reference_draw_with_a_generator():
    logits = _logits(8)
    temps = _requests()[0]
    got = gd.gumbel_draw_reference(logits, temps, generator=torch.Generator().manual_seed(4), nodes=NODES)
    want = gd.gumbel_draw_reference(logits, temps.repeat_interleave(NODES, dim=0),
                                    generator=torch.Generator().manual_seed(4))  # fmt: skip
    assert torch.equal(got, want)


def _node_info(min_p: bool = True, filters: bool = True) -> NodeSamplingInfo:
    temps, top_ks, top_ps, min_ps = _requests()
    return NodeSamplingInfo(temps, top_ks, top_ps, min_ps, None, need_top_k_sampling=filters,
                            need_top_p_sampling=filters, need_min_p_sampling=filters and min_p,
                            nodes=NODES)  # fmt: skip


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("candidates", sorted(CANDIDATES))
@pytest.mark.parametrize("batch", ["plain", "top-k/top-p", "min-p too"])
def test_the_fused_draw_per_request_is_the_draw_per_row(impl, batch, candidates, chunk):
    """draw_node_tokens with the requests' own parameters against the same info per row: the
    same tokens for the same seed, whatever the chunks (``FusedDraw.max_rows``)."""
    info = _node_info(min_p=batch == "min-p too", filters=batch != "plain")
    rule = FilterRule.for_backend("flashinfer", need_min_p=info.need_min_p_sampling)
    fused = FusedDraw(rule=rule, candidates=CANDIDATES[candidates], max_rows=chunk, max_sorted_rows=2)
    logits = _logits(9)
    per_row = info.per_row()
    assert per_row.nodes == 1 and per_row.temperatures.shape == (ROWS, 1)
    for seed in range(3):
        torch.manual_seed(seed)
        got = draw_node_tokens(logits.clone(), info, None, None, max_rows=5, fused=fused)
        torch.manual_seed(seed)
        want = draw_node_tokens(logits.clone(), per_row, None, None, max_rows=5, fused=fused)
        assert torch.equal(got, want), seed


class _Ops(TorchDispatchMode):
    """The torch ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", ["plain", "top-k/top-p", "min-p too"])
def test_the_fused_draw_spreads_parameters_over_nodes_without_an_op(batch):
    """The same ops with the requests' parameters as with parameters already per row: nothing
    copies them per node. The sampler's path (no ``fused``) does copy them, so the count can
    tell."""
    info = _node_info(min_p=batch == "min-p too", filters=batch != "plain")
    per_row = info.per_row()
    fused = FusedDraw(rule=FilterRule.for_backend("flashinfer", need_min_p=info.need_min_p_sampling),
                      candidates=CANDIDATES["some"], max_rows=7, max_sorted_rows=2)  # fmt: skip
    logits = _logits(10)

    def ops(node_info, fused, sampler=None):
        with _Ops() as rec:
            draw_node_tokens(logits.clone(), node_info, sampler, torch.zeros(ROWS, dtype=torch.int64), max_rows=5,
                             fused=fused)  # fmt: skip
        return rec.ops

    assert ops(info, fused) == ops(per_row, fused)
    if batch != "plain":
        def sampler(probs, part, positions, simple):
            return torch.zeros(probs.shape[0], dtype=torch.int64)

        assert len(ops(info, None, sampler)) > len(ops(per_row, None, sampler))

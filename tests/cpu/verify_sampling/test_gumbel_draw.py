# SPDX-License-Identifier: Apache-2.0
"""The fused Gumbel-max draw: the kernel (interpreted) and its torch reference sample exactly
softmax(logits / T) per row (a chi-squared fit that a 10% temperature error fails), never draw
a -inf logit, and draw_node_tokens takes it for every unseeded row (for the plain case only
with SGLANG_DDTREE_VERIFY_DRAW=sampler)."""

from types import SimpleNamespace

import pytest
import torch
import triton
from _upstream import VOCAB, Req, forward_info, params

from sglang.srt.speculative.verify_sampling import gumbel_draw as gd
from sglang.srt.speculative.verify_sampling.node_draws import FusedDraw, NodeSamplingInfo, draw_node_tokens
from sglang.srt.speculative.verify_sampling.node_logits import chain_paths
from sglang.srt.speculative.verify_sampling.sampling_filters import Candidates, FilterRule
from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

NEG = float("-inf")
LOGITS = [0.5, -1.0, NEG, 2.0, 0.0, 1.0]
TEMPS = (0.5, 1.3)
PER_GROUP = 16000
P_MIN = 1e-4


def _kernel_chunked(logits, temps):
    """The kernel with a vocabulary block smaller than the row (two chunks, the second partial)
    and many rows per program: the running argmax across chunks and lanes."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    rows_per_program = 256
    gd._gumbel_draw_kernel[(triton.cdiv(rows, rows_per_program),)](
        logits, logits.stride(0), temps, temps.stride(0), logits, out, int(torch.randint(0, 2**31 - 1, (1,))),
        out, rows, v, 1, ROWS=rows_per_program, BLOCK=4, HAS_FLOOR=False, SEED_FROM_PTR=False,
    )  # fmt: skip
    return out


def _seed():
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)


DRAWS = {
    "kernel": lambda logits, temps: gd.gumbel_draw(logits, temps, use_triton=True),
    "kernel, chunked": _kernel_chunked,
    "kernel, seed tensor": lambda logits, temps: gd.gumbel_draw(logits, temps, use_triton=True, seed=_seed()),
    "reference": lambda logits, temps: gd.gumbel_draw(logits, temps, use_triton=False),
    "reference, seed tensor": lambda logits, temps: gd.gumbel_draw(logits, temps, use_triton=False, seed=_seed()),
}


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy import stats

    n = float(counts.sum())
    live = probs > 0
    return float(stats.chisquare(counts[live].numpy(), (probs[live] * n).numpy()).pvalue)


def test_the_interpreter_runs_the_kernel():
    assert gd._interpreted()


@pytest.mark.parametrize("impl", sorted(DRAWS))
def test_each_row_samples_softmax_of_its_scaled_logits(impl):
    """Rows alternate between the two temperatures; each group fits softmax(logits / T) and
    rejects softmax(logits / (1.1 T)), so the fit has the power to fail."""
    rows = PER_GROUP * len(TEMPS)
    logits = torch.tensor(LOGITS).expand(rows, -1).contiguous()
    temps = torch.tensor(TEMPS).repeat(PER_GROUP).view(rows, 1)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        tokens = DRAWS[impl](logits, temps)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    base = torch.tensor(LOGITS, dtype=torch.float64)
    for g, t in enumerate(TEMPS):
        counts = torch.bincount(tokens[g :: len(TEMPS)], minlength=len(LOGITS)).double()
        assert counts[2] == 0, "a -inf logit was drawn"
        assert _chi2_pvalue(counts, torch.softmax(base / t, -1)) > P_MIN, (t, counts)
        assert _chi2_pvalue(counts, torch.softmax(base / (1.1 * t), -1)) < P_MIN, (t, counts)


@pytest.mark.parametrize("impl", sorted(DRAWS))
def test_masked_logits_are_never_drawn(impl):
    gen = torch.Generator().manual_seed(5)
    rows, v = 64, 11
    logits = torch.randn(rows, v, generator=gen) * 4
    masked = torch.rand(rows, v, generator=gen) < 0.7
    masked[torch.arange(rows), torch.randint(0, v, (rows,), generator=gen)] = False  # one live per row
    logits[masked] = NEG
    only = torch.full((4, v), NEG)
    only[torch.arange(4), torch.tensor([0, 3, 4, v - 1])] = 0.0  # one live logit: first, chunk edges, last
    logits = torch.cat([logits, only])
    temps = torch.empty(len(logits), 1).uniform_(0.2, 2.0, generator=gen)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        for _ in range(5):
            tokens = DRAWS[impl](logits, temps)
            assert torch.isfinite(logits[torch.arange(len(logits)), tokens]).all()
            assert tokens[rows:].tolist() == [0, 3, 4, v - 1]


@pytest.mark.parametrize("use_triton", [True, False], ids=["kernel", "reference"])
def test_a_seed_tensor_keys_the_draw(use_triton):
    """The same seed tensor draws the same tokens, another seed others; the kernel reading its
    seed from the tensor draws what it draws given that seed as a number."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(8))
    temps = torch.ones(64, 1)
    draw = lambda seed: gd.gumbel_draw(logits, temps, use_triton=use_triton, seed=torch.tensor([seed]))  # noqa: E731
    assert torch.equal(draw(12345), draw(12345))
    assert not torch.equal(draw(12345), draw(54321))
    if use_triton:
        by_number = torch.empty(64, dtype=torch.int64)
        gd._gumbel_draw_kernel[(64,)](
            logits, logits.stride(0), temps, temps.stride(0), logits, by_number, 12345, by_number, 64, 300, 1,
            ROWS=1, BLOCK=512, HAS_FLOOR=False, SEED_FROM_PTR=False,
        )  # fmt: skip
        assert torch.equal(draw(12345), by_number)


@pytest.mark.parametrize("bad", [torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32), torch.tensor(1)])
def test_a_seed_tensor_of_another_shape_or_type_is_refused(bad):
    with pytest.raises(ValueError, match="seed must be int64"):
        gd.gumbel_draw(torch.zeros(2, 4), torch.ones(2, 1), seed=bad)


def test_a_row_of_only_masked_logits_gives_token_zero():
    logits = torch.full((3, 9), NEG)
    logits[1, 5] = 1.0
    temps = torch.ones(3, 1)
    for impl, draw in DRAWS.items():
        assert draw(logits, temps).tolist() == [0, 5, 0], impl


def test_the_kernel_leaves_the_logits_as_they_are():
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(1))
    logits[:, 7] = NEG
    before = logits.clone()
    gd.gumbel_draw(logits, torch.full((40, 1), 0.8), use_triton=True)
    assert torch.equal(logits, before)


def _info(rows, *, top_k=False, top_p=False, min_p=False, seeded=False):
    return NodeSamplingInfo(
        temperatures=torch.full((rows, 1), 0.9),
        top_ks=torch.full((rows,), 1 << 30, dtype=torch.int32),
        top_ps=torch.ones(rows),
        min_ps=torch.zeros(rows),
        sampling_seed=torch.arange(rows, dtype=torch.int64) if seeded else None,
        need_top_k_sampling=top_k,
        need_top_p_sampling=top_p,
        need_min_p_sampling=min_p,
    )


class _Recorder:
    """Stands in for ``Sampler._sample_from_probs``: records that the sampler's path ran."""

    def __init__(self):
        self.calls = []

    def __call__(self, probs, info, positions, simple):
        self.calls.append(simple)
        return torch.zeros(probs.shape[0], dtype=torch.int32)


def test_the_plain_unseeded_case_is_the_fused_draw():
    rows = 12
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2))
    buf = logits.clone()
    sampler = _Recorder()
    tokens = draw_node_tokens(buf, _info(rows), sampler, torch.zeros(rows, dtype=torch.int64), max_rows=5)
    assert sampler.calls == []
    assert torch.equal(buf, logits)  # no temperature, no softmax: the logits were only read
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert bool(((tokens >= 0) & (tokens < VOCAB)).all())


_FUSED = FusedDraw(rule=FilterRule.for_backend("flashinfer", need_min_p=False), candidates=Candidates(8, True),
                   max_rows=5, max_sorted_rows=5)  # fmt: skip


@pytest.mark.parametrize("flag", ["top_k", "top_p", "min_p", "seeded"])
def test_filters_are_drawn_fused_and_seeds_by_the_samplers_path(flag):
    """With the fused draw a filtered row reads the logits only; a seeded one keeps the
    sampler's seeded path (temperature, softmax, then its draw)."""
    rows = 12
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2))
    buf = logits.clone()
    sampler = _Recorder()
    positions = torch.zeros(rows, dtype=torch.int64)
    tokens = draw_node_tokens(buf, _info(rows, **{flag: True}), sampler, positions, max_rows=5, fused=_FUSED)
    if flag == "seeded":
        assert sampler.calls == [True] * 3  # chunks of 5, 5, 2 rows
        torch.testing.assert_close(buf.sum(-1), torch.ones(rows))  # overwritten with the probabilities
    else:
        assert sampler.calls == [] and torch.equal(buf, logits)
        assert tokens.dtype == torch.int64 and bool(((tokens >= 0) & (tokens < VOCAB)).all())


@pytest.mark.parametrize("flag", ["top_k", "top_p", "min_p", "seeded"])
def test_without_the_fused_draw_any_filter_or_seed_takes_the_samplers_path(flag):
    rows = 12
    buf = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2))
    sampler = _Recorder()
    positions = torch.zeros(rows, dtype=torch.int64)
    draw_node_tokens(buf, _info(rows, **{flag: True}), sampler, positions, max_rows=5)
    assert sampler.calls == [flag == "seeded"] * 3  # chunks of 5, 5, 2 rows
    torch.testing.assert_close(buf.sum(-1), torch.ones(rows))  # overwritten with the probabilities


def _target_tokens(sampler, reqs):
    n = 3
    bs = len(reqs)
    vs = VerifySampler(vocab_size=VOCAB, device="cpu", sampler=SimpleNamespace(_sample_from_probs=sampler),
                       sampling_backend="pytorch")  # fmt: skip
    logits = torch.randn(bs * n, VOCAB, generator=torch.Generator().manual_seed(4))
    buf = logits.clone()
    paths = chain_paths(torch.full((bs, n), 5))
    vs.target_tokens(buf, forward_info(reqs, VOCAB), reqs, paths, torch.zeros(bs, n, dtype=torch.int64))
    return torch.equal(buf, logits)


BATCHES = {
    "temperature 1": ([dict(temperature=1.0)], True),
    "two temperatures": ([dict(temperature=0.7), dict(temperature=1.3)], True),
    # upstream turns a greedy request into temperature 1 and top_k 1: the batch needs top-k
    "a greedy request beside a sampled one": ([dict(temperature=1.0), dict(temperature=0.0)], False),
    "top_k": ([dict(temperature=1.0), dict(temperature=1.0, top_k=20)], False),
    "top_p": ([dict(temperature=1.0, top_p=0.9)], False),
    "min_p": ([dict(temperature=1.0, min_p=0.1)], False),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_the_verify_draws_every_unseeded_batch_fused(published, single_rank, batch):
    """Through upstream's own SamplingBatchInfo: plain or filtered, the fused draw."""
    kws, _ = BATCHES[batch]
    reqs = [Req(params(**kw), [0], [5], pool_idx=i, prefilled_outputs=0) for i, kw in enumerate(kws)]
    sampler = _Recorder()
    assert _target_tokens(sampler, reqs) and sampler.calls == []


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_the_samplers_draw_fuses_exactly_its_multinomial_case(published, single_rank, monkeypatch, batch):
    """SGLANG_DDTREE_VERIFY_DRAW=sampler: the fused draw only where the sampler would call
    torch.multinomial, its own kernels wherever a request of the batch filters."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", "sampler")
    kws, fused = BATCHES[batch]
    reqs = [Req(params(**kw), [0], [5], pool_idx=i, prefilled_outputs=0) for i, kw in enumerate(kws)]
    sampler = _Recorder()
    untouched = _target_tokens(sampler, reqs)
    assert (sampler.calls == [], untouched) == (fused, fused), sampler.calls


def test_an_unknown_draw_is_refused(published, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", "flashinfer")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_VERIFY_DRAW='flashinfer': expected one of fused, sampler"):
        VerifySampler(vocab_size=VOCAB, device="cpu", sampler=SimpleNamespace(_sample_from_probs=None),
                      sampling_backend="pytorch")  # fmt: skip


def test_seeded_requests_keep_the_samplers_seeded_path(deterministic, single_rank):
    reqs = [Req(params(temperature=1.0, sampling_seed=7), [0], [5], prefilled_outputs=0)]
    sampler = _Recorder()
    assert not _target_tokens(sampler, reqs)
    assert sampler.calls == [True]


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_per_node_parameters_are_the_requests_own_and_repeat_per_row(published, batch):
    """The fused draw's info holds the batch's own tensors (no copy) and the number of nodes;
    per row, every request's temperature, top-k and top-p on each of its nodes."""
    kws, plain = BATCHES[batch]
    reqs = [Req(params(**kw), [0], [5], pool_idx=i, prefilled_outputs=0) for i, kw in enumerate(kws)]
    info = forward_info(reqs, VOCAB)
    node = NodeSamplingInfo.for_nodes(info, 3)
    assert node.nodes == 3 and node.simple == plain
    assert node.temperatures.shape == (len(reqs), 1)
    assert node.temperatures.data_ptr() == info.temperatures.data_ptr()
    assert node.top_ks is info.top_ks and node.top_ps is info.top_ps and node.min_ps is info.min_ps
    row = node.per_row()
    assert row.nodes == 1 and row.simple == plain
    assert torch.equal(row.temperatures.view(-1), info.temperatures.view(-1).repeat_interleave(3))
    assert torch.equal(row.top_ks, info.top_ks.repeat_interleave(3))
    assert torch.equal(row.top_ps, info.top_ps.repeat_interleave(3))
    assert (row.min_ps is None) == (not info.need_min_p_sampling)
    if info.need_min_p_sampling:
        assert torch.equal(row.min_ps, info.min_ps.repeat_interleave(3))
    assert row.per_row() is row
    with pytest.raises(ValueError, match="rows per request"):
        node.rows(0, 2)

# SPDX-License-Identifier: Apache-2.0
"""The verify sampler against upstream's own sampler, node by node: seeded draws token for
token, and the distribution each unseeded draw samples from (joint top-k/top-p, min-p)."""

import contextlib

import pytest
import torch
from _upstream import (
    VOCAB,
    Req,
    forward_info,
    params,
    random_tree,
    root_path,
    upstream_node_distribution,
    upstream_node_token,
)

from sglang.srt.sampling.sampling_params import TOP_K_ALL
from sglang.srt.speculative.verify_sampling import node_draws
from sglang.srt.speculative.verify_sampling import verify_sampler as verify_sampler_module
from sglang.srt.speculative.verify_sampling.node_logits import NodePaths, chain_paths
from sglang.srt.speculative.verify_sampling.sampling_filters import FilterRule, filtered_probs_reference
from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

PROMPT = 3


def _random_params(gen, seeded: bool, min_p: bool):
    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    kw = dict(
        temperature=pick([0.0, 0.6, 1.0, 1.4]),
        top_k=pick([-1, 1, 4, 20]),
        top_p=pick([1.0, 0.8, 0.5]),
    )
    if min_p:
        kw["min_p"] = pick([0.0, 0.05, 0.3])
    if bool(torch.rand(1, generator=gen) < 0.6):
        kw.update(frequency_penalty=pick([0.0, 0.4, 1.0]), presence_penalty=pick([0.0, 0.5]),
                  repetition_penalty=pick([1.0, 1.3, 0.8]), min_new_tokens=pick([0, 4]))  # fmt: skip
    if bool(torch.rand(1, generator=gen) < 0.3):
        kw["logit_bias"] = {str(int(torch.randint(0, VOCAB, (1,), generator=gen))): 4.0}
    if seeded:
        kw["sampling_seed"] = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    return params(**kw)


def _step(gen, bs, n, seeded, min_p=False):
    reqs = []
    for b in range(bs):
        committed = torch.randint(0, 12, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
        root = int(torch.randint(0, 12, (1,), generator=gen))
        reqs.append(Req(_random_params(gen, seeded, min_p), list(range(PROMPT)), committed + [root],
                        pool_idx=b, prefilled_outputs=len(committed)))  # fmt: skip
    tokens, parent, depth = random_tree(gen, bs, n, 12)
    tokens[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
    committed_len = torch.tensor([PROMPT + len(r.output_ids) - 1 for r in reqs])
    positions = committed_len.view(bs, 1) + depth.to(torch.int64)
    logits = torch.randn(bs * n, VOCAB, generator=gen) * 2.5
    return reqs, NodePaths(tokens, parent, depth, int(depth.max())), positions, logits


def _verify_sampler(sampler, max_rows=None):
    vs = VerifySampler(vocab_size=VOCAB, device="cpu", sampler=sampler, sampling_backend="pytorch")
    if max_rows is not None:
        vs.max_rows = max_rows
    return vs


@pytest.mark.parametrize("seed", range(6))
def test_seeded_draws_are_upstreams_token_for_token(deterministic, upstream_sampler, single_rank, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = 4, 8
    reqs, paths, positions, logits = _step(gen, bs, n, seeded=True)
    info = forward_info(reqs, VOCAB)
    got = _verify_sampler(upstream_sampler, max_rows=5).target_tokens(
        logits.clone(), info, reqs, paths, positions).tokens
    for b, req in enumerate(reqs):
        for i in range(n):
            history = req.output_ids[:-1] + root_path(paths.tokens, paths.parent, b, i)
            want = upstream_node_token(upstream_sampler, req.sampling_params, history, logits[b * n + i],
                                       int(positions[b, i]), VOCAB, info)  # fmt: skip
            assert int(got[b, i]) == want, (b, i, req.sampling_params)


def test_greedy_batch_with_penalties_is_upstreams_argmax(published, upstream_sampler, single_rank):
    gen = torch.Generator().manual_seed(7)
    bs, n = 3, 10
    reqs, _, positions, logits = _step(gen, bs, n, seeded=False)
    for r in reqs:
        r.sampling_params = params(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7,
                                   presence_penalty=0.3, min_new_tokens=3)  # fmt: skip
    tokens = torch.randint(0, 6, (bs, n), generator=gen)  # a chain that repeats tokens
    tokens[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
    paths = chain_paths(tokens)
    info = forward_info(reqs, VOCAB)
    assert info.is_all_greedy
    got = _verify_sampler(upstream_sampler).target_tokens(logits.clone(), info, reqs, paths, positions).tokens
    for b, req in enumerate(reqs):
        for i in range(n):
            history = req.output_ids[:-1] + tokens[b, : i + 1].tolist()
            assert int(got[b, i]) == upstream_node_token(upstream_sampler, req.sampling_params, history,
                                                         logits[b * n + i], 0, VOCAB)  # fmt: skip
    # the penalties changed some argmax (else the comparison proves little)
    assert not torch.equal(got.view(-1), logits.argmax(-1))


@contextlib.contextmanager
def _recorded_multinomial():
    """The weights every torch.multinomial call samples from, row by row, normalised."""
    rows = []
    real = torch.multinomial

    def record(weights, num_samples, *args, **kwargs):
        w = weights.double()
        rows.extend(w / w.sum(-1, keepdim=True))
        return real(weights, num_samples, *args, **kwargs)

    torch.multinomial = record
    try:
        yield rows
    finally:
        torch.multinomial = real


@contextlib.contextmanager
def _recorded_draws(draw: str, monkeypatch):
    """Every row's distribution the verify's draw samples from, in vocabulary order: on the
    sampler's path torch.multinomial's weights (over the probabilities sorted in descending
    order) put back in place; for the fused Gumbel-max draw softmax(logits / T) over the
    logits at or above the row's floor."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", draw)
    rows = []
    if draw == "sampler":
        real = node_draws.draw_node_tokens

        def record_sampler(probs, info, sample_from_probs, positions, max_rows, fused=None):
            def sample(x, part, pos, simple):
                with _recorded_multinomial() as weights:
                    ids = sample_from_probs(x, part, pos, simple)
                for w, prow in zip(weights, x):
                    out = torch.zeros_like(w)
                    out[torch.argsort(prow, descending=True, stable=True)] = w
                    rows.append(out)
                return ids

            return real(probs, info, sample, positions, max_rows, fused)

        monkeypatch.setattr(verify_sampler_module, "draw_node_tokens", record_sampler)
        yield rows
        return
    real = node_draws.gumbel_draw

    def record(logits, temperatures, floors=None, **kwargs):
        # One temperature per request of ``nodes`` consecutive rows.
        x = logits.double() / temperatures.double().repeat_interleave(kwargs.get("nodes", 1), dim=0)
        if floors is not None:
            x = x.masked_fill(logits < floors.view(-1, 1), float("-inf"))
        rows.extend(torch.softmax(x, dim=-1))
        return real(logits, temperatures, floors, **kwargs)

    monkeypatch.setattr(node_draws, "gumbel_draw", record)
    yield rows


DRAWS = ("fused", "sampler")


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("seed", range(4))
def test_each_node_samples_upstreams_distribution(published, upstream_sampler, single_rank, monkeypatch, draw,
                                                  seed):  # fmt: skip
    """Unseeded draws (min-p included): the distribution each node's draw samples from, fused
    or by the sampler's kernels, is the one upstream's sampler samples from for that node's
    context."""
    gen = torch.Generator().manual_seed(40 + seed)
    bs, n = 4, 6
    reqs, paths, positions, logits = _step(gen, bs, n, seeded=False, min_p=True)
    info = forward_info(reqs, VOCAB)
    assert not info.is_all_greedy and info.need_min_p_sampling == any(r.sampling_params.min_p > 0 for r in reqs)
    with _recorded_draws(draw, monkeypatch) as ours:
        _verify_sampler(upstream_sampler, max_rows=7).target_tokens(logits.clone(), info, reqs, paths, positions)
    assert len(ours) == bs * n
    for b, req in enumerate(reqs):
        for i in range(n):
            history = req.output_ids[:-1] + root_path(paths.tokens, paths.parent, b, i)
            ref = upstream_node_distribution(upstream_sampler, req.sampling_params, history, logits[b * n + i],
                                             VOCAB, info)  # fmt: skip
            torch.testing.assert_close(ours[b * n + i], ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("draw", DRAWS)
def test_top_k_and_top_p_apply_jointly_to_the_original_distribution(published, upstream_sampler, single_rank,
                                                                     monkeypatch, draw):  # fmt: skip
    """p = [.4, .3, .2, .1], top_k=2, top_p=0.5: the sampler keeps both of the top two
    (0.571, 0.429), where a top-k renormalisation before top-p would keep one."""
    p = torch.zeros(VOCAB)
    p[:4] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.where(p > 0, p.log(), torch.tensor(-1e9)).view(1, -1)
    req = Req(params(temperature=1.0, top_k=2, top_p=0.5), [0, 1, 2], [9], prefilled_outputs=0)
    paths = chain_paths(torch.tensor([[9]]))
    with _recorded_draws(draw, monkeypatch) as rows:
        _verify_sampler(upstream_sampler).target_tokens(
            logits.clone(), forward_info([req], VOCAB), [req], paths, torch.tensor([[3]]))
    kept = rows[0][rows[0] > 0]
    torch.testing.assert_close(kept, torch.tensor([4 / 7, 3 / 7], dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("draw", DRAWS)
def test_unseeded_node_draws_follow_the_distribution(published, upstream_sampler, single_rank, monkeypatch, draw):
    """Many rows of one node, plain and filtered: the empirical frequencies match the
    distribution (the filtered one from its definitions, sampling_filters' reference)."""
    from scipy import stats

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", draw)
    rows = 4000
    logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5).expand(rows, VOCAB).contiguous()
    for kw in (dict(temperature=1.0, top_k=TOP_K_ALL), dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.01)):
        reqs = [Req(params(**kw), [0], [5], pool_idx=i, prefilled_outputs=0) for i in range(rows)]
        info = forward_info(reqs, VOCAB)
        want = filtered_probs_reference(
            logits[:1], info.temperatures[:1], info.top_ks[:1], info.top_ps[:1], info.min_ps[:1],
            FilterRule.for_backend("pytorch", need_min_p=True))[0]  # fmt: skip
        paths = chain_paths(torch.full((rows, 1), 5))
        got = _verify_sampler(upstream_sampler, max_rows=999).target_tokens(
            logits.clone(), info, reqs, paths, torch.zeros(rows, 1, dtype=torch.int64)).tokens
        counts = torch.bincount(got.view(-1), minlength=VOCAB).double()
        live = want > 0
        assert not bool((counts[~live] > 0).any()), kw
        assert stats.chisquare(counts[live].numpy(), (want[live] * rows).numpy()).pvalue > 1e-4, kw

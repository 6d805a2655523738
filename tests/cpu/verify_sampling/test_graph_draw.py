# SPDX-License-Identifier: Apache-2.0
"""A sampled DDTREE step's draw inside a CUDA graph (``VerifySampler.graph_draw``): which
batches a graph may draw (upstream's own ``SamplingBatchInfo`` for each), and that its draw is
the verify's eager draw token for token given the same seed (the kernel interpreted)."""

from types import SimpleNamespace

import pytest
import torch
from _upstream import VOCAB, Req, forward_info, params

from sglang.srt.speculative.verify_sampling.node_logits import chain_paths
from sglang.srt.speculative.verify_sampling.verify_sampler import GraphDraw, VerifySampler

NODES = 5

BATCHES = {
    "temperature 1": [dict(temperature=1.0)],
    "two temperatures": [dict(temperature=0.7), dict(temperature=1.3)],
    "a greedy request beside a sampled one": [dict(temperature=1.0), dict(temperature=0.0)],
    "top_k with top_p": [dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=1.0, top_k=5)],
    "top_p": [dict(temperature=1.0, top_p=0.9)],
    "min_p": [dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)],
}


def _reqs(kws):
    return [Req(params(**kw), [0], [5], pool_idx=i, prefilled_outputs=0) for i, kw in enumerate(kws)]


def _sampler():
    return VerifySampler(vocab_size=VOCAB, device="cpu", sampler=SimpleNamespace(_sample_from_probs=None),
                         sampling_backend="pytorch")  # fmt: skip


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_a_graph_draws_what_the_verify_draws_given_the_same_seed(published, single_rank, batch):
    reqs = _reqs(BATCHES[batch])
    info = forward_info(reqs, VOCAB)
    vs = _sampler()
    draw = vs.graph_draw(info, reqs)
    assert isinstance(draw, GraphDraw)
    assert (draw.need_top_k, draw.need_top_p, draw.need_min_p) == (
        info.need_top_k_sampling, info.need_top_p_sampling, info.need_min_p_sampling)  # fmt: skip
    assert (draw.fused is None) == (not (info.need_top_k_sampling or info.need_top_p_sampling
                                         or info.need_min_p_sampling))  # fmt: skip
    hash(draw)  # a graph's key
    bs = len(reqs)
    logits = torch.randn(bs * NODES, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    with torch.random.fork_rng():
        torch.manual_seed(21)
        eager = vs.target_tokens(logits.clone(), info, reqs, chain_paths(torch.full((bs, NODES), 5)),
                                 torch.zeros(bs, NODES, dtype=torch.int64)).tokens.view(-1)  # fmt: skip
        torch.manual_seed(21)  # the seed the eager draw took from the generator
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    got = draw.tokens(logits.clone(), info.temperatures.view(-1, 1), info.top_ks, info.top_ps, info.min_ps,
                      nodes=NODES, seed=seed)  # fmt: skip
    assert torch.equal(got, eager)
    torch.manual_seed(0)
    other = draw.tokens(logits.clone(), info.temperatures.view(-1, 1), info.top_ks, info.top_ps, info.min_ps,
                        nodes=NODES, seed=torch.tensor([987654321]))  # fmt: skip
    assert not torch.equal(other, eager), "another seed must draw otherwise"


def test_a_greedy_batch_is_the_argmax_not_a_draw(published, single_rank):
    reqs = _reqs([dict(temperature=0.0)])
    assert _sampler().graph_draw(forward_info(reqs, VOCAB), reqs) is None
    assert _sampler().graph_draw(None, reqs) is None


@pytest.mark.parametrize(
    "kw",
    [dict(repetition_penalty=1.1), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
     dict(logit_bias={"7": 2.0})],
    ids=["repetition", "frequency", "presence", "logit-bias"],
)  # fmt: skip
def test_adjusted_logits_draw_eagerly(published, single_rank, kw):
    reqs = _reqs([dict(temperature=1.0, **kw)])
    assert _sampler().graph_draw(forward_info(reqs, VOCAB), reqs) is None


def test_seeded_requests_draw_eagerly(deterministic, single_rank):
    reqs = _reqs([dict(temperature=1.0, sampling_seed=7)])
    assert _sampler().graph_draw(forward_info(reqs, VOCAB), reqs) is None


def test_tensor_parallel_draws_eagerly(published, monkeypatch):
    from sglang.srt.speculative.verify_sampling import verify_sampler

    monkeypatch.setattr(verify_sampler, "get_tp_group", lambda: SimpleNamespace(world_size=2))
    reqs = _reqs([dict(temperature=1.0)])
    assert _sampler().graph_draw(forward_info(reqs, VOCAB), reqs) is None


def test_the_samplers_kernels_draw_filters_eagerly(published, single_rank, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", "sampler")
    filtered = _reqs([dict(temperature=1.0, top_k=5)])
    assert _sampler().graph_draw(forward_info(filtered, VOCAB), filtered) is None
    plain = _reqs([dict(temperature=1.0)])
    assert _sampler().graph_draw(forward_info(plain, VOCAB), plain) == GraphDraw(False, False, False, None)

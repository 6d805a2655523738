# SPDX-License-Identifier: Apache-2.0
"""Per-node logit adjustments: the Triton kernel (interpreted) against the per-node loop, and
the loop against upstream's own penalizers fed each node's root path as the output so far."""

import math

import pytest
import torch
from _upstream import VOCAB, Req, params, random_tree, root_path

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.verify_sampling.node_logits import (
    NodePaths,
    apply_node_logit_adjustments,
    chain_paths,
    node_logit_adjustments_reference,
)
from sglang.srt.speculative.verify_sampling.penalty_table import PenaltyTable



def _penalised_batch(gen, bs, vocab, committed_max=6):
    """Requests with random penalties (every third without any) and committed outputs."""
    reqs = []
    for b in range(bs):
        if b % 3 == 2:
            p = params(temperature=0.0)
        else:
            p = params(
                temperature=0.0,
                frequency_penalty=float(torch.empty(1).uniform_(-0.5, 1.5, generator=gen)),
                presence_penalty=float(torch.empty(1).uniform_(-0.5, 1.5, generator=gen)),
                repetition_penalty=float(torch.empty(1).uniform_(0.7, 1.6, generator=gen)),
                min_new_tokens=int(torch.randint(0, 9, (1,), generator=gen)),
                stop_token_ids={int(torch.randint(4, vocab, (1,), generator=gen))},
            )
        committed = torch.randint(0, 8, (int(torch.randint(0, committed_max, (1,), generator=gen)),),
                                  generator=gen).tolist()  # fmt: skip
        root = int(torch.randint(0, 8, (1,), generator=gen))
        reqs.append(Req(p, [9, 9], committed + [root], pool_idx=b, prefilled_outputs=len(committed)))
    return reqs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vocab,with_bias", [(VOCAB, True), (VOCAB, False), (1100, True)])
def test_kernel_matches_the_per_node_loop(seed, vocab, with_bias):
    gen = torch.Generator().manual_seed(seed)
    bs, n = 3, 7 if vocab < 1000 else 3
    reqs = _penalised_batch(gen, bs, min(vocab, 40))
    table = PenaltyTable(vocab, "cpu")
    pen = table.rows_for(reqs)
    tokens, parent, depth = random_tree(gen, bs, n, 8)  # small token range: paths repeat tokens
    tokens[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
    paths = NodePaths(tokens, parent, depth, int(depth.max()))
    logits = torch.randn(bs * n, vocab, generator=gen) * 3
    bias = torch.randn(bs, vocab, generator=gen) if with_bias else None
    want = logits.clone()
    node_logit_adjustments_reference(want, paths, pen, bias)
    got = logits.clone()
    apply_node_logit_adjustments(got, paths, pen, bias, use_triton=True)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(got, logits)  # something was adjusted


def test_nothing_to_apply_leaves_logits_alone():
    logits = torch.randn(6, VOCAB)
    paths = chain_paths(torch.zeros(2, 3, dtype=torch.int64))
    before = logits.clone()
    apply_node_logit_adjustments(logits, paths, None, None)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", range(3))
def test_per_node_penalties_are_upstreams_for_the_nodes_root_path(published, seed):
    """Each node's logits as upstream adjusts them for one request whose output so far is the
    committed output, the root and the node's path (its penalizers fed token by token)."""
    gen = torch.Generator().manual_seed(100 + seed)
    bs, n = 4, 9
    reqs = _penalised_batch(gen, bs, VOCAB)
    table = PenaltyTable(VOCAB, "cpu")
    pen = table.rows_for(reqs)
    tokens, parent, depth = random_tree(gen, bs, n, 8)
    tokens[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
    logits = torch.randn(bs * n, VOCAB, generator=gen) * 3
    got = logits.clone()
    node_logit_adjustments_reference(got, NodePaths(tokens, parent, depth, int(depth.max())), pen, None)
    for b, req in enumerate(reqs):
        committed = req.output_ids[:-1]
        for i in range(n):
            history = committed + root_path(tokens, parent, b, i)
            one = Req(req.sampling_params, [9, 9], history)
            info = SamplingBatchInfo.from_schedule_batch(_Batch([one]), VOCAB)
            for t in history:
                info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor([t]))
            want = logits[b * n + i].clone().view(1, -1)
            info.copy_for_forward().apply_logits_bias(want)
            row = got[b * n + i]
            assert torch.equal(torch.isinf(row), torch.isinf(want[0])), (b, i)
            torch.testing.assert_close(row, want[0], rtol=0, atol=1e-5)
    # the stop tokens were blocked somewhere and released somewhere (min_new_tokens by depth)
    blocked = torch.isinf(got).any(-1)
    assert blocked.any() and not blocked.all()


class _Batch:
    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


def test_chain_paths_walk_back_to_the_root():
    paths = chain_paths(torch.arange(10).view(2, 5))
    assert paths.parent[1].tolist() == [-1, 0, 1, 2, 3]
    assert paths.depth[0].tolist() == [0, 1, 2, 3, 4]
    assert paths.max_depth == 4
    assert root_path(paths.tokens, paths.parent, 1, 3) == [5, 6, 7, 8]
    assert math.isfinite(float(paths.depth.float().sum()))

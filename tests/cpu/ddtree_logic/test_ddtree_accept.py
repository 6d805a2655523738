# SPDX-License-Identifier: Apache-2.0
"""DDTree acceptance (torch path) against a naive walk, and the walk over one
sampled target token per node against the target's own sampling distribution."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.reference import greedy_accept_ref
from sglang.srt.speculative.ddtree.tree_build import DraftTree
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth


def _compiled(rng, bs, budget, num_depths, vocab, pad_prob=0.0):
    tree = random_tree(rng, bs, budget, num_depths, vocab, pad_prob)
    bonus = torch.from_numpy(rng.integers(0, vocab, size=bs))
    ct = compile_tree(tree, bonus, torch.zeros(bs, dtype=torch.int64), max_tree_depth(budget, num_depths))
    return ct


def _walk_biased_predictions(rng, ct, vocab, follow):
    """Target argmax that follows some tree edge with probability ``follow``."""
    bs, n = ct.tokens.shape
    pred = rng.integers(0, vocab, size=(bs, n))
    parent = ct.parent.numpy()
    tokens = ct.tokens.numpy()
    for b in range(bs):
        for i in range(n):
            kids = [j for j in range(n) if parent[b, j] == i]
            if kids and rng.random() < follow:
                pred[b, i] = tokens[b, rng.choice(kids)]
    return torch.from_numpy(pred)


def _check_against_ref(res, ct, paths_and_bonus):
    d = ct.max_depth + 1
    for b, (path, bonus) in enumerate(paths_and_bonus):
        k = len(path) - 1
        assert int(res.num_accepted[b]) == k
        assert res.accept_index[b].tolist() == path + [-1] * (d - k - 1)
        emitted = [int(ct.tokens[b, j]) for j in path[1:]] + [bonus]
        assert res.accept_tokens[b].tolist() == emitted + [-1] * (d - k - 1)
        assert int(res.next_bonus[b]) == bonus


@settings(max_examples=60, deadline=None, database=None)
@given(
    bs=st.integers(1, 4),
    budget=st.integers(1, 60),
    num_depths=st.integers(1, 10),
    vocab=st.integers(1, 5),
    follow=st.sampled_from([0.0, 0.7, 1.0]),
    pad_prob=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_matches_naive_walk(bs, budget, num_depths, vocab, follow, pad_prob, seed):
    rng = np.random.default_rng(seed)
    ct = _compiled(rng, bs, budget, num_depths, vocab, pad_prob)
    pred = _walk_biased_predictions(rng, ct, vocab, follow)
    res = greedy_accept(ct, pred, use_kernel=False)
    refs = [greedy_accept_ref(ct.tokens[b].tolist(), ct.parent[b].tolist(), pred[b].tolist()) for b in range(bs)]
    _check_against_ref(res, ct, refs)
    # the flat form indexes [bs * N] verify outputs
    flat = res.flat_accept_index(budget + 1)
    assert torch.equal(flat >= 0, res.accept_index >= 0)
    assert torch.equal(flat[:, 0], torch.arange(bs) * (budget + 1))


def _chain_and_branch_tree(vocab):
    """Root with children {0, 1}; node 1 (token 0) has children {1, 2}."""
    return DraftTree(
        node_token=torch.tensor([[0, 1, 1, 2]]),
        node_parent=torch.tensor([[0, 0, 1, 1]], dtype=torch.int32),
        node_depth=torch.tensor([[1, 1, 2, 2]], dtype=torch.int32),
        node_rank=torch.tensor([[0, 1, 0, 1]], dtype=torch.int32),
        node_score=torch.zeros(1, 4),
        num_nodes=torch.tensor([4], dtype=torch.int32),
    )


def test_walk_over_per_node_draws_follows_the_target_distribution():
    """Chi-square: first token ~ q_root; second token given first ~ q_node."""
    vocab, trials = 5, 40000
    tree = _chain_and_branch_tree(vocab)
    g = torch.Generator().manual_seed(1234)
    # per-node target distributions of one request, shared by all trials
    q = torch.softmax(torch.randn(5, vocab, generator=g) * 1.2, -1)
    q[3, 4] = 0.0  # node 3 is a leaf; give it a zero-probability token too
    q[3] /= q[3].sum()
    tree = DraftTree(*(t.expand(trials, *t.shape[1:]).contiguous() for t in (
        tree.node_token, tree.node_parent, tree.node_depth, tree.node_rank, tree.node_score)),
        num_nodes=tree.num_nodes.expand(trials).contiguous())
    zeros = torch.zeros(trials, dtype=torch.int64)
    ct = compile_tree(tree, zeros, zeros, 2, use_triton=False)  # 40k interpreted programs would be slow
    # One independent draw per node from that node's distribution, then the walk.
    draws = torch.multinomial(q, trials, replacement=True, generator=g).T.contiguous()
    res = greedy_accept(ct, draws, use_kernel=False)
    first = res.accept_tokens[:, 0]
    second = res.accept_tokens[:, 1]

    def chi2_pvalue(samples, dist):
        counts = torch.bincount(samples, minlength=vocab).double()
        expected = dist.double() / dist.double().sum() * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0, "a zero-probability token was emitted"
        return stats.chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue

    assert chi2_pvalue(first, q[0]) > 1e-4
    # After first token 0 (node 1 accepted) the next token is drawn at node 1.
    after0 = second[first == 0]
    assert len(after0) > 1000
    assert chi2_pvalue(after0, q[1]) > 1e-4
    # After first token 1 (node 2, a leaf) the next token is node 2's draw.
    after1 = second[first == 1]
    assert chi2_pvalue(after1, q[2]) > 1e-4
    # After first token 0 then 2 (node 4, leaf) the third token is node 4's draw.
    third = res.accept_tokens[:, 2][(first == 0) & (second == 2)]
    assert len(third) > 300
    assert chi2_pvalue(third, q[4]) > 1e-4
    # After (0, 1) the bonus is node 3's draw, which never picks its zero-mass token.
    third3 = res.accept_tokens[:, 2][(first == 0) & (second == 1)]
    assert len(third3) > 300
    assert chi2_pvalue(third3, q[3]) > 1e-4
    # The test has power: a wrong distribution is rejected.
    assert chi2_pvalue(first, q[1]) < 1e-6


def test_accept_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    ct = _compiled(rng, 2, 5, 3, 4)
    with pytest.raises(ValueError, match="target_predict"):
        greedy_accept(ct, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="use_kernel=True"):
        greedy_accept(ct, torch.zeros(2, 6, dtype=torch.int64), use_kernel=True)


# ---------------------------------------------------------------------------
# The adapter around the sglang-kernel ops (which cannot load without a GPU),
# driven by loop models of the ops' documented semantics: linked-list walk,
# int32 outputs, row indices into the flattened [bs * N] batch. The GPU tests
# compare the real ops with the torch path.


def _op_model_walk(candidates, retrive_index, next_token, next_sibling, accept_index, choose):
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    nums, lasts = [], []
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        num, cur = 0, 0
        for _ in range(1, steps):
            cur = int(next_token[b, cur])
            picked = None
            candidates_seen = []
            while cur != -1:
                candidates_seen.append(cur)
                if choose(b, last, cur, candidates_seen):
                    picked = cur
                    break
                cur = int(next_sibling[b, cur])
            if picked is None:
                break
            num += 1
            accept_index[b, num] = int(retrive_index[b, picked])
            last = int(retrive_index[b, picked])
        nums.append(num)
        lasts.append(last)
    return nums, lasts


def _verify_tree_greedy_model(predicts, accept_index, accept_token_num, candidates,
                              retrive_index, retrive_next_token, retrive_next_sibling, target_predict):
    flat_pred = target_predict.flatten()

    def choose(b, last, cur, seen):
        if int(candidates[b, cur]) == int(flat_pred[last]):
            predicts[last] = int(flat_pred[last])
            return True
        return False

    nums, lasts = _op_model_walk(candidates, retrive_index, retrive_next_token,
                                 retrive_next_sibling, accept_index, choose)
    for b, (num, last) in enumerate(zip(nums, lasts)):
        accept_token_num[b] = num
        predicts[last] = int(flat_pred[last])


@pytest.fixture
def op_models(monkeypatch):
    from sglang.srt.speculative.ddtree import accept as accept_mod

    monkeypatch.setattr(accept_mod, "_kernel_ops", lambda: _verify_tree_greedy_model)
    return accept_mod


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the patch is input-independent
@given(bs=st.integers(1, 3), budget=st.integers(1, 30), num_depths=st.integers(1, 6),
       vocab=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_kernel_adapter_greedy(op_models, bs, budget, num_depths, vocab, seed):
    rng = np.random.default_rng(seed)
    ct = _compiled(rng, bs, budget, num_depths, vocab, 0.3)
    pred = _walk_biased_predictions(rng, ct, vocab, 0.8)
    a = op_models._greedy_accept_kernel(ct, pred).to_result(ct.num_tokens)  # the raw outputs, read back
    b = greedy_accept(ct, pred, use_kernel=False)
    for name in ("accept_index", "num_accepted", "accept_tokens", "next_bonus"):
        assert torch.equal(getattr(a, name).long(), getattr(b, name).long()), name

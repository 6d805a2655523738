# SPDX-License-Identifier: Apache-2.0
"""DDTree acceptance: greedy and target-only sampling (torch path) against
naive walks, and the sampling path's output distribution against the target's."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from sglang.srt.speculative.ddtree.accept import (
    greedy_accept,
    sample_accept,
    target_probs_from_logits,
)
from sglang.srt.speculative.ddtree.reference import (
    greedy_accept_ref,
    sample_accept_ref,
    target_probs_ref,
)
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


@settings(max_examples=60, deadline=None, database=None)
@given(
    bs=st.integers(1, 4),
    budget=st.integers(1, 40),
    num_depths=st.integers(1, 8),
    vocab=st.integers(1, 6),
    sharp=st.sampled_from([0.5, 3.0]),
    pad_prob=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampling_matches_naive_walk(bs, budget, num_depths, vocab, sharp, pad_prob, seed):
    rng = np.random.default_rng(seed)
    ct = _compiled(rng, bs, budget, num_depths, vocab, pad_prob)
    n = budget + 1
    probs = torch.softmax(torch.from_numpy(rng.normal(size=(bs, n, vocab)) * sharp).float(), -1)
    if vocab > 2:
        probs[:, :, -1] = 0.0  # a zero-probability token must never be emitted
        probs /= probs.sum(-1, keepdim=True)
    coins = torch.from_numpy(1.0 - rng.random((bs, n))).float()
    final = torch.from_numpy(1.0 - rng.random(bs)).float()
    res = sample_accept(ct, probs, coins, final, use_kernel=False)
    refs = [
        sample_accept_ref(ct.tokens[b].tolist(), ct.parent[b].tolist(), probs[b].numpy(),
                          coins[b].tolist(), float(final[b]))
        for b in range(bs)
    ]
    _check_against_ref(res, ct, refs)
    if vocab > 2:
        assert not (res.accept_tokens == vocab - 1).any()


def test_low_temperature_sampling_equals_greedy():
    rng = np.random.default_rng(1)
    bs, budget, num_depths, vocab = 64, 30, 6, 5
    ct = _compiled(rng, bs, budget, num_depths, vocab)
    # Logits that favour tree edges so paths get long.
    logits = torch.from_numpy(rng.normal(size=(bs, budget + 1, vocab))).float()
    pred = _walk_biased_predictions(rng, ct, vocab, 0.8)
    logits.scatter_add_(-1, pred.unsqueeze(-1), torch.full((bs, budget + 1, 1), 3.0))
    greedy = greedy_accept(ct, logits.argmax(-1), use_kernel=False)
    for temps, top_ks in [(torch.full((bs,), 1e-4), None), (torch.ones(bs), torch.ones(bs, dtype=torch.int64))]:
        probs = target_probs_from_logits(logits, temps, top_ks, None)
        res = sample_accept(ct, probs, generator=torch.Generator().manual_seed(0), use_kernel=False)
        assert torch.equal(res.accept_index, greedy.accept_index)
        assert torch.equal(res.accept_tokens, greedy.accept_tokens)
        assert torch.equal(res.num_accepted, greedy.num_accepted)
    assert greedy.num_accepted.float().mean() > 1.0  # the comparison covered real paths


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


def test_sampled_tokens_follow_the_target_distribution():
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
    probs = q.unsqueeze(0).expand(trials, 5, vocab).contiguous()
    res = sample_accept(ct, probs, generator=g, use_kernel=False)
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


def test_target_probs_from_logits_matches_reference():
    rng = np.random.default_rng(3)
    bs, n, vocab = 4, 3, 11
    logits = torch.from_numpy(rng.normal(size=(bs, n, vocab)) * 2).float()
    temps = torch.tensor([0.7, 1.0, 1.5, 1.0])
    top_ks = torch.tensor([3, 0, 11, 1])
    top_ps = torch.tensor([0.9, 0.5, 1.0, 1.0])
    got = target_probs_from_logits(logits, temps, top_ks, top_ps)
    for b in range(bs):
        for i in range(n):
            want = target_probs_ref(logits[b, i].numpy(), float(temps[b]), int(top_ks[b]), float(top_ps[b]))
            np.testing.assert_allclose(got[b, i].numpy(), want, atol=1e-6)


def test_accept_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    ct = _compiled(rng, 2, 5, 3, 4)
    with pytest.raises(ValueError, match="target_predict"):
        greedy_accept(ct, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_probs"):
        sample_accept(ct, torch.rand(2, 5, 4))
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


def _tree_sampling_model(predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, uniform_samples,
                         uniform_samples_for_final_sampling, target_probs, draft_probs,
                         threshold_single, threshold_acc, deterministic):
    bs, n = candidates.shape
    probs = target_probs.view(bs * n, -1)
    state = {}

    def choose(b, last, cur, seen):
        row = state.setdefault(b, {"row": b * n, "coin": float(uniform_samples[b, 0]), "acc": 0.0})
        tok = int(candidates[b, cur])
        row["acc"] += float(probs[row["row"], tok])
        if row["coin"] <= row["acc"]:
            predicts[last] = tok
            state[b] = {"row": b * n + cur, "coin": float(uniform_samples[b, cur]), "acc": 0.0}
            return True
        draft_probs.view(bs * n, -1)[row["row"], tok] = probs[row["row"], tok]
        return False

    nums, lasts = _op_model_walk(candidates, retrive_index, retrive_next_token,
                                 retrive_next_sibling, accept_index, choose)
    for b, (num, last) in enumerate(zip(nums, lasts)):
        accept_token_num[b] = num
        row = state.get(b, {"row": b * n})["row"]
        residual = (probs[row] - draft_probs.view(bs * n, -1)[row]).clamp(min=0)
        u = float(uniform_samples_for_final_sampling[b]) * float(residual.sum())
        cdf = torch.cumsum(residual, 0)
        predicts[last] = int(torch.searchsorted(cdf, torch.tensor([u]), right=True).clamp(max=len(cdf) - 1))


@pytest.fixture
def op_models(monkeypatch):
    from sglang.srt.speculative.ddtree import accept as accept_mod

    monkeypatch.setattr(accept_mod, "_kernel_ops", lambda: (_verify_tree_greedy_model, _tree_sampling_model))
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


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the patch is input-independent
@given(bs=st.integers(1, 3), budget=st.integers(1, 30), num_depths=st.integers(1, 6),
       vocab=st.integers(2, 6), seed=st.integers(0, 2**31 - 1))
def test_kernel_adapter_sampling(op_models, bs, budget, num_depths, vocab, seed):
    rng = np.random.default_rng(seed)
    ct = _compiled(rng, bs, budget, num_depths, vocab, 0.3)
    n = budget + 1
    probs = torch.softmax(torch.from_numpy(rng.normal(size=(bs, n, vocab)) * 2).float(), -1)
    coins = torch.from_numpy(1.0 - rng.random((bs, n))).float()
    final = torch.from_numpy(1.0 - rng.random(bs)).float()
    a = op_models._sample_accept_kernel(ct, probs, coins, final)
    b = sample_accept(ct, probs, coins, final, use_kernel=False)
    for name in ("accept_index", "num_accepted", "accept_tokens", "next_bonus"):
        assert torch.equal(getattr(a, name).long(), getattr(b, name).long()), name

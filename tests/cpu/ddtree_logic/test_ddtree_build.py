# SPDX-License-Identifier: Apache-2.0
"""DDTree build: the Triton kernel (interpreted) against the heap reference and
against brute-force enumeration of all prefixes."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.speculative.ddtree.reference import build_tree_ref, build_tree_ref_batched
from sglang.srt.speculative.ddtree.tree_build import (
    MAX_BUDGET,
    DraftTree,
    build_tree,
    build_tree_from_logits,
    draft_topk,
    triton_interpreted,
)


FIELDS = ("node_token", "node_parent", "node_depth", "node_rank", "node_score", "num_nodes")


def test_kernel_runs_interpreted():
    # Otherwise the comparisons below would compare the reference with itself.
    assert triton_interpreted(), "tests/cpu/conftest.py must set TRITON_INTERPRET=1"


def _random_logits(rng, bs, num_depths, vocab, ties, dtype):
    if ties:
        # Few distinct values: many exactly equal log-probs and path scores.
        logits = rng.integers(0, 3, size=(bs, num_depths, vocab)).astype(np.float32)
    else:
        logits = rng.normal(size=(bs, num_depths, vocab)).astype(np.float32) * 2
    return torch.from_numpy(logits).to(dtype)


def _assert_same(a: DraftTree, b: DraftTree):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def _check_tree_properties(tree: DraftTree, logprobs, token_ids, budget):
    bs, num_depths, k = logprobs.shape
    k = min(k, budget)
    for b in range(bs):
        n = int(tree.num_nodes[b])
        total_prefixes = sum(k**d for d in range(1, num_depths + 1))
        assert n == min(budget, total_prefixes)
        parent = tree.node_parent[b].tolist()
        depth = tree.node_depth[b].tolist()
        rank = tree.node_rank[b].tolist()
        score = tree.node_score[b].tolist()
        token = tree.node_token[b].tolist()
        lp = logprobs[b].float().numpy()
        children = {}
        for i in range(n):
            node = i + 1
            p = parent[i]
            assert 0 <= p < node, "parent index must precede the child"
            pd = 0 if p == 0 else depth[p - 1]
            assert depth[i] == pd + 1 <= num_depths
            assert token[i] == int(token_ids[b, depth[i] - 1, rank[i]])
            base = np.float32(0) if p == 0 else np.float32(score[p - 1])
            lpv = np.float32(lp[depth[i] - 1, rank[i]])
            lpv = np.float32(-np.inf) if np.isnan(lpv) else lpv
            assert np.float32(score[i]) == np.float32(base + lpv)
            children.setdefault(p, []).append((rank[i], token[i]))
            if i:
                assert score[i] <= score[i - 1], "pop order is best-first"
        for p, kids in children.items():
            ranks = [r for r, _ in kids]
            # prefix-closed among siblings too: ranks 0..m-1, in pop order
            assert ranks == list(range(len(ranks)))
            assert len({t for _, t in kids}) == len(kids), "siblings carry distinct tokens"
        for i in range(n, budget):
            assert parent[i] == -1 and depth[i] == 0 and token[i] == 0
            assert score[i] == -math.inf


def _brute_force_top_scores(lp, budget):
    """Scores of all prefixes (float32 left fold), the best ``budget`` of them."""
    num_depths, k = lp.shape
    scores = []
    for d in range(1, num_depths + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = np.float32(0)
            for depth, r in enumerate(ranks):
                s = np.float32(s + lp[depth, r])
            scores.append(float(s))
    scores.sort(reverse=True)
    return scores[:budget]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bs=st.integers(1, 3),
    num_depths=st.integers(1, 5),
    vocab=st.integers(1, 12),
    budget=st.integers(1, 40),
    ties=st.booleans(),
    half=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_matches_heap_reference(bs, num_depths, vocab, budget, ties, half, seed):
    rng = np.random.default_rng(seed)
    dtype = torch.float16 if half else torch.float32
    logits = _random_logits(rng, bs, num_depths, vocab, ties, dtype)
    logprobs, token_ids = draft_topk(logits, budget)
    if half:
        logprobs = logprobs.half()
    got = build_tree(logprobs, token_ids, budget, use_triton=True)
    want = build_tree_ref_batched(logprobs, token_ids, budget)
    _assert_same(got, want)
    _check_tree_properties(got, logprobs, token_ids, budget)


@settings(max_examples=25, deadline=None, database=None)
@given(
    num_depths=st.integers(1, 4),
    k=st.integers(1, 4),
    budget=st.integers(1, 30),
    ties=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_selects_the_top_budget_prefixes(num_depths, k, budget, ties, seed):
    # Independent of the heap: enumerate every prefix and compare score multisets.
    rng = np.random.default_rng(seed)
    logits = _random_logits(rng, 1, num_depths, k, ties, torch.float32)
    logprobs, token_ids = draft_topk(logits, budget)
    nodes = build_tree_ref(logprobs[0].numpy(), token_ids[0].tolist(), budget)
    want = _brute_force_top_scores(logprobs[0].numpy()[:, : min(k, budget)], budget)
    assert sorted((float(n.score) for n in nodes), reverse=True) == want


def test_ties_break_by_depth_then_parent_then_rank():
    # Uniform draft: every rank has the same log-prob at every depth.
    k, num_depths, budget = 3, 3, 10
    logprobs = torch.full((1, num_depths, k), -math.log(k))
    token_ids = torch.arange(num_depths * k).view(1, num_depths, k)
    tree = build_tree(logprobs, token_ids, budget, use_triton=True)
    _assert_same(tree, build_tree_ref_batched(logprobs, token_ids, budget))
    # depth 1 first (ranks 0,1,2 under the root), then depth 2 by parent, rank.
    assert tree.node_depth[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert tree.node_parent[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.node_rank[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]


def test_equal_score_child_precedes_nothing_it_depends_on():
    # A certain (log-prob 0) continuation ties with its parent; the parent must pop first.
    logprobs = torch.tensor([[[0.0, -1.0], [0.0, -2.0], [0.0, -3.0]]])
    token_ids = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    tree = build_tree(logprobs, token_ids, 4, use_triton=True)
    _assert_same(tree, build_tree_ref_batched(logprobs, token_ids, 4))
    assert tree.node_token[0].tolist() == [5, 7, 9, 6]
    assert tree.node_parent[0].tolist() == [0, 1, 2, 0]


def test_nan_and_neg_inf_logprobs_are_last():
    logprobs = torch.tensor([[[-0.1, float("nan"), float("-inf")], [-0.5, -0.7, float("-inf")]]])
    token_ids = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    tree = build_tree(logprobs, token_ids, 12, use_triton=True)
    _assert_same(tree, build_tree_ref_batched(logprobs, token_ids, 12))
    assert int(tree.num_nodes[0]) == 12
    assert tree.node_score[0, :3].tolist() == pytest.approx([-0.1, -0.6, -0.8])
    assert math.isinf(tree.node_score[0, -1].item())


@pytest.mark.parametrize("budget", [1, 64, MAX_BUDGET])
def test_large_budgets(budget):
    rng = np.random.default_rng(budget)
    logits = _random_logits(rng, 2, 15, 300, False, torch.float32)
    tree = build_tree_from_logits(logits, budget) if budget < MAX_BUDGET else None
    logprobs, token_ids = draft_topk(logits, budget)
    got = build_tree(logprobs, token_ids, budget, use_triton=True)
    _assert_same(got, build_tree_ref_batched(logprobs, token_ids, budget))
    _check_tree_properties(got, logprobs, token_ids, budget)
    if tree is not None:
        _assert_same(tree, got)


def test_draft_topk_uses_full_vocab_log_softmax():
    logits = torch.randn(2, 3, 50)
    lp, ids = draft_topk(logits, 8)
    assert lp.shape == ids.shape == (2, 3, 8)
    full = torch.log_softmax(logits.float(), -1)
    assert torch.equal(torch.gather(full, -1, ids), lp)
    assert torch.all(lp[..., :-1] >= lp[..., 1:])
    lp, ids = draft_topk(logits[..., :5], 8)
    assert lp.shape == (2, 3, 5)  # K = min(B, V)


def test_ranks_beyond_budget_are_ignored():
    logits = torch.randn(2, 3, 20)
    lp, ids = draft_topk(logits, 20)
    a = build_tree(lp, ids, 4, use_triton=True)
    b = build_tree(lp[..., :4], ids[..., :4], 4, use_triton=True)
    _assert_same(a, b)


def test_out_buffers_are_filled_in_place():
    logits = torch.randn(3, 4, 30)
    lp, ids = draft_topk(logits, 16)
    first = build_tree(lp, ids, 16, use_triton=True)
    out = DraftTree(*(torch.empty_like(getattr(first, n)) for n in FIELDS))
    ret = build_tree(lp, ids, 16, out=out, use_triton=True)
    assert ret is out
    _assert_same(out, first)
    bad = DraftTree(*(torch.empty_like(getattr(first, n)) for n in FIELDS))
    bad.node_parent = torch.empty((3, 16), dtype=torch.int64)
    with pytest.raises(ValueError, match="out.node_parent"):
        build_tree(lp, ids, 16, out=bad)


def test_cpu_fallback_is_the_reference():
    logits = torch.randn(2, 3, 30)
    lp, ids = draft_topk(logits, 9)
    _assert_same(build_tree(lp, ids, 9, use_triton=False), build_tree(lp, ids, 9, use_triton=True))


@pytest.mark.parametrize("budget", [0, MAX_BUDGET + 1, 2.0])
def test_bad_budget_is_refused(budget):
    lp, ids = draft_topk(torch.randn(1, 2, 5), 4)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, ids, budget)


def test_bad_shapes_are_refused():
    lp, ids = draft_topk(torch.randn(1, 2, 5), 4)
    with pytest.raises(ValueError, match=r"\[bs, L, K\]"):
        build_tree(lp, ids[..., :3], 4)
    with pytest.raises(ValueError, match=r"\[bs, L, K\]"):
        build_tree(lp[0], ids[0], 4)
    with pytest.raises(TypeError, match="token_ids"):
        build_tree(lp, ids.float(), 4)
    with pytest.raises(ValueError, match=r"\[bs, L, V\]"):
        draft_topk(torch.randn(2, 5), 4)


def test_negative_zero_ties_with_positive_zero():
    logprobs = torch.tensor([[[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]]])
    token_ids = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    tree = build_tree(logprobs, token_ids, 6, use_triton=True)
    _assert_same(tree, build_tree_ref_batched(logprobs, token_ids, 6))
    # all four zero-score prefixes first: depth 1 ranks 0, 1, then their rank-0/1 children
    assert tree.node_depth[0].tolist()[:4] == [1, 1, 2, 2]
    assert tree.node_parent[0].tolist()[:4] == [0, 0, 1, 1]

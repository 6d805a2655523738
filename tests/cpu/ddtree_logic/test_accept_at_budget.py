# SPDX-License-Identifier: Apache-2.0
"""The accept length every smaller budget would have had (``metrics``' path-maximum
row), against building that smaller tree and walking it.

Both tree builders (marginals: ``tree_build``; a DFlash 2 selector's transitions:
``selector_tree``) number nodes best-first, so the tree of budget b is the first b
nodes of the tree of budget B. The counters of one B-tree step must then give, for
every b <= B, exactly the drafts the b-tree accepts when the target's token at a
node depends only on the node's path (as the target's argmax or its draw at that
context does)."""

import hashlib

import numpy as np
import pytest
import torch

from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.metrics import (
    DDTreeStepStats,
    accept_length_at_budget,
    add_step_counts,
    budget_tiers,
)
from sglang.srt.speculative.ddtree.selector_tree import build_selector_tree
from sglang.srt.speculative.ddtree.tree_build import build_tree, draft_topk
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth

VOCAB = 10
DEPTHS = 7


def _node_paths(ct):
    """Per request, every node's token path from the root (the bonus token first)."""
    tokens, parent = ct.tokens.tolist(), ct.parent.tolist()
    out = []
    for toks, par in zip(tokens, parent):
        paths = []
        for i, p in enumerate(par):
            paths.append((toks[i],) if p < 0 else paths[p] + (toks[i],))
        out.append(paths)
    return out


def _target_tokens(ct, prefer, seed):
    """The target's token at every node, a function of the node's path only: mostly one
    of the next depth's likely draft tokens (``prefer[b][depth]``), so paths get long."""
    out = torch.empty_like(ct.tokens)
    depth = ct.depth.tolist()
    for b, paths in enumerate(_node_paths(ct)):
        for i, path in enumerate(paths):
            h = int.from_bytes(hashlib.blake2b(repr((seed, b, path)).encode(), digest_size=8).digest(), "little")
            d = min(depth[b][i], DEPTHS - 1)
            out[b, i] = prefer[b][d][h % 3] if (h >> 8) % 5 else (h >> 16) % VOCAB
    return out


def _walk(tree, bonus, max_depth, prefer, seed):
    ct = compile_tree(tree, bonus, torch.zeros_like(bonus), max_depth)
    return ct, greedy_accept(ct, _target_tokens(ct, prefer, seed), use_kernel=False)


def _marginal_trees(gen, bs):
    logits = torch.randn(bs, DEPTHS, VOCAB, generator=gen) * 2.5
    logprobs, ids = draft_topk(logits, VOCAB)
    prefer = ids[:, :, :3].tolist()
    return (lambda b: build_tree(logprobs, ids, b, use_triton=False)), prefer


def _selector_trees(gen, bs):
    k = 4
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(bs * DEPTHS)]).view(bs, DEPTHS, k)
    scores = torch.randn(bs, DEPTHS, k, k, generator=gen) * 2.0
    prefer = ids[:, :, :3].tolist()
    return (lambda b: build_selector_tree(ids, scores, b, use_triton=False)), prefer


@pytest.mark.parametrize("source", [_marginal_trees, _selector_trees], ids=["marginals", "transitions"])
@pytest.mark.parametrize("budget", [6, 16, 31])
@pytest.mark.parametrize("seed", range(2))
def test_counters_give_every_smaller_budgets_accept(source, budget, seed):
    gen = torch.Generator().manual_seed(1000 * budget + seed)
    bs = 5
    counts = torch.zeros((3, budget + 1), dtype=torch.int64)
    accepted_at = {b: 0 for b in range(1, budget + 1)}
    requests = 0
    for step in range(4):
        trees, prefer = source(gen, bs)
        bonus = torch.randint(0, VOCAB, (bs,), generator=gen)
        big = trees(budget)
        ct, res = _walk(big, bonus, max_tree_depth(budget, DEPTHS), prefer, (seed, step))
        add_step_counts(counts, res.num_accepted, ct.depth, res.accept_index)
        requests += bs
        for b in range(1, budget + 1):
            small = trees(b)
            # The smaller tree is the larger one's first b nodes.
            for field in ("node_token", "node_parent", "node_depth"):
                assert torch.equal(getattr(small, field), getattr(big, field)[:, :b]), (b, field)
            _, res_b = _walk(small, bonus, max_tree_depth(b, DEPTHS), prefer, (seed, step))
            accepted_at[b] += int(res_b.num_accepted.sum())
    assert int(counts[0].sum()) == requests
    got = {b: accept_length_at_budget([budget], [counts.tolist()], b) for b in range(1, budget + 1)}
    for b, drafts in accepted_at.items():
        assert got[b] == pytest.approx(1.0 + drafts / requests, abs=1e-12), b
    assert got[budget] == pytest.approx(1.0 + sum(d * c for d, c in enumerate(counts[0].tolist())) / requests)
    # Paths long enough that the budgets differ.
    assert accepted_at[budget] > accepted_at[1] > 0


def test_tiers_and_empty_counters():
    assert budget_tiers(16) == [1, 2, 4, 8, 16]
    assert budget_tiers(24) == [1, 2, 4, 8, 16, 24]
    assert budget_tiers(1) == [1]
    assert accept_length_at_budget([2], [[[0, 0, 0]] * 3], 1) is None
    stats = DDTreeStepStats(8, interval=1 << 30)
    assert tuple(stats.counters("cpu").shape) == (3, 9)
    with pytest.raises(ValueError, match="step budget 4 is not one of"):
        stats.counters("cpu", 4)
    with pytest.raises(ValueError, match="must lie in"):
        DDTreeStepStats(8, step_budgets=(4, 16))


def test_reference_ignores_the_path_after_its_end():
    """Entries after the accepted depth (stale or -1) never count."""
    counts = torch.zeros((3, 9), dtype=torch.int64)
    accept_index = torch.tensor([[0, 3, 7, 5, 8], [0, 2, 9, 9, 9], [0, -1, -1, -1, -1]])
    add_step_counts(counts, torch.tensor([3, 1, 0]), torch.zeros((3, 9), dtype=torch.int64), accept_index)
    # Request 0: path maxima 3, 7, 7; request 1: 2; request 2: nothing.
    assert counts[2].tolist() == [0, 0, 1, 1, 0, 0, 0, 2, 0]
    got = {b: accept_length_at_budget([8], [counts.tolist()], b) for b in (1, 2, 3, 6, 7, 8)}
    assert got == pytest.approx({1: 1.0, 2: 1 + 1 / 3, 3: 1 + 2 / 3, 6: 1 + 2 / 3, 7: 1 + 4 / 3, 8: 1 + 4 / 3})


@pytest.mark.parametrize("source", [_marginal_trees, _selector_trees], ids=["marginals", "transitions"])
def test_steps_at_several_budgets_count_only_for_budgets_they_cover(source):
    """Under the adaptive policy each step runs at its own budget (the first nodes of the
    drafted tree) and counts into that budget's block. A budget's accept length comes from
    the steps run at it or above, and equals walking its own tree over those steps."""
    full, step_budgets = 16, (2, 4, 8, 16)
    gen = torch.Generator().manual_seed(77)
    stats = DDTreeStepStats(full, interval=1 << 30, step_budgets=step_budgets)
    walked = {b: [0, 0] for b in budget_tiers(full)}  # drafts, request steps (steps at b or above)
    for step in range(12):
        run_at = step_budgets[step % len(step_budgets)]
        trees, prefer = source(gen, 3)
        bonus = torch.randint(0, VOCAB, (3,), generator=gen)
        ct, res = _walk(trees(run_at), bonus, max_tree_depth(run_at, DEPTHS), prefer, ("mixed", step))
        stats.record(res.num_accepted, ct.depth, res.accept_index, step_budget=run_at)
        for b in walked:
            if b <= run_at:
                _, res_b = _walk(trees(b), bonus, max_tree_depth(b, DEPTHS), prefer, ("mixed", step))
                walked[b][0] += int(res_b.num_accepted.sum())
                walked[b][1] += 3
    blocks = stats._counts.tolist()
    for b, (drafts, steps) in walked.items():
        assert accept_length_at_budget(step_budgets, blocks, b) == pytest.approx(1 + drafts / steps), b
    # The decayed view the policy reads: after one snapshot it holds every step so far.
    stats._snapshot()
    stats.step_counted()
    assert stats.accept_lengths([1, 16]) == pytest.approx(
        {1: accept_length_at_budget(step_budgets, blocks, 1), 16: accept_length_at_budget(step_budgets, blocks, 16)})
    assert DDTreeStepStats(full, interval=1 << 30, step_budgets=step_budgets).accept_lengths([4]) == {4: None}

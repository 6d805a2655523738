# SPDX-License-Identifier: Apache-2.0
"""KV bookkeeping after acceptance: nothing leaked, nothing freed twice, the
accepted path's KV ends up at the request's next positions in depth order."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.kv_slot_plan import (
    apply_kv_moves,
    plan_kv_compaction,
    plan_kv_remap,
)
from sglang.srt.speculative.ddtree.reference import greedy_accept_ref, kv_commit_ref
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth


def _accepted(rng, bs, budget, num_depths, vocab, pad_prob):
    """A compiled tree, an acceptance result with varied path lengths, and slots."""
    tree = random_tree(rng, bs, budget, num_depths, vocab, pad_prob)
    ct = compile_tree(tree, torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64),
                      max_tree_depth(budget, num_depths))
    n = budget + 1
    pred = torch.from_numpy(rng.integers(0, vocab, size=(bs, n)))
    for b in range(bs):  # steer the target along random edges
        for i in range(n):
            kids = (ct.parent[b] == i).nonzero().flatten().tolist()
            if kids and rng.random() < 0.8:
                pred[b, i] = ct.tokens[b, int(rng.choice(kids))]
    res = greedy_accept(ct, pred, use_kernel=False)
    slots = torch.from_numpy(rng.permutation(10 * bs * n)[: bs * n].reshape(bs, n)).to(torch.int64)
    return ct, pred, res, slots


# The batches the tests below draw through ``_accepted``.
_ACCEPTED_TREES = dict(
    bs=st.integers(1, 4),
    budget=st.integers(1, 50),
    num_depths=st.integers(1, 8),
    vocab=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=60, deadline=None, database=None)
@given(**_ACCEPTED_TREES, pad_prob=st.sampled_from([0.0, 0.5]))
def test_remap_keeps_the_path_and_frees_the_rest(bs, budget, num_depths, vocab, pad_prob, seed):
    rng = np.random.default_rng(seed)
    ct, pred, res, slots = _accepted(rng, bs, budget, num_depths, vocab, pad_prob)
    c = plan_kv_remap(slots, res.accept_index, res.num_accepted)
    for b in range(bs):
        path, _ = greedy_accept_ref(ct.tokens[b].tolist(), ct.parent[b].tolist(), pred[b].tolist())
        kept, freed = kv_commit_ref(slots[b].tolist(), path)
        k = int(c.num_kept[b])
        assert k == len(path)
        row = c.new_cache_loc[b].tolist()
        assert row[:k] == kept  # accepted path in depth order, root first
        assert row[k:] == freed  # the rest, in tree order
        assert sorted(row) == sorted(slots[b].tolist())  # a permutation: nothing leaked or duplicated
        assert c.keep_mask[b].tolist() == [i < k for i in range(budget + 1)]
    # across the batch: kept and freed are disjoint and cover every tree slot exactly once
    kept_all, freed_all = c.kept_slots().tolist(), c.freed_slots().tolist()
    assert len(set(freed_all)) == len(freed_all) and not set(kept_all) & set(freed_all)
    assert sorted(kept_all + freed_all) == sorted(slots.flatten().tolist())
    assert torch.equal(c.move_src, c.move_dst)  # remap copies nothing


@settings(max_examples=60, deadline=None, database=None)
@given(**_ACCEPTED_TREES)
def test_compaction_moves_path_kv_to_the_front(bs, budget, num_depths, vocab, seed):
    rng = np.random.default_rng(seed)
    ct, pred, res, slots = _accepted(rng, bs, budget, num_depths, vocab, 0.3)
    c = plan_kv_compaction(slots, res.accept_index, res.num_accepted)
    pool = 10 * bs * (budget + 1)
    kv = torch.randn(pool, 3)
    kv_k = torch.randn(pool, 2, 2)
    before, before_k = kv.clone(), kv_k.clone()
    apply_kv_moves([kv, kv_k], c)
    for b in range(bs):
        path, _ = greedy_accept_ref(ct.tokens[b].tolist(), ct.parent[b].tolist(), pred[b].tolist())
        k = int(c.num_kept[b])
        assert k == len(path)
        for t, node in enumerate(path):
            dst, src = int(slots[b, t]), int(slots[b, node])
            assert torch.equal(kv[dst], before[src]) and torch.equal(kv_k[dst], before_k[src])
        assert c.freed_slots().numel() == sum(budget + 1 - int(x) for x in c.num_kept)
        assert c.new_cache_loc[b, k:].tolist() == slots[b, k:].tolist()
    # slots outside every tree are untouched
    outside = torch.ones(pool, dtype=torch.bool)
    outside[slots.flatten()] = False
    assert torch.equal(kv[outside], before[outside])


def test_compaction_handles_chained_moves():
    # path 0 -> 2 -> 3: slot 1 <- slot 2 and slot 2 <- slot 3 (a source is also a destination)
    slots = torch.tensor([[10, 11, 12, 13, 14]])
    accept_index = torch.tensor([[0, 2, 3, -1]])
    c = plan_kv_compaction(slots, accept_index, torch.tensor([2]))
    kv = torch.arange(20.0).unsqueeze(1)
    apply_kv_moves([kv], c)
    assert kv[10:15, 0].tolist() == [10.0, 12.0, 13.0, 13.0, 14.0]
    assert c.freed_slots().tolist() == [13, 14]


def test_slots_survive_many_steps_without_leaking():
    """Allocate tree slots, commit, free the dropped ones, repeat; then count."""
    rng = np.random.default_rng(7)
    bs, budget, num_depths, vocab = 3, 12, 4, 3
    n = budget + 1
    free = list(range(1000))
    owned = {b: [] for b in range(bs)}
    for step in range(30):
        ct, pred, res, _ = _accepted(rng, bs, budget, num_depths, vocab, 0.2)
        slots = torch.tensor([free[i * n:(i + 1) * n] for i in range(bs)], dtype=torch.int64)
        free = free[bs * n:]
        plan = plan_kv_remap if step % 2 else plan_kv_compaction
        c = plan(slots, res.accept_index, res.num_accepted)
        for b in range(bs):
            owned[b] += c.new_cache_loc[b, : int(c.num_kept[b])].tolist()
        free += c.freed_slots().tolist()
    in_use = [s for b in owned for s in owned[b]]
    assert len(set(in_use)) == len(in_use)
    assert sorted(in_use + free) == list(range(1000))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="out_cache_loc"):
        plan_kv_remap(torch.zeros(5, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1))
    with pytest.raises(ValueError, match="accept_index"):
        plan_kv_remap(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2))
    with pytest.raises(ValueError, match="num_accepted"):
        plan_kv_compaction(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(3))

# SPDX-License-Identifier: Apache-2.0
"""The fused commit kernel (``step_io.commit_accepted``, run by the Triton
interpreter) against its torch reference (``plan_kv_remap`` +
``write_tree_window`` + ``output_tokens`` + ``draft_context_inputs``):
random trees, bs 1 and 8, budgets 4..128, ragged acceptance, padded trees."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree

from sglang.srt.speculative.ddtree import step_io
from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth

FIELDS = ("new_cache_loc", "output_tokens", "commit_lens", "new_seq_lens", "ctx_rows", "ctx_positions",
          "ctx_cache_loc")  # fmt: skip


def _step(rng, bs, budget, num_depths, vocab, pad_prob, follow):
    """A compiled tree, a greedy acceptance of varied length, and request state."""
    tree = random_tree(rng, bs, budget, num_depths, vocab, pad_prob)
    prefix = torch.from_numpy(rng.integers(0, 300, size=bs)).to(torch.int64)
    ct = compile_tree(tree, torch.from_numpy(rng.integers(0, vocab, size=bs)), prefix,
                      max_tree_depth(budget, num_depths))  # fmt: skip
    n = budget + 1
    pred = torch.from_numpy(rng.integers(0, vocab, size=(bs, n)))
    for b in range(bs):  # steer the target along random edges, so paths vary in length
        for i in range(n):
            kids = (ct.parent[b] == i).nonzero().flatten().tolist()
            if kids and rng.random() < follow:
                pred[b, i] = ct.tokens[b, int(rng.choice(kids))]
    res = greedy_accept(ct, pred, use_kernel=False)
    pool = 2 * bs + 1
    req_to_token = torch.from_numpy(rng.permutation(pool * 512).reshape(pool, 512)).to(torch.int32)
    pool_rows = torch.from_numpy(rng.permutation(pool)[:bs]).to(torch.int64)
    loc = step_io.tree_cache_locs(req_to_token, pool_rows, prefix, n)
    return ct, res, loc, prefix, req_to_token, pool_rows


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("budget", [4, 7, 16, 33, 64, 128])
@pytest.mark.parametrize("seed", range(2))
def test_commit_kernel_matches_reference(bs, budget, seed):
    rng = np.random.default_rng(1000 * budget + 10 * bs + seed)
    num_depths = int(rng.integers(1, 16))
    ct, res, loc, prefix, r2t, rows = _step(rng, bs, budget, num_depths, vocab=5, pad_prob=0.3,
                                            follow=float(rng.choice([0.3, 0.9])))  # fmt: skip
    r2t_kernel, r2t_ref = r2t.clone(), r2t.clone()
    got = step_io.commit_accepted(res, loc, prefix, r2t_kernel, rows, use_triton=True)
    want = step_io.commit_accepted_torch(res, loc, prefix, r2t_ref, rows)
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    assert torch.equal(r2t_kernel, r2t_ref)
    # The window's slots are permuted, never lost or duplicated.
    assert torch.equal(got.new_cache_loc.sort(1).values, loc.sort(1).values)


@pytest.mark.parametrize("seed", range(3))
def test_commit_reference_is_the_step_glue(seed):
    """The reference's context rows pick the same hidden states, positions and
    slots as ``draft_context_inputs``; its tokens are ``output_tokens``."""
    rng = np.random.default_rng(seed)
    bs, budget = 3, 20
    ct, res, loc, prefix, r2t, rows = _step(rng, bs, budget, 6, vocab=4, pad_prob=0.0, follow=0.8)
    n = budget + 1
    hidden = torch.randn(bs * n, 8)
    commit = step_io.commit_accepted_torch(res, loc, prefix, r2t.clone(), rows)
    h, pos, loc2d, lens = step_io.draft_context_inputs(hidden, res, commit.new_cache_loc, prefix)
    assert torch.equal(hidden.index_select(0, commit.ctx_rows), h)
    assert torch.equal(commit.ctx_positions, pos)
    assert torch.equal(commit.ctx_cache_loc, loc2d)
    assert torch.equal(commit.commit_lens, lens)
    assert torch.equal(commit.output_tokens, step_io.output_tokens(res, n))
    assert torch.equal(commit.new_seq_lens, prefix + lens)


def test_commit_rejects_mismatched_shapes():
    rng = np.random.default_rng(0)
    ct, res, loc, prefix, r2t, rows = _step(rng, 2, 6, 3, vocab=3, pad_prob=0.0, follow=0.5)
    with pytest.raises(ValueError, match="prefix_lens"):
        step_io.commit_accepted(res, loc, prefix[:1], r2t, rows)
    with pytest.raises(ValueError, match="accept_index"):
        step_io.commit_accepted(res, loc[:, :2], prefix, r2t, rows)

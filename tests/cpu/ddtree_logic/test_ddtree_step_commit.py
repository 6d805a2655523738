# SPDX-License-Identifier: Apache-2.0
"""The fused commit kernel (``step_io.commit_accepted``, run by the Triton
interpreter) against its torch reference (``plan_kv_remap`` +
``write_tree_window`` + ``output_tokens`` + ``draft_context_rows``, the
torch read-back of sglang-kernel's greedy outputs, ``metrics.add_step_counts``):
random trees, bs 1 and 8, budgets 4..128, ragged acceptance, padded trees."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree

from benchmarks.step_ops import verify_tree_greedy_cpu
from sglang.srt.speculative.ddtree import step_io
from sglang.srt.speculative.ddtree.accept import KernelAccept, greedy_accept
from sglang.srt.speculative.ddtree.metrics import DDTreeStepStats
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
    raw = _kernel_outputs(rng, ct, pred)
    pool = 2 * bs + 1
    req_to_token = torch.from_numpy(rng.permutation(pool * 512).reshape(pool, 512)).to(torch.int32)
    pool_rows = torch.from_numpy(rng.permutation(pool)[:bs]).to(torch.int64)
    loc = step_io.tree_cache_locs(req_to_token, pool_rows, prefix, n)
    return ct, res, loc, prefix, req_to_token, pool_rows, raw


def _kernel_outputs(rng, ct, pred):
    """sglang-kernel's ``verify_tree_greedy`` outputs (the contract's stand-in)
    in unfilled buffers, as the step passes them: flat rows on the path, stale
    rows after it, ``predicts`` stale off the path."""
    bs, n = ct.tokens.shape
    predicts = torch.from_numpy(rng.integers(-(2**30), 2**30, size=bs * n)).to(torch.int32)
    accept_index = torch.from_numpy(rng.integers(-3, bs * n, size=(bs, ct.max_depth + 1))).to(torch.int32)
    accept_num = torch.from_numpy(rng.integers(-3, 99, size=bs)).to(torch.int32)
    verify_tree_greedy_cpu(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=ct.tokens,
        retrive_index=ct.retrive_index, retrive_next_token=ct.retrive_next_token,
        retrive_next_sibling=ct.retrive_next_sibling, target_predict=pred,
    )  # fmt: skip
    return KernelAccept(predicts, accept_index, accept_num)


def _assert_same(got, want, names):
    for name in names:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


ACCEPT_FIELDS = ("accept_index", "num_accepted", "accept_tokens", "next_bonus")


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")
@pytest.mark.parametrize("raw_input", [False, True], ids=["accept_result", "greedy_kernel"])
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("budget", [4, 7, 16, 33, 64, 128])
@pytest.mark.parametrize("seed", range(2))
def test_commit_kernel_matches_reference(raw_input, bs, budget, seed):
    """From an ``AcceptResult`` or from sglang-kernel's raw greedy outputs, the
    commit launch commits what the torch accept path + torch commit do, and
    returns the same acceptance."""
    rng = np.random.default_rng((7000 if raw_input else 1000) * budget + 10 * bs + seed)
    num_depths = int(rng.integers(1, 16))
    ct, res, loc, prefix, r2t, rows, raw = _step(rng, bs, budget, num_depths, vocab=5, pad_prob=0.3,
                                                 follow=float(rng.choice([0.3, 0.9])))  # fmt: skip
    r2t_kernel, r2t_ref = r2t.clone(), r2t.clone()
    got = step_io.commit_accepted(raw if raw_input else res, loc, prefix, r2t_kernel, rows, use_triton=True)
    want = step_io.commit_accepted_torch(res, loc, prefix, r2t_ref, rows)
    _assert_same(got, want, FIELDS)
    _assert_same(got.accept, res, ACCEPT_FIELDS)
    assert torch.equal(r2t_kernel, r2t_ref)
    # The window's slots are permuted, never lost or duplicated.
    assert torch.equal(got.new_cache_loc.sort(1).values, loc.sort(1).values)
    if raw_input:  # the torch commit reads the raw outputs back the same way
        ref = step_io.commit_accepted_torch(raw, loc, prefix, r2t.clone(), rows)
        _assert_same(ref.accept, res, ACCEPT_FIELDS)


@pytest.mark.parametrize("seed", range(3))
def test_commit_reference_is_the_step_glue(seed):
    """The reference's context rows pick each request's kept nodes' hidden
    states (a gather along the path), at positions ``P + depth`` in the permuted
    window's first slots; its tokens are ``output_tokens``."""
    rng = np.random.default_rng(seed)
    bs, budget = 3, 20
    ct, res, loc, prefix, r2t, rows, _ = _step(rng, bs, budget, 6, vocab=4, pad_prob=0.0, follow=0.8)
    n = budget + 1
    width = res.accept_index.shape[1]
    hidden = torch.randn(bs * n, 8)
    commit = step_io.commit_accepted_torch(res, loc, prefix, r2t.clone(), rows)
    path = res.accept_index.clamp(min=0).to(torch.int64)
    h = torch.gather(hidden.view(bs, n, 8), 1, path.unsqueeze(-1).expand(bs, width, 8)).reshape(bs * width, 8)
    pos = (prefix.to(torch.int64).unsqueeze(1) + torch.arange(width)).reshape(-1)
    loc2d = commit.new_cache_loc[:, :width]
    lens = (res.num_accepted + 1).to(torch.int32)
    assert torch.equal(hidden.index_select(0, commit.ctx_rows), h)
    assert torch.equal(commit.ctx_positions, pos)
    assert torch.equal(commit.ctx_cache_loc, loc2d)
    assert torch.equal(commit.commit_lens, lens)
    assert torch.equal(commit.output_tokens, step_io.output_tokens(res, n))
    assert torch.equal(commit.new_seq_lens, prefix + lens)


def test_commit_rejects_mismatched_shapes():
    rng = np.random.default_rng(0)
    ct, res, loc, prefix, r2t, rows, raw = _step(rng, 2, 6, 3, vocab=3, pad_prob=0.0, follow=0.5)
    with pytest.raises(ValueError, match="prefix_lens"):
        step_io.commit_accepted(res, loc, prefix[:1], r2t, rows)
    with pytest.raises(ValueError, match="accept_index"):
        step_io.commit_accepted(res, loc[:, :2], prefix, r2t, rows)
    with pytest.raises(ValueError, match="predicts"):
        step_io.commit_accepted(KernelAccept(raw.predicts[:3], raw.accept_index, raw.accept_num), loc, prefix,
                                r2t, rows)  # fmt: skip
    with pytest.raises(ValueError, match="tree_depth"):
        step_io.commit_accepted(res, loc, prefix, r2t, rows, stats_counts=torch.zeros((3, 7), dtype=torch.int64))


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")
@pytest.mark.parametrize("raw_input", [False, True])
@pytest.mark.parametrize("bs", [1, 8])
def test_commit_kernel_counts_steps_as_stats_record(raw_input, bs):
    """The counters after random steps counted by the commit launch equal
    ``DDTreeStepStats.record``'s (the torch implementation's)."""
    rng = np.random.default_rng(31 * bs + raw_input)
    budget = 24
    kernel_stats, torch_stats = (DDTreeStepStats(budget, interval=1 << 30) for _ in range(2))
    accepted_drafts = 0
    for _ in range(12):
        num_depths = int(rng.integers(1, 12))
        ct, res, loc, prefix, r2t, rows, raw = _step(rng, bs, budget, num_depths, vocab=4, pad_prob=0.3,
                                                     follow=float(rng.choice([0.3, 0.9])))  # fmt: skip
        step_io.commit_accepted(raw if raw_input else res, loc, prefix, r2t, rows, use_triton=True,
                                stats_counts=kernel_stats.counters(loc.device), tree_depth=ct.depth)  # fmt: skip
        kernel_stats.step_counted()
        torch_stats.record(res.num_accepted, ct.depth, res.accept_index)
        accepted_drafts += int(res.num_accepted.sum())
    assert kernel_stats.steps == torch_stats.steps == 12
    assert torch.equal(kernel_stats.counters("cpu"), torch_stats.counters("cpu"))
    counts = kernel_stats.counters("cpu")
    assert int(counts[:2].sum()) == 2 * 12 * bs
    assert int(counts[0, 1:].sum()) > 0  # some steps accepted drafts
    assert int(counts[2].sum()) == accepted_drafts and int(counts[2, 0]) == 0

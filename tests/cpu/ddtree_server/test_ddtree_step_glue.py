# SPDX-License-Identifier: Apache-2.0
"""The worker's pure pieces on CPU tensors: verify input from a compiled tree,
the dense TARGET_VERIFY mask from the ancestor bitmask, and the step's
request-state glue (``step_io``: KV window permutation, emitted tokens, drafter context rows).

The last test runs whole decode steps against an oracle target with a fake
paged KV store, checking that the emitted text is the oracle's greedy text and
that after every step ``req_to_token`` maps each committed position to a slot
holding exactly that position's token, with no slot lost or duplicated.
"""

import random

import pytest
import torch

from sglang.srt.speculative.ddtree import step_io
from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.info import (
    DDTreeVerifyInput,
    dense_mask_numel_bound,
    dense_verify_mask,
)
from sglang.srt.speculative.ddtree.kv_slot_plan import plan_kv_remap
from sglang.srt.speculative.ddtree.tree_build import build_tree
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth
from sglang.srt.speculative.spec_info import SpecInputType


def _random_tree(bs, depths, k, budget, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((bs, depths, vocab), generator=g) * 3
    lp = torch.log_softmax(logits, -1)
    vals, ids = torch.topk(lp, min(k, vocab), dim=-1)
    tree = build_tree(vals, ids, budget, use_triton=False)
    return tree


def _compiled(bs=3, depths=5, budget=12, vocab=17, seed=0, prefix=None):
    tree = _random_tree(bs, depths, budget, budget, vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    bonus = torch.randint(0, vocab, (bs,), generator=g)
    if prefix is None:
        prefix = torch.randint(0, 40, (bs,), generator=g)
    return compile_tree(tree, bonus, prefix, max_tree_depth(budget, depths)), prefix


def _ancestors(parent, i):
    out = {i}
    while parent[i] >= 0:
        i = parent[i]
        out.add(i)
    return out


def _naive_dense_mask(parent, prefix_lens):
    """Concatenated per-request [N, P + N] rows, prefix visible."""
    chunks = []
    for b in range(parent.shape[0]):
        p = parent[b].tolist()
        n = len(p)
        P = int(prefix_lens[b])
        for i in range(n):
            anc = _ancestors(p, i)
            chunks.append([True] * P + [j in anc for j in range(n)])
    return torch.tensor([v for row in chunks for v in row], dtype=torch.bool)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 7, 33])
def test_dense_mask_matches_naive(seed, budget):
    compiled, prefix = _compiled(bs=3, depths=6, budget=budget, vocab=40, seed=seed)
    bs, n = compiled.tokens.shape
    exact = _naive_dense_mask(compiled.parent, prefix)
    # A lagging host bound (larger than the device sum) must still be safe.
    numel = dense_mask_numel_bound(int(prefix.sum()) + 5, bs, n)
    assert numel >= exact.numel()
    mask = dense_verify_mask(compiled.tree_mask, prefix, numel)
    assert mask.shape == (numel,) and mask.dtype == torch.bool
    assert torch.equal(mask[: exact.numel()], exact)
    assert bool(mask[exact.numel():].all())


def test_dense_mask_is_the_triton_layout():
    # Row i of request b starts at mask_indptr[b] + i * (P_b + N): the layout
    # upstream's Triton TARGET_VERIFY computes from seq_lens (seq_mask_len).
    compiled, prefix = _compiled(bs=2, depths=4, budget=5, vocab=9, seed=3, prefix=torch.tensor([3, 0]))
    n = compiled.num_tokens
    mask = dense_verify_mask(compiled.tree_mask, prefix, dense_mask_numel_bound(3, 2, n))
    seq_mask_len = n * (prefix + n)
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seq_mask_len, 0)])
    for b in range(2):
        P = int(prefix[b])
        for i in range(n):
            row = mask[mask_indptr[b] + i * (P + n): mask_indptr[b] + (i + 1) * (P + n)]
            assert bool(row[:P].all())
            assert bool(row[P + i])  # itself
            assert bool(row[P + 0])  # the root
            anc = _ancestors(compiled.parent[b].tolist(), i)
            assert set(torch.nonzero(row[P:]).flatten().tolist()) == anc


def test_verify_input_from_compiled():
    compiled, prefix = _compiled(bs=2, depths=4, budget=9, vocab=30, seed=5)
    n = compiled.num_tokens
    mask = dense_verify_mask(compiled.tree_mask, prefix, dense_mask_numel_bound(int(prefix.sum()), 2, n))
    vi = DDTreeVerifyInput.from_compiled(compiled, custom_mask=mask)
    assert vi.spec_input_type == SpecInputType.DFLASH_VERIFY and vi.is_verify_input()
    assert vi.draft_token_num == n == 10
    assert vi.num_tokens_per_req == n and vi.num_tokens_for_logprob_per_req == n
    assert vi.topk == 1
    assert torch.equal(vi.draft_token.view(2, n), compiled.tokens)
    assert vi.draft_token[0] == compiled.tokens[0, 0]  # root = bonus
    # Positions: committed length + depth; siblings share one.
    assert torch.equal(vi.positions.view(2, n), prefix.view(2, 1) + compiled.depth)
    assert vi.tree_mask_bits is compiled.tree_mask
    assert vi.custom_mask is mask


def _greedy_predictions_along(compiled, path_len, rng):
    """Target argmax that accepts a random root path of ``path_len`` nodes."""
    bs, n = compiled.tokens.shape
    predict = torch.full((bs, n), -7, dtype=torch.int64)  # never a child token
    chosen = []
    for b in range(bs):
        parent = compiled.parent[b].tolist()
        node, path = 0, [0]
        for _ in range(path_len):
            kids = [c for c in range(n) if parent[c] == node]
            if not kids:
                break
            nxt = rng.choice(kids)
            predict[b, node] = compiled.tokens[b, nxt]
            node = nxt
            path.append(node)
        predict[b, node] = 1000 + b  # the bonus
        chosen.append(path)
    return predict, chosen


@pytest.mark.parametrize("seed", range(5))
def test_commit_window_permutation(seed):
    rng = random.Random(seed)
    compiled, prefix = _compiled(bs=3, depths=5, budget=14, vocab=25, seed=seed)
    bs, n = compiled.tokens.shape
    pool_rows = torch.tensor([4, 0, 2])
    req_to_token = torch.randperm(6 * 80).view(6, 80).to(torch.int32)
    before = req_to_token.clone()
    predict, paths = _greedy_predictions_along(compiled, rng.randint(0, 5), rng)
    res = greedy_accept(compiled, predict, use_kernel=False)

    loc = step_io.tree_cache_locs(req_to_token, pool_rows, prefix, n)
    for b in range(bs):
        P = int(prefix[b])
        assert loc[b].tolist() == before[pool_rows[b], P: P + n].tolist()
    kv = plan_kv_remap(loc, res.accept_index, res.num_accepted)
    step_io.write_tree_window(req_to_token, pool_rows, prefix, kv.new_cache_loc)

    for b in range(bs):
        row, P = int(pool_rows[b]), int(prefix[b])
        path = paths[b]
        assert int(res.num_accepted[b]) == len(path) - 1
        window = req_to_token[row, P: P + n].tolist()
        # Same slots (nothing leaked, nothing duplicated) ...
        assert sorted(window) == sorted(before[row, P: P + n].tolist())
        # ... the kept path first, in depth order ...
        assert window[: len(path)] == [int(before[row, P + i]) for i in path]
        # ... and nothing outside the window touched.
        outside = torch.ones(80, dtype=torch.bool)
        outside[P: P + n] = False
        assert torch.equal(req_to_token[row][outside], before[row][outside])
    untouched = [r for r in range(6) if r not in pool_rows.tolist()]
    assert torch.equal(req_to_token[untouched], before[untouched])

    out = step_io.output_tokens(res, n)
    assert out.shape == (bs, n)
    for b in range(bs):
        k = int(res.num_accepted[b])
        emitted = out[b, : k + 1].tolist()
        assert emitted[:k] == [int(compiled.tokens[b, i]) for i in paths[b][1:]]
        assert emitted[k] == 1000 + b == int(res.next_bonus[b])


def test_draft_context_rows():
    rng = random.Random(1)
    compiled, prefix = _compiled(bs=2, depths=5, budget=10, vocab=20, seed=9)
    bs, n = compiled.tokens.shape
    predict, paths = _greedy_predictions_along(compiled, 4, rng)
    res = greedy_accept(compiled, predict, use_kernel=False)
    hidden = torch.arange(bs * n * 3, dtype=torch.float32).view(bs * n, 3)
    new_loc = torch.arange(bs * n).view(bs, n) + 100
    rows, pos, loc2d, lens = step_io.draft_context_rows(res, new_loc, prefix)
    h = hidden.index_select(0, rows)
    width = compiled.max_depth + 1
    assert h.shape == (bs * width, 3) and pos.shape == (bs * width,)
    assert loc2d.shape == (bs, width) and lens.dtype == torch.int32
    for b in range(bs):
        k = len(paths[b])
        assert int(lens[b]) == k
        for t, node in enumerate(paths[b]):
            assert torch.equal(h[b * width + t], hidden[b * n + node])
            assert int(pos[b * width + t]) == int(prefix[b]) + t
            assert int(loc2d[b, t]) == int(new_loc[b, t])


def _oracle(seq):
    """The 'target': a deterministic next token for any prefix."""
    h = 0
    for t in seq[-3:]:
        h = (h * 31 + t + 7) % 1009
    return h % 11


@pytest.mark.parametrize("seed", range(3))
def test_multi_step_lossless_and_kv_consistent(seed):
    """Whole steps with a drafter that is right sometimes: emitted tokens equal
    the oracle's greedy continuation, and the KV store stays consistent."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs, budget, depths, vocab, width_alloc = 2, 9, 4, 11, 200
    n = budget + 1
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(bs)]
    seqs = [list(p) for p in prompts]
    # Slot -> (position, token) the "target" wrote there.
    kv = {}
    pool_rows = torch.tensor([1, 0])
    req_to_token = torch.randperm(2 * width_alloc).view(2, width_alloc).to(torch.int64)
    owned = [set(req_to_token[r].tolist()) for r in range(2)]
    for b in range(bs):
        for pos, tok in enumerate(seqs[b][:-1]):
            kv[int(req_to_token[pool_rows[b], pos])] = (pos, tok)
    bonus = torch.tensor([s[-1] for s in seqs])
    prefix = torch.tensor([len(s) - 1 for s in seqs])
    for _ in range(6):
        # Draft: noisy logits that favour the oracle's chain continuation.
        logits = torch.randn((bs, depths, vocab), generator=g)
        for b in range(bs):
            s = list(seqs[b])
            for d in range(depths):
                t = _oracle(s)
                if rng.random() < 0.7:
                    logits[b, d, t] += 4.0
                s.append(t)
        lp = torch.log_softmax(logits, -1)
        vals, ids = torch.topk(lp, budget, -1)
        tree = build_tree(vals, ids, budget, use_triton=False)
        compiled = compile_tree(tree, bonus, prefix, max_tree_depth(budget, depths))
        loc = step_io.tree_cache_locs(req_to_token, pool_rows, prefix, n)
        # Verify: every node writes its KV and yields the oracle's argmax
        # given its own root path (what the tree mask guarantees).
        predict = torch.empty((bs, n), dtype=torch.int64)
        for b in range(bs):
            par = compiled.parent[b].tolist()
            for i in range(n):
                path, j = [], i
                while j >= 0:
                    path.append(int(compiled.tokens[b, j]))
                    j = par[j]
                ctx = seqs[b][:-1] + path[::-1]
                kv[int(loc[b, i])] = (int(compiled.positions[b, i]), int(compiled.tokens[b, i]))
                predict[b, i] = _oracle(ctx)
        res = greedy_accept(compiled, predict, use_kernel=False)
        plan = plan_kv_remap(loc, res.accept_index, res.num_accepted)
        step_io.write_tree_window(req_to_token, pool_rows, prefix, plan.new_cache_loc)
        out = step_io.output_tokens(res, n)
        for b in range(bs):
            k = int(res.num_accepted[b])
            for t in out[b, : k + 1].tolist():
                assert t == _oracle(seqs[b]), "emitted token differs from target greedy"
                seqs[b].append(t)
        prefix = prefix + res.num_accepted.to(torch.int64) + 1
        bonus = res.next_bonus.clone()
        for b in range(bs):
            row = req_to_token[pool_rows[b]].tolist()
            assert set(row) == owned[int(pool_rows[b])]  # no leak, no duplicate
            for pos in range(int(prefix[b])):
                assert kv[row[pos]] == (pos, seqs[b][pos])


def test_dense_mask_skipped_only_for_bit_reading_backends():
    from sglang.srt.speculative.ddtree.info import backend_reads_tree_mask_bits

    class Plain:
        pass

    class Reads:
        consumes_tree_mask_bits = True

    class Hybrid:
        def __init__(self, inner):
            self.full_attn_backend = inner

    assert not backend_reads_tree_mask_bits(Plain())
    assert backend_reads_tree_mask_bits(Reads())
    assert backend_reads_tree_mask_bits(Hybrid(Reads()))
    assert not backend_reads_tree_mask_bits(Hybrid(Plain()))


def test_stats_summary():
    from sglang.srt.speculative.ddtree.metrics import summarize

    hist = torch.tensor([2, 0, 3, 1, 0, 0])  # accepted drafts 0,0,2,2,2,3
    s = summarize(hist, torch.tensor([24, 6]))
    assert s["requests"] == 6
    assert s["mean_accepted"] == pytest.approx((0 + 0 + 6 + 3) / 6)
    assert s["mean_tree_depth"] == 4.0
    assert s["histogram"] == [2, 0, 3, 1]
    assert summarize(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 0])) is None

# SPDX-License-Identifier: Apache-2.0
"""DDTree compile: tokens, positions, ancestor bitmask and retrive_* links
against naive per-node walks."""

import numpy as np
import pytest
import torch
from _ddtree_helpers import random_tree
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.layers.attention.tree_verify.masks import mask_words, pack_bits, unpack_tree_mask
from sglang.srt.speculative.ddtree.reference import ancestors_ref, compile_tree_ref
from sglang.srt.speculative.ddtree.tree_build import build_tree_from_logits, triton_interpreted
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth



def _compile(tree, num_depths, rng, use_triton=None):
    bs = tree.node_token.shape[0]
    bonus = torch.from_numpy(rng.integers(0, 1000, size=bs))
    committed = torch.from_numpy(rng.integers(0, 5000, size=bs))
    ct = compile_tree(tree, bonus, committed, max_tree_depth(tree.budget, num_depths), use_triton=use_triton)
    return ct, bonus, committed


@settings(max_examples=60, deadline=None, database=None)
@given(
    bs=st.integers(1, 4),
    budget=st.integers(1, 80),
    num_depths=st.integers(1, 16),
    vocab=st.integers(1, 6),
    pad_prob=st.sampled_from([0.0, 0.5]),
    use_triton=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_compile_matches_naive(bs, budget, num_depths, vocab, pad_prob, use_triton, seed):
    """Both implementations: the Triton kernel (interpreted) and batched torch."""
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, bs, budget, num_depths, vocab, pad_prob)
    ct, bonus, committed = _compile(tree, num_depths, rng, use_triton)
    n = budget + 1
    assert ct.tree_mask.shape == (bs, n, mask_words(n)) and ct.tree_mask.dtype == torch.int32
    assert ct.tokens.dtype == ct.positions.dtype == ct.retrive_next_token.dtype == torch.int64
    for b in range(bs):
        ref = compile_tree_ref(
            tree.node_token[b].tolist(),
            tree.node_parent[b].tolist(),
            tree.node_depth[b].tolist(),
            int(bonus[b]),
            int(committed[b]),
        )
        assert ct.tokens[b].tolist() == ref["tokens"]
        assert ct.positions[b].tolist() == ref["positions"]
        assert ct.tree_mask[b].tolist() == ref["tree_mask"]
        assert ct.retrive_next_token[b].tolist() == ref["first_child"]
        assert ct.retrive_next_sibling[b].tolist() == ref["next_sibling"]
        assert ct.retrive_index[b].tolist() == [b * n + i for i in range(n)]


@settings(max_examples=30, deadline=None, database=None)
@given(budget=st.integers(1, 70), num_depths=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_dense_mask_is_ancestor_closure(budget, num_depths, seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, budget, num_depths, 5, 0.3)
    ct, _, _ = _compile(tree, num_depths, rng)
    dense = unpack_tree_mask(ct.tree_mask, budget + 1)
    for b in range(2):
        parent_full = ct.parent[b].tolist()
        for i in range(budget + 1):
            want = set(ancestors_ref(parent_full, i))
            assert set(torch.nonzero(dense[b, i]).flatten().tolist()) == want


@settings(max_examples=30, deadline=None, database=None)
@given(budget=st.integers(1, 70), num_depths=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_links_enumerate_each_nodes_children(budget, num_depths, seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, budget, num_depths, 4, 0.3)
    ct, _, _ = _compile(tree, num_depths, rng)
    for b in range(2):
        parent = ct.parent[b].tolist()
        first = ct.retrive_next_token[b].tolist()
        nxt = ct.retrive_next_sibling[b].tolist()
        reached = {0}
        for i in range(budget + 1):
            kids, j = [], first[i]
            while j != -1:
                kids.append(j)
                j = nxt[j]
            assert kids == [c for c in range(budget + 1) if parent[c] == i]
            reached.update(kids)
        real = {0} | {c for c in range(1, budget + 1) if parent[c] >= 0}
        assert reached == real, "padding must not be linked into the tree"


def test_compile_of_a_built_tree():
    torch.manual_seed(0)
    tree = build_tree_from_logits(torch.randn(3, 15, 500), 64)
    ct = compile_tree(tree, torch.tensor([1, 2, 3]), torch.tensor([10, 0, 7]), max_tree_depth(64, 15))
    assert ct.positions[:, 0].tolist() == [10, 0, 7]
    assert torch.equal(ct.positions[:, 1:] - ct.positions[:, :1], tree.node_depth.long())
    dense = unpack_tree_mask(ct.tree_mask, 65)
    # every node sees root and itself; row popcount = depth + 1
    assert dense[..., 0].all() and torch.diagonal(dense, dim1=1, dim2=2).all()
    assert torch.equal(dense.sum(-1), ct.depth.long() + 1)


def test_bit_31_and_word_boundaries():
    # A chain of 70 nodes: row i has bits 0..i set, crossing words and the sign bit.
    budget = 70
    parent = torch.arange(budget, dtype=torch.int32).unsqueeze(0)
    tree = random_tree(np.random.default_rng(0), 1, budget, 1, 1)
    tree.node_parent = parent
    tree.node_depth = torch.arange(1, budget + 1, dtype=torch.int32).unsqueeze(0)
    ct = compile_tree(tree, torch.tensor([0]), torch.tensor([0]), budget, use_triton=True)
    assert torch.equal(ct.tree_mask, compile_tree(tree, torch.tensor([0]), torch.tensor([0]), budget,
                                                  use_triton=False).tree_mask)
    dense = unpack_tree_mask(ct.tree_mask, budget + 1)
    assert torch.equal(dense[0], torch.tril(torch.ones(budget + 1, budget + 1, dtype=torch.bool)))
    assert ct.tree_mask[0, 31, 0].item() == -1  # all 32 bits of word 0
    assert ct.tree_mask[0, 40, 1].item() == (1 << 9) - 1


@pytest.mark.parametrize("budget", [1, 31, 32, 64, 256])
def test_triton_and_torch_compile_agree(budget):
    rng = np.random.default_rng(budget)
    tree = random_tree(rng, 3, budget, 15, 8, 0.3)
    bonus = torch.tensor([1, 2, 3], dtype=torch.int32)
    committed = torch.tensor([0, 100, 4096], dtype=torch.int32)
    depth = max_tree_depth(budget, 15)
    a = compile_tree(tree, bonus, committed, depth, use_triton=True)
    b = compile_tree(tree, bonus, committed, depth, use_triton=False)
    for name in ("tokens", "positions", "depth", "parent", "tree_mask", "retrive_index",
                 "retrive_next_token", "retrive_next_sibling"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_pack_bits_round_trip():
    flags = torch.rand(3, 5, 77) > 0.5
    assert torch.equal(unpack_tree_mask(pack_bits(flags), 77), flags)


def test_compile_rejects_bad_shapes():
    tree = random_tree(np.random.default_rng(0), 2, 4, 3, 3)
    with pytest.raises(ValueError, match="bonus"):
        compile_tree(tree, torch.tensor([1]), torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="max_depth"):
        compile_tree(tree, torch.tensor([1, 1]), torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="req_pool_indices"):
        compile_tree(tree, torch.tensor([1, 1]), torch.tensor([1, 2]), 3, req_to_token=torch.zeros((4, 64)))


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("budget", [4, 16, 33, 128])
def test_compile_reads_the_tree_window(use_triton, bs, budget):
    """With req_to_token, compile returns the tree window's KV slots, the same
    as ``step_io.tree_cache_locs``; without it, none."""
    from sglang.srt.speculative.ddtree.step_io import tree_cache_locs

    if use_triton and not triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before triton loads")
    rng = np.random.default_rng(budget + bs)
    tree = random_tree(rng, bs, budget, 8, 6, 0.3)
    pool, context = 2 * bs + 1, 512
    req_to_token = torch.from_numpy(rng.permutation(pool * context).reshape(pool, context)).to(torch.int32)
    rows = torch.from_numpy(rng.permutation(pool)[:bs]).to(torch.int64)
    committed = torch.from_numpy(rng.integers(0, context - budget - 1, size=bs)).to(torch.int64)
    bonus = torch.zeros(bs, dtype=torch.int64)
    depth = max_tree_depth(budget, 8)
    ct = compile_tree(tree, bonus, committed, depth, req_to_token=req_to_token, req_pool_indices=rows,
                      use_triton=use_triton)  # fmt: skip
    want = tree_cache_locs(req_to_token, rows, committed, budget + 1)
    assert ct.cache_loc.dtype == want.dtype and torch.equal(ct.cache_loc, want)
    assert compile_tree(tree, bonus, committed, depth, use_triton=use_triton).cache_loc is None

# SPDX-License-Identifier: Apache-2.0
"""DDTree from a DFlash 2 selector's transitions: the Triton kernel (interpreted) against
the plain heap reference (exact, every field), against brute-force enumeration of every
path, against ``tree_build`` when transitions do not depend on the predecessor, and
through ``tree_compile``."""

import itertools
import math

import numpy as np
import pytest
import torch

from sglang.srt.speculative.ddtree.draft_tree import FIELDS
from sglang.srt.speculative.ddtree.selector_tree import (
    build_selector_tree,
    build_selector_tree_ref_batched,
    transition_logprobs,
)
from sglang.srt.speculative.ddtree.tree_build import build_tree, triton_interpreted
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth


def test_kernel_runs_interpreted():
    assert triton_interpreted(), "tests/cpu/conftest.py must set TRITON_INTERPRET=1"


def _lattice(rng, bs, slots, k, vocab=1000, ties=False):
    ids = torch.stack(
        [torch.from_numpy(rng.choice(vocab, size=k, replace=False)) for _ in range(bs * slots)]
    ).view(bs, slots, k)
    if ties:
        scores = rng.integers(0, 3, size=(bs, slots, k, k)).astype(np.float32)
    else:
        scores = (rng.normal(size=(bs, slots, k, k)) * 2).astype(np.float32)
    scores[:, 0] = scores[:, 0, :1]  # slot 0 follows the anchor: its rows are equal
    return ids.to(torch.int64), torch.from_numpy(scores)


def _assert_same(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


CASES = [
    # bs, slots, K, budget, ties
    (1, 1, 1, 1, False),
    (2, 1, 4, 8, False),
    (3, 3, 4, 5, False),
    (2, 5, 4, 16, False),
    (2, 15, 8, 16, False),
    (2, 7, 8, 64, False),
    (1, 4, 3, 40, False),
    (3, 5, 4, 16, True),
    (2, 6, 8, 33, True),
    (1, 15, 16, 128, False),
]


@pytest.mark.parametrize("bs,slots,k,budget,ties", CASES)
def test_kernel_matches_reference(bs, slots, k, budget, ties):
    rng = np.random.default_rng(bs * 1000 + slots * 100 + k * 10 + budget)
    ids, scores = _lattice(rng, bs, slots, k, ties=ties)
    got = build_selector_tree(ids, scores, budget, use_triton=True)
    want = build_selector_tree_ref_batched(ids, scores, budget)
    _assert_same(got, want)
    assert (got.num_nodes == min(budget, sum(k ** d for d in range(1, slots + 1)))).all()


def test_nan_and_minus_inf_scores():
    rng = np.random.default_rng(7)
    ids, scores = _lattice(rng, 2, 4, 4)
    scores[0, 1, 2, 3] = float("nan")
    scores[1, 2, :, 1] = float("-inf")
    scores[1, 3, 0] = float("nan")
    got = build_selector_tree(ids, scores, 20, use_triton=True)
    _assert_same(got, build_selector_tree_ref_batched(ids, scores, 20))


def _all_paths(lp):
    """Every path's (score, depth, candidates) by brute force, float32 sums in path order."""
    slots, k, _ = lp.shape
    out = []
    for depth in range(1, slots + 1):
        for cands in itertools.product(range(k), repeat=depth):
            s = np.float32(lp[0, 0, cands[0]])
            for d in range(1, depth):
                s = np.float32(s + lp[d, cands[d - 1], cands[d]])
            out.append((float(s), depth, cands))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_tree_is_the_best_prefix_closed_set(seed):
    rng = np.random.default_rng(100 + seed)
    slots, k, budget = 3, 3, 11
    ids, scores = _lattice(rng, 1, slots, k)
    tree = build_selector_tree(ids, scores, budget, use_triton=True)
    lp = transition_logprobs(scores)[0].numpy()
    n = int(tree.num_nodes[0])
    parent = tree.node_parent[0, :n].tolist()
    depth = tree.node_depth[0, :n].tolist()
    cand = tree.node_rank[0, :n].tolist()
    score = tree.node_score[0, :n].tolist()
    paths = {}
    for i in range(n):
        p = parent[i]
        assert p < i + 1 and (p == 0 or depth[p - 1] == depth[i] - 1)
        prefix = () if p == 0 else paths[p]
        paths[i + 1] = prefix + (cand[i],)
        assert tree.node_token[0, i] == ids[0, depth[i] - 1, cand[i]]
    # Siblings hold distinct candidates; every score is its path's log-prob.
    assert len(set(paths.values())) == n
    every = {c: s for s, _, c in _all_paths(lp)}
    for i in range(n):
        assert score[i] == every[paths[i + 1]]
    # No path outside the tree scores above the tree's worst whose parent is in it.
    chosen = set(paths.values())
    worst = min(score)
    for s, d, c in _all_paths(lp):
        if c not in chosen and (d == 1 or c[:-1] in chosen):
            assert s <= worst


def test_predecessor_free_transitions_give_the_marginal_tree():
    """Rows that do not depend on the predecessor are per-depth marginals: the tree is
    tree_build's, field for field (node_rank: candidates are sorted by their score)."""
    rng = np.random.default_rng(3)
    bs, slots, k, budget = 3, 6, 8, 24
    marg = torch.from_numpy((rng.normal(size=(bs, slots, k)) * 2).astype(np.float32))
    marg = torch.sort(marg, dim=-1, descending=True).values
    ids = torch.from_numpy(rng.choice(1000, size=(bs, slots, k))).to(torch.int64)
    scores = marg.unsqueeze(2).expand(bs, slots, k, k).contiguous()
    got = build_selector_tree(ids, scores, budget, use_triton=True)
    logprobs = torch.log_softmax(marg, dim=-1)
    want = build_tree(logprobs, ids, budget, use_triton=True)
    _assert_same(got, want)


def test_transitions_change_the_tree():
    rng = np.random.default_rng(4)
    ids, scores = _lattice(rng, 1, 4, 4)
    scores[0, 1] = torch.eye(4) * 10  # slot 1 strictly follows slot 0's candidate index
    tree = build_selector_tree(ids, scores, 4, use_triton=True)
    first = int(tree.node_rank[0, 0])
    assert int(tree.node_depth[0, 1]) == 2 and int(tree.node_rank[0, 1]) == first


def test_reference_path_on_cpu_without_triton():
    rng = np.random.default_rng(5)
    ids, scores = _lattice(rng, 2, 5, 4)
    _assert_same(build_selector_tree(ids, scores, 12, use_triton=False),
                 build_selector_tree(ids, scores, 12, use_triton=True))  # fmt: skip


def test_compiles_like_a_marginal_tree():
    rng = np.random.default_rng(6)
    bs, slots, k, budget = 2, 7, 4, 16
    ids, scores = _lattice(rng, bs, slots, k)
    tree = build_selector_tree(ids, scores, budget, use_triton=True)
    compiled = compile_tree(tree, bonus=torch.tensor([5, 6]), committed_len=torch.tensor([10, 20]),
                            max_depth=max_tree_depth(budget, slots), use_triton=True)  # fmt: skip
    assert compiled.tokens.shape == (bs, budget + 1)
    assert torch.equal(compiled.tokens[:, 1:], tree.node_token)


def test_out_buffers_and_bad_inputs():
    from sglang.srt.speculative.ddtree.draft_tree import empty_tree

    rng = np.random.default_rng(8)
    ids, scores = _lattice(rng, 2, 3, 4)
    out = empty_tree(2, 8, "cpu")
    assert build_selector_tree(ids, scores, 8, out=out, use_triton=True) is out
    with pytest.raises(ValueError):
        build_selector_tree(ids, scores[..., :3], 8)
    with pytest.raises(ValueError):
        build_selector_tree(ids, scores, 0)
    with pytest.raises(ValueError):
        build_selector_tree(ids, scores, 257)
    assert math.isinf(float(build_selector_tree_ref_batched(ids, scores, 200).node_score[0, -1]))


_AOT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang.srt.speculative.ddtree.selector_tree import _selector_tree_kernel as fn
from sglang.srt.layers.attention.tree_verify.masks import MAX_BUDGET
from sglang.srt.speculative.ddtree.tree_build import _launch_config

types = {n: "i32" for n in ("stride_out_b", "slots", "k", "width", "budget")}
types.update(lp_ptr="*fp32", order_ptr="*i32", ids_ptr="*i64", out_token_ptr="*i64", out_parent_ptr="*i32",
             out_depth_ptr="*i32", out_rank_ptr="*i32", out_score_ptr="*fp32", out_num_ptr="*i32")
out = []
for cap in (90, 120):
    for budget in sorted({1, 16, 64, 128, MAX_BUDGET}):
        frontier, num_warps = _launch_config(budget)
        sig = {n: ("constexpr" if n == "FRONTIER" else types[n]) for n in fn.arg_names}
        c = triton.compile(ASTSource(fn, sig, constexprs={"FRONTIER": frontier}),
                           target=GPUTarget("cuda", cap, 32), options={"num_warps": num_warps})
        out.append(dict(cap=cap, budget=budget, shared=c.metadata.shared, spills="ld.local" in c.asm["ptx"]))
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_and_sm120():
    """The interpreter accepts code the compiler rejects: compile for real GPUs, in a
    subprocess without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 10
    for r in results:
        assert r["shared"] <= 99 * 1024, r
        assert not r["spills"], f"register spills to local memory: {r}"

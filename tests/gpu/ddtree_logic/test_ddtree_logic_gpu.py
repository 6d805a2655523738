# SPDX-License-Identifier: Apache-2.0
"""DDTree algorithm core on a real GPU: the compiled Triton build kernel
against the heap reference at serving shapes, the sglang-kernel acceptance op
against the torch path, CUDA-graph capture of the whole per-step pipeline, and
step-time measurements.

Run on the GPU host: ``python3 -m pytest tests/gpu/ddtree_logic -q -s``.
Set ``DDTREE_LOGIC_BENCH_JSON=<path>`` to also write the timings as JSON.
"""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang.srt.speculative.ddtree.accept import greedy_accept, kernel_ops_available  # noqa: E402
from sglang.srt.speculative.ddtree.kv_slot_plan import plan_kv_compaction, plan_kv_remap  # noqa: E402
from sglang.srt.speculative.ddtree.reference import build_tree_ref_batched  # noqa: E402
from sglang.srt.speculative.ddtree.tree_build import (  # noqa: E402
    build_tree,
    draft_topk,
    triton_interpreted,
)
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth  # noqa: E402

DEV = "cuda"
FIELDS = ("node_token", "node_parent", "node_depth", "node_rank", "node_score", "num_nodes")
needs_sgl_kernel = pytest.mark.skipif(
    not kernel_ops_available(), reason="sgl_kernel tree ops do not load here"
)
_BENCH = {}


def setup_module():
    assert not triton_interpreted(), "unset TRITON_INTERPRET for the GPU tests"


def teardown_module():
    path = os.environ.get("DDTREE_LOGIC_BENCH_JSON")
    if path and _BENCH:
        with open(path, "w") as f:
            json.dump(_BENCH, f, indent=2)


def _assert_same_tree(a, b):
    for name in FIELDS:
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert torch.equal(x, y), f"{name} differs"


def _draft(bs, num_depths, vocab, budget, dtype, seed, ties=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    if ties:
        logits = torch.randint(0, 3, (bs, num_depths, vocab), device=DEV, generator=g).to(dtype)
    else:
        logits = (torch.randn(bs, num_depths, vocab, device=DEV, generator=g) * 3).to(dtype)
    return draft_topk(logits, budget)


@pytest.mark.parametrize("budget", [1, 7, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_build_kernel_matches_reference(budget, dtype):
    lp, ids = _draft(8, 15, 4096, budget, dtype, seed=budget)
    got = build_tree(lp, ids, budget)
    _assert_same_tree(got, build_tree_ref_batched(lp.cpu(), ids.cpu(), budget))


@pytest.mark.parametrize("budget", [1, 31, 64, 256])
def test_compile_kernel_matches_torch(budget):
    lp, ids = _draft(8, 15, 4096, budget, torch.float32, seed=budget)
    tree = build_tree(lp, ids, budget)
    bonus = torch.randint(0, 4096, (8,), device=DEV)
    committed = torch.randint(0, 10000, (8,), device=DEV, dtype=torch.int32)
    depth = max_tree_depth(budget, 15)
    a = compile_tree(tree, bonus, committed, depth, use_triton=True)
    b = compile_tree(tree, bonus, committed, depth, use_triton=False)
    for name in ("tokens", "positions", "depth", "parent", "tree_mask", "retrive_index",
                 "retrive_next_token", "retrive_next_sibling"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("budget", [16, 64, 256])
def test_build_kernel_ties_and_small_vocab(budget):
    lp, ids = _draft(4, 6, 5, budget, torch.float32, seed=3, ties=True)
    got = build_tree(lp, ids, budget)
    _assert_same_tree(got, build_tree_ref_batched(lp.cpu(), ids.cpu(), budget))


def _random_step(bs, budget, num_depths, vocab, seed, follow=0.85):
    """Build + compile a tree and make target outputs that often follow it."""
    lp, ids = _draft(bs, num_depths, vocab, budget, torch.float32, seed)
    tree = build_tree(lp, ids, budget)
    bonus = torch.randint(0, vocab, (bs,), device=DEV)
    committed = torch.randint(0, 10000, (bs,), device=DEV)
    ct = compile_tree(tree, bonus, committed, max_tree_depth(budget, num_depths))
    n = budget + 1
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    logits = torch.randn(bs, n, vocab, device=DEV, generator=g)
    # boost the token of the first child at most nodes so paths get long
    first = ct.retrive_next_token.clamp(min=0)
    child_tok = torch.gather(ct.tokens, 1, first)
    boost = (torch.rand(bs, n, device=DEV, generator=g) < follow) & (ct.retrive_next_token >= 0)
    logits.scatter_add_(2, child_tok.unsqueeze(-1), boost.unsqueeze(-1).float() * 8.0)
    return ct, logits


@needs_sgl_kernel
@pytest.mark.parametrize("bs,budget", [(1, 8), (8, 64), (4, 256)])
def test_greedy_kernel_matches_torch(bs, budget):
    accepted = []
    for seed in range(5):
        ct, logits = _random_step(bs, budget, 15, 512, seed)
        pred = logits.argmax(-1)
        a = greedy_accept(ct, pred, use_kernel=True)
        b = greedy_accept(ct, pred, use_kernel=False)
        for name in ("accept_index", "num_accepted", "accept_tokens", "next_bonus"):
            assert torch.equal(getattr(a, name).long(), getattr(b, name).long()), name
        accepted.append(b.num_accepted.float())
    # The inputs must exercise paths longer than one node: over all seeds, not per
    # seed (one bs=1 step may legitimately stop at the first child).
    assert torch.cat(accepted).mean() > 1


@needs_sgl_kernel
@pytest.mark.parametrize("bs,budget", [(1, 8), (8, 64), (4, 256)])
def test_commit_reads_back_the_greedy_kernel(bs, budget):
    """The commit kernel fed verify_tree_greedy's raw outputs commits and returns
    what the torch accept path and the torch commit do."""
    from sglang.srt.speculative.ddtree import step_io

    for seed in range(3):
        ct, logits = _random_step(bs, budget, 15, 512, seed)
        pred = logits.argmax(-1)
        n = budget + 1
        pool = 2 * bs + 1
        req_to_token = torch.randperm(pool * 20000, device=DEV).view(pool, 20000).to(torch.int32)
        rows = torch.randperm(pool, device=DEV)[:bs]
        prefix = ct.positions[:, 0].clone()
        loc = step_io.tree_cache_locs(req_to_token, rows, prefix, n)
        raw = greedy_accept(ct, pred, use_kernel=True, read_back=False)
        want_res = greedy_accept(ct, pred, use_kernel=False)
        r2t_k, r2t_t = req_to_token.clone(), req_to_token.clone()
        got = step_io.commit_accepted(raw, loc, prefix, r2t_k, rows)
        want = step_io.commit_accepted_torch(want_res, loc, prefix, r2t_t, rows)
        for name in ("accept_index", "num_accepted", "accept_tokens", "next_bonus"):
            assert torch.equal(getattr(got.accept, name).long(), getattr(want_res, name).long()), name
        for name in ("new_cache_loc", "output_tokens", "commit_lens", "new_seq_lens", "ctx_rows",
                     "ctx_positions", "ctx_cache_loc"):  # fmt: skip
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(r2t_k, r2t_t)


def _per_step(lp, ids, budget, bonus, committed, pred, slots, num_depths):
    tree = build_tree(lp, ids, budget)
    ct = compile_tree(tree, bonus, committed, max_tree_depth(budget, num_depths))
    res = greedy_accept(ct, pred, use_kernel=False)
    kv = plan_kv_remap(slots, res.accept_index, res.num_accepted)
    return tree, ct, res, kv


def test_whole_step_is_cuda_graph_capturable():
    bs, budget, num_depths, vocab = 8, 64, 15, 1000
    lp, ids = _draft(bs, num_depths, vocab, budget, torch.float32, seed=11)
    bonus = torch.randint(0, vocab, (bs,), device=DEV)
    committed = torch.randint(0, 5000, (bs,), device=DEV)
    pred = torch.randint(0, vocab, (bs, budget + 1), device=DEV)
    slots = torch.arange(bs * (budget + 1), device=DEV).view(bs, budget + 1)
    args = (lp, ids, budget, bonus, committed, pred, slots, num_depths)
    eager = _per_step(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _per_step(*args)  # warm-up (caches, autotune)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _per_step(*args)
    # new inputs in place, replay, compare with eager on the same inputs
    lp2, ids2 = _draft(bs, num_depths, vocab, budget, torch.float32, seed=12)
    lp.copy_(lp2)
    ids.copy_(ids2)
    pred.copy_(torch.randint(0, vocab, pred.shape, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    eager = _per_step(*args)
    _assert_same_tree(captured[0], eager[0])
    assert torch.equal(captured[1].tree_mask, eager[1].tree_mask)
    assert torch.equal(captured[2].accept_index, eager[2].accept_index)
    assert torch.equal(captured[3].new_cache_loc, eager[3].new_cache_loc)


def _time_us(fn, iters=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("bs,budget", [(1, 64), (8, 64), (8, 256), (32, 64)])
def test_step_time(bs, budget):
    """Median GPU time of build (one launch), compile, greedy accept, KV plan."""
    num_depths, vocab = 15, 32000
    lp, ids = _draft(bs, num_depths, vocab, budget, torch.float32, seed=1)
    bonus = torch.randint(0, vocab, (bs,), device=DEV)
    committed = torch.randint(0, 5000, (bs,), device=DEV)
    pred = torch.randint(0, vocab, (bs, budget + 1), device=DEV)
    slots = torch.arange(bs * (budget + 1), device=DEV).view(bs, budget + 1)
    tree = build_tree(lp, ids, budget)
    depth = max_tree_depth(budget, num_depths)
    ct = compile_tree(tree, bonus, committed, depth)
    res = greedy_accept(ct, pred, use_kernel=False)

    build_us = _time_us(lambda: build_tree(lp, ids, budget, out=tree))
    compile_us = _time_us(lambda: compile_tree(tree, bonus, committed, depth))
    compile_torch_us = _time_us(lambda: compile_tree(tree, bonus, committed, depth, use_triton=False))
    accept_us = _time_us(lambda: greedy_accept(ct, pred, use_kernel=False))
    kv_us = _time_us(lambda: plan_kv_remap(slots, res.accept_index, res.num_accepted))

    def step():
        _per_step(lp, ids, budget, bonus, committed, pred, slots, num_depths)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_us = _time_us(graph.replay)
    row = dict(build_us=build_us, compile_us=compile_us, compile_torch_us=compile_torch_us,
               greedy_accept_torch_us=accept_us,
               kv_remap_us=kv_us, whole_step_graph_us=graph_us)
    if kernel_ops_available():
        row["greedy_accept_sgl_kernel_us"] = _time_us(lambda: greedy_accept(ct, pred, use_kernel=True))
    _BENCH[f"bs{bs}_B{budget}_L{num_depths}"] = row
    print(f"\nbs={bs} B={budget} L={num_depths}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()))
    if (bs, budget) == (8, 64):
        assert build_us < 100, "tree build must cost at most a few tens of microseconds"

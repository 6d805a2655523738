# SPDX-License-Identifier: Apache-2.0
"""DDTREE's tree from a DFlash 2 selector as the one segment the worker replays as a CUDA
graph (``DDTreeWorker._build_selector_and_compile``): on the recorded case's hidden states,
with the drafter the server builds, it is the selector's lattice, the best-first tree over its
transitions and the compile, with the verified bonus as the lattice's anchor. The replay
against eager on a GPU: ``tests/gpu/ddtree_logic/test_step_graphs.py``; through servers: the
``dflash2`` GPU tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.cpu.dflash2 import harness


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_the_segment_is_lattice_tree_and_compile(drafter, reference, reference_inputs, budget):
    from sglang.srt.speculative.ddtree.selector_tree import build_selector_tree
    from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth
    from sglang.srt.speculative.ddtree.worker import _TREE_TENSORS, DDTreeWorker

    bs, block = len(harness.PREFIX_LENS), harness.block_size()
    slots = reference["output.hidden"].view(bs, block, -1)[:, 1:]
    head = harness.LMHead(reference_inputs["lm_head"])
    bonus = reference_inputs["anchor_ids"]
    prefix = torch.tensor(harness.PREFIX_LENS, dtype=torch.int64)
    rows = torch.tensor([1, 0], dtype=torch.int64)
    req_to_token = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    max_depth = max_tree_depth(budget, block - 1)

    w = object.__new__(DDTreeWorker)
    w.draft_model = drafter
    w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(lm_head=head)))
    with torch.no_grad():
        got = w._build_selector_and_compile(budget, max_depth, slots, req_to_token, bonus, prefix, rows)
        ids, scores = drafter.selector_lattice(slots, bonus, head)
        want = compile_tree(build_selector_tree(ids, scores, budget), bonus=bonus.to(torch.int64),
                            committed_len=prefix, max_depth=max_depth, req_to_token=req_to_token,
                            req_pool_indices=rows)  # fmt: skip
    for name in _TREE_TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # The tree's first node is the first slot's best candidate after this anchor, by its
    # transition score (not the LM head's order of the candidates).
    best = torch.gather(ids[:, 0], 1, scores[:, 0, 0].argmax(-1, keepdim=True)).squeeze(1)
    assert torch.equal(got.tokens[:, 1], best), (got.tokens[:, 1], best)


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 64])
def test_candidates_in_chunks_of_rows_are_the_whole_matmuls(monkeypatch, rows_per_chunk):
    """The selector's LM-head top-K scores at most ``_CHUNK_ELEMS`` logits per matmul (what a
    graph of it keeps in its pool); every chunking gives the candidates of the one matmul,
    padding rows past ``num_valid`` never among them."""
    from sglang.srt.speculative.dflash2 import selector

    g = torch.Generator().manual_seed(rows_per_chunk)
    vocab, k = 300, 8
    weight, hidden = torch.randn(vocab + 4, 16, generator=g), torch.randn(7, 16, generator=g)
    logits = hidden @ weight[:vocab].T
    want = torch.topk(logits, k, dim=-1)
    monkeypatch.setattr(selector, "_CHUNK_ELEMS", rows_per_chunk * vocab)
    ids, values = selector.head_topk(hidden, weight, k, num_valid=vocab)
    assert torch.equal(ids, want.indices)  # random logits: no ties
    torch.testing.assert_close(values, want.values, atol=1e-5, rtol=0)
    assert int(ids.max()) < vocab and ids.dtype == torch.int64


def _dflash_worker(disable_cuda_graph=False):
    return SimpleNamespace(server_args=SimpleNamespace(disable_cuda_graph=disable_cuda_graph))


@pytest.mark.parametrize(
    "cuda,env,disabled,tp,graphs",
    [(True, True, False, 1, True), (False, True, False, 1, False), (True, False, False, 1, False),
     (True, True, True, 1, False), (True, True, False, 2, False)],
    ids=["one-rank-graphs", "no-cuda", "step-graphs-off", "cuda-graphs-off", "tensor-parallel"],
)  # fmt: skip
def test_which_dflash_servers_replay_the_selector_path(monkeypatch, cuda, env, disabled, tp, graphs):
    """DFLASH's selector path replays as a graph on one rank with CUDA graphs on, and is made
    once per worker; anything else runs it eagerly."""
    from sglang.srt.ddtree_environ import ddtree_envs
    from sglang.srt.speculative.ddtree.step_graphs import SegmentGraphs
    from sglang.srt.speculative.dflash2 import dflash_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dflash_step, "_tp_size", lambda: tp)
    monkeypatch.setenv("SGLANG_DDTREE_STEP_GRAPHS", "1" if env else "0")
    assert ddtree_envs.SGLANG_DDTREE_STEP_GRAPHS.get() is env
    worker = _dflash_worker(disabled)
    first = dflash_step._path_graphs(worker, object(), object())
    assert isinstance(first, SegmentGraphs) if graphs else first is None
    assert dflash_step._path_graphs(worker, object(), object()) is first


def test_the_greedy_path_is_the_lattice_walk(drafter, reference, reference_inputs):
    """What DFLASH verifies with a DFlash 2 drafter, as the graph captures it: the selector's
    greedy walk over its lattice after the anchor (the recorded greedy walk of upstream's
    selector on these hidden states)."""
    from sglang.srt.speculative.dflash2.dflash_step import greedy_path

    bs, block = len(harness.PREFIX_LENS), harness.block_size()
    slots = reference["output.hidden"].view(bs, block, -1)[:, 1:]
    head = harness.LMHead(reference_inputs["lm_head"])
    with torch.no_grad():
        got = greedy_path(drafter, head, slots, reference_inputs["anchor_ids"])
    assert torch.equal(got, reference["output.walk.greedy_tokens"]) and got.shape == (bs, block - 1)

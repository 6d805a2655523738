# SPDX-License-Identifier: Apache-2.0
"""Where DDTREE's per-depth top-K runs: in the drafter's CUDA graph (the head upstream's
``init_cuda_graphs`` registers as a capture tail hook) on one rank with a float LM head, and
eagerly where the graph cannot hold it; a step reads the head only after a replay."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.speculative.ddtree import worker as worker_mod
from sglang.srt.speculative.ddtree.budget import TreeBudget
from sglang.srt.speculative.ddtree.draft_topk import DraftTopKHead
from sglang.srt.speculative.ddtree.worker import DDTreeWorker


def _worker(monkeypatch, *, vocab=120, weight_rows=128, weight_dtype=torch.float32, tp=1, transitions=False,
            eager_env=False, budget=16):  # fmt: skip
    w = object.__new__(DDTreeWorker)
    lm_head = SimpleNamespace(weight=torch.zeros(weight_rows, 8, dtype=weight_dtype))
    runner = SimpleNamespace(model=SimpleNamespace(lm_head=lm_head), model_config=SimpleNamespace(vocab_size=vocab))
    w.__dict__.update(
        _target_worker=SimpleNamespace(model_runner=runner), model_runner=runner,
        ps=SimpleNamespace(tp_rank=0), block_size=8, tree_from_transitions=transitions,
        tree=TreeBudget.resolve(budget, None, 8, vocab),
    )  # fmt: skip
    monkeypatch.setattr(worker_mod, "get_tp_group", lambda: SimpleNamespace(world_size=tp))
    graphs = SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(bs=[1, 2, 4]))))
    monkeypatch.setattr(worker_mod, "get_exec", lambda: graphs)
    monkeypatch.setenv("SGLANG_DFLASH_EAGER_DRAFT_SAMPLER", "1" if eager_env else "0")
    return w


def test_one_rank_folds_the_topk_into_the_draft_graph(monkeypatch):
    head = _worker(monkeypatch)._maybe_build_draft_sampler()
    assert isinstance(head, DraftTopKHead)
    # The tree's top-K, over the model's vocabulary (LM-head padding rows excluded), for the
    # largest captured batch.
    assert (head.topk, head.num_valid, head.id_offset, head.block_size) == (16, 120, 0, 8)
    assert head.logprobs.shape == head.ids.shape == (4 * 7, 16)


@pytest.mark.parametrize(
    "setting",
    [dict(tp=2), dict(transitions=True), dict(eager_env=True), dict(weight_dtype=torch.int8)],
    ids=["tensor-parallel", "tree-from-transitions", "env-eager", "quantized-lm-head"],
)
def test_kept_eager(monkeypatch, setting):
    assert _worker(monkeypatch, **setting)._maybe_build_draft_sampler() is None

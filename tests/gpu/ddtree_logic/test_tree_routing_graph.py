# SPDX-License-Identifier: Apache-2.0
"""The benchmark-only tree-sibling MoE routing (patch 0061) inside a CUDA graph: a replay
routes by the sibling groups written before it, as a verify graph's replay must, and by the
identity outside a verify."""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang.srt.ddtree_environ import ddtree_envs  # noqa: E402
from sglang.srt.layers.moe import topk as upstream_topk  # noqa: E402
from sglang.srt.layers.moe import tree_routing  # noqa: E402
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth  # noqa: E402
from tests.cpu.ddtree_logic._ddtree_helpers import random_tree  # noqa: E402

E, K, HIDDEN = 64, 6, 128


def _parent(seed: int, bs: int, budget: int) -> torch.Tensor:
    tree = random_tree(np.random.default_rng(seed), bs, budget, num_depths=8, vocab=12)
    compiled = compile_tree(tree, torch.arange(bs), torch.full((bs,), 5), max_tree_depth(budget, 8), use_triton=False)
    return compiled.parent.cuda()


def _expert_sets(ids: torch.Tensor) -> int:
    return len({tuple(x) for x in ids.tolist()})


def test_a_graph_replay_routes_by_the_groups_written_before_it():
    bs, budget = 4, 16
    n = budget + 1
    cfg = upstream_topk.TopKConfig(top_k=K)
    h = torch.randn(bs * n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(bs * n, E, device="cuda", dtype=torch.float32)
    with ddtree_envs.SGLANG_DDTREE_SIMULATE_TREE_ROUTING.override(True):
        upstream_topk.select_experts(h, logits, cfg)  # eager first, as a graph runner's warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = upstream_topk.select_experts(h, logits, cfg)
        for seed in range(3):
            parent = _parent(seed, bs, budget)
            with tree_routing.siblings_share(parent):
                graph.replay()
                ids = out.topk_ids.view(bs, n, K).clone()
            groups = tree_routing.sibling_groups(parent).view(bs, n)
            for r in range(bs):
                for i in range(n):
                    for j in range(n):
                        if groups[r, i] == groups[r, j]:
                            assert torch.equal(ids[r, i], ids[r, j]), (seed, r, i, j)
            assert torch.all((ids - ids[..., :1]) % E == torch.arange(K, device="cuda") * (E // K))
            assert _expert_sets(ids.view(-1, K)) <= len(set(groups.flatten().tolist()))
        # outside a verify the same graph routes every row by itself
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tree_routing._groups[: bs * n], torch.arange(bs * n, device="cuda"))
        assert _expert_sets(out.topk_ids) > bs * 6

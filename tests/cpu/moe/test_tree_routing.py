# SPDX-License-Identifier: Apache-2.0
"""Benchmark-only routing in which a tree verify's siblings share their experts (patch 0061),
through the real patched ``select_experts``, on trees the DDTREE compiler builds."""

import numpy as np
import pytest
import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.environ import envs
from sglang.srt.layers.moe import topk as upstream_topk
from sglang.srt.layers.moe import tree_routing
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth
from tests.cpu.ddtree_logic._ddtree_helpers import random_tree

E, K = 64, 6  # DeepSeek-V2-Lite's routed experts and top-k


@pytest.fixture
def tree_routing_on():
    with ddtree_envs.SGLANG_DDTREE_SIMULATE_TREE_ROUTING.override(True):
        yield


def _compiled(seed: int, bs: int = 3, budget: int = 16, pad_prob: float = 0.3):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, bs, budget, num_depths=8, vocab=12, pad_prob=pad_prob)
    return compile_tree(tree, torch.arange(bs), torch.full((bs,), 5), max_tree_depth(budget, 8))


def _select(num_tokens: int) -> torch.Tensor:
    out = upstream_topk.select_experts(torch.randn(num_tokens, 16), torch.randn(num_tokens, E),
                                       upstream_topk.TopKConfig(top_k=K, torch_native=True))
    assert torch.all(out.topk_weights == 1.0 / K)
    return out.topk_ids


@pytest.mark.parametrize("seed", range(4))
def test_sibling_groups_are_one_row_per_parent(seed):
    """Two rows share a group exactly when they are one request's siblings; the root and every
    node's children each get their own, and the group is a row of the verify."""
    parent = _compiled(seed).parent
    bs, n = parent.shape
    groups = tree_routing.sibling_groups(parent).view(bs, n)
    assert torch.all(parent < torch.arange(n))  # a node's parent comes first: p + 1 < N
    for r in range(bs):
        for i in range(n):
            assert r * n <= groups[r, i] < (r + 1) * n
            for j in range(n):  # the root and padding nodes (parent -1) go together
                assert bool(groups[r, i] == groups[r, j]) == bool(parent[r, i] == parent[r, j])
        for s in range(bs):
            if s != r:
                assert not set(groups[r].tolist()) & set(groups[s].tolist())


def test_select_experts_sends_siblings_to_the_same_experts(tree_routing_on):
    torch.manual_seed(1)
    compiled = _compiled(7, pad_prob=0.0)
    parent = compiled.parent
    bs, n = parent.shape
    _select(4)  # an eager forward first, as upstream's graph runners warm up before capturing
    with tree_routing.siblings_share(parent):
        ids = _select(bs * n + 5).view(-1, K)  # a padded graph batch: rows past the tree's
    tree_ids = ids[: bs * n].view(bs, n, K)
    for r in range(bs):
        for i in range(n):
            for j in range(n):
                if parent[r, i] == parent[r, j]:
                    assert torch.equal(tree_ids[r, i], tree_ids[r, j])
    # uniform routing's pattern: k experts E // k apart from each row's offset
    assert torch.all((ids - ids[:, :1]) % E == torch.arange(K) * (E // K))
    # distinct groups draw their own offsets: many different expert sets across the batch
    assert len({tuple(x) for x in ids.tolist()}) > bs * 2
    # after the verify every row is its own group again (a prefill, a chain, a decode step)
    assert torch.equal(tree_routing._groups[: bs * n], torch.arange(bs * n))
    torch.manual_seed(0)
    plain = _select(bs * n)
    assert len({tuple(x) for x in plain.tolist()}) > len({tuple(x) for x in tree_ids.view(-1, K).tolist()})


def test_off_by_default_and_refused_beside_upstreams_simulations():
    assert not tree_routing.enabled()
    with ddtree_envs.SGLANG_DDTREE_SIMULATE_TREE_ROUTING.override(True):
        for other in (envs.SGLANG_SIMULATE_UNIFORM_EXPERTS, envs.SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS):
            with other.override(True), pytest.raises(ValueError, match="set one of"):
                _select(4)
    # off, a forward inside siblings_share routes by the router as upstream does
    logits = torch.randn(6, E)
    want = torch.topk(torch.softmax(logits, -1), K).indices.sort(-1).values
    got = upstream_topk.select_experts(torch.randn(6, 16), logits, upstream_topk.TopKConfig(top_k=K, torch_native=True))
    assert torch.equal(got.topk_ids.sort(-1).values, want)


def test_a_forward_longer_than_the_buffer_routes_uniformly(tree_routing_on, monkeypatch):
    _select(2)
    monkeypatch.setattr(tree_routing, "CAPACITY", 8)
    ids = _select(12)
    assert torch.all((ids - ids[:, :1]) % E == torch.arange(K) * (E // K))


def test_a_ddtree_step_routes_its_verify_by_its_tree(tree_routing_on, monkeypatch):
    """The DDTREE worker's verify forward runs with its tree's sibling groups in place (what a
    graph replay reads by address), and every other forward after it with the identity."""
    from benchmarks import step_ops

    world = step_ops.StepWorld("DDTREE", 2, 16, 16, 256)
    world.worker._tree_routing = True  # as DDTreeWorker.__init__ sets it under the variable
    _select(2)  # the group buffer, made by an eager forward
    seen = {}
    forward = world._target_forward
    parents = []
    real_compile = world.worker._compile

    def compile_and_keep(*args, **kwargs):
        compiled = real_compile(*args, **kwargs)
        parents.append(compiled.parent)
        return compiled

    def target_forward(**kwargs):
        rows = kwargs["forward_batch"].spec_info.draft_token_num * world.bs
        seen["groups"] = tree_routing._groups[:rows].clone()
        return forward(**kwargs)

    monkeypatch.setattr(world.worker, "_compile", compile_and_keep)
    monkeypatch.setattr(world.worker.target_worker, "forward_batch_generation", target_forward)
    world.step()
    assert len(parents) == 1 and parents[0].shape == (2, 17)
    assert torch.equal(seen["groups"], tree_routing.sibling_groups(parents[0]))
    assert len(set(seen["groups"].tolist())) < 2 * 17  # siblings grouped: fewer groups than rows
    assert torch.equal(tree_routing._groups[:64], torch.arange(64))

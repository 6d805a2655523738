# SPDX-License-Identifier: Apache-2.0
"""A Gated DeltaNet layer verifying DDTree trees: upstream's Triton kernels in
tree mode (the causal conv ``causal_conv1d_update`` and the gated delta rule
``fused_sigmoid_gating_delta_rule_update``), fed DDTree's compiled
``retrive_next_*`` links as the hybrid backend feeds them (patch 0054), against

- the plain torch reference in ``layers/attention/linear/tree_reference.py``
  (the recurrence run along each node's root path), and
- transformers' own Qwen3-Next torch recurrence (``torch_recurrent_gated_delta_rule``,
  ``torch_causal_conv1d_update``) run as an ordinary sequence along each root path;

then a whole step: the accepted node's states (``linear_state.last_accepted_nodes``)
become the request's, and the next tree verified from them matches a sequential
run over everything committed. Under TRITON_INTERPRET=1, float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
    fused_sigmoid_gating_delta_rule_update,
)
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
from sglang.srt.layers.attention.linear.tree_reference import (
    conv_tree_reference,
    gated_delta_tree_reference,
    gdn_gates,
    root_path,
)
from sglang.srt.speculative.ddtree.linear_state import last_accepted_nodes
from sglang.srt.speculative.ddtree.tree_compile import compile_tree

from _ddtree_helpers import random_tree

WIDTH = 4  # conv kernel
DIM = 12  # conv channels
H, HV, K, V = 2, 4, 16, 16  # GDN heads and head dims (two value heads per key head)
SLOTS = 6


def _trees(seed, bs, budget, depths):
    tree = random_tree(np.random.default_rng(seed), bs, budget, depths, vocab=5, pad_prob=0.3)
    compiled = compile_tree(
        tree, bonus=torch.zeros(bs, dtype=torch.int64), committed_len=torch.zeros(bs, dtype=torch.int64),
        max_depth=depths, use_triton=False,
    )
    return compiled


def _parents(compiled):
    """Parent lists as the kernels derive them: a padded node hangs off the root."""
    par = compiled.parent.clone()
    par[:, 1:] = torch.where(par[:, 1:] < 0, 0, par[:, 1:])
    return par.tolist()


class Layer:
    """One GDN layer's random inputs for ``bs`` requests of ``n`` tree nodes."""

    def __init__(self, seed, bs, n):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
        self.x = r(bs, DIM, n)
        self.conv_pool = r(SLOTS, DIM, WIDTH - 1)
        self.weight, self.bias = r(DIM, WIDTH, scale=0.5), r(DIM, scale=0.1)
        t = bs * n
        self.q, self.k, self.v = r(1, t, H, K), r(1, t, H, K), r(1, t, HV, V)
        self.a, self.b = r(t, HV), r(t, HV)
        self.A_log, self.dt_bias = r(HV, scale=0.5), r(HV, scale=0.5)
        self.ssm_pool = r(SLOTS, HV, V, K, scale=0.3)  # pool layout [HV, V, K]
        self.slots = torch.tensor([4, 1, 3, 0][:bs], dtype=torch.int32)
        self.bs, self.n = bs, n


def _verify(layer, compiled):
    """Upstream's kernels in tree mode, with the backend's buffers: one
    intermediate row per batch position, one state per node."""
    bs, n = layer.bs, layer.n
    next_token = compiled.retrive_next_token.to(torch.int32)
    next_sibling = compiled.retrive_next_sibling.to(torch.int32)
    parent_out = torch.empty_like(next_token)
    rows = torch.arange(bs, dtype=torch.int32)
    conv_windows = torch.zeros(bs + 1, n, DIM, WIDTH - 1)
    conv_pool = layer.conv_pool.clone()
    conv_out = causal_conv1d_update(
        layer.x.clone(), conv_pool, layer.weight, layer.bias, "silu",
        conv_state_indices=layer.slots, intermediate_conv_window=conv_windows,
        intermediate_state_indices=rows, retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling, retrieve_parent_token=parent_out,
    )
    states = torch.zeros(bs + 1, n, HV, V, K)
    ssm_pool = layer.ssm_pool.clone()
    out = fused_sigmoid_gating_delta_rule_update(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=layer.q, k=layer.k, v=layer.v,
        a=layer.a, b=layer.b, initial_state_source=ssm_pool, initial_state_indices=layer.slots,
        cu_seqlens=torch.arange(0, bs * n + 1, n, dtype=torch.int32), use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, disable_state_update=True,
        intermediate_states_buffer=states, intermediate_state_indices=rows, cache_steps=n,
        retrieve_parent_token=parent_out,
    )
    # A tree verify leaves the request's own SSM slot alone (the commit writes it).
    assert torch.equal(ssm_pool, layer.ssm_pool)
    return conv_out, conv_windows, out[0].view(bs, n, HV, V), states, parent_out


@pytest.mark.parametrize("seed,bs,budget,depths", [(0, 2, 8, 4), (1, 3, 16, 6), (2, 1, 12, 12)])
def test_tree_kernels_match_the_root_path_reference(seed, bs, budget, depths):
    compiled = _trees(seed, bs, budget, depths)
    n = budget + 1
    layer = Layer(seed, bs, n)
    conv_out, windows, out, states, parent_out = _verify(layer, compiled)
    parents = _parents(compiled)
    assert parent_out[:, 1:].tolist() == [p[1:] for p in parents]
    g, beta = gdn_gates(layer.A_log, layer.a, layer.dt_bias, layer.b)
    for r in range(bs):
        slot = int(layer.slots[r])
        want_conv, want_windows = conv_tree_reference(
            layer.x[r], parents[r], layer.conv_pool[slot], layer.weight, layer.bias
        )
        torch.testing.assert_close(conv_out[r].double(), want_conv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(windows[r].double(), want_windows, atol=1e-6, rtol=0)
        rows = slice(r * n, (r + 1) * n)
        want_out, want_states = gated_delta_tree_reference(
            layer.q[0, rows], layer.k[0, rows], layer.v[0, rows], g[rows], beta[rows],
            parents[r], layer.ssm_pool[slot].transpose(-1, -2), scale=K**-0.5,
        )
        torch.testing.assert_close(out[r].double(), want_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[r].transpose(-1, -2).double(), want_states, atol=2e-5, rtol=1e-4)


def test_reference_equals_transformers_recurrence_along_each_root_path():
    """The reference's per-node outputs are what Qwen3-Next's own torch code
    computes when the node's root path is fed as a plain sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_causal_conv1d_update,
        torch_recurrent_gated_delta_rule,
    )

    compiled = _trees(7, 1, 10, 5)
    n = 11
    layer = Layer(7, 1, n)
    parent = _parents(compiled)[0]
    g, beta = gdn_gates(layer.A_log, layer.a, layer.dt_bias, layer.b)
    conv_ref, _ = conv_tree_reference(layer.x[0], parent, layer.conv_pool[4], layer.weight, layer.bias)
    h0 = layer.ssm_pool[4].transpose(-1, -2)
    out_ref, states_ref = gated_delta_tree_reference(
        layer.q[0], layer.k[0], layer.v[0], g, beta, parent, h0, scale=K**-0.5
    )
    for i in range(n):
        path = root_path(parent, i)
        state = layer.conv_pool[4].clone().double().unsqueeze(0)  # [1, dim, W - 1]
        for t in path:  # one decode step per path node, the model's cached-decode path
            y = torch_causal_conv1d_update(
                layer.x[0, :, t].double().view(1, DIM, 1), state, layer.weight.double(),
                layer.bias.double(), "silu",
            )
        torch.testing.assert_close(y.view(DIM), conv_ref[:, i], atol=1e-10, rtol=0)
        group = HV // H
        seq = lambda t: t[0, path].double().repeat_interleave(group, dim=1).unsqueeze(0)  # noqa: E731
        o, last = torch_recurrent_gated_delta_rule(
            seq(layer.q), seq(layer.k), layer.v[0, path].double().unsqueeze(0),
            g=g[path].unsqueeze(0), beta=beta[path].unsqueeze(0), initial_state=h0.unsqueeze(0),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        # transformers computes the recurrence in float32.
        torch.testing.assert_close(o[0, -1].double(), out_ref[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[0].double(), states_ref[i], atol=1e-5, rtol=1e-5)


def test_commit_then_next_tree_matches_the_sequential_run():
    """Step 1 verifies a tree; the accepted node's windows and state go to the
    request's slot (what ``update_mamba_state_after_mtp_verify`` copies: batch
    row ``b``, node ``last_accepted_nodes[b]``); step 2 verifies a new tree
    from there. Every step-2 node must see the committed prefix plus its root
    path as one sequence."""
    bs, budget, depths = 2, 10, 5
    n = budget + 1
    first = _trees(11, bs, budget, depths)
    layer = Layer(11, bs, n)
    _, windows, _, states, _ = _verify(layer, first)
    # Accept a root path per request: the deepest node, and the root alone.
    parents = _parents(first)
    deepest = int(first.depth[0].argmax())
    paths = [root_path(parents[0], deepest), [0]]
    accept_index = torch.full((bs, depths + 1), -1, dtype=torch.int64)
    for r, p in enumerate(paths):
        accept_index[r, : len(p)] = torch.tensor(p)
    num_accepted = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int32)
    last = last_accepted_nodes(accept_index, num_accepted)
    assert last.tolist() == [p[-1] for p in paths]

    committed = Layer(12, bs, n)  # step 2's inputs, from the committed state
    committed.conv_pool, committed.ssm_pool = layer.conv_pool.clone(), layer.ssm_pool.clone()
    committed.A_log, committed.dt_bias = layer.A_log, layer.dt_bias
    committed.weight, committed.bias = layer.weight, layer.bias
    for r in range(bs):
        slot = int(layer.slots[r])
        committed.conv_pool[slot] = windows[r, last[r]]
        committed.ssm_pool[slot] = states[r, last[r]]
    second = _trees(12, bs, budget, depths)
    conv_out, _, out, _, _ = _verify(committed, second)

    g1, beta1 = gdn_gates(layer.A_log, layer.a, layer.dt_bias, layer.b)
    g2, beta2 = gdn_gates(committed.A_log, committed.a, committed.dt_bias, committed.b)
    parents2 = _parents(second)
    for r in range(bs):
        slot = int(layer.slots[r])
        rows1 = [r * n + t for t in paths[r]]
        for i in range(n):
            path2 = root_path(parents2[r], i)
            rows2 = [r * n + t for t in path2]
            # The whole committed history as one chain: step 1's path, then step 2's.
            chain = list(range(len(rows1) + len(rows2)))
            x = torch.cat([layer.x[r][:, paths[r]], committed.x[r][:, path2]], dim=1)
            conv_want, _ = conv_tree_reference(
                x, [c - 1 for c in chain], layer.conv_pool[slot], layer.weight, layer.bias
            )
            torch.testing.assert_close(conv_out[r, :, i].double(), conv_want[:, -1], atol=1e-5, rtol=1e-5)
            cat = lambda a, b: torch.cat([a[rows1], b[rows2]])  # noqa: E731
            out_want, _ = gated_delta_tree_reference(
                cat(layer.q[0], committed.q[0]), cat(layer.k[0], committed.k[0]),
                cat(layer.v[0], committed.v[0]), cat(g1, g2), cat(beta1, beta2),
                [c - 1 for c in chain], layer.ssm_pool[slot].transpose(-1, -2), scale=K**-0.5,
            )
            torch.testing.assert_close(out[r, i].double(), out_want[-1], atol=5e-5, rtol=1e-4)

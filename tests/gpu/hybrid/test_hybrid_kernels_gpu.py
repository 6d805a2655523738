# SPDX-License-Identifier: Apache-2.0
"""GPU: upstream's tree-mode linear-attention kernels at a Qwen3.6-35B-A3B layer
(16 key and 32 value heads of 128, conv dim 8192; bf16 activations, fp32 state)
on DDTree trees of budget 16 and 64, against the root-path torch reference
(``layers/attention/linear/tree_reference.py``), then the commit a DDTREE step
makes: upstream's CUDA-only gather-scatter (``scatter_mamba_states_after_mtp_verify``)
of each request's deepest accepted node (``linear_state.last_accepted_nodes``)
into its state slot, batch > 1 with ragged trees."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.cpu.ddtree_logic._ddtree_helpers import random_tree  # noqa: E402

from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update  # noqa: E402
from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (  # noqa: E402
    scatter_mamba_states_after_mtp_verify,
)
from sglang.srt.layers.attention.linear.tree_reference import (  # noqa: E402
    conv_tree_reference,
    gated_delta_tree_reference,
    gdn_gates,
    root_path,
)
from sglang.srt.speculative.ddtree.linear_state import last_accepted_nodes  # noqa: E402
from sglang.srt.speculative.ddtree.tree_compile import compile_tree  # noqa: E402

H, HV, K, V, W = 16, 32, 128, 128, 4
DIM = 2 * H * K + HV * V  # conv channels: q, k, v
SLOTS = 12


@pytest.mark.parametrize("budget", [16, 64])
def test_tree_verify_and_commit_at_a_real_layer(budget):
    bs, n, dev = 3, budget + 1, "cuda"
    depths = min(budget, 15)
    tree = random_tree(np.random.default_rng(budget), bs, budget, depths, vocab=6)
    compiled = compile_tree(
        tree, bonus=torch.zeros(bs, dtype=torch.int64), committed_len=torch.zeros(bs, dtype=torch.int64),
        max_depth=depths, use_triton=False,
    )
    parents = compiled.parent.tolist()
    g = torch.Generator(device=dev).manual_seed(budget)
    r = lambda *s, scale=1.0, dtype=torch.bfloat16: (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)  # noqa: E731
    slots = torch.tensor([7, 2, 10], dtype=torch.int32, device=dev)
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    next_token = compiled.retrive_next_token.to(dev, torch.int32)
    next_sibling = compiled.retrive_next_sibling.to(dev, torch.int32)
    parent_out = torch.empty_like(next_token)

    # Pools with a layer dim of 1, as the mamba pool keeps them (dense windows).
    conv_pool = r(1, SLOTS + 1, DIM, W - 1)
    ssm_pool = r(1, SLOTS + 1, HV, V, K, scale=0.2, dtype=torch.float32)
    windows = torch.zeros(1, SLOTS + 1, n, DIM, W - 1, dtype=torch.bfloat16, device=dev)
    states = torch.zeros(1, SLOTS + 1, n, HV, V, K, dtype=torch.float32, device=dev)
    conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()

    x = r(bs * n, DIM)
    weight, bias = r(DIM, W, scale=0.5), None
    conv_out = causal_conv1d_update(
        x.view(bs, n, DIM).transpose(1, 2), conv_pool[0], weight, bias, "silu",
        conv_state_indices=slots, intermediate_conv_window=windows[0], intermediate_state_indices=rows,
        retrieve_next_token=next_token, retrieve_next_sibling=next_sibling, retrieve_parent_token=parent_out,
    )
    q, k, v = (t.contiguous().view(1, bs * n, -1, K) for t in conv_out.transpose(1, 2).reshape(bs * n, DIM).split(
        [H * K, H * K, HV * V], dim=-1))
    a, b = r(bs * n, HV), r(bs * n, HV)
    A_log, dt_bias = r(HV, scale=0.5, dtype=torch.float32), r(HV, scale=0.5)
    out = fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ssm_pool[0],
        initial_state_indices=slots, cu_seqlens=torch.arange(0, bs * n + 1, n, dtype=torch.int32, device=dev),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=True, intermediate_states_buffer=states[0], intermediate_state_indices=rows,
        cache_steps=n, retrieve_parent_token=parent_out,
    )
    torch.cuda.synchronize()
    assert torch.equal(ssm_pool, ssm_before)
    gates = gdn_gates(A_log.cpu(), a.float().cpu(), dt_bias.float().cpu(), b.float().cpu())
    for req in range(bs):
        s = int(slots[req])
        want_conv, want_windows = conv_tree_reference(
            x.view(bs, n, DIM)[req].T.float().cpu(), parents[req], conv_before[0, s].float().cpu(), weight.float().cpu()
        )
        got_conv = conv_out[req].float().cpu().double()
        torch.testing.assert_close(got_conv, want_conv, atol=3e-2, rtol=3e-2)  # bf16 output
        torch.testing.assert_close(windows[0, req].float().cpu().double(), want_windows, atol=0, rtol=0)
        span = slice(req * n, (req + 1) * n)
        want_out, want_states = gated_delta_tree_reference(
            q[0, span].float().cpu(), k[0, span].float().cpu(), v[0, span].float().cpu(),
            gates[0][span], gates[1][span], parents[req], ssm_before[0, s].transpose(-1, -2).cpu(), scale=K**-0.5,
        )
        torch.testing.assert_close(out[0, span].float().cpu().double(), want_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(states[0, req].transpose(-1, -2).cpu().double(), want_states, atol=1e-3, rtol=1e-3)

    # Accept: the deepest node for request 0, a middle node for 1, only the root for 2.
    deepest = int(compiled.depth[0].argmax())
    middle = next(i for i in range(1, n) if compiled.depth[1, i] == 2)
    paths = [root_path(parents[0], deepest), root_path(parents[1], middle), [0]]
    accept_index = torch.full((bs, depths + 1), -1, dtype=torch.int64)
    for req, p in enumerate(paths):
        accept_index[req, : len(p)] = torch.tensor(p)
    num_accepted = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int32)
    last = last_accepted_nodes(accept_index, num_accepted).to(dev)
    cache = SimpleNamespace(temporal=ssm_pool, intermediate_ssm=states, conv=[conv_pool],
                            intermediate_conv_window=[windows])
    scatter_mamba_states_after_mtp_verify(cache, slots, last, None, None)
    torch.cuda.synchronize()
    for req in range(bs):
        s = int(slots[req])
        torch.testing.assert_close(ssm_pool[0, s], states[0, req, paths[req][-1]], atol=0, rtol=0)
        torch.testing.assert_close(conv_pool[0, s], windows[0, req, paths[req][-1]], atol=0, rtol=0)
    untouched = [i for i in range(SLOTS + 1) if i not in slots.tolist()]
    assert torch.equal(ssm_pool[0, untouched], ssm_before[0, untouched])

# SPDX-License-Identifier: Apache-2.0
"""Plain torch references for a Gated DeltaNet layer verifying a token tree.

Every node of a verify tree must see the layer as if its root path were an
ordinary sequence: the short causal convolution reads the node's ancestors
(then the request's committed conv state), and the gated delta rule starts
from the parent's state. These references do exactly that, one root path at
a time, in float64, for one request. Upstream's Triton kernels
(``causal_conv1d_update`` and ``fused_sigmoid_gating_delta_rule_update`` with
tree links) are tested against them.

Shapes follow the math, not the pools: a state is ``[HV, K, V]`` (the pools
store ``[HV, V, K]``), a conv window is ``[dim, W - 1]``, oldest input first.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F


def root_path(parent: Sequence[int], node: int) -> List[int]:
    """Node indices from the root (``parent == -1``) down to ``node``."""
    path = [node]
    while parent[path[-1]] >= 0:
        path.append(int(parent[path[-1]]))
        if len(path) > len(parent):
            raise ValueError(f"parent links of node {node} form a cycle: {list(parent)}")
    return path[::-1]


def conv_tree_reference(
    x: torch.Tensor,
    parent: Sequence[int],
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of every tree node over its root path.

    ``x`` ``[dim, N]`` the nodes' conv inputs, ``conv_state`` ``[dim, W - 1]``
    the committed inputs before the root, ``weight`` ``[dim, W]`` (the last
    tap multiplies the node itself). Returns ``(out [dim, N], windows
    [N, dim, W - 1])``: each node's output and its conv state after it, i.e.
    the last ``W - 1`` inputs of its root path.
    """
    dim, n = x.shape
    width = weight.shape[1]
    w = weight.double()
    out = torch.empty((dim, n), dtype=torch.float64)
    windows = torch.empty((n, dim, width - 1), dtype=torch.float64)
    for i in range(n):
        seq = torch.cat([conv_state.double(), x.double()[:, root_path(parent, i)]], dim=1)
        y = (seq[:, -width:] * w).sum(dim=1)
        if bias is not None:
            y = y + bias.double()
        out[:, i] = F.silu(y) if activation in ("silu", "swish") else y
        windows[i] = seq[:, -(width - 1):]
    return out, windows


def gdn_gates(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token log decay ``g = -exp(A_log) * softplus(a +
    dt_bias)`` and update gate ``beta = sigmoid(b)``; ``a``, ``b`` ``[N, HV]``."""
    g = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    return g, torch.sigmoid(b.double())


def gated_delta_tree_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parent: Sequence[int],
    h0: torch.Tensor,
    scale: float,
    qk_l2norm: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of every tree node, run along its root path.

    ``q``, ``k`` ``[N, H, K]``, ``v`` ``[N, HV, V]`` (query/key head ``h``
    serves value heads ``h * HV / H ...``), ``g``, ``beta`` ``[N, HV]``, ``h0``
    ``[HV, K, V]`` the committed state. Per step: ``h *= exp(g)``;
    ``h += k (beta (v - h^T k))^T``; output ``h^T q * scale``. Returns
    ``(o [N, HV, V], states [N, HV, K, V])``, the state being the one after
    the node.
    """
    n, heads, _ = q.shape
    hv = v.shape[1]
    group = hv // heads
    qd, kd, vd = q.double(), k.double(), v.double()
    if qk_l2norm:
        qd = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + 1e-6)
        kd = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    out = torch.empty((n, hv, vd.shape[2]), dtype=torch.float64)
    states = torch.empty((n, hv, kd.shape[2], vd.shape[2]), dtype=torch.float64)
    for i in range(n):
        h = h0.double().clone()
        for t in root_path(parent, i):
            for j in range(hv):
                kt, qt = kd[t, j // group], qd[t, j // group]
                h[j] *= torch.exp(g[t, j].double())
                delta = beta[t, j].double() * (vd[t, j] - h[j].T @ kt)
                h[j] += torch.outer(kt, delta)
                if t == i:
                    out[i, j] = (h[j].T @ qt) * scale
        states[i] = h
    return out, states

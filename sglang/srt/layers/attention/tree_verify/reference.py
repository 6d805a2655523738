# SPDX-License-Identifier: Apache-2.0
"""Plain torch fp32 tree-verify attention: the definition the kernels are tested
against, and the documented fallback where no kernel strategy is available.

It gathers each request's prefix and tree KV, builds the dense mask and runs a
softmax per request, so it allocates O(N * H * (P + N)) per request: fine for
tests and small batches, not for serving at long context.

Positions, for a sliding window: tree node i sits at ``P + depth(i)`` (its depth
is the number of ancestors in its mask row), prefix key t at ``t``, so the prefix
passed is the last P committed tokens of the request. A key is seen iff the
query's position minus the key's is at most ``sliding_window`` (upstream's
``layer.sliding_window_size``: the Triton extend kernel keeps
``q_pos <= k_pos + sliding_window_size``). ``sinks`` (gpt-oss): a per-head logit
that joins each softmax denominator and contributes no value.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from sglang.srt.layers.attention.tree_verify.masks import unpack_tree_mask


def tree_verify_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    tree_kv_indices: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    out: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    kv_scales: Optional[Tuple[float, float]] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    bs, n = tree_kv_indices.shape
    h = q.shape[1]
    hkv = k_buffer.shape[1]
    group = h // hkv
    dv = v_buffer.shape[-1]
    visible = unpack_tree_mask(tree_mask, n)
    depth = visible.sum(-1) - 1  # [bs, N]: a mask row is the node's ancestors and itself
    indptr = prefix_kv_indptr.tolist()
    result = torch.empty(bs * n, h, dv, dtype=torch.float32, device=q.device)

    for b in range(bs):
        slots = torch.cat(
            [
                prefix_kv_indices[indptr[b] : indptr[b + 1]].long(),
                tree_kv_indices[b].long(),
            ]
        )
        p = indptr[b + 1] - indptr[b]
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [T, H, Dqk]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)  # [T, H, Dv]
        if kv_scales is not None:  # fp8 KV holds K / k_scale and V / v_scale
            k, v = k * kv_scales[0], v * kv_scales[1]
        qb = q[b * n : (b + 1) * n].float()  # [N, H, Dqk]
        scores = torch.einsum("nhd,thd->hnt", qb, k) * sm_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
        allowed[:, p:] = visible[b]
        if sliding_window is not None:
            q_pos = p + depth[b]  # [N]
            k_pos = torch.cat([torch.arange(p, device=q.device), p + depth[b]])
            allowed &= (q_pos[:, None] - k_pos[None, :]) <= sliding_window
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            sink = sinks.float().view(h, 1, 1).expand(h, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        result[b * n : (b + 1) * n] = torch.einsum("hnt,thd->nhd", probs, v)

    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out

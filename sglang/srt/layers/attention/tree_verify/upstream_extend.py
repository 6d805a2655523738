# SPDX-License-Identifier: Apache-2.0
"""The baseline (the ``upstream_extend`` strategy, ``strategies/upstream_extend.py``):
upstream's Triton ``extend_attention_fwd`` with a dense custom mask, which is what
upstream's Triton backend runs for a tree verify.

Kept for measurement and as a fallback with upstream's own numerics; it is
slow at long context because each (head, query block) program streams the
whole prefix alone.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.srt.layers.attention.tree_verify.masks import unpack_tree_mask


def dense_custom_mask(
    prefix_kv_indptr: torch.Tensor, tree_mask: torch.Tensor, num_nodes: int
) -> torch.Tensor:
    """Upstream's layout: per request ``N x (P + N)`` bytes, flattened."""
    bs = tree_mask.shape[0]
    visible = unpack_tree_mask(tree_mask, num_nodes)
    plens = (prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]).tolist()
    pieces = []
    for b in range(bs):
        m = torch.ones(num_nodes, plens[b] + num_nodes, dtype=torch.bool, device=tree_mask.device)
        m[:, plens[b] :] = visible[b]
        pieces.append(m.flatten())
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bool)


def tree_verify_upstream_extend(
    q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
    tree_mask, sm_scale, out, logit_cap, custom_mask=None,
):  # fmt: skip
    """``custom_mask`` (from :func:`dense_custom_mask`) may be built ahead, as
    upstream's backend does, to time the kernel alone or capture it in a graph."""
    bs, n = tree_kv_indices.shape
    flat = tree_kv_indices.reshape(-1).long()
    k_extend = k_buffer[flat].contiguous()
    v_extend = v_buffer[flat].contiguous()
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_buffer.shape[-1])
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=q.device)
    plens = prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=q.device)
    mask_indptr[1:] = torch.cumsum(n * (plens.long() + n), 0)
    extend_attention_fwd(
        q, k_extend, v_extend, out, k_buffer, v_buffer,
        qo_indptr, prefix_kv_indptr, prefix_kv_indices,
        custom_mask if custom_mask is not None
        else dense_custom_mask(prefix_kv_indptr, tree_mask, n),
        False, mask_indptr, n,
        1.0, 1.0, sm_scale=sm_scale, logit_cap=logit_cap,
        skip_prefix_custom_mask=True,
    )  # fmt: skip
    return out

# SPDX-License-Identifier: Apache-2.0
"""The DDTree verify input: a compiled tree packaged for the target forward.

The attention backends see a ``DFlashVerifyInput`` (spec_input_type
DFLASH_VERIFY, width ``draft_token_num`` = N = budget + 1) that additionally
carries the tree:

- ``tree_mask_bits`` ``int32 [bs, N, ceil(N/32)]``, the compact ancestor mask.
  A backend with tree-verify support reads this and nothing else.
- ``custom_mask``, the dense ``bool`` mask upstream's Triton / FlashInfer
  TARGET_VERIFY paths take (as EAGLE trees use it): per request ``N`` rows of
  ``prefix_len + N`` columns, flattened and concatenated in batch order, the
  prefix columns all visible. It is built only when the backend needs it.

Positions are ``committed_len + depth`` (siblings share one), passed through
``positions`` as the DFlash chain does.

On hybrid linear-attention targets the verify input also carries the tree as
``retrieve_next_token`` / ``retrieve_next_sibling`` (``int32 [bs, N]``: first
child and next sibling, -1 for none), the links upstream's linear-attention
backend hands its causal-conv and gated-delta kernels in tree mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.tree_verify.hook import innermost_attention_backend
from sglang.srt.layers.attention.tree_verify.masks import unpack_tree_mask
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ddtree.tree_compile import CompiledTree
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


def backend_reads_tree_mask_bits(attn_backend) -> bool:
    """Whether the verify backend reads ``tree_mask_bits`` itself.

    A backend (or a tree-verify hook installed on it) that sets
    ``consumes_tree_mask_bits = True`` gets no dense mask: building one would
    only cost ``N * (prefix + N)`` bytes per request per step.
    """
    backend = innermost_attention_backend(attn_backend)
    return bool(getattr(backend, "consumes_tree_mask_bits", False))


def dense_mask_numel_bound(prefix_lens_sum_bound: int, bs: int, num_tokens: int) -> int:
    """Host-side size for ``dense_verify_mask``: ``N * sum(prefix + N)``.

    ``prefix_lens_sum_bound`` must be an upper bound of the device prefix
    lengths' sum (the host copy may lag the device in overlap scheduling).
    """
    return num_tokens * (int(prefix_lens_sum_bound) + bs * num_tokens)


def dense_verify_mask(
    tree_mask: torch.Tensor, prefix_lens: torch.Tensor, numel: int
) -> torch.Tensor:
    """Expand the ancestor bitmask into the flattened TARGET_VERIFY custom mask.

    Request b occupies ``N * (P_b + N)`` entries starting at the exclusive
    prefix sum of those sizes: row i is ``[True] * P_b`` followed by node i's
    visibility over the tree. ``numel`` (>= the exact total, see
    ``dense_mask_numel_bound``) keeps the output shape host-known; the tail
    beyond the exact total is left visible and never read. No host sync.
    """
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64).view(bs)
    row_len = prefix + n
    seg = row_len * n
    start = torch.cumsum(seg, 0) - seg
    rows = torch.arange(n, device=device, dtype=torch.int64).view(1, n, 1)
    cols = torch.arange(n, device=device, dtype=torch.int64).view(1, 1, n)
    tail_idx = (
        start.view(bs, 1, 1) + rows * row_len.view(bs, 1, 1) + prefix.view(bs, 1, 1) + cols
    )
    mask = torch.ones((numel,), dtype=torch.bool, device=device)
    mask[tail_idx.reshape(-1)] = unpack_tree_mask(tree_mask, n).reshape(-1)
    return mask


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """DFlash verify input with a tree instead of a chain.

    CUDA-graph replay is safe: patch 0053 captures the DDTREE TARGET_VERIFY
    graphs with the custom-mask path, and the Triton backend copies
    ``custom_mask`` into the captured buffer on replay.
    """

    tree_mask_bits: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None

    @classmethod
    def from_compiled(
        cls,
        tree: CompiledTree,
        *,
        custom_mask: Optional[torch.Tensor] = None,
        tree_links: bool = False,
    ) -> "DDTreeVerifyInput":
        """``tree_links``: also carry ``retrieve_next_*`` (hybrid targets)."""
        links = {}
        if tree_links:
            links = dict(
                retrieve_next_token=tree.retrive_next_token.to(torch.int32),
                retrieve_next_sibling=tree.retrive_next_sibling.to(torch.int32),
            )
        return cls(
            draft_token=tree.tokens.reshape(-1),
            positions=tree.positions.reshape(-1),
            draft_token_num=tree.num_tokens,
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            tree_mask_bits=tree.tree_mask,
            **links,
        )

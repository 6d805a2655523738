# SPDX-License-Identifier: Apache-2.0
"""A DDTree step's reads and writes of request state: the tree's window in
``req_to_token``, the tokens the scheduler emits, the drafter's context rows.

The tree's N tokens occupy ``req_to_token[req, P : P + N]`` (P = committed
length; the slots were reserved ahead of time by spec-v2 over-allocation).
After acceptance the kept path moves to the front of that window by permuting
the window's slots (``kv_slot_plan.plan_kv_remap``): the set of slots a request
owns never changes, so nothing leaks and nothing is double-freed, and the
dropped slots stay reserved as the next step's spare slots. page_size 1 only.

Everything here is batched torch with host-known shapes: no host sync.
"""

from __future__ import annotations

from typing import Tuple

import torch

from sglang.srt.speculative.ddtree.accept import AcceptResult


def _window(prefix_lens: torch.Tensor, n: int) -> torch.Tensor:
    offsets = torch.arange(n, device=prefix_lens.device, dtype=torch.int64)
    return prefix_lens.to(torch.int64).unsqueeze(1) + offsets


def tree_cache_locs(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """``int64 [bs, N]`` KV slots the verify writes the tree tokens into."""
    rows = req_pool_indices.to(torch.int64).unsqueeze(1)
    return req_to_token[rows, _window(prefix_lens, num_tokens)].to(torch.int64)


def write_tree_window(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_cache_loc: torch.Tensor,
) -> None:
    """Store the permuted window (``KVCommit.new_cache_loc``) back in place."""
    rows = req_pool_indices.to(torch.int64).unsqueeze(1)
    cols = _window(prefix_lens, new_cache_loc.shape[1])
    req_to_token[rows, cols] = new_cache_loc.to(req_to_token.dtype)


def output_tokens(res: AcceptResult, num_tokens: int) -> torch.Tensor:
    """``int64 [bs, N]`` row-strided emitted tokens for the scheduler.

    Row b holds the accepted drafts then the new bonus in its first
    ``num_accepted + 1`` columns; the scheduler reads exactly that many
    (``accept_lens``) at stride N. The rest is 0 and never read.
    """
    bs, width = res.accept_tokens.shape
    out = torch.zeros((bs, num_tokens), dtype=torch.int64, device=res.accept_tokens.device)
    out[:, :width] = res.accept_tokens.clamp(min=0)
    return out


def draft_context_inputs(
    verify_hidden: torch.Tensor,
    res: AcceptResult,
    new_cache_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the drafter's context KV append needs for the kept path.

    ``verify_hidden`` is the target's captured hidden states ``[bs * N, H]``.
    Returns ``(hidden [bs * (D + 1), H], positions [bs * (D + 1)],
    cache_loc_2d [bs, D + 1], commit_lens [bs] int32)``: row (b, t) is the
    kept node at depth t, placed at position ``P_b + t`` in slot
    ``new_cache_loc[b, t]``; only the first ``commit_lens[b]`` rows of a
    request are written (``set_kv_buffer_prefix_valid``).
    """
    bs, width = res.accept_index.shape
    n = new_cache_loc.shape[1]
    hidden = verify_hidden.view(bs, n, -1)
    index = res.accept_index.clamp(min=0).to(torch.int64)
    kept_hidden = torch.gather(
        hidden, 1, index.unsqueeze(-1).expand(bs, width, hidden.shape[-1])
    )
    positions = _window(prefix_lens, width)
    commit_lens = (res.num_accepted.to(torch.int32) + 1).contiguous()
    return (
        kept_hidden.reshape(bs * width, -1),
        positions.reshape(-1),
        new_cache_loc[:, :width].contiguous(),
        commit_lens,
    )

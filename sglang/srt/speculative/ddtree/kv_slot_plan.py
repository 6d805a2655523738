# SPDX-License-Identifier: Apache-2.0
"""Which KV slots a DDTree verify keeps, and where the kept KV goes.

The verify wrote the KV of all N tree tokens into ``out_cache_loc [bs, N]``.
Only the root (bonus) and the accepted nodes - ``num_accepted + 1`` entries, in
depth order - stay; everything else is dropped. Two ways to get the kept KV to
the request's next positions (``committed_len .. committed_len + num_accepted``):

- **remap** (page_size 1): no copy. ``new_cache_loc`` is a permutation of the
  tree's slots with the kept ones first in path order and the dropped ones
  after them in tree order; write it into ``req_to_token`` at the tree's
  positions. The dropped slots are ``new_cache_loc[b, num_kept:]``: free them,
  or keep them as the request's spare slots (spec v2 over-allocation).
- **compact**: copy the accepted nodes' KV into the first ``num_kept`` tree
  slots (``move_src -> move_dst``); slot order is unchanged, the dropped slots
  are ``out_cache_loc[b, num_kept:]``. Needed when slots cannot be reordered
  (page_size > 1). Copy all sources before writing any destination
  (``buf[dst] = buf[src]`` does): a source can be another move's destination.
  Moves beyond a request's path are padded as self-copies (src == dst) so
  shapes stay static.

Either way ``keep_mask``/``free_mask`` mark positions of ``new_cache_loc``:
position t is kept iff ``t < num_kept``. All batched, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class KVCommit:
    new_cache_loc: torch.Tensor  # [bs, N] slots; first num_kept are the kept path
    num_kept: torch.Tensor  # [bs] int64 = num_accepted + 1
    keep_mask: torch.Tensor  # [bs, N] bool, position < num_kept
    move_src: torch.Tensor  # [bs, D + 1] slots to copy from (compact only; else == dst)
    move_dst: torch.Tensor  # [bs, D + 1] slots to copy to

    @property
    def free_mask(self) -> torch.Tensor:
        return ~self.keep_mask

    def freed_slots(self) -> torch.Tensor:
        """Flat tensor of the dropped slots. Boolean indexing: syncs the host."""
        return self.new_cache_loc[self.free_mask]

    def kept_slots(self) -> torch.Tensor:
        """Flat tensor of the kept slots, request by request. Syncs the host."""
        return self.new_cache_loc[self.keep_mask]


def plan_kv_remap(
    out_cache_loc: torch.Tensor, accept_index: torch.Tensor, num_accepted: torch.Tensor
) -> KVCommit:
    """Keep the accepted path's own slots (no KV copy).

    ``accept_index`` ``[bs, D + 1]`` holds the path's node indices, root first,
    -1 after the path (``AcceptResult.accept_index``).
    """
    bs, n = _check(out_cache_loc, accept_index, num_accepted)
    accept_index = accept_index.to(torch.int64)
    device = out_cache_loc.device
    num_kept = num_accepted.to(torch.int64) + 1
    on_path = torch.zeros((bs, n + 1), dtype=torch.bool, device=device)
    on_path.scatter_(1, torch.where(accept_index >= 0, accept_index, n), True)
    on_path = on_path[:, :n]

    # Kept nodes go to ranks 0..num_kept-1 by depth (their column in
    # accept_index); dropped nodes follow in tree order.
    width = accept_index.shape[1]
    rank = torch.empty((bs, n + 1), dtype=torch.int64, device=device)
    col = torch.arange(width, device=device).expand(bs, width)
    dropped_rank = num_kept.unsqueeze(1) + torch.cumsum((~on_path).to(torch.int64), 1) - 1
    rank[:, :n] = dropped_rank
    rank.scatter_(1, torch.where(accept_index >= 0, accept_index, n), col)
    rank = rank[:, :n]
    new_cache_loc = torch.empty_like(out_cache_loc).scatter_(1, rank, out_cache_loc)

    keep_mask = _prefix_mask(num_kept, n)
    src = torch.gather(new_cache_loc, 1, col.clamp(max=n - 1))
    return KVCommit(new_cache_loc, num_kept, keep_mask, src, src.clone())


def plan_kv_compaction(
    out_cache_loc: torch.Tensor, accept_index: torch.Tensor, num_accepted: torch.Tensor
) -> KVCommit:
    """Copy the accepted path's KV into the first ``num_kept`` tree slots."""
    bs, n = _check(out_cache_loc, accept_index, num_accepted)
    accept_index = accept_index.to(torch.int64)
    num_kept = num_accepted.to(torch.int64) + 1
    width = accept_index.shape[1]
    col = torch.arange(width, device=out_cache_loc.device).expand(bs, width)
    dst = torch.gather(out_cache_loc, 1, col.clamp(max=n - 1))
    src = torch.gather(out_cache_loc, 1, accept_index.clamp(min=0))
    src = torch.where(accept_index >= 0, src, dst)
    return KVCommit(out_cache_loc, num_kept, _prefix_mask(num_kept, n), src, dst)


def apply_kv_moves(buffers: Sequence[torch.Tensor], commit: KVCommit) -> None:
    """Copy ``move_src`` rows to ``move_dst`` rows in every KV buffer.

    Sources are gathered before any destination is written.
    """
    src = commit.move_src.flatten()
    dst = commit.move_dst.flatten()
    for buf in buffers:
        buf[dst] = buf[src]


def _prefix_mask(num_kept: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=num_kept.device).unsqueeze(0) < num_kept.unsqueeze(1)


def _check(out_cache_loc, accept_index, num_accepted):
    if out_cache_loc.dim() != 2:
        raise ValueError(f"out_cache_loc must be [bs, N], got {tuple(out_cache_loc.shape)}")
    bs, n = out_cache_loc.shape
    if accept_index.dim() != 2 or accept_index.shape[0] != bs or accept_index.shape[1] > n:
        raise ValueError(
            f"accept_index must be [bs={bs}, D+1 <= {n}], got {tuple(accept_index.shape)}"
        )
    if num_accepted.shape != (bs,):
        raise ValueError(f"num_accepted must be [bs={bs}], got {tuple(num_accepted.shape)}")
    return bs, n

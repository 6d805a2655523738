# SPDX-License-Identifier: Apache-2.0
"""The one place DDTREE reaches into upstream's ``DFlashWorkerV2`` internals.

``DDTreeWorker`` subclasses upstream's DFlash worker and reuses its draft block
buffers, mask token, block positions, draft spec info and context-KV writer,
none of which upstream exposes publicly. Every such access goes through
``DFlashInternals``; the names it touches are listed below, and
``tests/cpu/ddtree_server/test_dflash_internals.py`` checks them against the
installed upstream, so an upstream bump that renames or moves one fails that
test instead of the first decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
from sglang.srt.speculative.ddtree import step_io

if TYPE_CHECKING:
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

#: Private attributes of ``DFlashWorkerV2`` read here.
ATTRIBUTES: Tuple[str, ...] = (
    "_mask_token_id",
    "_block_pos_offsets",
    "_draft_block_spec_info",
    "_use_triton_prepare_block",
    "_draft_block_ids_buf",
    "_draft_block_positions_buf",
    "_draft_verify_out_cache_loc_buf",
    "_draft_seq_lens_cpu_buf",
    "_draft_sampler",
)
#: Private methods of ``DFlashWorkerV2`` called here, with the parameters passed.
METHODS: Dict[str, Tuple[str, ...]] = {
    "_ensure_draft_block_buffers": ("bs",),
    "_append_target_hidden_to_draft_kv_by_loc": (
        "target_hidden",
        "cache_loc",
        "positions",
        "cache_loc_2d",
        "commit_lens",
    ),
}
#: Private methods of ``DFlashWorkerV2`` that ``DDTreeWorker`` overrides; upstream
#: must still call them for the override to take effect.
HOOKS: Tuple[str, ...] = ("_maybe_build_draft_sampler",)
#: Private module functions called here: ``(module, name) -> parameters passed``.
FUNCTIONS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("sglang.kernels.ops.speculative.dflash", "_prepare_dflash_draft_block_unchecked"): (
        "bonus_tokens",
        "prefix_lens",
        "req_pool_indices",
        "req_to_token",
        "block_ids_out",
        "positions_out",
        "cache_loc_out",
        "mask_token_id",
    ),
}


@dataclass
class DraftBlockBuffers:
    """Row views ``[:bs]`` of the worker's reusable draft-block buffers."""

    block_ids: torch.Tensor  # [bs, block] int64
    positions: torch.Tensor  # [bs, block] int64
    cache_loc: torch.Tensor  # [bs, block] int64
    seq_lens_cpu: torch.Tensor  # [bs] int32, host


class DFlashInternals:
    """Typed access to the private state of one ``DFlashWorkerV2``."""

    def __init__(self, worker: "DFlashWorkerV2"):
        self._worker = worker

    @property
    def draft_block_spec_info(self):
        return self._worker._draft_block_spec_info

    @property
    def draft_graph_head(self):
        """What ``_maybe_build_draft_sampler`` returned, which upstream keeps and registers
        as the draft graph's capture tail hook (``None`` without draft graphs)."""
        return self._worker._draft_sampler

    def draft_block_buffers(self, bs: int) -> DraftBlockBuffers:
        w = self._worker
        w._ensure_draft_block_buffers(bs)
        return DraftBlockBuffers(
            block_ids=w._draft_block_ids_buf[:bs],
            positions=w._draft_block_positions_buf[:bs],
            cache_loc=w._draft_verify_out_cache_loc_buf[:bs],
            seq_lens_cpu=w._draft_seq_lens_cpu_buf[:bs],
        )

    def prepare_draft_block(
        self,
        buffers: DraftBlockBuffers,
        bonus_tokens: torch.Tensor,
        prefix_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
    ) -> None:
        """Fill ``[bonus, MASK x L]``, its positions and its KV slots, as
        DFlash does (its Triton kernel on GPUs, batched torch otherwise)."""
        w = self._worker
        mask_token_id = int(w._mask_token_id)
        if w._use_triton_prepare_block:
            _prepare_dflash_draft_block_unchecked(
                bonus_tokens=bonus_tokens.view(-1),
                prefix_lens=prefix_lens.view(-1),
                req_pool_indices=req_pool_indices.view(-1),
                req_to_token=req_to_token,
                block_ids_out=buffers.block_ids,
                positions_out=buffers.positions,
                cache_loc_out=buffers.cache_loc,
                mask_token_id=mask_token_id,
            )
            return
        block = buffers.block_ids.shape[1]
        buffers.block_ids.fill_(mask_token_id)
        buffers.block_ids[:, 0].copy_(bonus_tokens)
        torch.add(prefix_lens.unsqueeze(1), w._block_pos_offsets, out=buffers.positions)
        buffers.cache_loc.copy_(
            step_io.tree_cache_locs(req_to_token, req_pool_indices, prefix_lens, block)
        )

    def draft_context_buffers(self) -> Tuple[int, ...]:
        """Addresses of the buffers the context-KV writer reuses from step to step (its
        workspaces grow with the rows written, the RoPE cache with the positions): a CUDA
        graph that captured the writer is valid while they hold."""
        helper = getattr(self._worker, "_fused_kv_helper", None)
        if helper is None:
            return ()
        buffers = [getattr(helper, name, None) for name in ("_proj_workspace", "_k_workspace", "_v_workspace")]
        rotary = getattr(helper, "rotary_emb", None)
        buffers.append(getattr(rotary, "cos_sin_cache", None))
        return tuple(0 if b is None else b.data_ptr() for b in buffers)

    def append_draft_context(
        self,
        *,
        target_hidden: torch.Tensor,
        cache_loc: torch.Tensor,
        positions: torch.Tensor,
        cache_loc_2d: Optional[torch.Tensor] = None,
        commit_lens: Optional[torch.Tensor] = None,
    ) -> None:
        """Write the drafter's context KV from target hidden states at given slots."""
        self._worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=target_hidden,
            cache_loc=cache_loc,
            positions=positions,
            cache_loc_2d=cache_loc_2d,
            commit_lens=commit_lens,
        )

# SPDX-License-Identifier: Apache-2.0
"""DDTREE in upstream's speculative-algorithm registry.

Imported at the end of ``sglang.srt.speculative.spec_info`` (patch 0051), so
every process that resolves an algorithm name sees DDTREE. Kept free of torch
model code: the worker is imported only when a worker is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

DDTREE = "DDTREE"


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE is a member of the DFlash family: same drafter, same target
    layer capture, same draft KV pool and scheduler paths. Only the verify
    (a tree instead of a chain) and its width differ."""

    # Read by the decode CUDA-graph runner (patch 0053): capture the
    # TARGET_VERIFY graphs with the custom-mask path.
    verify_uses_tree_mask = True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    # The enum carries these three and the scheduler calls them on whatever
    # from_string returned; CustomSpecAlgo (0.5.17) does not define them.
    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device,
            self,
            req_to_token_pool,
            needs_cpu_seq_lens,
            needs_confidence_relay,
        )

    def handle_server_args(self, server_args: ServerArgs) -> None:
        from sglang.srt.speculative.ddtree.flags import handle_ddtree_server_args

        handle_ddtree_server_args(server_args)

    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        # The target verifies budget + 1 tree tokens; the drafter runs one
        # DFlash block ([bonus, MASK x L]) in TARGET_VERIFY mode.
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec as get_spec_config

            block_size = get_spec_config().speculative_dflash_block_size
            if block_size:
                return int(block_size)
        return num_draft_tokens


def _worker_factory(server_args: ServerArgs):
    from sglang.srt.speculative.ddtree.worker import DDTreeWorker

    return DDTreeWorker


def register() -> None:
    """Idempotent: a second import (or a reload in tests) is a no-op."""
    if get_spec(DDTREE) is not None:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    SpeculativeAlgorithm.register(
        DDTREE, supports_overlap=True, spec_class=DDTreeSpecAlgo
    )(_worker_factory)


register()

# SPDX-License-Identifier: Apache-2.0
"""The verify sampling's GPU workspace: a fixed bound, kept out of the KV pool.

A DFLASH or DDTREE step draws a token for every verified node, ``bs * N`` rows of the
vocabulary: 4,160 rows at batch 64 and budget 64, 2.5 GB of float32 at a 152k
vocabulary for each temporary a sampling kernel makes. The draw goes in chunks of rows
(``node_draws.chunk_rows``) so those temporaries never exceed this workspace, and the
KV pool is sized with the workspace set aside (patch 0073), so a full batch of
sampled requests cannot run the GPU out of memory. The verify logits themselves are
the target forward's output, sized by upstream with the rest of its activations.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.ddtree_environ import ddtree_envs


def workspace_bytes() -> int:
    return max(1, int(ddtree_envs.SGLANG_DDTREE_SAMPLING_WORKSPACE_MB.get())) << 20


def reserved_gb(kv_configurator: Any) -> float:
    """GB the target's KV pool leaves for the workspace (DFLASH and DDTREE targets only)."""
    if kv_configurator.is_draft_worker or not kv_configurator.spec_algorithm.is_dflash_family():
        return 0.0
    return workspace_bytes() / (1 << 30)

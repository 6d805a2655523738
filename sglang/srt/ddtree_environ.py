# SPDX-License-Identifier: Apache-2.0
"""The environment variables this fork reads, declared the way upstream declares its own.

Upstream lists every ``SGLANG_*`` variable once, as a typed field of ``Envs`` in
``sglang.srt.environ``, and code reads ``envs.NAME.get()``. The fork's variables are
declared here with the same field types, so they parse, default and override
(``ddtree_envs.NAME.override(value)``) exactly like upstream's, and nothing else in
the fork reads ``os.environ`` for them.

Upstream closes field declaration once its own ``Envs`` exists (so that aliasing a
field inside a class body, ``a = envs.A``, is caught); the fork's class body reopens
it for its own declarations only.
"""

from __future__ import annotations

from contextlib import contextmanager

from sglang.srt.environ import EnvBool, EnvField, EnvInt, EnvStr


@contextmanager
def _declaring_fields():
    allowed = EnvField._allow_set_name
    EnvField._allow_set_name = True
    try:
        yield
    finally:
        EnvField._allow_set_name = allowed


with _declaring_fields():

    class DDTreeEnvs:
        # Tree-verify attention (layers/attention/tree_verify/).
        # A strategy name forces that strategy for the target's verify (benchmarks,
        # A/B runs); "upstream_extend" turns the tree-verify hook off. Unset: the
        # per-arch policy (tree_verify/policy.py).
        SGLANG_DDTREE_VERIFY_STRATEGY = EnvStr("")
        # An fp8 KV cache is read by the fused kernels; False hands it back to
        # upstream's dense-mask verify path.
        SGLANG_DDTREE_FP8_KV_VERIFY = EnvBool(True)
        # Compute capability whose kernel tile configurations to use ("12.0",
        # "sm_120"): runs sm_120 tiles on another GPU. Tiles only.
        SGLANG_DDTREE_KERNEL_ARCH = EnvStr("")
        # Serve as an sm_120 GPU would: sm_120 tiles, the sm_12x strategy policy,
        # no FlashMLA, FlashInfer's fa2 kernels (measurement on other GPUs).
        SGLANG_DDTREE_SM120_PROXY = EnvBool(False)
        # A measured strategy table to use instead of the one shipped with the
        # policy (tree_verify/strategy_table.json's format).
        SGLANG_DDTREE_STRATEGY_TABLE = EnvStr("")
        # Refill the attention backend's own TARGET_VERIFY buffers before every graph replay
        # even where the tree-verify path serves every captured layer and never reads them
        # (TreeVerifyHook.claims_replay_indptr); for A/B runs.
        SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM = EnvBool(False)
        # Build a verify's KV indices with torch ops (a cumsum, copies, the gather kernel)
        # instead of the one-launch kernel (tree_verify/verify_indices.py); for A/B runs.
        SGLANG_DDTREE_VERIFY_INDICES_TORCH = EnvBool(False)

        # DFLASH/DDTREE verify sampling: GPU workspace of one chunk of per-node draws,
        # reserved when the KV pool is sized (speculative/verify_sampling/workspace.py).
        SGLANG_DDTREE_SAMPLING_WORKSPACE_MB = EnvInt(512)
        # How unseeded verify nodes are drawn: "fused" (the filtered Gumbel-max draw,
        # verify_sampling/node_draws.py) or "sampler" (the sampling backend's own kernels,
        # for comparisons).
        SGLANG_DDTREE_VERIFY_DRAW = EnvStr("fused")
        # Split each row of the whole-row floors search over several programs while the rows
        # are too few to fill the GPU (sampling_filters.row_slices). Off: one program per row
        # (1.1x to 6.3x slower from 17 to 1,088 rows on an H100, docs/benchmarks.md).
        SGLANG_DDTREE_FLOORS_SPLIT_ROWS = EnvBool(True)

        # DDTREE step: replay the tree's build and compile, and the tail of a step (the
        # target's token at every node, argmax or draw, the acceptance walk, the commit and the
        # drafter's context KV), each as one CUDA graph per batch size
        # (speculative/ddtree/step_graphs.py); likewise DFLASH's DFlash 2 selector path
        # (speculative/dflash2/dflash_step.py). False runs them eagerly (A/B runs).
        SGLANG_DDTREE_STEP_GRAPHS = EnvBool(True)

        # DDTree metrics: verify steps between two logged summaries.
        SGLANG_DDTREE_STATS_INTERVAL = EnvInt(256)

        # Benchmark-only MoE routing (patch 0061, layers/moe/tree_routing.py): uniform routing
        # (upstream's SGLANG_SIMULATE_UNIFORM_EXPERTS) in which a DDTREE tree's siblings share
        # their experts. Never in production.
        SGLANG_DDTREE_SIMULATE_TREE_ROUTING = EnvBool(False)

        # Fused-MoE default row tile (patch 0060): "rows_per_expert" (the fork's
        # rule, default) or "upstream" (upstream's M <= E switch).
        SGLANG_MOE_DEFAULT_TILE_RULE = EnvStr("")


ddtree_envs = DDTreeEnvs()

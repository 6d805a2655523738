# SPDX-License-Identifier: Apache-2.0
"""Servers for the DDTREE end-to-end tests (GPU host only), on the shared GPU
harness of ``tests/gpu/conftest.py`` (``ServerProcess``, ``tiny_models``,
``gpu_log_dir``).

Four servers on one GPU, started together so their ~60 s starts overlap: the
tiny MLA target without speculation (the reference), and the same target with
DDTREE and its DFlash drafter, once with CUDA graphs + the overlap scheduler,
once eager + synchronous, and once choosing each step's budget. Every server runs the scheduler's idle KV check
in strict mode, so a leak, double free or use-after-free kills it.

``DDTREE_E2E_SERVERS`` picks the DDTREE servers (default
``ddtree,ddtree_eager,ddtree_adaptive,ddtree_graph_budgets,ddtree_auto``;
``ddtree_dense`` runs upstream's Triton extend kernel with the dense mask,
``ddtree_flashinfer`` the FlashInfer backend; ~135 s of JIT on a fresh host;
``ddtree_adaptive`` chooses each step's budget, graphs + overlap; ``ddtree_graph_budgets``
chooses between budget 4, whose verify replays graphs of its own width, and the full one;
``ddtree_auto`` gives no budget and ``--speculative-ddtree-budget-policy auto``),
``DDTREE_E2E_BUDGET`` (default 16) sets the tree budget, ``DDTREE_E2E_EXTRA_ARGS``
is appended to the DDTREE servers.
"""

from __future__ import annotations

import os
import shlex

import pytest

from tests.gpu.harness import harness

# DDTREE servers to run, beside the no-speculation baseline.
TREE_SERVERS = [
    s for s in os.environ.get("DDTREE_E2E_SERVERS", "ddtree,ddtree_eager,ddtree_adaptive,ddtree_graph_budgets,ddtree_auto").split(",")
    if s
]
#: Tree budget of the DDTREE servers.
BUDGET = int(os.environ.get("DDTREE_E2E_BUDGET", "16"))
STRICT_KV_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
COMMON = [
    "--attention-backend", "triton",
    # Three servers start at once: cap the KV pools instead of sizing them from
    # free memory, which each start would measure while the others allocate.
    "--mem-fraction-static", "0.85",
    "--max-total-tokens", "131072",
    "--max-running-requests", "16",
    "--cuda-graph-max-bs", "8",
    "--enable-metrics",
    "--decode-log-interval", "4",  # /metrics acceptance is set when a decode batch is logged
    "--log-level", "info",
]


@pytest.fixture(scope="session")
def servers(request, tiny_models, gpu_log_dir):
    target = str(tiny_models / "tiny-mla")
    drafter = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(tiny_models / "tiny-mla-dflash")]
    extra = shlex.split(os.environ.get("DDTREE_E2E_EXTRA_ARGS", ""))
    ddtree = drafter + ["--speculative-ddtree-budget", str(BUDGET)] + extra
    # Tree statistics reach /metrics every 8 verify steps (default 256), so the
    # short test traffic publishes several snapshots.
    stats = {"SGLANG_DDTREE_STATS_INTERVAL": "8"}
    dense = {"SGLANG_DDTREE_VERIFY_STRATEGY": "upstream_extend", **stats}
    configs = {
        "baseline": (COMMON, {}),
        # CUDA graphs (draft and tree verify) and the overlap scheduler.
        "ddtree": (COMMON + ddtree, stats),
        # Eager and synchronous: the other code paths of the same step.
        "ddtree_eager": (COMMON + ddtree + ["--disable-cuda-graph", "--disable-overlap-schedule"], stats),
        # Upstream's Triton extend kernel with the dense custom mask (the
        # fork's tree-verify hook switched off), CUDA graphs on.
        "ddtree_dense": (COMMON + ddtree, dense),
        # FlashInfer: the MLA target verifies through the hook (its FA2 MLA
        # kernel takes no mask), the drafter runs FlashInfer's own kernels.
        "ddtree_flashinfer": ([("flashinfer" if a == "triton" else a) for a in COMMON] + ddtree, stats),
        # Each step's budget chosen per batch size (steps below the full budget run eagerly).
        "ddtree_adaptive": (COMMON + ddtree + ["--speculative-ddtree-budget-policy", "adaptive"], stats),
        # The same, choosing between budget 4 (its verify graphs captured at width 5) and the full one.
        "ddtree_graph_budgets": (COMMON + ddtree + ["--speculative-ddtree-budget-policy", "adaptive",
                                                    "--speculative-ddtree-graph-budgets", "4"], stats),
        # No budget: the auto policy's B=64, adaptive, verify graphs at 16 as well.
        "ddtree_auto": (COMMON + drafter + extra + ["--speculative-ddtree-budget-policy", "auto"], stats),
    }
    configs = {k: configs[k] for k in ["baseline", *TREE_SERVERS]}
    configs = {name: (args, {**STRICT_KV_CHECK, **env}) for name, (args, env) in configs.items()}
    with harness(request.config).launch_servers_together("ddtree-e2e-", target, configs, gpu_log_dir) as started:
        yield started


@pytest.fixture(params=TREE_SERVERS)
def tree(request, servers):
    return servers[request.param]

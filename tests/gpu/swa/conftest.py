# SPDX-License-Identifier: Apache-2.0
"""Servers for DDTREE on a sliding-window + attention-sink target (GPU host only), on
the shared harness of ``tests/gpu/conftest.py``.

The target is ``tiny-gptoss`` (scripts/make_test_models.py): a gpt-oss model whose
sliding layer (window 8) carries the greedy rule. A tree verify that counts a node's
window from its index instead of its depth hides the node's parent from the
previous-token heads; a window one key too wide, or lost sinks, let the far heads
or the full layer's sink head overwrite the rule: each changes the output. Upstream
serves it with a hybrid SWA KV pool (the sliding layer's KV under translated slot
ids, evicted beyond the window).

Four servers start together: no speculation (the reference), DDTREE with CUDA graphs
and the overlap scheduler, DDTREE eager and synchronous with no attention-backend flag
(DDTREE's own choice for a sliding-window target: Triton), and DFLASH (its chain
verify goes through the same tree-verify path now). Every server runs the
scheduler's idle pool check in strict mode over both KV pools (full and SWA), so a
leaked or double-freed slot kills it.

``SWA_E2E_BUDGET`` (default 16) sets the tree budget.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.harness import harness

PAIR = "tiny-gptoss"
BUDGET = int(os.environ.get("SWA_E2E_BUDGET", "16"))
TREE_SERVERS = ["ddtree", "ddtree_eager"]
STRICT_POOL_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_DDTREE_STATS_INTERVAL": "8"}
TRITON = ["--attention-backend", "triton"]
COMMON = [
    # Four servers start at once on one GPU: cap every pool instead of sizing
    # them from the free memory the others are taking.
    "--mem-fraction-static", "0.85",
    "--max-total-tokens", "65536",
    "--max-running-requests", "16",
    "--cuda-graph-max-bs", "8",
    "--enable-metrics",
    "--decode-log-interval", "4",  # /metrics acceptance is set when a decode batch is logged
    "--log-level", "info",
]  # fmt: skip


@pytest.fixture(scope="session")
def swa_models(request, tiny_models):
    """The models dir with the gpt-oss pair (generated into it when an older dir lacks it)."""
    return harness(request.config).with_test_pair(tiny_models, PAIR, "gptoss")


@pytest.fixture(scope="session")
def servers(request, swa_models, gpu_log_dir):
    target = str(swa_models / PAIR)
    drafter = ["--speculative-draft-model-path", str(swa_models / f"{PAIR}-dflash")]
    ddtree = ["--speculative-algorithm", "DDTREE", *drafter, "--speculative-ddtree-budget", str(BUDGET)]
    configs = {
        "baseline": COMMON + TRITON,
        "ddtree": COMMON + TRITON + ddtree,
        "ddtree_eager": COMMON + ddtree + ["--disable-cuda-graph", "--disable-overlap-schedule"],
        "dflash": COMMON + TRITON + ["--speculative-algorithm", "DFLASH", *drafter],
    }
    configs = {name: (args, STRICT_POOL_CHECK) for name, args in configs.items()}
    with harness(request.config).launch_servers_together("swa-", target, configs, gpu_log_dir) as started:
        yield started


@pytest.fixture(params=TREE_SERVERS)
def tree(request, servers):
    return servers[request.param]


@pytest.fixture(scope="session")
def swa_setup():
    """What the servers were started with, for the tests' expectations."""
    return {"budget": BUDGET}

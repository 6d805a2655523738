# SPDX-License-Identifier: Apache-2.0
"""Servers for DDTREE on a hybrid linear-attention target (GPU host only), on the
shared harness of ``tests/gpu/conftest.py``.

The target is ``tiny-qwen3next`` (scripts/make_test_models.py): a Qwen3-Next
model whose layer-0 Gated DeltaNet carries the greedy rule through its recurrent
state and conv window, so a tree verify that gives a node the wrong state, or a
commit that keeps the wrong node's, changes the output. Three servers start
together: no speculation (the reference), DDTREE with CUDA graphs and the
overlap scheduler (its radix cache keeps state snapshots: ``extra_buffer``), and
DDTREE eager and synchronous (``no_buffer``). Every server runs the scheduler's
idle pool check in strict mode (KV, request and mamba pools), so a leaked or
double-freed slot kills it.

``HYBRID_E2E_BUDGET`` (default 16) sets the tree budget.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.harness import harness

PAIR = "tiny-qwen3next"
BUDGET = int(os.environ.get("HYBRID_E2E_BUDGET", "16"))
#: State snapshots every 64 tokens, so the short test requests cross one in decode.
TRACK_INTERVAL = 64
TREE_SERVERS = ["ddtree", "ddtree_eager"]
STRICT_POOL_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_DDTREE_STATS_INTERVAL": "8"}
COMMON = [
    "--attention-backend", "triton",
    # Three servers start at once on one GPU: cap every pool instead of sizing
    # them from the free memory the others are taking.
    "--mem-fraction-static", "0.85",
    "--max-total-tokens", "65536",
    "--max-running-requests", "16",
    "--max-mamba-cache-size", "128",
    "--mamba-track-interval", str(TRACK_INTERVAL),
    "--cuda-graph-max-bs", "8",
    "--enable-metrics",
    "--decode-log-interval", "4",  # /metrics acceptance is set when a decode batch is logged
    "--log-level", "info",
]


@pytest.fixture(scope="session")
def hybrid_models(request, tiny_models):
    """The models dir with the hybrid pair (generated into it when an older dir lacks it)."""
    return harness(request.config).with_test_pair(tiny_models, PAIR, "hybrid")


@pytest.fixture(scope="session")
def servers(request, hybrid_models, gpu_log_dir):
    target = str(hybrid_models / PAIR)
    ddtree = [
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", str(hybrid_models / f"{PAIR}-dflash"),
        "--speculative-ddtree-budget", str(BUDGET),
    ]
    configs = {
        "baseline": COMMON,
        "ddtree": COMMON + ddtree,
        "ddtree_eager": COMMON + ddtree + ["--disable-cuda-graph", "--disable-overlap-schedule"],
    }
    configs = {name: (args, STRICT_POOL_CHECK) for name, args in configs.items()}
    with harness(request.config).launch_servers_together("hybrid-", target, configs, gpu_log_dir) as started:
        yield started


@pytest.fixture(params=TREE_SERVERS)
def tree(request, servers):
    return servers[request.param]


@pytest.fixture(scope="session")
def hybrid_setup():
    """What the servers were started with, for the tests' expectations."""
    return {"budget": BUDGET, "track_interval": TRACK_INTERVAL}

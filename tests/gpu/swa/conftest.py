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
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
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


def _harness(config):
    """The shared GPU harness module (tests/gpu/conftest.py), as pytest loaded it."""
    for plugin in config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None) or ""
        if Path(path).resolve() == Path(__file__).resolve().parent.parent / "conftest.py":
            return plugin
    raise RuntimeError("tests/gpu/conftest.py (the shared GPU harness) is not loaded")


@pytest.fixture(scope="session")
def swa_models(tiny_models):
    """The models dir with the gpt-oss pair (generated into it when an older dir lacks it)."""
    if not (tiny_models / PAIR / "config.json").exists() or not (tiny_models / f"{PAIR}-dflash").exists():
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(tiny_models), "--only", "gptoss"],
            check=True,
        )
    return tiny_models


@pytest.fixture(scope="session")
def servers(request, swa_models, gpu_log_dir):
    ServerProcess = _harness(request.config).ServerProcess
    target = str(swa_models / PAIR)
    drafter = ["--speculative-draft-model-path", str(swa_models / f"{PAIR}-dflash")]
    ddtree = ["--speculative-algorithm", "DDTREE", *drafter, "--speculative-ddtree-budget", str(BUDGET)]
    configs = {
        "baseline": COMMON + TRITON,
        "ddtree": COMMON + TRITON + ddtree,
        "ddtree_eager": COMMON + ddtree + ["--disable-cuda-graph", "--disable-overlap-schedule"],
        "dflash": COMMON + TRITON + ["--speculative-algorithm", "DFLASH", *drafter],
    }
    started = []
    try:
        for name, args in configs.items():
            started.append(ServerProcess(f"swa-{name}", target, args, gpu_log_dir, env=STRICT_POOL_CHECK))
        timeout = float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420"))
        for s in started:
            s.wait_healthy(timeout)
            print(f"\n[server {s.name} healthy after {s.ready_s:.0f} s]", flush=True)
        yield dict(zip(configs, started))
    finally:
        for s in started:
            s.stop()


@pytest.fixture(params=TREE_SERVERS)
def tree(request, servers):
    return servers[request.param]


@pytest.fixture(scope="session")
def swa_setup():
    """What the servers were started with, for the tests' expectations."""
    return {"budget": BUDGET}

# SPDX-License-Identifier: Apache-2.0
"""Servers for the DFlash 2 end-to-end tests (GPU host only), on the shared GPU harness.

Per tiny target (``DFLASH2_E2E_TARGETS``, default ``tiny-qwen3,tiny-mla``): the target
without speculation (the reference), DFLASH with its constructed DFlash 2 drafter
(``<target>-dflash2``, scripts/make_test_models.py) and DDTREE with the same drafter (its
tree from the drafter's marginals, and from the selector's transitions),
with CUDA graphs and the overlap scheduler, the scheduler's idle KV check strict.
``DFLASH2_E2E_EXTRA_ARGS`` is appended to the speculative servers.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.harness import harness

REPO = Path(__file__).resolve().parents[3]
TARGETS = [t for t in os.environ.get("DFLASH2_E2E_TARGETS", "tiny-qwen3,tiny-mla").split(",") if t]
STRICT_KV_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
COMMON = [
    "--attention-backend", "triton",
    "--mem-fraction-static", "0.85",
    "--max-total-tokens", "131072",
    "--max-running-requests", "16",
    "--cuda-graph-max-bs", "8",
    "--log-level", "info",
]


@pytest.fixture(scope="session")
def dflash2_models(tiny_models) -> Path:
    """``tiny_models`` with the DFlash 2 drafters (generated into an older dir that lacks them)."""
    if not all((tiny_models / f"{t}-dflash2" / "config.json").exists() for t in ("tiny-mla", "tiny-qwen3")) or \
            not (tiny_models / "tiny-qwen3-dflash2-unsupported" / "config.json").exists():  # fmt: skip
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(tiny_models),
                        "--only", "mla", "qwen3"], check=True)  # fmt: skip
    return tiny_models


@pytest.fixture(scope="session", params=TARGETS)
def servers(request, dflash2_models, gpu_log_dir):
    target = request.param
    drafter = ["--speculative-draft-model-path", str(dflash2_models / f"{target}-dflash2"),
               *shlex.split(os.environ.get("DFLASH2_E2E_EXTRA_ARGS", ""))]  # fmt: skip
    configs = {
        "baseline": (COMMON, {}),
        "dflash": (COMMON + ["--speculative-algorithm", "DFLASH", *drafter], {}),
        "ddtree": (COMMON + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16", *drafter], {}),
        "ddtree_transitions": (COMMON + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16",
                                         "--speculative-ddtree-tree", "transitions", *drafter], {}),  # fmt: skip
    }
    configs = {name: (args, {**STRICT_KV_CHECK, **env}) for name, (args, env) in configs.items()}
    with harness(request.config).launch_servers_together(f"dflash2-{target}-", str(dflash2_models / target),
                                                         configs, gpu_log_dir) as started:  # fmt: skip
        yield started


@pytest.fixture(params=["dflash", "ddtree", "ddtree_transitions"])
def spec(request, servers):
    return servers[request.param]

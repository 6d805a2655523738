"""Servers for the DDTREE end-to-end tests (GPU host only).

Three servers on one GPU, started concurrently: the tiny MLA target without
speculation (the reference), and the same target with DDTREE and its DFlash
drafter, once with CUDA graphs + overlap scheduling and once eager + synchronous. Test models come from ``scripts/make_test_models.py`` (or
``DDTREE_TEST_MODELS`` pointing at an existing output directory).

Environment knobs: ``DDTREE_E2E_EXTRA_ARGS`` (appended to the DDTREE server,
e.g. ``--disable-cuda-graph``), ``DDTREE_E2E_BUDGET`` (default 16),
``DDTREE_E2E_LOG_DIR`` (server logs; default a temp dir).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _ddtree_server import Server

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def models() -> Path:
    given = os.environ.get("DDTREE_TEST_MODELS")
    if given:
        return Path(given)
    out = Path(tempfile.mkdtemp(prefix="ddtree_models_"))
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(out), "--only", "mla"],
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def servers(models):
    log_dir = Path(os.environ.get("DDTREE_E2E_LOG_DIR") or tempfile.mkdtemp(prefix="ddtree_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    target, drafter = str(models / "tiny-mla"), str(models / "tiny-mla-dflash")
    common = [
        "--model-path", target,
        "--attention-backend", "triton",
        "--mem-fraction-static", "0.2",
        "--max-running-requests", "16",
        "--cuda-graph-max-bs", "8",
        "--enable-metrics",
    ]
    budget = os.environ.get("DDTREE_E2E_BUDGET", "16")
    ddtree_args = common + [
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", drafter,
        "--speculative-ddtree-budget", budget,
        *shlex.split(os.environ.get("DDTREE_E2E_EXTRA_ARGS", "")),
    ]
    started = [
        Server("baseline", common, log_dir),
        # CUDA graphs (draft and tree verify) and the overlap scheduler.
        Server("ddtree", ddtree_args, log_dir),
        # Eager and synchronous: the other code paths of the same step.
        Server("ddtree_eager", ddtree_args + ["--disable-cuda-graph", "--disable-overlap-schedule"], log_dir),
    ]
    try:
        deadline = time.time() + float(os.environ.get("DDTREE_E2E_START_TIMEOUT", "420"))
        for s in started:
            s.wait_healthy(deadline)
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(params=["ddtree", "ddtree_eager"])
def tree(request, servers):
    return servers[request.param]

# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the arch-gating tests: tiny HF configs and a ServerArgs cell runner.

The cell runner executes ``_cells.py`` in a subprocess, once against the
patched venv and once against the pristine upstream tree, so each cell's
outcome under our series can be compared with upstream's on the same inputs.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from _arch_gating_configs import CONFIGS  # this folder is on the path (pytest puts it there)

HERE = pathlib.Path(__file__).resolve().parent

REPO = HERE.parents[2]
PRISTINE_ROOT = REPO / ".cache" / "upstream" / "sglang-0.5.17"
GPU_NAME = "FAKE RTX PRO 6000 Blackwell"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch_gating_models")
    dirs = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(d)
    return dirs


def _launch(cells, models, tmp_path, tag, pristine):
    spec = {
        "gpu_name": GPU_NAME,
        "models": models,
        "cells": cells,
        "pristine_root": str(PRISTINE_ROOT) if pristine else None,
    }
    spec_path = tmp_path / f"{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(
        [sys.executable, str(HERE / "_cells.py"), str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_cells(cells, models, tmp_path, compare_pristine=True):
    """Outcomes of ``cells`` on the patched venv (and on pristine upstream)."""
    if compare_pristine and not (PRISTINE_ROOT / "sglang").is_dir():
        pytest.fail(f"pristine upstream tree missing at {PRISTINE_ROOT}: run make setup")
    procs = {"patched": _launch(cells, models, tmp_path, "patched", False)}
    if compare_pristine:
        procs["pristine"] = _launch(cells, models, tmp_path, "pristine", True)
    results = {}
    for tag, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{tag} cell runner failed:\n{err[-4000:]}"
        results[tag] = json.loads(out)
        assert len(results[tag]["cells"]) == len(cells)
    return results


@pytest.fixture(scope="session")
def cell_runner(model_dirs, tmp_path_factory):
    """``runner(cells, compare_pristine=True) -> {"patched": ..., "pristine": ...}``."""
    tmp = tmp_path_factory.mktemp("arch_gating_cells")
    counter = iter(range(1_000_000))

    def runner(cells, compare_pristine=True):
        d = tmp / f"run{next(counter)}"
        d.mkdir()
        return run_cells(cells, model_dirs, d, compare_pristine)

    return runner

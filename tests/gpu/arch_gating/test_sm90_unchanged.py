# SPDX-License-Identifier: Apache-2.0
"""On a real Hopper GPU (the H200 test host) the patched series changes no
attention-backend decision: every registered backend x MLA/MHA x speculative
on/off resolves (or fails) exactly as pristine upstream 0.5.17 does.

Nothing is faked. The pristine tree is rebuilt from the installed, patched
sglang by reversing the series into a temporary copy.

Run on the GPU host:  python -m pytest tests/gpu/arch_gating -q
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
CELLS = REPO / "tests" / "cpu" / "arch_gating" / "_cells.py"
from tests.gpu.conftest import NOT_APPLICABLE  # noqa: E402
from tests.gpu.tree_verify_integration._gpu_host import require_cuda  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _hopper():
    """No GPU on the GPU host is a broken host (a failure); another GPU than
    compute capability 9.0 is not what this test is about (a skip)."""
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(NOT_APPLICABLE + "needs a compute capability 9.0 GPU")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    import sglang

    from patchkit import apply_cli

    installed = pathlib.Path(sglang.__file__).resolve().parent
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(installed, root / "sglang", symlinks=True)
    assert apply_cli.main(["--target", str(root), "--reverse", "-q"]) == 0
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.cpu.arch_gating._arch_gating_configs import CONFIGS

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, cfg in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = str(root / name)
    return out


def _run(cells, models, tmp, pristine_root):
    spec = {"gpu_name": "", "models": models, "cells": cells, "real_gpu": True,
            "pristine_root": str(pristine_root) if pristine_root else None}
    path = tmp / ("pristine.json" if pristine_root else "patched.json")
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(CELLS), str(path)],
                          capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_backend_decisions_match_upstream_on_h200(trees, models, tmp_path):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from sglang.srt.utils import gpu_arch

    assert gpu_arch.max_shared_memory_per_block((9, 0)) == (
        torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    )
    cells = [{"cap": None, "model": kind, "spec": spec, "args": args}
             for kind in ("mla", "mha", "step3p5", "olmo2")
             for spec in (False, True)
             for args in [{}] + [{"attention_backend": b} for b in sorted(ATTENTION_BACKENDS)]]
    patched = _run(cells, models, tmp_path, None)
    upstream = _run(cells, models, tmp_path, trees)
    assert patched["registered"] == upstream["registered"]
    diffs = [f"{c}: {a} != {b}" for c, a, b in zip(cells, patched["cells"], upstream["cells"])
             if a != b]
    assert not diffs, "\n".join(diffs)
    assert any(o["ok"] and o["prefill"] == "fa3" for o in patched["cells"])

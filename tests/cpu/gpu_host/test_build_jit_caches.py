# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/build_jit_caches.py (run on the GPU host by install.sh): which modules of
docker/jit_modules.json it builds for which target, its refusals, and a listed module whose
generator makes another is reported as a failure, not built under the wrong name."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "build_jit_caches.py"


@pytest.fixture(scope="module")
def bjc():
    spec = importlib.util.spec_from_file_location("build_jit_caches", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_the_list_for_each_target(bjc):
    data = json.loads((REPO / "docker" / "jit_modules.json").read_text())
    for targets in (["mla"], ["mha"], ["mha", "mla"]):
        fi, sg = bjc.selected(data, targets)
        assert {e["name"] for e in fi} == {e["name"] for e in data["flashinfer"] if set(targets) & set(e["for"])}
        assert len(sg) == len([e for e in data["sglang_jit"] if set(targets) & set(e["for"])])
    fi, _ = bjc.selected(data, ["mla"])
    names = {e["name"] for e in fi}
    assert {"norm", "sampling"} <= names and not any(n.startswith("batch_prefill") for n in names)
    r = run("--for", "mla", "--list")
    assert r.returncode == 0, r.stderr
    assert "flashinfer  norm  (mha, mla)" in r.stdout and "flashinfer  sampling" in r.stdout
    assert "batch_prefill" not in r.stdout and "sglang_jit  _jit_clamp_position_module" in r.stdout


def test_refusals():
    for args, msg in ((["--for", "gqa"], "--for takes mha, mla"), (["--jobs", "0"], "--jobs takes a positive"),
                      (["--modules", "/nonexistent.json"], "nonexistent")):
        r = run(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_without_a_gpu_nothing_is_built():
    r = run("--for", "mla")
    assert r.returncode == 2 and "no GPU visible" in r.stderr


def test_a_generator_that_makes_another_module_fails():
    """The arch comes from the environment here (no GPU), as in the image's build, set before
    FlashInfer is imported (a fresh process); the check of the generated name comes before any
    compiler runs."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bjc', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "entry = {'name': 'not_norm', 'gen': 'flashinfer.jit.norm:gen_norm_module', 'args': [], 'for': ['mla']}\n"
        "status, _, err = m.build_flashinfer(m._kernel_list(), entry)\n"
        "print(status, err)\n"
    )
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": "9.0a"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAIL ") and "generates norm, not the listed not_norm" in r.stdout

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


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` with the script loaded as ``m``, in a fresh process whose arch comes from the
    environment (no GPU here), as in the image's build: FlashInfer reads it when first imported."""
    head = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bjc', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
    )
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": "9.0a"}
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, timeout=300, env=env)


def test_a_generator_that_makes_another_module_fails():
    """The check of the generated name comes before any compiler runs."""
    r = _fresh(
        "entry = {'name': 'not_norm', 'gen': 'flashinfer.jit.norm:gen_norm_module', 'args': [], 'for': ['mla']}\n"
        "[(_, spec, err)] = m.made_here([entry], m._kernel_list().flashinfer_spec)\n"
        "status, _, err = m.build_flashinfer(spec, err)\n"
        "print(status, err)\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAIL ") and "generates norm, not the listed not_norm" in r.stdout


def test_every_listed_module_is_made_before_the_builds():
    """Every FlashInfer generator and sglang factory of the list, made in one thread as ``main``
    makes them before its build threads start (on a GPU host two builds once imported the same
    FlashInfer module from two threads and one failed with ``_DeadlockError``): each makes the
    module it is listed as, and nothing is left for a build thread to import."""
    r = _fresh(
        "import json\n"
        "ck = m._kernel_list()\n"
        "fi, sg = m.selected(ck.load_modules(m.REPO / 'docker' / 'jit_modules.json'), m.TARGETS)\n"
        "specs = m.made_here(fi, ck.flashinfer_spec)\n"
        "factories = m.made_here(sg, lambda e: ck.resolve(e['factory']))\n"
        "print(json.dumps({'fi': [[e['name'], s is not None and s.name, err] for e, s, err in specs],\n"
        "                  'sg': [[e['factory'], callable(f), err] for e, f, err in factories]}))\n"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["fi"] and out["sg"]
    for name, made, err in out["fi"]:
        assert err is None and made == name, (name, made, err)
    for factory, ok, err in out["sg"]:
        assert err is None and ok, (factory, err)
